"""The benchmark runner: interleaved methods, metrics that follow from the measurements, peers, CLI."""

import json
import os

import pytest
import torch
from helpers import EOS, char_tokenizer, make_oracle, make_target

from hf_specdec import AutoModelForDrafting, Eagle3Config, cpu_kernels
from hf_specdec.bench.prompts import PromptItem
from hf_specdec.bench.runner import (
    _acceptance,
    _count_new_tokens,
    assisted_method,
    drafter_method,
    plain_method,
    prompt_lookup_method,
    run_benchmark,
)

PROMPTS = [
    PromptItem(id="a", category="letters", text="abcabcabc"),
    PromptItem(id="b", category="letters", text="hello world"),
    PromptItem(id="c", category="digits", text="0123401234"),
]


def _records(report, **where):
    return [r for r in report["records"] if all(r.get(k) == v for k, v in where.items())]


def test_acceptance_statistics_from_pass_counts():
    # Passes committed 6, 1 and 3 tokens (bonus included) out of 5 drafted: 5, 0 and 2 drafts accepted.
    by_position, alpha = _acceptance([6, 1, 3], [5, 5, 5])
    assert by_position == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert alpha == pytest.approx(7 / 9)  # accepted drafts over drafts reached (5 + 1 + 3)
    # A short final pass (2 drafted, both accepted) only counts for positions 1 and 2.
    by_position, alpha = _acceptance([3, 3], [5, 2])
    assert by_position == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])
    assert alpha == pytest.approx(4 / 5)


def test_new_tokens_stop_at_eos():
    new = torch.tensor([[7, 8, EOS, EOS, EOS], [7, 8, 9, 10, 11]])
    assert _count_new_tokens(new, {EOS}) == 3 + 5


def test_benchmark_drafter_identical_and_metrics_consistent():
    torch.manual_seed(0)
    target, tok = make_target(), char_tokenizer()
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    # A fixed K and no lookup copies: the metrics below are checked against K = 3.
    methods = [plain_method(), drafter_method(drafter, name="eagle3", draft_length="fixed", lookup_tokens=0)]
    report = run_benchmark(
        target, tok, methods, PROMPTS, max_new_tokens=12, batch_sizes=[1, 2], warmup=1, repeats=2, progress=False
    )
    assert report["hardware"]["device"] == "cpu" and report["config"]["repeats"] == 2
    for bsz in (1, 2):
        (plain,) = _records(report, method="plain", batch_size=bsz, category="all")
        (spec,) = _records(report, method="eagle3", batch_size=bsz, category="all")
        assert spec["identical"] is True and plain["identical"] is True
        assert spec["new_tokens"] == plain["new_tokens"]  # same tokens, greedy
        assert spec["speedup"] == pytest.approx(spec["tokens_per_s"] / plain["tokens_per_s"], rel=1e-3)
        assert plain["mean_accepted_length"] == 1.0 and plain["speedup"] == 1.0
        assert 1.0 <= spec["mean_accepted_length"] <= 4.0  # K = 3: at most 3 drafts + the bonus token per pass
        assert len(spec["acceptance_by_position"]) == 3
        assert 0.0 <= spec["alpha"] <= 1.0 and spec["draft_cost_ratio"] > 0
        expected_bound = min(1 / spec["draft_cost_ratio"], 1 / (1 - spec["alpha"]) if spec["alpha"] < 1 else 1e9)
        assert spec["speedup_bound"] == pytest.approx(expected_bound, rel=1e-3)
        # tau over the measured cost of a pass (verification + drafting) in plain steps; timings vary from run to
        # run, so only the identity linking the three figures is checked, never a speed.
        per_pass = spec["mean_accepted_length"] / spec["predicted_speedup"]
        assert spec["verify_cost_ratio"] > 0 and per_pass > spec["verify_cost_ratio"]
    # Per-category records partition the prompts.
    cats = _records(report, method="eagle3", batch_size=1)
    assert sorted(r["category"] for r in cats) == ["all", "digits", "letters"]
    assert sum(r["num_prompts"] for r in cats if r["category"] != "all") == 3
    (all_rec,) = [r for r in cats if r["category"] == "all"]
    assert sum(r["new_tokens"] for r in cats if r["category"] != "all") == all_rec["new_tokens"]


