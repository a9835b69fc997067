"""N-gram copies at each draft position (``copy_threshold``): where the drafter is unsure, a chain drafts the token
that followed the text's latest matching 2-3 tokens. The lookup, the selection rule, identity and losslessness."""

from __future__ import annotations

import pytest
import torch
from helpers import make_oracle, make_target, ragged_batch, repetitive_prompt

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.generation.logits import ScoreProcessor
from hf_specdec.generation.loop import _DraftSelector
from hf_specdec.generation.ngram import NgramIndex


def _reference(text: list[int], drafted: list[int], sizes=(3, 2)) -> int | None:
    """What followed the latest earlier occurrence (in ``text``) of the last n tokens of ``text + drafted``."""
    full = text + drafted
    for n in sizes:
        if len(full) < n:
            continue
        query = full[-n:]
        for w in range(len(text) - n - 1, -1, -1):  # the window's next token must lie in the committed text
            if text[w : w + n] == query:
                return text[w + n]
    return None


def _next_tokens(seq, starts, lengths, depth, ngram_sizes=None):
    """The index's look-up after ``depth`` drafted tokens, read from ``seq`` past each row's text."""
    drafted = [tuple(seq[b, lengths[b] : lengths[b] + depth].tolist()) for b in range(seq.shape[0])]
    return NgramIndex(seq, starts, lengths, ngram_sizes=ngram_sizes).next_tokens(drafted)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_next_tokens_match_a_reference_lookup(depth):
    gen = torch.Generator().manual_seed(depth)
    bsz, width = 6, 40
    seq = torch.randint(1, 5, (bsz, width), generator=gen)  # 4 symbols: many repeated bigrams and trigrams
    starts = torch.tensor([0, 3, 0, 7, 2, 0])
    lengths = torch.tensor([30, 25, 2, 20, 33, 12])  # row 2: too short for any match
    seq[torch.arange(width)[None] < starts[:, None]] = 0  # left padding never matches (0 is not a symbol)
    tokens, found = _next_tokens(seq, starts, lengths, depth)
    assert int(found.sum()) >= 2  # the comparison sees matches, not only empty rows
    for b in range(bsz):
        text = seq[b, starts[b] : lengths[b]].tolist()
        drafted = seq[b, lengths[b] : lengths[b] + depth].tolist()
        expected = _reference(text, drafted)
        assert bool(found[b]) == (expected is not None), (b, text, drafted)
        if expected is not None:
            assert int(tokens[b]) == expected, (b, text, drafted)


def test_next_tokens_prefer_the_longest_ngram_and_skip_padding():
    #        pad pad  9  5  6  7  8  1  6  7  2  5  6  7
    row = [9, 9, 9, 5, 6, 7, 8, 1, 6, 7, 2, 5, 6, 7]
    seq = torch.tensor([row + [0, 0]])
    tokens, found = _next_tokens(seq, torch.tensor([2]), torch.tensor([len(row)]), 0)
    assert found.tolist() == [True] and tokens.tolist() == [8]  # "5 6 7" -> 8, not the later bigram "6 7" -> 2
    # Row text 1 9 9 after the pad tokens 9 9: the query "9 9" occurs earlier only inside the padding.
    padded = torch.tensor([[9, 9, 1, 9, 9, 0]])
    _, found = _next_tokens(padded, torch.tensor([2]), torch.tensor([5]), 0, ngram_sizes=(2,))
    assert found.tolist() == [False]
    tokens, found = _next_tokens(padded, torch.tensor([0]), torch.tensor([5]), 0, ngram_sizes=(2,))
    assert found.tolist() == [True] and tokens.tolist() == [1]  # the same columns as text: 9 9 was followed by 1


def _selector(seq, lengths, threshold, do_sample=False, vocab=12, processor=None):
    return _DraftSelector(
        processor or ScoreProcessor(None, seq.shape[0]),
        seq,
        lengths,
        do_sample,
        vocab,
        threshold,
        NgramIndex(seq, torch.zeros_like(lengths), lengths),
    )


