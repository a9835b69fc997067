"""Self-distillation data at scale (hf_specdec.training.distill): Magpie prompts, sources mixed and deduplicated,
benchmark-disjoint, resumable compressed shards."""

import gzip
import json

import pytest
import torch
from helpers import chat_tokenizer

from hf_specdec.training import distill
from hf_specdec.training.data import DrafterDataset
from hf_specdec.training.distill import (
    build_distill_dataset,
    normalize_prompt,
    read_distill_dataset,
    shard_path,
    synthesize_prompts,
    user_turn_prefix,
)


class ScriptedTarget(torch.nn.Module):
    """A stand-in target whose ``generate`` writes scripted texts: the next user prompt from ``prompts`` when asked
    after the bare user prefix (Magpie), else an answer that names the prompt's length."""

    def __init__(self, tokenizer, prompts):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.prompts, self.calls = tokenizer, list(prompts), 0
        self.config = type("Config", (), {"max_position_embeddings": 4096})()
        self.prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]

    def _text(self, row):
        if row == self.prefix:
            return self.prompts.pop(0) + "<|im_end|>" if self.prompts else "unfinished"
        return f"answer {len(row)}<|im_end|>"

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        self.calls += 1
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            real = [t for t, m in zip(ids, mask) if m]
            new = self.tok(self._text(real), add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(new + [pad_token_id] * (max_new_tokens - len(new)))
        return torch.cat([input_ids, torch.tensor(rows)], dim=1)


@pytest.fixture
def tok():
    return chat_tokenizer()


def test_user_turn_prefix_is_the_template_before_the_user_content(tok):
    assert user_turn_prefix(tok) == "<|im_start|>user\n"
    with pytest.raises(ValueError, match="chat_template"):
        user_turn_prefix(chat_tokenizer(chat_template=False))


def test_synthesised_prompts_are_finished_new_and_not_degenerate(tok):
    script = [
        "How do I bake bread at home?",
        "how do I bake bread at home",  # the same prompt again (case, punctuation)
        "Hi",  # too short
        "go go go go go go go go go go go go",  # repeats itself
        "Explain tides to a child, please.",
    ]
    target = ScriptedTarget(tok, script)
    out = synthesize_prompts(target, tok, 10, batch_size=3, max_new_tokens=64, max_batches=2)
    assert [r["prompt"] for r in out] == ["How do I bake bread at home?", "Explain tides to a child, please."]
    assert all(r["source"] == "magpie" for r in out)
    assert target.calls == 2  # stopped at max_batches, with the 6th sample unfinished


def test_dataset_mixes_sources_dedups_across_shards_and_stays_disjoint(tok, tmp_path, monkeypatch):
    benchmark = "Write a persuasive essay about the importance of public transport in large and busy cities."
    monkeypatch.setattr(distill, "benchmark_texts", lambda: [benchmark])
    monkeypatch.setattr(distill, "chat_training_prompts", lambda n, seed=0: [{"prompt": f"Template prompt {i}",
                        "category": "writing", "source": "hf_specdec.chat_prompts"} for i in range(8)])  # fmt: skip
    synth = [f"Synthesised question number {w}?" for w in ("one", "two", "three", "four", "five", "six")]
    synth.insert(1, benchmark)  # the target wrote a benchmark prompt: dropped
    synth.insert(3, "Synthesised question number one?")  # repeated in a later shard: dropped
    target = ScriptedTarget(tok, synth)
    user = [{"messages": [{"role": "user", "content": "A user's own question"}]}]
    index = build_distill_dataset(
        target, tok, tmp_path / "data", num_shards=2, shard_size=4, extra_records=user, templated_share=0.5,
        max_new_tokens=16, batch_size=2, synth_batch_size=1, log=lambda m: None,
    )  # fmt: skip
    records = read_distill_dataset(tmp_path / "data")
    prompts = [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in records]
    assert len(prompts) == len({normalize_prompt(p) for p in prompts}) == 8
    assert benchmark not in prompts and "A user's own question" in prompts
    assert index["sources"] == {"user": 1, "hf_specdec.chat_prompts": 4, "magpie": 3}  # 1 + 2 + 1, 2 + 2
    assert index["answer_tokens"] == sum(r["answer_tokens"] for r in records)
    assert all(r["messages"][-1]["role"] == "assistant" and r["finished"] for r in records)
    assert not any((tmp_path / "data" / ".work").iterdir())  # finished shards leave no work files
    # the records train as chat records, the loss on the assistant turn only
    ds = DrafterDataset.from_records(records, tok, max_length=256)
    first = ds[0]
    kept = [t for t, m in zip(first["input_ids"], first["loss_mask"]) if m]
    assert tok.decode(kept) == records[0]["messages"][-1]["content"] + "<|im_end|>"


def test_a_killed_run_resumes_inside_its_shard_and_skips_finished_ones(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "benchmark_texts", lambda: [])
    prompts = [f"Question about topic {w}?" for w in "abcdefgh"]
    kwargs = dict(shard_size=4, templated_share=0.0, max_new_tokens=16, batch_size=2, synth_batch_size=4)
    build_distill_dataset(ScriptedTarget(tok, prompts), tok, tmp_path / "ref", num_shards=2, log=print, **kwargs)
    reference = [gzip.open(shard_path(tmp_path / "ref", s)).read() for s in (0, 1)]

    out = tmp_path / "run"
    build_distill_dataset(ScriptedTarget(tok, prompts), tok, out, num_shards=1, log=print, **kwargs)
    # shard 1 was killed after its prompts and one batch of answers had been written
    target = ScriptedTarget(tok, prompts[4:])
    work = out / ".work"
    (work / "shard-00001.prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "category": "synthesised", "source": "magpie"}) + "\n" for p in prompts[4:])
    )
    answers = [r for r in json.loads("[" + ",".join(_answers(tok, target, prompts[4:6])) + "]")]
    (work / "shard-00001.answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
    target.prompts = []  # nothing more may be synthesised: the saved prompts are used
    build_distill_dataset(target, tok, out, num_shards=2, log=print, **kwargs)
    assert target.calls == 1  # only the one missing batch of answers
    assert [gzip.open(shard_path(out, s)).read() for s in (0, 1)] == reference
    assert json.loads((out / "index.json").read_text())["records"] == 8


def _answers(tok, target, prompts):
    """The regenerated lines of the first batch (source indices 0, 1) as ``regenerate`` writes them."""
    from hf_specdec.training.regenerate import build_prompt

    lines = []
    for i, p in enumerate(prompts):
        text, _ = build_prompt(tok, {"prompt": p})
        ids = tok(text, add_special_tokens=False)["input_ids"]
        answer = f"answer {len(ids)}"
        rec = {"prompt": p, "category": "synthesised", "source": "magpie", "response": answer, "regenerated": True,
               "source_index": i, "answer_tokens": len(tok(answer + "<|im_end|>")["input_ids"]), "finished": True}  # fmt: skip
        lines.append(json.dumps(rec))
    return lines


def test_the_card_states_counts_sources_settings_and_the_command(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "benchmark_texts", lambda: [])
    prompts = [f"Question about topic {w}?" for w in "abcd"]
    out = tmp_path / "d"
    index = build_distill_dataset(
        ScriptedTarget(tok, prompts), tok, out, num_shards=1, shard_size=4, templated_share=0.0, max_new_tokens=16,
        synth_batch_size=4, settings={"command": "python make_it.py --num-shards 1"}, log=lambda m: None,
    )  # fmt: skip
    card = (out / "README.md").read_text()
    assert "| records | 4 in 1 shards of 4 prompts |" in card
    assert f"| answer tokens | {index['answer_tokens']} " in card
    assert "| synthesised by the target (Magpie" in card and "| 4 |" in card
    assert "python make_it.py --num-shards 1" in card and "MiB" in card and "License" in card
    assert "holds shards 0–0: `--num-shards 1` rebuilds exactly these" in card


def test_a_card_of_given_prompts_says_none_was_synthesised_and_shows_extra_settings(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "benchmark_texts", lambda: [])
    given = [{"prompt": f"Summarise document {w}.", "source": "user"} for w in "abcd"]
    out = tmp_path / "d"
    documents = {"written_by": "the target, sampled", "temperature": 1.0}
    build_distill_dataset(
        ScriptedTarget(tok, []), tok, out, num_shards=1, shard_size=4, templated_share=0.0, max_new_tokens=16,
        extra_records=given, settings={"documents": documents}, log=lambda m: None,
    )  # fmt: skip
    card = (out / "README.md").read_text()
    assert "| synthesis | none: every prompt comes from the sources below |" in card and "magpie" not in card
    assert f"| documents | {json.dumps(documents)} |" in card


def test_training_reads_the_sharded_folder_and_names_a_bad_shard_line(tok, tmp_path, monkeypatch):
    from hf_specdec.training.data import load_records

    monkeypatch.setattr(distill, "benchmark_texts", lambda: [])
    prompts = [f"Question about topic {w}?" for w in "abcdefgh"]
    out = tmp_path / "d"
    build_distill_dataset(ScriptedTarget(tok, prompts), tok, out, num_shards=2, shard_size=4, templated_share=0.0,
                          max_new_tokens=16, synth_batch_size=4, log=lambda m: None)  # fmt: skip
    records = load_records(out)
    assert list(records) == read_distill_dataset(out) and len(records) == 8
    assert records.location(5) == f"{shard_path(out, 1)}:2"
    with gzip.open(shard_path(out, 1), "at") as fh:
        fh.write('{"messages": "not a list"}\n')
    with pytest.raises(ValueError, match=r"shard-00001\.jsonl\.gz:5"):
        load_records(out)
    with pytest.raises(ValueError, match="none"):
        load_records(tmp_path / "d" / ".work")
