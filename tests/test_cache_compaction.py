"""Batched caches stay compact: dead slots (left padding, rejected draft tokens) are dropped as they pile up."""

from __future__ import annotations

import torch
from helpers import FIXED_K, make_oracle, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting
from hf_specdec.layers import SlotKVCache, compaction_index


def test_compaction_index_right_aligns_live_slots_in_order():
    valid = torch.tensor([[0, 1, 0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    index, new_valid = compaction_index(valid, min_waste=1, min_share=0.0)
    assert index[0].tolist() == [1, 3, 4] and new_valid[0].tolist() == [True, True, True]
    assert index[1, 0:].tolist()[0:] == [0, 1, 7] and new_valid[1].tolist() == [True, True, True]
    ragged = torch.tensor([[1, 0, 0, 0, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    index, new_valid = compaction_index(ragged, min_waste=1, min_share=0.0)
    assert new_valid.tolist() == [[True, True], [False, True]] and index[1, 1] == 4
    assert compaction_index(valid, min_waste=16) is None  # not worth it yet


def test_slot_cache_compaction_keeps_attention_outputs():
    torch.manual_seed(0)
    cache = SlotKVCache()
    k, v = torch.randn(2, 2, 40, 8), torch.randn(2, 2, 40, 8)
    valid = torch.rand(2, 40) < 0.3
    cache.append(k, v, valid)
    q = torch.randn(2, 2, 1, 8)
    from hf_specdec.layers import slot_attention

    def attend(c):
        keys = torch.cat([c.keys, k[:, :, :1]], dim=2)
        vals = torch.cat([c.values, v[:, :, :1]], dim=2)
        ok = torch.cat([c.valid, torch.ones(2, 1, dtype=torch.bool)], dim=1)
        return slot_attention(q, keys, vals, ok)

    before = attend(cache)
    assert cache.compact()
    assert cache.length == int(valid.sum(1).max())
    torch.testing.assert_close(attend(cache), before)


def test_batched_generation_compacts_the_cache_and_stays_identical():
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(4, seed=2)
    n = 120
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=n + 8, do_sample=False, eos_token_id=None)
    drafter = make_oracle(target, plain[:, ids.shape[1] :], corruption=0.35, num_draft_tokens=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None)
    # drafting every pass, chains of at most K: the adaptive length reads the clock and may run plain steps
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    longest = int(mask.sum(1).max()) + n - 1  # the cache covers every token but the last
    assert out.timings["cache_compactions"] > 0
    # Without compaction the cache would hold every rejected slot: here it stays within a margin of the longest row.
    assert out.timings["cache_length"] <= longest + 16 + 6 + longest // 10
    passes = len(out.accepted_lengths[0])
    assert out.timings["cache_length"] < ids.shape[1] + passes * 6  # far below prompt + every slot ever fed


def test_eagle3_drafter_cache_is_compacted_too():
    """The shipped demo target and drafter (real, ragged acceptance) at batch 3: both caches drop dead slots.

    Fixed draft length: the adaptive length chooses passes from measured wall-clock costs, so on a slow or noisy machine
    it may run plain steps and copies only, and the drafter would never see a rejected slot to drop."""
    from hf_specdec.demo import DEMO_DRAFTER, load_demo_target

    target, tok = load_demo_target()
    drafter = AutoModelForDrafting.from_pretrained(DEMO_DRAFTER).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(
        ["def fibonacci(n):\n", "import os\n\n\ndef walk(path):\n", "class Stack:\n"], return_tensors="pt", padding=True
    )
    kwargs = dict(**batch, max_new_tokens=96, do_sample=False)
    lengths = []
    original = drafter.observe

    def observe(state, inputs):
        original(state, inputs)
        lengths.append(state.cache.length)

    drafter.observe = observe
    out = target.generate(assistant_model=drafter, return_dict_in_generate=True, draft_length="fixed", **kwargs)
    assert torch.equal(out.sequences, target.generate(**kwargs))
    assert out.timings["cache_compactions"] > 0
    assert any(b < a for a, b in zip(lengths, lengths[1:]))  # the drafter cache shrank at least once
    rows = batch["attention_mask"].sum(1) + (out.sequences[:, batch["input_ids"].shape[1] :] != tok.pad_token_id).sum(1)
    assert lengths[-1] <= int(rows.max()) + 16 + int(rows.max()) // 10