def test_oracle_drafter_is_fully_accepted():
    target, tok = make_target(), char_tokenizer()
    item = PromptItem(id="x", category="default", text="abcdefgh")
    ids = tok(item.text, return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    oracle = make_oracle(target, ref[:, ids.shape[1] :], num_draft_tokens=4)
    method = drafter_method(oracle, name="oracle", draft_length="fixed", lookup_tokens=0)
    report = run_benchmark(target, tok, [method], [item], max_new_tokens=16,
                           warmup=0, progress=False)  # fmt: skip
    (spec,) = _records(report, method="oracle")
    assert spec["identical"] is True
    assert spec["acceptance_by_position"] == [1.0, 1.0, 1.0, 1.0]
    assert spec["alpha"] == 1.0
    assert spec["speedup_bound"] == pytest.approx(1 / spec["draft_cost_ratio"], rel=1e-3)
    new_tokens = int(ref.shape[1] - ids.shape[1])
    passes = -(-(new_tokens - 1) // 5)  # the prefill commits one token; each pass commits K + 1 = 5
    assert spec["target_forwards"] == passes + 1


def test_peers_sampling_and_skips():
    target, tok = make_target(), char_tokenizer()
    assistant = make_target(seed=1, layers=1)
    methods = [plain_method(), assisted_method(assistant, name="assisted", num_assistant_tokens=3),
               prompt_lookup_method(4)]  # fmt: skip
    report = run_benchmark(target, tok, methods, PROMPTS[:2], max_new_tokens=10, temperatures=[0.0, 0.8],
                           batch_sizes=[1, 2], warmup=0, progress=False)  # fmt: skip
    (assisted,) = _records(report, method="assisted", mode="greedy", batch_size=1, category="all")
    assert assisted["identical"] is True
    assert assisted["mean_accepted_length"] >= 1.0 and assisted["draft_cost_ratio"] > 0
    (lookup,) = _records(report, method="prompt-lookup:4", mode="greedy", batch_size=1, category="all")
    assert lookup["identical"] is True and lookup["mean_accepted_length"] >= 1.0
    (sampled,) = _records(report, method="assisted", mode="sampling", batch_size=1, category="all")
    assert sampled["identical"] is None and sampled["new_tokens"] > 0
    for name in ("assisted", "prompt-lookup:4"):
        (rec,) = _records(report, method=name, mode="greedy", batch_size=2, category="all")
        assert "batch size" in rec["skipped"]


def test_benchmark_rejects_bad_input():
    target, tok = make_target(), char_tokenizer()
    with pytest.raises(ValueError, match="No prompts"):
        run_benchmark(target, tok, [plain_method()], [], progress=False)
    with pytest.raises(ValueError, match="unique"):
        run_benchmark(target, tok, [plain_method(), plain_method()], PROMPTS, progress=False)
    with pytest.raises(ValueError, match="batch sizes"):
        run_benchmark(target, tok, [plain_method()], PROMPTS, batch_sizes=[0], progress=False)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        run_benchmark(target, tok, [plain_method()], [PromptItem("long", "d", text="a" * 600)], progress=False)
    with pytest.raises(ValueError, match="Unknown verifier"):
        drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
        drafter_method(drafter, verifier="nope")


def test_bench_and_demo_commands(tmp_path, monkeypatch):
    from hf_specdec.bench import runner
    from hf_specdec.commands import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "import os\n\n\ndef main():\n", "category": "code"})
        + "\n"
        + json.dumps({"prompt": "class Config:\n    def __init__(self):\n", "category": "classes"})
        + "\n"
    )
    out = tmp_path / "bench"
    rc = main(["bench", "--prompts", str(prompts), "--max-new-tokens", "8", "--out", str(out), "--warmup", "0",
               "--prompt-lookup", "4"])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    methods = {r["method"] for r in report["records"]}
    assert (
        "plain" in methods
        and any(m.startswith("eagle3:demo-drafter") for m in methods)
        and "prompt-lookup:4" in methods
    )
    for rec in report["records"]:
        for key in ("method", "tokens_per_s", "speedup", "mean_accepted_length", "identical"):
            assert key in rec
    assert (out / "bench.md").read_text().count("|") > 10
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert report["config"]["linear_kernels"].startswith("packed (")  # the default, for every method alike
    assert report["config"]["attention"] == "sdpa, grouped-query kernel for every call"  # 6 heads over 2 K/V heads
    expected = "int8, packed (" if cpu_kernels.int8_linears_supported() else "stock"  # the default, where it can
    assert report["config"]["draft_kernels"].startswith(expected)

    # the demo drafts every pass here (its adaptive length reads the clock and may run plain steps on a loaded machine)
    adaptive = runner.drafter_method
    monkeypatch.setattr(runner, "drafter_method", lambda *a, **k: adaptive(*a, **{"draft_length": "fixed", **k}))
    rc = main(["demo", "--target", "demo-code", "--prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path),
               "--linear-kernels", "stock", "--draft-kernels", "stock"])  # fmt: skip
    assert rc == 0
    summary = json.loads((tmp_path / "demo_report.json").read_text())
    assert summary["report"]["config"]["linear_kernels"] == "stock"
    assert summary["report"]["config"]["draft_kernels"] == "stock"
    for key in ("speedup", "mean_accepted_length", "identical", "tokens_per_s_plain", "tokens_per_s_speculative"):
        assert key in summary
    assert summary["target"] == "demo-code" and summary["report"]["config"]["target"] == "hf_specdec demo-target"
    assert summary["identical"] is True and summary["mean_accepted_length"] > 1.0
    assert os.path.exists(tmp_path / "demo_report.png")


