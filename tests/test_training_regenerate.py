"""Self-distillation: regenerating responses with the target."""

import json

import pytest
import torch
from helpers import chat_tokenizer as make_tokenizer

from hf_specdec.testing import tiny_target
from hf_specdec.training.regenerate import build_prompt, regenerate

MAX_NEW = 6


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_target("llama", seed=0, vocab=len(tokenizer), layers=4, sharpen=20.0)


def read_jsonl(path):
    """The lines of a regenerated file in source order (batches are written in length-bucketed order)."""
    with open(path, encoding="utf-8") as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["source_index"])


RECORDS = [
    {"prompt": "Hello there", "id": "a"},
    {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello, old answer"},
            {"role": "user", "content": "Name a color"},
            {"role": "assistant", "content": "old blue", "name": "bot"},
        ],
        "source": "x",
    },
    {"prompt": "Tell me a story about a cat"},
    {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2 unanswered"},
        ]
    },
    {"prompt": "Why"},
    {"prompt": "Count to three, please"},
]


def greedy_reference(target, tokenizer, record):
    text, templated = build_prompt(tokenizer, record)
    ids = torch.tensor([tokenizer(text, add_special_tokens=not templated)["input_ids"]])
    out = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)


def generated_text(line):
    if "messages" in line:
        return line["messages"][-1]["content"] if line["messages"][-1]["role"] == "assistant" else None
    return line["response"]


def test_build_prompt(tokenizer):
    text, templated = build_prompt(tokenizer, RECORDS[2])
    assert templated
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello, old answer<|im_end|>\n<|im_start|>user\nName a color<|im_end|>\n<|im_start|>assistant\n"
    )
    assert build_prompt(tokenizer, {"prompt": "Yo"})[0] == "<|im_start|>user\nYo<|im_end|>\n<|im_start|>assistant\n"
    assert build_prompt(make_tokenizer(chat_template=False), {"prompt": "Yo"}) == ("Yo", False)
    with pytest.raises(ValueError, match="chat_template"):
        build_prompt(make_tokenizer(chat_template=False), RECORDS[1])


