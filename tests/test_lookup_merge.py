"""Prompt lookup merged into drafted chains (``lookup_tokens``): the lookup, the merge rule, identity and
losslessness."""

from __future__ import annotations

import pytest
import torch
from helpers import make_oracle, make_target, ragged_batch, repetitive_prompt

from hf_specdec import AutoModelForDrafting, Eagle3Config, Proposal
from hf_specdec.generation.ngram import CopyOutcomes, NgramIndex, lookup_continuations, merge_lookup


def test_lookup_finds_the_latest_occurrence_of_the_longest_ngram():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12
    row = [0, 0, 5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]  # two pads, then text ending with 5 6 7
    seq = torch.tensor([row + [0, 0, 0]])
    toks, n = lookup_continuations(seq, torch.tensor([2]), torch.tensor([len(row)]), 4)
    assert n.tolist() == [4] and toks.tolist() == [[1, 2, 5, 6]]  # after the latest 5 6 7 (not the first one)
    short, n = lookup_continuations(seq, torch.tensor([2]), torch.tensor([len(row)]), 10)
    assert n.tolist() == [5] and short[0, :5].tolist() == [1, 2, 5, 6, 7]  # stops at the end of the text


def test_lookup_falls_back_to_shorter_ngrams_and_ignores_padding():
    seq = torch.tensor([[3, 3, 9, 4, 8, 2, 4], [3, 3, 9, 4, 5, 6, 7]])
    toks, n = lookup_continuations(seq, torch.tensor([0, 2]), torch.tensor([7, 7]), 3, ngram_sizes=(3, 2, 1))
    assert n.tolist()[0] == 3 and toks[0].tolist() == [8, 2, 4]  # only the unigram 4 matches
    assert n.tolist()[1] == 0  # 7 never occurred before in row 1's text
    # The padding (3 3) of row 1 is not text: a lookup of "3" there finds nothing.
    seq2 = torch.tensor([[3, 3, 9, 3]])
    _, n2 = lookup_continuations(seq2, torch.tensor([2]), torch.tensor([4]), 3, ngram_sizes=(1,))
    assert n2.tolist() == [0]


@pytest.mark.parametrize("sizes", [(3, 2), (3, 2, 1)])
def test_the_ngram_index_finds_what_a_scan_of_the_whole_text_finds_as_rows_grow(sizes):
    """The loop looks copies up in an index it extends with each pass's committed tokens; at every pass it must
    give what the scan of each row's text (left padding, rows that commit nothing, several tokens at once) gives."""
    gen = torch.Generator().manual_seed(3)
    bsz, prompt, width = 3, 12, 80
    seq = torch.randint(0, 5, (bsz, width), generator=gen)  # a small vocabulary: n-grams repeat often
    starts = torch.tensor([0, 4, 9])  # left padding the text must not see
    lengths = torch.full((bsz,), prompt)
    index = NgramIndex(seq, starts, lengths, ngram_sizes=sizes)
    found = 0
    while int(lengths.max()) < width - 4:
        for num_tokens in (1, 6):
            got = index.continuations(num_tokens)
            want = lookup_continuations(seq, starts, lengths, num_tokens, ngram_sizes=sizes)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            found += int((want[1] > 0).sum())
        counts = torch.randint(0, 4, (bsz,), generator=gen)
        new = torch.randint(0, 5, (bsz, 3), generator=gen)
        seq.scatter_(1, lengths[:, None] + torch.arange(3)[None], new)  # past a row's count: scratch, not text
        index.extend(new, counts)
        lengths = lengths + counts
    assert found > 50  # the comparison saw many matches, not only empty rows


