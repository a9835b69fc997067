"""Tests for hf_specdec.training.data: records, loss masks, packing, splitting, collation, resumable sampling."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hf_specdec.training.data import (
    DataCollator,
    DrafterDataset,
    ResumableBatchSampler,
    load_records,
    pack_examples,
    record_kind,
    split_train_eval,
    tokenize_record,
)

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Renders "<think></think>" only in the final assistant turn, so earlier turns render differently once the
# conversation goes on (like templates that strip reasoning from history): exercises the search fallback.
REWRITES_HISTORY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a terse assistant. What is the capital of France? Paris. And of Italy? Rome is the capital of Italy.",
    "system user assistant Question: Answer: Hello there, how are you? I am fine, thanks. The quick brown fox.",
    "ok Say it again. Paris. Right? Rome! Berlin, Madrid; numbers 0123456789 <think></think>",
]


@pytest.fixture(scope="module")
def backend_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok.to_str()


def _make_tokenizer(backend_json: str, template: str | None):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(backend_json),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token="<|begin_of_text|>",
        additional_special_tokens=SPECIALS[1:],
    )
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def chatml(backend_json):
    return _make_tokenizer(backend_json, CHATML)


@pytest.fixture(scope="module")
def llama3(backend_json):
    return _make_tokenizer(backend_json, LLAMA3)


@pytest.fixture(scope="module")
def plain(backend_json):
    return _make_tokenizer(backend_json, None)


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


def masked_runs(tok, ids, mask) -> list[str]:
    """Decodes each maximal run of masked tokens."""
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def first_masked(mask) -> int:
    return mask.index(1)


# ---------------------------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------------------------


def test_load_records_all_kinds_keeps_extra_keys_and_skips_blank_lines(tmp_path):
    rows = [
        {"messages": CONVERSATION, "id": "c1", "category": "chat"},
        {"prompt": "Question:", "response": " Paris.", "id": "p1"},
        {"prompt": "Question:"},
        {"text": "The quick brown fox.", "id": 7},
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [4, 5]},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n" + "\n\n".join(json.dumps(r) for r in rows) + "\n   \n")
    records = load_records(path)
    assert records == rows
    assert [record_kind(r) for r in records] == ["messages", "prompt", "prompt", "text", "tokens", "tokens"]
    assert records[0]["category"] == "chat" and records[3]["id"] == 7


def test_record_kind_unknown_raises():
    with pytest.raises(ValueError, match="unknown record kind"):
        record_kind({"question": "x"})


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ('{"text": "unterminated', "invalid JSON"),
        ('{"question": "hi"}', "unknown record kind"),
        ('{"messages": "hello"}', "non-empty list"),
        ('{"messages": [{"content": "hi"}]}', "'role' and 'content'"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "must be a string"),
        ('{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}', "length 2"),
        ('{"input_ids": [1, 2], "loss_mask": [0, 2]}', "0/1"),
        ('{"prompt": 5}', "'prompt' must be a string"),
        ("[1, 2, 3]", "JSON object"),
    ],
)
def test_load_records_bad_line_names_file_and_line(tmp_path, bad_line, problem):
    path = tmp_path / "bad.jsonl"
    # Line 4 is the bad one (line 2 is blank and still counts).
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n' + bad_line + '\n{"text": "c"}\n')
    with pytest.raises(ValueError) as info:
        load_records(path)
    message = str(info.value)
    assert f"{path}:4:" in message
    assert problem in message


# ---------------------------------------------------------------------------------------------------------------
# Chat loss masks
# ---------------------------------------------------------------------------------------------------------------


def test_chatml_mask_is_exactly_assistant_content_plus_end_of_turn(chatml):
    out = tokenize_record({"messages": CONVERSATION}, chatml)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask)
    # The token sequence is exactly the rendered template, with no extra specials.
    assert chatml.decode(ids, skip_special_tokens=False) == chatml.apply_chat_template(CONVERSATION, tokenize=False)
    assert masked_runs(chatml, ids, mask) == ["Paris.<|im_end|>", "Rome is the capital of Italy.<|im_end|>"]

    # Off-by-one: the header's last token ("\n") is not a target, the first content token is.
    k = first_masked(mask)
    assert chatml.decode(ids[:k], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert chatml.convert_ids_to_tokens(ids[k - 1]) == "Ċ" and mask[k - 1] == 0
    first_token = chatml.decode(ids[k : k + 1])
    assert first_token and "Paris.".startswith(first_token)

    # Header tokens, system/user tokens and the newline after <|im_end|> are all unmasked.
    im_start, im_end = chatml.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert all(m == 0 for t, m in zip(ids, mask) if t == im_start)
    assert [m for t, m in zip(ids, mask) if t == im_end] == [0, 0, 1, 0, 1]
    end_positions = [i for i, t in enumerate(ids) if t == im_end and mask[i]]
    assert all(mask[i + 1] == 0 for i in end_positions)
    assert "assistant" not in "".join(masked_runs(chatml, ids, mask))


def test_chatml_mask_when_user_repeats_assistant_text(chatml):
    messages = [
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "ok"},
    ]
    out = tokenize_record({"messages": messages}, chatml)
    assert masked_runs(chatml, out["input_ids"], out["loss_mask"]) == ["ok<|im_end|>", "ok<|im_end|>"]
    # The user's "ok" (right after the first "<|im_start|>user\n") is not masked.
    k = first_masked(out["loss_mask"])
    assert chatml.decode(out["input_ids"][:k], skip_special_tokens=False) == (
        "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_template_mask_is_template_agnostic_and_bos_not_doubled(llama3):
    messages = [dict(m) for m in CONVERSATION]
    messages[4]["content"] = "Rome is the capital of Italy.  "  # the template trims it
    out = tokenize_record({"messages": messages}, llama3)
    ids, mask = out["input_ids"], out["loss_mask"]
    bos = llama3.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1 and mask[0] == 0
    assert masked_runs(llama3, ids, mask) == ["Paris.<|eot_id|>", "Rome is the capital of Italy.<|eot_id|>"]
    k = first_masked(mask)
    assert llama3.decode(ids[:k], skip_special_tokens=False).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert mask[k - 1] == 0
    eot = llama3.convert_tokens_to_ids("<|eot_id|>")
    assert [m for t, m in zip(ids, mask) if t == eot] == [0, 0, 1, 0, 1]


@pytest.mark.parametrize(
    "template, header, end",
    [
        (CHATML, "<|im_start|>assistant\n", "<|im_end|>"),
        (LLAMA3, "<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ],
    ids=["chatml", "llama3"],
)
def test_conversation_opening_with_assistant_turn(backend_json, template, header, end):
    # transformers refuses to render the empty conversation before the first turn: the header is found another way.
    tok = _make_tokenizer(backend_json, template)
    messages = [
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "Paris."},
    ]
    out = tokenize_record({"messages": messages}, tok)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == [f"Hello there{end}", f"Paris.{end}"]
    k = first_masked(out["loss_mask"])
    assert tok.decode(out["input_ids"][:k], skip_special_tokens=False) == header


def test_template_that_rewrites_history_uses_search_fallback(backend_json):
    tok = _make_tokenizer(backend_json, REWRITES_HISTORY)
    messages = [
        {"role": "user", "content": "Paris. Right?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome!"},
    ]
    out = tokenize_record({"messages": messages}, tok)
    assert masked_runs(tok, out["input_ids"], out["loss_mask"]) == [
        "Paris.<|im_end|>",
        "<think></think>Rome!<|im_end|>",
    ]
    k = first_masked(out["loss_mask"])
    assert tok.decode(out["input_ids"][:k], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_conversation_without_assistant_has_no_loss(chatml):
    out = tokenize_record({"messages": CONVERSATION[:2]}, chatml)
    assert len(out["input_ids"]) > 5 and sum(out["loss_mask"]) == 0


def test_chat_record_without_template_raises(plain):
    with pytest.raises(ValueError, match="chat template"):
        tokenize_record({"messages": CONVERSATION}, plain)


class _NoOffsets:
    """A tokenizer without offset mapping (like a slow tokenizer) delegating to a fast one."""

    is_fast = False

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template
        self.eos_token_id = inner.eos_token_id

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def __call__(self, text, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError
        return self.inner(text, **kwargs)


def test_tokenizer_without_offsets_falls_back_to_pieces(chatml):
    fast = tokenize_record({"messages": CONVERSATION}, chatml)
    slow = tokenize_record({"messages": CONVERSATION}, _NoOffsets(chatml))
    assert slow == fast


# ---------------------------------------------------------------------------------------------------------------
# Other record kinds
# ---------------------------------------------------------------------------------------------------------------


def test_prompt_response_with_template_is_a_two_turn_chat(chatml):
    out = tokenize_record({"prompt": "What is the capital of France?", "response": "Paris."}, chatml)
    ref = tokenize_record(
        {
            "messages": [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ]
        },
        chatml,
    )
    assert out == ref
    assert masked_runs(chatml, out["input_ids"], out["loss_mask"]) == ["Paris.<|im_end|>"]


def test_prompt_response_without_template_masks_response_and_eos(plain):
    prompt, response = "Question: capital of France?\nAnswer:", " Paris."
    out = tokenize_record({"prompt": prompt, "response": response}, plain)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert ids == plain(prompt + response)["input_ids"] + [plain.eos_token_id]
    assert masked_runs(plain, ids, mask) == [" Paris.<|endoftext|>"]
    k = first_masked(mask)
    assert plain.decode(ids[:k]) == prompt and mask[-1] == 1


def test_prompt_without_response(chatml, plain):
    with_template = tokenize_record({"prompt": "Hello there"}, chatml)
    assert sum(with_template["loss_mask"]) == 0
    assert chatml.decode(with_template["input_ids"], skip_special_tokens=False) == (
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenize_record({"prompt": "Hello there"}, plain)
    assert without["input_ids"] == plain("Hello there")["input_ids"]
    assert sum(without["loss_mask"]) == 0


def test_text_record_masks_all_but_first(plain):
    out = tokenize_record({"text": "The quick brown fox."}, plain)
    assert out["input_ids"] == plain("The quick brown fox.")["input_ids"]
    n = len(out["input_ids"])
    assert n > 2 and out["loss_mask"] == [0] + [1] * (n - 1)


def test_tokens_record(plain):
    assert tokenize_record({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]}, plain) == {
        "input_ids": [5, 6, 7],
        "loss_mask": [0, 0, 1],
    }
    assert tokenize_record({"input_ids": [5, 6, 7, 8]}, None) == {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}


def test_truncation_from_the_right(chatml, plain):
    full = tokenize_record({"messages": CONVERSATION}, chatml)
    cut = tokenize_record({"messages": CONVERSATION}, chatml, max_length=20)
    assert cut == {"input_ids": full["input_ids"][:20], "loss_mask": full["loss_mask"][:20]}
    assert tokenize_record({"input_ids": list(range(10))}, plain, max_length=4) == {
        "input_ids": [0, 1, 2, 3],
        "loss_mask": [0, 1, 1, 1],
    }
    with pytest.raises(ValueError, match="max_length"):
        tokenize_record({"text": "x"}, plain, max_length=0)


# ---------------------------------------------------------------------------------------------------------------
# Dataset, packing, split
# ---------------------------------------------------------------------------------------------------------------


def test_dataset_from_records_drops_and_counts(chatml):
    records = [
        {"messages": CONVERSATION, "id": "a"},
        {"prompt": "Hello there"},  # no loss
        {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1], "id": "c"},
        {"input_ids": [4, 5], "loss_mask": [0, 0]},  # no loss
    ]
    ds = DrafterDataset.from_records(records, chatml)
    assert len(ds) == 2 and ds.num_dropped == 2
    assert [ex["id"] for ex in ds.examples] == ["a", "c"]
    chat = tokenize_record(records[0], chatml)
    assert ds.num_tokens == len(chat["input_ids"]) + 3
    assert ds.num_loss_tokens == sum(chat["loss_mask"]) + 1
    assert ds.lengths == [len(chat["input_ids"]), 3]
    item = ds[1]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == [1, 2, 3]
    assert item["loss_mask"].tolist() == [0, 0, 1] and item["index"] == 1

    strict = DrafterDataset.from_records(records, chatml, min_loss_tokens=2)
    assert len(strict) == 1 and strict.num_dropped == 3
    keep_all = DrafterDataset.from_records(records, chatml, min_loss_tokens=0)
    assert len(keep_all) == 4 and keep_all.num_dropped == 0


def test_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="loss_mask"):
        DrafterDataset([{"input_ids": [1, 2], "loss_mask": [1]}])


def _examples(lengths, start=1):
    out, tok = [], start
    for n in lengths:
        out.append({"input_ids": list(range(tok, tok + n)), "loss_mask": [1] * n})
        tok += n
    return out


def test_pack_examples_greedy_no_cross_document_loss():
    examples = _examples([5, 4, 3, 8, 12])
    packs = pack_examples(examples, max_length=10)
    assert [p["example_indices"] for p in packs] == [[0, 1], [2], [3], [4]]
    assert packs[0]["input_ids"] == examples[0]["input_ids"] + examples[1]["input_ids"]
    assert packs[0]["segment_ids"] == [0] * 5 + [1] * 4
    assert packs[0]["loss_mask"] == [0, 1, 1, 1, 1, 0, 1, 1, 1]
    assert packs[3]["input_ids"] == examples[4]["input_ids"][:10]  # truncated
    for p in packs:
        n = len(p["input_ids"])
        assert n <= 10 and len(p["loss_mask"]) == n == len(p["segment_ids"])
        starts = [t for t in range(n) if t == 0 or p["segment_ids"][t] != p["segment_ids"][t - 1]]
        assert all(p["loss_mask"][t] == 0 for t in starts)
        assert sum(p["loss_mask"]) == n - len(starts)
    # Input is not modified.
    assert examples[1]["loss_mask"][0] == 1


def test_packed_dataset_collates_segment_ids():
    packs = pack_examples(_examples([3, 2, 6]), max_length=6)
    ds = DrafterDataset(packs)
    batch = DataCollator(pad_token_id=0)([ds[0], ds[1]])
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 1, 1]]


def test_split_train_eval_deterministic_and_disjoint():
    ds = DrafterDataset([dict(ex, id=i) for i, ex in enumerate(_examples([3] * 50))])
    train, held_out = split_train_eval(ds, 0.1, seed=3)
    train2, held_out2 = split_train_eval(ds, 0.1, seed=3)

    def ids(d):
        return [ex["id"] for ex in d.examples]

    assert len(held_out) == 5 and len(train) == 45
    assert ids(held_out) == ids(held_out2) and ids(train) == ids(train2)
    assert set(ids(train)).isdisjoint(ids(held_out))
    assert sorted(ids(train) + ids(held_out)) == list(range(50))
    assert ids(held_out) == sorted(ids(held_out))
    _, other = split_train_eval(ds, 0.1, seed=4)
    assert ids(other) != ids(held_out)

    tiny = DrafterDataset(_examples([2, 2]))
    assert [len(d) for d in split_train_eval(tiny, 0.01)] == [1, 1]
    assert [len(d) for d in split_train_eval(DrafterDataset(_examples([2])), 0.5)] == [1, 0]
    assert [len(d) for d in split_train_eval(ds, 0.0)] == [50, 0]
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="eval_fraction"):
            split_train_eval(ds, bad)


# ---------------------------------------------------------------------------------------------------------------
# Collator
# ---------------------------------------------------------------------------------------------------------------


def test_collator_right_pads():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1]), "index": 4},
        {"input_ids": [8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1], "index": 9},
    ]
    batch = DataCollator(pad_token_id=99)(items)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99, 99], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert batch["index"].tolist() == [4, 9]
    assert "segment_ids" not in batch
    assert all(v.dtype == torch.long for v in batch.values())

    padded = DataCollator(pad_token_id=0, pad_to_multiple_of=4)(items)
    assert padded["input_ids"].shape == (2, 8)
    assert padded["attention_mask"].sum().item() == 8 and padded["loss_mask"][:, 5:].sum().item() == 0


# ---------------------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------------------


def _lengths(n=103, seed=0):
    rng = random.Random(seed)
    return [rng.randint(1, 50) for _ in range(n)]


@pytest.mark.parametrize("group_by_length", [False, True])
def test_sampler_resume_mid_epoch_matches_uninterrupted(group_by_length):
    lengths = _lengths()
    kwargs = dict(batch_size=8, shuffle=True, seed=11, group_by_length=group_by_length)
    reference = ResumableBatchSampler(lengths, **kwargs)
    epoch0, epoch1 = list(reference), list(reference)
    assert reference.epoch == 2 and reference.batches_yielded == 0
    assert len(epoch0) == len(reference) == 13
    for epoch in (epoch0, epoch1):
        assert sorted(i for b in epoch for i in b) == list(range(len(lengths)))
    assert epoch0 != epoch1

    interrupted = ResumableBatchSampler(lengths, **kwargs)
    iterator = iter(interrupted)
    first = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 0 and state["batches_yielded"] == 3

    restored = ResumableBatchSampler(lengths, **dict(kwargs, seed=0))
    restored.load_state_dict(state)
    restored.set_epoch(0)  # the usual call at the top of a training loop must not lose the position
    rest = list(restored)
    assert first + rest == epoch0
    assert len(rest) == len(epoch0) - 3
    assert restored.epoch == 1 and restored.batches_yielded == 0
    assert list(restored) == epoch1

    restored.set_epoch(0)
    assert list(restored) == epoch0


def test_sampler_without_shuffle_and_drop_last():
    sampler = ResumableBatchSampler(list(range(10)), batch_size=4, shuffle=False)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropping = ResumableBatchSampler(_lengths(30), batch_size=4, drop_last=True, group_by_length=True)
    batches = list(dropping)
    assert len(batches) == len(dropping) == 7 and all(len(b) == 4 for b in batches)


def test_sampler_load_state_dict_rejects_other_dataset():
    sampler = ResumableBatchSampler(_lengths(20), batch_size=4)
    with pytest.raises(ValueError, match="num_samples"):
        sampler.load_state_dict({"epoch": 0, "batches_yielded": 1, "seed": 0, "num_samples": 21, "batch_size": 4})


def _padding(batches, lengths):
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)


def test_group_by_length_reduces_padding():
    rng = random.Random(0)
    lengths = [rng.randint(500, 1000) if rng.random() < 0.05 else rng.randint(10, 20) for _ in range(800)]
    grouped = list(ResumableBatchSampler(lengths, batch_size=8, seed=1, group_by_length=True))
    plain = list(ResumableBatchSampler(lengths, batch_size=8, seed=1))
    assert sorted(i for b in grouped for i in b) == list(range(800))
    assert _padding(grouped, lengths) < 0.2 * _padding(plain, lengths)
    # Batches are shuffled after grouping: the longest batch is not simply first.
    batch_max = [max(lengths[i] for i in b) for b in grouped]
    assert batch_max != sorted(batch_max, reverse=True)


def test_dataloader_end_to_end(chatml):
    records = [{"messages": CONVERSATION}, {"text": "Hello there, how are you?"}, {"input_ids": [3, 4, 5, 6]}]
    ds = DrafterDataset.from_records(records * 3, chatml)
    sampler = ResumableBatchSampler(ds.lengths, batch_size=4, seed=2, group_by_length=True)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, collate_fn=DataCollator(chatml.pad_token_id))
    seen = []
    for batch in loader:
        assert batch["input_ids"].shape == batch["loss_mask"].shape == batch["attention_mask"].shape
        assert (batch["loss_mask"] <= batch["attention_mask"]).all()
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(9)) and sampler.epoch == 1