def test_selector_copies_where_the_drafter_is_unsure_and_keeps_its_token_elsewhere():
    text = [1, 2, 3, 4, 5, 2, 3]  # the last bigram "2 3" was followed by 4
    seq = torch.tensor([text + [0] * 5, text + [0] * 5, [1, 6, 7, 8, 9, 10, 11] + [0] * 5])
    lengths = torch.tensor([7, 7, 7])
    logits = torch.zeros(3, 12)
    logits[0, 9] = 8.0  # row 0: sure of 9
    logits[1, 9] = 0.5  # row 1: unsure (top probability about 0.14)
    logits[2, 9] = 0.5  # row 2: unsure, but its text has no repeated n-gram
    select = _selector(seq, lengths, 0.7)
    tokens, probs = select(logits, 0)
    assert tokens.tolist() == [9, 4, 9] and probs is None
    # Depth 1: rows 0 and 1 now end in "3 9" / "3 4"; "3 4" occurred before (followed by 5), "3 9" did not.
    tokens, _ = select(torch.zeros(3, 12), 1)
    assert tokens.tolist()[1] == 5 and tokens.tolist()[0] != 5
    # A new chain starts again from the committed text: depth 0 forgets the tokens drafted before.
    tokens, _ = select(torch.zeros(3, 12), 0)
    assert tokens.tolist()[:2] == [4, 4]
    off, _ = _selector(seq, lengths, 0.0)(logits, 0)
    assert off.tolist() == [9, 9, 9]


def test_copied_tokens_are_point_masses_when_sampling_and_processors_can_rule_them_out():
    from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper

    text = [1, 2, 3, 4, 5, 2, 3]
    seq = torch.tensor([text + [0] * 5, text + [0] * 5])
    lengths = torch.tensor([7, 7])
    logits = torch.zeros(2, 12)
    logits[1, 4] = -10.0  # row 1 ranks the copy (4) last
    torch.manual_seed(0)
    tokens, probs = _selector(seq, lengths, 1.0, do_sample=True)(logits, 0)
    assert tokens.tolist() == [4, 4]
    assert probs[0].tolist() == torch.nn.functional.one_hot(torch.tensor(4), 12).float().tolist()
    top11 = ScoreProcessor(LogitsProcessorList([TopKLogitsWarper(top_k=11)]), 2)  # rules out row 1's last token
    tokens, probs = _selector(seq, lengths, 1.0, do_sample=True, processor=top11)(logits, 0)
    assert tokens[0].item() == 4 and tokens[1].item() != 4
    assert probs[1, 4].item() == 0.0 and probs[1].max().item() < 1.0  # row 1 kept its own draw and q


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_with_copies_everywhere(batch):
    """Copies wherever there is a match (threshold 1) and an oracle drafter wrong half the time: the output is plain
    greedy decoding's."""
    target = make_target("llama", sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    drafter = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.5, seed=1, num_draft_tokens=3)
    for threshold in (1.0, 0.7):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                              draft_length="fixed", copy_threshold=threshold)  # fmt: skip
        assert torch.equal(out, ref), threshold


def test_copies_lift_an_unsure_drafter_on_repetitive_text():
    """A target that falls into a loop of its own output and a fresh (unsure) drafter: with the copies its chains are
    accepted where the text repeats (without them never), and the output is the same."""
    target = make_target("llama")
    ids = torch.arange(6, 30)[None].repeat(1, 3)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    committed = {}
    for threshold in (0.0, 1.0):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, draft_length="fixed",
                              lookup_tokens=0, copy_threshold=threshold, return_dict_in_generate=True)  # fmt: skip
        assert torch.equal(out.sequences, ref)
        committed[threshold] = out.accepted_lengths[0]  # tokens each pass committed
    assert max(committed[0.0]) == 1  # the fresh drafter alone is never right
    assert max(committed[1.0]) == 4 and len(committed[1.0]) < len(committed[0.0]), committed
    # Without prompt lookup the copies are off unless asked for (lookup_tokens=0: no copying from the text).
    alone = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, draft_length="fixed",
                            lookup_tokens=0, return_dict_in_generate=True)  # fmt: skip
    assert alone.accepted_lengths[0] == committed[0.0]