def test_asd_quality_audit_fields():
    target, tok = make_target(seed=1), char_tokenizer()
    item = PromptItem(id="x", category="default", text="abcdefgh")
    ids = tok(item.text, return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    oracle = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3, seed=1, num_draft_tokens=4)
    methods = [
        plain_method(),
        # Fixed K, no lookup: every pass drafts, so ASD meets the corrupted tokens (the adaptive length could
        # choose plain steps on wall-clock grounds).
        drafter_method(oracle, name="strict", draft_length="fixed", lookup_tokens=0),
        drafter_method(
            oracle, name="asd", verifier="asd", verifier_options={"budget": 50.0, "gate": 50.0},
            draft_length="fixed", lookup_tokens=0,
        ),
    ]  # fmt: skip
    report = run_benchmark(target, tok, methods, [item], max_new_tokens=20, warmup=0, progress=False)
    plain, strict, asd = (_records(report, method=m)[0] for m in ("plain", "strict", "asd"))
    assert strict["identical"] is True and strict["divergence_rate"] == 0.0
    assert asd["approximate"] is True and plain["approximate"] is False
    assert plain["target_logprob"] is not None and asd["target_logprob"] is not None
    assert strict["target_logprob"] is None  # only the baseline and approximate methods are scored
    assert asd["divergence_rate"] == 1.0 and asd["identical"] is False  # corrupted draft tokens were accepted
    assert asd["target_logprob"] <= 0.0 and plain["target_logprob"] <= 0.0
    # ASD is greedy-only: a sampling run reports it as skipped instead of running it.
    report = run_benchmark(target, tok, methods, [item], max_new_tokens=4, temperatures=[0.5], warmup=0,
                           progress=False)  # fmt: skip
    assert "greedy-only" in _records(report, method="asd")[0]["skipped"]


