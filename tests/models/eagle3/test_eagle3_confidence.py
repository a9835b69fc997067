"""EAGLE-3's confidence stop (``draft_confidence_threshold``): variable-length chains from a real family."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_K, make_target, ragged_batch
from test_tree import _chi_square_pvalue, _exact_second_third, _tree_sampling_target

from hf_specdec import AutoModelForDrafting, Eagle3Config, Eagle3ForDrafting, Proposal


def _drafter(target, seed=0, **kw):
    torch.manual_seed(seed)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, **kw)).eval()
    with torch.no_grad():  # agree with the target often (its head), so that confidence varies along chains
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[: drafter.lm_head.weight.shape[0]] * 3)
    return drafter


@pytest.mark.parametrize("batch", [1, 3])
def test_confidence_stop_gives_ragged_lengths_and_greedy_identity(batch):
    target = make_target("llama", seed=5, sharpen=3.0)
    drafter = _drafter(target)
    ids, mask = ragged_batch(batch, seed=1)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False)
    ref = target.generate(ids, **kwargs)
    out = target.generate(
        ids, assistant_model=drafter, draft_confidence_threshold=0.1, return_dict_in_generate=True, **kwargs, **FIXED_K
    )
    assert torch.equal(out.sequences, ref)
    drafted = {d for row in out.draft_lengths for d in row}
    assert len(drafted) > 2 and min(drafted) < 5  # the threshold cut chains at different depths
    full = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    assert sum(map(sum, out.draft_lengths)) < sum(map(sum, full.draft_lengths))
    with pytest.raises(ValueError, match="probability in"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, draft_confidence_threshold=2.0)


class DecidesAfterDrawing(Eagle3ForDrafting):
    """Control with a subtle bug: the chain stops at the first *drawn* token whose draft probability is below the
    threshold, so whether a token is proposed depends on the token itself — its law is no longer q."""

    def propose(self, state, num_tokens, select):
        threshold, state.confidence_threshold = state.confidence_threshold, None
        proposal = super().propose(state, num_tokens, select)
        state.confidence_threshold = threshold
        q_x = proposal.draft_probs.gather(-1, proposal.tokens[..., None]).squeeze(-1)
        lengths = (q_x >= threshold).long().cumprod(dim=1).sum(dim=1)
        return Proposal(tokens=proposal.tokens, draft_probs=proposal.draft_probs, lengths=lengths)


@pytest.mark.parametrize("lossless", [True, False])
def test_confidence_stop_keeps_sampling_lossless(lossless):
    """The stop is decided from the distribution before its token is drawn, so sampling stays exact (chi-square on
    the joint law of two tokens drafted in one pass, p > 1e-3); the control that decides after drawing fails."""
    torch.manual_seed(3)
    target = _tree_sampling_target()
    drafter = _drafter(target, seed=1, num_draft_tokens=3)
    threshold = 0.3
    if not lossless:
        buggy = DecidesAfterDrawing(drafter.config).eval()
        buggy.load_state_dict(drafter.state_dict())
        drafter, threshold = buggy, 0.15
    prompt = torch.tensor([1, 7, 9, 14])
    joint = _exact_second_third(target, prompt)
    v = joint.shape[0]
    out = target.generate(
        prompt[None].expand(6000, -1), assistant_model=drafter, do_sample=True, max_new_tokens=4, top_k=0,
        temperature=1.0, eos_token_id=None, draft_confidence_threshold=threshold, return_dict_in_generate=True,
    )  # fmt: skip
    first = [row[0] for row in out.draft_lengths]
    assert {0, 1, 2} <= set(first)
    gen = out.sequences[:, prompt.shape[0] :]
    counts = torch.bincount(gen[:, 1] * v + gen[:, 2], minlength=v * v).double()
    p_joint = _chi_square_pvalue(counts, joint.flatten().double())
    p_second = _chi_square_pvalue(torch.bincount(gen[:, 1], minlength=v).double(), joint.sum(1).double())
    if lossless:
        assert p_joint > 1e-3 and p_second > 1e-3, (p_joint, p_second)
    else:
        assert min(p_joint, p_second) < 1e-6, (p_joint, p_second)