def test_greedy_matches_generate(target, tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    n = regenerate(target, tokenizer, RECORDS, out, max_new_tokens=MAX_NEW, batch_size=3, progress=False, log=None)
    assert n == len(RECORDS)
    lines = read_jsonl(out)
    assert [line["source_index"] for line in lines] == list(range(len(RECORDS)))
    assert all(line["regenerated"] is True for line in lines)
    for i, (line, record) in enumerate(zip(lines, RECORDS)):
        expected = greedy_reference(target, tokenizer, record)
        if i == 4:  # the last assistant turn is not the last message
            got = line["messages"][1]["content"]
        else:
            got = generated_text(line)
        assert got == expected, i
    assert tokenizer.padding_side == "right"  # restored


def test_records_layout(target, tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    regenerate(target, tokenizer, RECORDS, out, max_new_tokens=MAX_NEW, batch_size=4, progress=False, log=None)
    lines = read_jsonl(out)
    # prompt record: prompt + response + other keys
    assert lines[0]["prompt"] == "Hello there" and lines[0]["id"] == "a" and isinstance(lines[0]["response"], str)
    # no assistant message: appended
    assert lines[1]["messages"][0] == RECORDS[1]["messages"][0] and len(lines[1]["messages"]) == 2
    assert lines[1]["messages"][1]["role"] == "assistant"
    # earlier turns kept, last assistant replaced, other keys kept
    msgs = lines[2]["messages"]
    assert msgs[:4] == RECORDS[2]["messages"][:4] and len(msgs) == 5
    assert msgs[4]["role"] == "assistant" and msgs[4]["content"] != "old blue"
    assert lines[2]["source"] == "x"
    # a trailing user turn after the last assistant turn is kept in place
    assert lines[4]["messages"][0] == RECORDS[4]["messages"][0] and lines[4]["messages"][2] == RECORDS[4]["messages"][2]
    assert lines[4]["messages"][1]["role"] == "assistant"
    # the input records are not modified
    assert RECORDS[2]["messages"][4]["content"] == "old blue" and "regenerated" not in RECORDS[0]


def test_resume_reproduces_uninterrupted_run(target, tokenizer, tmp_path):
    # Sampling: the strictest case (outputs depend on the per-batch seeds as well as on the batch composition).
    records = RECORDS[:5]
    kwargs = dict(max_new_tokens=MAX_NEW, batch_size=2, temperature=1.0, seed=3, progress=False, log=None)
    full = tmp_path / "full.jsonl"
    assert regenerate(target, tokenizer, records, full, **kwargs) == len(records)
    reference = full.read_bytes()
    other = tmp_path / "other.jsonl"
    regenerate(target, tokenizer, records[:2], other, **{**kwargs, "seed": 4})
    assert not reference.startswith(other.read_bytes())  # the seed matters

    # Killed after the first batch: the file holds its two lines.
    lines = reference.split(b"\n")
    half = tmp_path / "half.jsonl"
    half.write_bytes(b"\n".join(lines[:2]) + b"\n")
    assert regenerate(target, tokenizer, records, half, **kwargs) == len(records) - 2
    assert half.read_bytes() == reference

    # Killed while writing a line in the middle of a batch (truncated last line).
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][: len(lines[3]) // 2])
    messages = []
    assert regenerate(target, tokenizer, records, cut, **{**kwargs, "log": messages.append}) == len(records) - 3
    assert any("truncated" in m for m in messages)
    assert cut.read_bytes() == reference

    # Nothing left to do; resume=False starts over.
    assert regenerate(target, tokenizer, records, full, **kwargs) == 0
    assert full.read_bytes() == reference
    assert regenerate(target, tokenizer, records[:2], full, **{**kwargs, "resume": False}) == 2
    assert len(read_jsonl(full)) == 2


def test_batches_are_bucketed_by_prompt_length(target, tokenizer, tmp_path):
    records = [{"prompt": "word " * n} for n in (30, 1, 29, 2, 31, 3)]
    seen = []
    original = target.generate

    def spy(**kwargs):
        seen.append(kwargs["attention_mask"].sum(1).tolist())
        return original(**kwargs)

    target.generate = spy
    try:
        regenerate(target, tokenizer, records, tmp_path / "b.jsonl", max_new_tokens=2, batch_size=3, progress=False)
        short_first = list(seen)
        seen.clear()
        regenerate(
            target, tokenizer, records, tmp_path / "f.jsonl", max_new_tokens=2, batch_size=3, progress=False,
            bucket_by_length=False,
        )  # fmt: skip
    finally:
        del target.generate
    assert max(short_first[0]) < min(short_first[1])  # the three short prompts together, then the long ones
    assert max(seen[0]) > min(seen[1])  # file order mixes them
    lines = read_jsonl(tmp_path / "b.jsonl")
    assert [r["source_index"] for r in lines] == list(range(6))
    assert all(r["answer_tokens"] == 2 and r["finished"] is False for r in lines)  # cut by max_new_tokens


def test_prompts_longer_than_the_context_are_skipped_or_truncated(tokenizer, tmp_path):
    small = tiny_target("llama", seed=0, vocab=len(tokenizer), layers=2)
    small.config.max_position_embeddings = 64
    records = [{"prompt": "Hello there"}, {"prompt": "word " * 80}]
    messages = []
    out = tmp_path / "r.jsonl"
    assert regenerate(small, tokenizer, records, out, max_new_tokens=4, progress=False, log=messages.append) == 1
    assert [r["source_index"] for r in read_jsonl(out)] == [0]
    assert any("Skipping 1 of 2" in m and "truncate_left" in m for m in messages)
    out2 = tmp_path / "t.jsonl"
    assert regenerate(small, tokenizer, records, out2, max_new_tokens=4, progress=False, truncate_left=True) == 2


def test_text_and_token_records_raise(target, tokenizer, tmp_path):
    out = tmp_path / "regen.jsonl"
    with pytest.raises(ValueError, match="nothing to regenerate"):
        regenerate(target, tokenizer, RECORDS[:2] + [{"text": "plain text"}], out, progress=False, log=None)
    assert not out.exists() or out.read_text() == ""
    with pytest.raises(ValueError, match="nothing to regenerate"):
        regenerate(target, tokenizer, [{"input_ids": [7, 8, 9]}], out, progress=False, log=None)
    with pytest.raises(ValueError, match="temperature"):
        regenerate(target, tokenizer, RECORDS, out, temperature=-1.0, progress=False, log=None)


def test_no_chat_template_and_no_pad_token(target, tmp_path):
    tok = make_tokenizer(chat_template=False, pad=False)
    assert tok.pad_token is None
    records = [{"prompt": "Hello there"}, {"prompt": "Why not"}]
    out = tmp_path / "regen.jsonl"
    assert regenerate(target, tok, records, out, max_new_tokens=MAX_NEW, progress=False, log=None) == 2
    assert tok.pad_token == tok.eos_token
    for line, record in zip(read_jsonl(out), records):
        ids = torch.tensor([tok(record["prompt"])["input_ids"]])
        ref = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=5
        )
        assert line["response"] == tok.decode(ref[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
        assert line["prompt"] == record["prompt"]


def test_records_from_jsonl_path(target, tokenizer, tmp_path):
    src = tmp_path / "data.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:3]), encoding="utf-8")
    out = tmp_path / "regen.jsonl"
    assert regenerate(target, tokenizer, src, out, max_new_tokens=MAX_NEW, progress=False, log=None) == 3
    direct = tmp_path / "direct.jsonl"
    regenerate(target, tokenizer, RECORDS[:3], direct, max_new_tokens=MAX_NEW, progress=False, log=None)
    assert out.read_bytes() == direct.read_bytes()