def test_asd_commands(tmp_path):
    from hf_specdec.commands import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\\n\\n\\ndef main():\\n\nclass A:\\n    def f(self):\\n\nx = 1\ny = 2\n")
    out = tmp_path / "bench"
    rc = main(["bench", "--prompts", str(prompts), "--max-new-tokens", "8", "--out", str(out), "--warmup", "0",
               "--no-peers", "--verifier", "asd", "--asd-budget", "4"])  # fmt: skip
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    (asd,) = [r for r in report["records"] if "asd" in r["method"]]
    assert asd["approximate"] is True and asd["target_logprob"] is not None and asd["divergence_rate"] is not None
    assert "Approximate verification" in (out / "bench.md").read_text()

    rc = main(["asd-tune", "--prompts", str(prompts), "--max-new-tokens", "8", "--budgets", "0", "4", "--gates",
               "0.5", "--block-caps", "2", "--out", str(tmp_path / "tune.json")])  # fmt: skip
    assert rc == 0
    tune = json.loads((tmp_path / "tune.json").read_text())
    assert len(tune["candidates"]) == 2 and tune["recommended"] is not None
    assert sorted(tune["dev_prompt_ids"] + tune["test_prompt_ids"]) == ["1", "2", "3", "4"]
    # the audit: bench --split test runs exactly the prompts that asd-tune held out
    rc = main(["bench", "--prompts", str(prompts), "--max-new-tokens", "4", "--out", str(out), "--warmup", "0",
               "--no-peers", "--verifier", "asd", "--split", "test", "--stem", "audit"])  # fmt: skip
    assert rc == 0
    audit = json.loads((out / "audit.json").read_text())
    assert "test split" in audit["config"]["prompts"]
    assert {r["num_prompts"] for r in audit["records"] if r["category"] == "all"} == {len(tune["test_prompt_ids"])}


def test_draft_option_rows(tmp_path, capsys):
    """``--draft-option KEY=VALUE`` adds chain rows with that option for drafters that declare it."""
    from hf_specdec.commands import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n\n\ndef main():\n", "category": "code"}) + "\n")
    out = tmp_path / "bench"
    assert main(["bench", "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out), "--warmup", "0",
                 "--no-peers", "--draft-option", "draft_confidence_threshold=0.5"]) == 0  # fmt: skip
    report = json.loads((out / "bench.json").read_text())
    names = {r["method"] for r in report["records"]}
    with_option = [n for n in names if "draft_confidence_threshold=0.5" in n]
    assert len(with_option) == 1 and len(names) == 3
    (config,) = [m for m in report["config"]["methods"] if m["name"] == with_option[0]]
    assert "0.5" in json.dumps(config)
    # an option no drafter declares is a typo: refused with a message, before anything runs
    assert main(["bench", "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out), "--no-peers",
                 "--draft-option", "not_an_option=1"]) == 2  # fmt: skip
    assert "not_an_option" in capsys.readouterr().err


def test_copy_threshold_rows(tmp_path):
    """``--copy-threshold 0 0.7`` measures a drafter's chain without and with the n-gram copies, side by side."""
    from hf_specdec.commands import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n\n\ndef main():\n", "category": "code"}) + "\n")
    out = tmp_path / "bench"
    assert main(["bench", "--prompts", str(prompts), "--max-new-tokens", "6", "--out", str(out), "--warmup", "0",
                 "--no-peers", "--copy-threshold", "0", "0.7"]) == 0  # fmt: skip
    report = json.loads((out / "bench.json").read_text())
    rows = {m["name"]: m.get("copy_threshold") for m in report["config"]["methods"] if m["kind"] == "drafter"}
    assert sorted(rows.values()) == [0.0, 0.7] and all(name.endswith(f"copy={v:g}") for name, v in rows.items())