def test_copy_outcomes_wait_for_their_text_then_count_what_a_lookup_pass_commits():
    outcomes = CopyOutcomes()
    everyone = torch.ones(3, dtype=torch.bool)
    # Row 0 ends at 4, row 1 at 6 (it has no copy), row 2 at 3.
    copies = Proposal(tokens=torch.tensor([[7, 8, 9], [0, 0, 0], [5, 5, 0]]), lengths=torch.tensor([3, 0, 2]))
    outcomes.add(copies, torch.tensor([4, 6, 3]), everyone)
    seq = torch.tensor([[1, 2, 3, 4, 7, 8, 0, 0, 0], [1, 2, 3, 4, 7, 6, 6, 0, 0], [1, 2, 3, 5, 6, 0, 0, 0, 0]])
    none = ~everyone
    # Row 2, the row furthest behind, has repeated its copy's first token so far: the pass could still move the
    # call on by 2 or by 3 (up to row 1, which commits its one token, to 7).
    assert outcomes.resolve(seq, torch.tensor([6, 7, 4]), none) == []
    # Row 2's text departs from its copy at the second token: that pass commits 2 tokens there (from 3 to 5), row 0
    # at least 3 (from 4 to 7, still repeating its copy), row 1 its one (from 6 to 7): the row furthest behind was at
    # 3 and the shortest would now be at 5, so the pass moves the call on by 2 (not the rows' mean), whatever row 0's
    # copy goes on to repeat.
    assert outcomes.resolve(seq, torch.tensor([6, 7, 5]), none) == [2.0]
    assert not outcomes.pending


def test_a_copy_the_text_departs_from_is_scored_at_once_not_when_its_text_is_as_long():
    """A ten-token copy rejected at its first token settles one token later: the estimate follows failing copies
    pass by pass (scored only once ten tokens had followed, a run of them left it on earlier copies' outcomes)."""
    outcomes = CopyOutcomes()
    seq = torch.tensor([[1, 2, 3, 4] + [0] * 12])
    one = torch.ones(1, dtype=torch.bool)
    outcomes.add(
        Proposal(tokens=torch.tensor([list(range(5, 15))]), lengths=torch.tensor([10])), torch.tensor([4]), one
    )
    seq[0, 4] = 5  # the copy's first token holds
    assert outcomes.resolve(seq, torch.tensor([5]), ~one) == []
    seq[0, 5] = 9  # its second does not: a lookup pass would have committed 5 and the target's 9
    assert outcomes.resolve(seq, torch.tensor([6]), ~one) == [2.0]
    assert not outcomes.pending


def test_a_copy_still_repeated_in_a_row_ahead_does_not_hold_back_the_pass_nor_count_twice():
    outcomes = CopyOutcomes()
    both = torch.ones(2, dtype=torch.bool)
    seq = torch.tensor([[1, 2, 3, 4, 7, 8, 9, 10, 11, 0], [1, 2, 3, 4, 6, 2, 0, 0, 0, 0]])
    # Both rows end at 4: row 0 copies 7 8 9 10 (its text repeats all of it), row 1 copies 5 (its text has 6).
    outcomes.add(Proposal(tokens=torch.tensor([[7, 8, 9, 10], [5, 0, 0, 0]]), lengths=torch.tensor([4, 1])),
                 torch.tensor([4, 4]), both)  # fmt: skip
    # A token later row 1 settles the pass at 1 token, whatever row 0's copy goes on to repeat.
    assert outcomes.resolve(seq, torch.tensor([5, 5]), ~both) == [1.0]
    # The next pass's copy in row 0 lies inside the copy the text still repeats: only row 1's copy is scored.
    outcomes.add(Proposal(tokens=torch.tensor([[8, 9, 10, 11], [3, 0, 0, 0]]), lengths=torch.tensor([4, 1])),
                 torch.tensor([5, 5]), both)  # fmt: skip
    assert outcomes.resolve(seq, torch.tensor([6, 6]), ~both) == [1.0]
    assert outcomes.stops == {0: (4, [7, 8, 9, 10]), 1: 6}
    # A pass whose only copy lies inside row 0's is worth the one token of row 1, which has none; and once the text
    # settles row 0's copy (4 tokens and the target's own), its next copies are scored after it.
    outcomes.add(
        Proposal(tokens=torch.tensor([[9, 9], [0, 0]]), lengths=torch.tensor([2, 0])), torch.tensor([6, 6]), both
    )
    assert outcomes.resolve(seq, torch.tensor([9, 7]), ~both) == [1.0]
    assert outcomes.stops[0] == 9 and not outcomes.pending


