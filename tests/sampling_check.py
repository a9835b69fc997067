"""Statistical check that speculative sampling is lossless (shared by the drafter tester and loop tests)."""

from __future__ import annotations

import torch
from drafter_tester import tv_bound
from helpers import make_target
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_specdec import VerificationResult, Verifier

TEMPERATURE = 0.8
TOP_K = 24


class AcceptAllVerifier(Verifier):
    """A deliberately lossy verifier (keeps every draft token): proves the check has the power to fail."""

    name = "accept_all_test"
    supports_sampling = True

    def verify(self, proposal, scores):
        probs = torch.softmax(scores[:, -1], -1)
        bonus = torch.multinomial(probs, 1)
        tokens = torch.cat([proposal.tokens, bonus], dim=1)
        return VerificationResult(num_accepted=torch.full((tokens.shape[0],), proposal.num_nodes), tokens=tokens)


def exact_marginals(target, prompt: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Exact marginal law of each of the first ``steps`` sampled tokens under temperature + top-k."""
    procs = LogitsProcessorList([TemperatureLogitsWarper(TEMPERATURE), TopKLogitsWarper(TOP_K)])
    vocab = target.config.vocab_size
    prefixes = prompt[None]  # (paths, len)
    weights = torch.ones(1)
    marginals = []
    with torch.no_grad():
        for _ in range(steps):
            logits = target(prefixes).logits[:, -1].float()
            probs = torch.softmax(procs(prefixes, logits), -1)  # (paths, vocab)
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            keep = joint.flatten() > 1e-7  # prune negligible paths to keep the tree small
            idx = keep.nonzero().squeeze(-1)
            parent, token = idx // vocab, idx % vocab
            prefixes = torch.cat([prefixes[parent], token[:, None]], dim=1)
            weights = joint.flatten()[idx]
    return marginals


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def check_sampling_matches_target(make_drafter, num_samples: int = 3000, num_draft_tokens: int = 2):
    vocab = 32
    target = make_target("llama", seed=5, vocab=vocab, sharpen=40.0, eos_token_id=None)
    drafter = make_drafter(target, seed=6)
    prompt = torch.tensor([7, 9, 11, 13, 17, 19])
    exact = exact_marginals(target, prompt)
    ids = prompt[None].repeat(num_samples, 1)
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=TEMPERATURE, top_k=TOP_K, top_p=1.0)
    torch.manual_seed(0)
    out = target.generate(
        ids, assistant_model=drafter, num_assistant_tokens=num_draft_tokens, return_dict_in_generate=True, **kwargs
    )
    gen = out.sequences[:, prompt.numel() :]
    bound = tv_bound(vocab, num_samples)
    # Rejections must have happened, otherwise the residual path was not exercised.
    tau = out.mean_accepted_length
    assert tau >= 1.0 and tau < num_draft_tokens + 1, tau
    for step in range(3):
        tv = 0.5 * (empirical(gen[:, step], vocab) - exact[step]).abs().sum().item()
        assert tv < bound, f"token {step + 1}: TV {tv:.4f} >= bound {bound:.4f}"
    # Power: keeping every draft token (a lossy rule) is detected by the same bound.
    torch.manual_seed(0)
    lossy = target.generate(
        ids, assistant_model=drafter, num_assistant_tokens=num_draft_tokens, verifier=AcceptAllVerifier(), **kwargs
    )[:, prompt.numel() :]
    tv_lossy = 0.5 * (empirical(lossy[:, 1], vocab) - exact[1]).abs().sum().item()
    assert tv_lossy > 2 * bound, f"the check cannot tell a lossy verifier apart (TV {tv_lossy:.4f})"
    return out
