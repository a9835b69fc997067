"""Strict verifiers: greedy (token-identical to the target's greedy decoding) and lossless speculative sampling."""

from __future__ import annotations

import torch

from ..generation.proposals import Proposal
from .base import VerificationResult, Verifier, register_verifier

__all__ = ["GreedyVerifier", "SpeculativeSamplingVerifier"]


def _require_linear(verifier: Verifier, proposal: Proposal) -> None:
    if not proposal.is_linear:
        raise NotImplementedError(
            f"The {verifier.name!r} verifier in this release verifies chain and block proposals; got a "
            f"{proposal.kind!r} proposal."
        )


def accepted_prefix_length(ok: torch.Tensor) -> torch.LongTensor:
    """Length of the all-true prefix of each row of a ``(batch, n)`` bool tensor (O(n), no Python loop)."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(dim=1).sum(dim=1)


@register_verifier
class GreedyVerifier(Verifier):
    """Keeps the longest draft prefix that equals the target's argmax; the bonus token is the argmax after it.

    With greedy decoding this reproduces the target's own output token for token.
    """

    name = "greedy"
    supports_sampling = False

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        _require_linear(self, proposal)
        target_tokens = scores.argmax(dim=-1)  # (batch, n + 1)
        draft = proposal.tokens.to(target_tokens.device)
        n = accepted_prefix_length(draft == target_tokens[:, :-1])
        # Accepted draft tokens equal the target's argmax, so the committed tokens are the argmax row itself.
        return VerificationResult(num_accepted=n, tokens=target_tokens)


@register_verifier
class SpeculativeSamplingVerifier(Verifier):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Token ``x_i`` drawn from the draft distribution ``q_i`` is accepted with probability ``min(1, p_i(x_i) /
    q_i(x_i))``; at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))``; if every token is
    accepted the bonus token is drawn from ``p_{n+1}``. The output is distributed exactly as the target's own
    sampling. Deterministic proposals (``draft_probs is None``) are treated as point masses.
    """

    name = "sampling"
    supports_sampling = True
    supports_greedy = False

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        _require_linear(self, proposal)
        probs = torch.softmax(scores, dim=-1)  # (batch, n + 1, vocab)
        bsz, n_nodes = proposal.tokens.shape
        draft = proposal.tokens.to(probs.device)
        rows = torch.arange(bsz, device=probs.device)
        gen = getattr(self, "generator", None)
        if n_nodes:
            p_x = probs[:, :-1].gather(-1, draft[..., None]).squeeze(-1)
            if proposal.draft_probs is not None:
                q = proposal.draft_probs.to(probs.device, torch.float32)
                q_x = q.gather(-1, draft[..., None]).squeeze(-1)
            else:
                q = None
                q_x = torch.ones_like(p_x)
            u = torch.rand(p_x.shape, device=probs.device, generator=gen)
            # u < p/q  <=>  u * q < p (no division by a zero q; q_x > 0 for sampled tokens anyway)
            n = accepted_prefix_length(u * q_x < p_x)
        else:
            q = None
            n = torch.zeros(bsz, dtype=torch.long, device=probs.device)

        # Distribution of the token after the kept prefix: the residual at a rejection, p itself after a full accept.
        p_next = probs[rows, n]
        rejected = n < n_nodes
        if n_nodes:
            idx = n.clamp(max=n_nodes - 1)
            if q is not None:
                q_next = q[rows, idx]
            else:
                q_next = torch.zeros_like(p_next)
                q_next[rows, draft[rows, idx]] = 1.0
            residual = (p_next - q_next).clamp_min(0)
            mass = residual.sum(-1, keepdim=True)
            # If p == q exactly (mass 0) a rejection has probability 0; fall back to p for numerical safety.
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
            p_next = torch.where(rejected[:, None], residual, p_next)
        bonus = torch.multinomial(p_next, 1, generator=gen).squeeze(-1)
        tokens = torch.cat([draft, bonus[:, None]], dim=1)
        tokens[rows, n] = bonus
        return VerificationResult(num_accepted=n, tokens=tokens)