def test_copy_outcomes_of_finished_rows_count_what_they_committed():
    outcomes = CopyOutcomes()
    seq = torch.tensor([[1, 2, 3, 4, 7, 8, 9, 0, 0], [1, 2, 3, 4, 4, 0, 0, 0, 0], [1, 2, 3, 5, 6, 0, 0, 0, 0]])
    # A row that finished before its copy's end counts only the tokens it committed, and none where it ended.
    outcomes.add(Proposal(tokens=torch.tensor([[9, 9], [4, 7], [0, 0]]), lengths=torch.tensor([2, 2, 0])),
                 torch.tensor([7, 4, 5]), torch.ones(3, dtype=torch.bool))  # fmt: skip
    assert outcomes.resolve(seq, torch.tensor([7, 5, 5]), torch.tensor([True, True, False])) == [1.0]
    # A pass whose only copy's row finished where the copy began has no outcome.
    outcomes.add(Proposal(tokens=torch.tensor([[9], [0], [0]]), lengths=torch.tensor([1, 0, 0])),
                 torch.tensor([7, 5, 5]), torch.tensor([True, False, False]))  # fmt: skip
    assert outcomes.resolve(seq, torch.tensor([7, 5, 5]), torch.tensor([True, True, True])) == []
    assert not outcomes.pending


def test_copies_inside_what_an_earlier_copy_would_commit_are_not_scored():
    """Plain steps through a repeated run: the run is scored once, at its start, as a pass verifying it would
    commit it, not again one token shorter at each step."""
    outcomes = CopyOutcomes()
    seq = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 9, 4, 4, 4]])
    one = torch.ones(1, dtype=torch.bool)
    for end, copy in [(6, [7, 8]), (7, [8, 5]), (8, [9, 9]), (9, [4, 3])]:  # the copies after each plain step
        outcomes.add(Proposal(tokens=torch.tensor([copy]), lengths=torch.tensor([2])), torch.tensor([end]), one)
    # At 6 the copy 7 8 holds, and a pass verifying it commits 7 8 9 (3 tokens): the copies at 7 and 8 lie inside
    # it; the next pass would begin at 9, where the copy holds for one token (then the target's own: 2).
    assert outcomes.resolve(seq, torch.tensor([12]), ~one) == [3.0, 2.0]


def _chain(tokens, probs=None, lengths=None):
    return Proposal(tokens=torch.tensor(tokens), draft_probs=probs, lengths=lengths)


def test_merge_switches_only_rows_whose_draft_agrees_with_the_copy():
    # Row texts end with "5 6"; earlier "5 6" was followed by 7 8 9 10.
    text = [5, 6, 7, 8, 9, 10, 1, 5, 6]
    seq = torch.tensor([text, text, [1, 2, 3, 4, 2, 2, 2, 2, 2]])
    starts, lengths = torch.zeros(3, dtype=torch.long), torch.full((3,), 9)
    prop = _chain([[7, 8, 1], [7, 4, 4], [7, 8, 9]])
    merged, switched = merge_lookup(prop, seq, starts, lengths, num_tokens=4, agree=2)
    assert switched.tolist() == [True, False, False]  # row 1 disagrees at token 2; row 2 has no match
    assert merged.tokens.shape == (3, 4)
    assert merged.tokens[0].tolist() == [7, 8, 9, 10]
    assert merged.tokens[1, :3].tolist() == [7, 4, 4] and merged.lengths.tolist() == [4, 3, 3]


