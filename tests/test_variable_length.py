"""Variable-length proposals: a drafter may propose fewer tokens than asked, per row (``Proposal.lengths``)."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, FIXED_K, make_target, ragged_batch
from test_tree import _chi_square_pvalue, _exact_second_third, _tree_sampling_target

from hf_specdec import DrafterPreTrainedModel, Proposal
from hf_specdec.configuration_utils import DrafterConfig
from hf_specdec.verification import SpeculativeSamplingVerifier, register_verifier


class VarLenConfig(DrafterConfig):
    model_type = "varlen_test_drafter"
    seed: int = 0


class VarLenDrafter(DrafterPreTrainedModel):
    """Proposes a random number of tokens per row (0 included), like a drafter that stops at low confidence.

    Greedy: the target's own continuation (so acceptance is high). Sampling: tokens drawn by the loop's selector
    from a flattened copy of the target's distribution. Positions past a row's length hold the target's argmax, a
    token the verifier must never look at."""

    config_class = VarLenConfig
    requires_target_hidden_states = False
    requires_target_logits = True

    def __init__(self, config):
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))
        self.continuation = None
        self.violations = 0  # passes that accepted more tokens than the row proposed (the verifier's feedback)
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size, max_length):
        return {"n_gen": None, "gen": torch.Generator().manual_seed(self.config.seed), "proposals": []}

    def observe(self, state, inputs):
        added = inputs.valid.long().sum(1)
        state["n_gen"] = torch.ones_like(added) if state["n_gen"] is None else state["n_gen"] + added
        slot = torch.arange(inputs.valid.shape[1])
        last = torch.where(inputs.valid, slot, -1).max(1).values
        state["root"] = inputs.logits[torch.arange(inputs.valid.shape[0]), last].float()
        if inputs.feedback is not None:
            lengths = inputs.feedback.proposal.lengths
            self.violations += int((inputs.feedback.num_accepted > lengths).sum())

    def propose(self, state, num_tokens, select):
        bsz = state["root"].shape[0]
        lengths = torch.randint(0, num_tokens + 1, (bsz,), generator=state["gen"])
        if select.do_sample:
            toks, probs = [], []
            for depth in range(num_tokens):
                tok, q = select(state["root"] * 0.4, depth)
                toks.append(tok)
                probs.append(q)
            tokens, draft_probs = torch.stack(toks, 1), torch.stack(probs, 1)
        else:
            idx = (state["n_gen"][:, None] + torch.arange(num_tokens)[None]).clamp(max=self.continuation.shape[1] - 1)
            tokens, draft_probs = self.continuation.gather(1, idx), None
        col = torch.arange(num_tokens)[None]
        tokens = torch.where(col < lengths[:, None], tokens, state["root"].argmax(-1)[:, None])
        # every row may stop early: the proposal can be narrower than asked (or keep its padding, untrimmed)
        width = int(lengths.max()) if getattr(self, "trim", True) else num_tokens
        if draft_probs is not None:
            draft_probs = draft_probs[:, :width]
        proposal = Proposal(tokens=tokens[:, :width], draft_probs=draft_probs, lengths=lengths)
        state["proposals"].append(proposal)
        self.state_proposals = state["proposals"]
        return proposal


def _drafter(target, seed=0, k=4):
    return VarLenDrafter(VarLenConfig.for_target(target.config, seed=seed, num_draft_tokens=k)).eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_variable_length_chains_are_identical_to_plain_greedy(arch, batch):
    target = make_target(arch, seed=3)
    ids, mask = ragged_batch(batch, seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    drafter = _drafter(target, seed=batch)
    drafter.continuation = torch.cat([ref[:, ids.shape[1] :], ref[:, -6:]], dim=1)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    assert torch.equal(out.sequences, ref)
    assert drafter.violations == 0
    # Rows proposed different lengths in the same pass, some passes proposed nothing at all, and every pass
    # accepted exactly what the row proposed (the continuation is right), never the argmax padding behind it.
    drafted = [d for row in out.draft_lengths for d in row]
    assert 0 in drafted and max(drafted) == 4
    for acc_row, draft_row in zip(out.accepted_lengths, out.draft_lengths):
        assert all(a <= d + 1 for a, d in zip(acc_row, draft_row))


def test_asd_and_typical_honour_lengths():
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(3, seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    drafter = _drafter(target, seed=1)
    drafter.continuation = torch.cat([ref[:, ids.shape[1] :], ref[:, -6:]], dim=1)
    out = target.generate(ids, assistant_model=drafter, verifier="asd", asd_budget=0.0, **kwargs)
    assert torch.equal(out, ref)
    out = target.generate(
        ids, assistant_model=drafter, verifier="typical", return_dict_in_generate=True, **kwargs, **FIXED_K
    )
    for acc_row, draft_row in zip(out.accepted_lengths, out.draft_lengths):
        assert all(a <= d + 1 for a, d in zip(acc_row, draft_row))


@register_verifier
class IgnoresLengthsBug(SpeculativeSamplingVerifier):
    """Subtle bug: the verifier treats the padding behind a short proposal as real draft tokens."""

    name = "ignores_lengths_bug_test"

    def verify(self, proposal, scores):
        proposal = Proposal(tokens=proposal.tokens, draft_probs=proposal.draft_probs)
        return super().verify(proposal, scores)


@pytest.mark.parametrize("verifier,lossless", [(None, True), ("ignores_lengths_bug_test", False)])
def test_variable_length_sampling_is_lossless_and_ignoring_lengths_is_caught(verifier, lossless):
    """Tokens 2 and 3 come from one pass drafting up to 2 tokens per row; their joint law must be the target's
    (chi-square, p > 1e-3: a 0.1% chance of a false failure); a verifier that ignores ``lengths`` fails."""
    torch.manual_seed(1)
    target = _tree_sampling_target()
    prompt = torch.tensor([1, 7, 9, 14])
    joint = _exact_second_third(target, prompt)
    v = joint.shape[0]
    t2s, t3s = [], []
    for seed in range(4):
        drafter = _drafter(target, seed=seed, k=2)
        ids = prompt[None].expand(1500, -1)
        out = target.generate(
            ids, assistant_model=drafter, do_sample=True, max_new_tokens=4, top_k=0, temperature=1.0,
            eos_token_id=None, verifier=verifier, return_dict_in_generate=True,
        )  # fmt: skip
        gen = out.sequences[:, prompt.shape[0] :]
        t2s.append(gen[:, 1])
        t3s.append(gen[:, 2])
    first_pass = [row[0] for row in out.draft_lengths]
    assert {0, 1, 2} <= set(first_pass)
    t2, t3 = torch.cat(t2s), torch.cat(t3s)
    p_joint = _chi_square_pvalue(torch.bincount(t2 * v + t3, minlength=v * v).double(), joint.flatten().double())
    p_second = _chi_square_pvalue(torch.bincount(t2, minlength=v).double(), joint.sum(1).double())
    if lossless:
        assert p_joint > 1e-3 and p_second > 1e-3, (p_joint, p_second)
    else:
        assert min(p_joint, p_second) < 1e-6, (p_joint, p_second)


def test_a_proposal_longer_than_asked_is_refused():
    target = make_target("llama")
    ids, _ = ragged_batch(1)

    class Greedy(VarLenDrafter):
        def propose(self, state, num_tokens, select):
            return Proposal(tokens=torch.zeros(1, num_tokens + 1, dtype=torch.long) + 7)

    drafter = Greedy(VarLenConfig.for_target(target.config))
    with pytest.raises(ValueError, match="at most"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="lengths must lie"):
        Proposal(tokens=torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([1, 4]))


def test_the_target_pass_runs_only_up_to_the_longest_proposed_row():
    """A proposal whose rows all stop early (lengths) but that keeps its padding nodes is cut by the loop: the target
    pass covers the bonus slot plus the longest row, not the padding behind it (what makes a length scheduler pay)."""
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(3, seed=2)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    drafter = _drafter(target, seed=4, k=6)
    drafter.trim = False
    drafter.continuation = torch.cat([ref[:, ids.shape[1] :], ref[:, -8:]], dim=1)
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    finally:
        hook.remove()
    assert torch.equal(out.sequences, ref) and drafter.violations == 0
    proposed = [int(p.lengths.max()) for p in drafter.state_proposals]
    passes = widths[1 : 1 + len(proposed)]  # after the prefill, one target pass per proposal (then plain steps)
    assert passes == [n + 1 for n in proposed] and min(proposed) < 6  # cut below the asked 6