def test_a_trees_chain_shaped_size_drafts_the_copies_too():
    """An EAGLE-2 tree of one node per depth is the drafter's chain: it is drafted as one, so the copies lift it on
    repetitive text as they lift a chain (without them the fresh drafter is never right), a prompt-lookup copy that
    starts like it is merged in, and the output is the same."""
    target = make_target("llama")
    ids = torch.arange(6, 30)[None].repeat(1, 3)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    tree = dict(tree="eagle2", tree_depth=3, tree_top_k=1, tree_total_tokens=3)
    committed = {}
    for threshold in (0.0, 1.0):
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, draft_length="fixed",
                              lookup_tokens=0, copy_threshold=threshold, return_dict_in_generate=True,
                              **tree)  # fmt: skip
        assert torch.equal(out.sequences, ref)
        committed[threshold] = out.accepted_lengths[0]
    assert max(committed[0.0]) == 1
    assert max(committed[1.0]) == 4 and len(committed[1.0]) < len(committed[0.0]), committed
    merged = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, draft_length="fixed",
                             lookup_tokens=8, copy_threshold=1.0, return_dict_in_generate=True, **tree)  # fmt: skip
    assert torch.equal(merged.sequences, ref)
    assert max(merged.accepted_lengths[0]) > 4  # the chain of 3, extended by the copy it starts like


@pytest.mark.parametrize("value", [-0.1, 1.5, True, "high"])
def test_bad_copy_thresholds_are_refused(value):
    target = make_target("llama")
    ids, mask = ragged_batch(1)
    drafter = make_oracle(target, torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ValueError, match="copy_threshold must be a number in"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, copy_threshold=value)


def test_sampling_stays_lossless_with_copies_everywhere(monkeypatch):
    """The shared law check (``sampling_check.py``) with a copy at every draft position that has a unigram match
    (threshold 1): copies are point masses chosen from the text and the drafter's distribution alone. The output law
    stays the target's, and the check rejects a verifier that samples from p after a rejection."""
    from sampling_check import (
        PROMPT,
        ResidualIsTargetVerifier,
        describe,
        exact_laws,
        fails_check,
        law_pvalues,
        sample,
        sampling_target,
    )

    from hf_specdec.generation import loop, ngram

    monkeypatch.setattr(ngram, "NGRAM_SIZES", (1,))  # unigram matches: copies nearly always
    copied = []
    original = loop._DraftSelector._copy_where_unsure

    def counting(self, tokens, probs, scores, depth):
        tokens, probs = original(self, tokens, probs, scores, depth)
        copied.append(int((probs.amax(dim=-1) == 1.0).sum()))  # the drafter's own q is never a point mass here
        return tokens, probs

    monkeypatch.setattr(loop._DraftSelector, "_copy_where_unsure", counting)
    prompt = tuple(range(4, 16)) + PROMPT
    target = sampling_target()
    laws = exact_laws(target, prompt)
    torch.manual_seed(6)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    opts = {"num_assistant_tokens": 3, "lookup_tokens": 0, "copy_threshold": 1.0}
    _, gen = sample(target, drafter, prompt=prompt, **opts)
    assert sum(copied) > 4000, f"only {sum(copied)} draft tokens were copies: the copies were not exercised"
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), f"the output law differs from the target's: {describe(pvalues)}"
    _, bad = sample(target, drafter, verifier=ResidualIsTargetVerifier(), prompt=prompt, **opts)
    assert fails_check(law_pvalues(bad, laws)), "the check cannot tell a wrong residual apart"


def test_calls_with_another_copy_threshold_learn_their_draft_lengths_apart():
    """The copies change what every draft depth accepts, so the adaptive length keeps a controller per threshold (a
    benchmark's rows with and without copies do not teach each other)."""
    from hf_specdec.generation.adaptive import controller_for, draft_length_memory

    target = make_target("llama")
    ids, mask = ragged_batch(1)
    drafter = make_oracle(target, torch.zeros(1, 40, dtype=torch.long), num_draft_tokens=3)
    default = controller_for(drafter, target, 3, None, 1, False, torch.device("cpu"))
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8, copy_threshold=0)
    assert default.passes == 0
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8)
    assert default.passes > 0
    # A tree's chain-shaped sizes take the copies too, so its calls learn apart the same way.
    tree = dict(tree="eagle2", tree_depth=3, tree_top_k=2, tree_total_tokens=6)
    tree_drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    for threshold in (0.0, None):
        target.generate(ids, attention_mask=mask, assistant_model=tree_drafter, max_new_tokens=8,
                        copy_threshold=threshold, **tree)  # fmt: skip
    memory = draft_length_memory(tree_drafter)._by_target[target]
    assert {key[-1] for key in memory if key[3] is not None} == {(), (("copy_threshold", 0.0),)}