def test_merged_copies_are_point_masses_and_drawn_tokens_keep_their_law():
    text = [5, 6, 7, 8, 9, 10, 1, 5, 6]
    seq = torch.tensor([text])
    q = torch.softmax(torch.randn(1, 3, 12), dim=-1)
    merged, switched = merge_lookup(
        _chain([[7, 8, 1]], probs=q), seq, torch.zeros(1, dtype=torch.long), torch.tensor([9]), 4, agree=2
    )
    assert switched.tolist() == [True]
    assert torch.equal(merged.draft_probs[0, :2], q[0, :2])  # the drafter's own draws keep their q
    assert merged.draft_probs[0, 2].tolist() == torch.nn.functional.one_hot(torch.tensor(9), 12).float().tolist()
    assert merged.draft_probs[0, 3].argmax().item() == 10 and merged.draft_probs[0, 3].max().item() == 1.0


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_with_lookup(batch):
    target = make_target("llama", sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    cont = ref[:, ids.shape[1] :]
    # An oracle drafter that is right about half the time (it then agrees with a copy when the copy is right).
    drafter = make_oracle(target, cont, corruption=0.4, seed=1, num_draft_tokens=3)
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False, lookup_tokens=8,
        draft_length="fixed", return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    off = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False, lookup_tokens=0,
        draft_length="fixed", return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(off.sequences, ref) and off.timings["lookup_rows"] == 0


def test_lookup_copies_raise_tokens_per_pass_on_repetitive_text():
    """A target that repeats its prompt: an unhelpful drafter (always wrong after its first token) gets long accepted
    chains from the copies, and never drafts more than ``lookup_tokens``."""
    target = make_target("llama")
    ids = torch.arange(6, 30)[None].repeat(1, 3)  # 6..29 three times: the target's best guess is to continue it
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    cont = ref[:, ids.shape[1] :]
    drafter = make_oracle(target, cont, corruption=0.0, num_draft_tokens=3)
    with_lookup = target.generate(
        ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, lookup_tokens=8, draft_length="fixed",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(with_lookup.sequences, ref)
    assert max(max(row) for row in with_lookup.draft_lengths) <= 8
    copies = with_lookup.timings["lookup_rows"]
    if copies:  # the target continues its repetition: copies agree with the oracle and are used
        assert max(max(row) for row in with_lookup.accepted_lengths) > 4
    else:  # the target broke the pattern at once: nothing to copy (still identical)
        assert max(max(row) for row in with_lookup.draft_lengths) <= 3


def test_negative_lookup_is_refused():
    target = make_target("llama")
    ids, mask = ragged_batch(1)
    drafter = make_oracle(target, torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ValueError, match="lookup_tokens must be >= 0"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, lookup_tokens=-1)


def test_sampling_stays_lossless_with_lookup_copies(monkeypatch):
    """The shared law check (``sampling_check.py``) with copies merged as often as possible: unigram lookup and no
    agreement needed, so every row whose last token occurred before drafts the copy (point masses). K = 2 drafted
    tokens grow to 3 with a copy, inside the checked window. The output law stays the target's, and the check
    rejects a verifier that samples from p after a rejection."""
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

    from hf_specdec.generation import ngram

    monkeypatch.setattr(ngram, "AGREE", 0)
    monkeypatch.setattr(ngram, "NGRAM_SIZES", (1,))
    prompt = tuple(range(4, 16)) + PROMPT  # nearly every token occurs before: the first drawn token has a copy
    target = sampling_target()
    laws = exact_laws(target, prompt)
    torch.manual_seed(6)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2))
    opts = {"num_assistant_tokens": 2, "lookup_tokens": 3}
    out, gen = sample(target, drafter, prompt=prompt, **opts)
    copied = sum(1 for row in out.draft_lengths if row[0] == 3)
    assert copied > 1000, f"only {copied} rows drafted a copy in their first pass: the lookup was not exercised"
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), f"the output law differs from the target's: {describe(pvalues)}"
    _, bad = sample(target, drafter, verifier=ResidualIsTargetVerifier(), prompt=prompt, **opts)
    assert fails_check(law_pvalues(bad, laws)), "the check cannot tell a wrong residual apart"
