"""Typical acceptance (Cai et al. 2024): an opt-in, *approximate* verifier.

A draft token ``x`` following a node is accepted when the target gives it enough probability relative to how
uncertain the target is there: ``p(x) > min(eps, delta * exp(-H(p)))`` with ``p`` the target's processed
distribution (temperature included). Among the longest accepted paths of a tree, the one with the largest
``sum log p`` wins. The token after the accepted path is the target's argmax ("the first token is always decoded
greedily"), so decoding is deterministic. Outputs are flagged ``approximate``: they follow the target's typical
set, not its exact distribution, and may differ from plain greedy decoding.

Use::

    out = target.generate(**inputs, assistant_model=drafter, verifier="typical",
                          typical_posterior_threshold=0.09, typical_posterior_alpha=0.3)
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from ..tree.structure import tree_structure
from ..types import Proposal
from .base import VerificationResult, Verifier, register_verifier
from .standard import accepted_prefix_length, best_tree_path, tree_path_result

__all__ = ["TypicalAcceptanceVerifier"]


@register_verifier
class TypicalAcceptanceVerifier(Verifier):
    """Typical acceptance; defaults ``eps = posterior_threshold = 0.09``, ``delta = posterior_alpha = 0.3``.

    Args:
        posterior_threshold: ``eps``, the probability above which a token is always accepted.
        posterior_alpha: ``delta``, the scale of the entropy-adaptive threshold ``delta * exp(-H(p))``.
    """

    name = "typical"
    supports_sampling = True
    supports_greedy = True
    approximate = True
    generate_options: ClassVar[dict[str, str]] = {
        "typical_posterior_threshold": "posterior_threshold",
        "typical_posterior_alpha": "posterior_alpha",
    }

    def __init__(self, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3):
        for label, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"typical acceptance {label} must be a finite number >= 0, got {value!r}.")
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        logp = torch.log_softmax(scores.float(), dim=-1)  # (batch, N + 1, vocab)
        p = logp.exp()
        entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)  # (batch, N + 1)
        threshold = torch.minimum(
            torch.full_like(entropy, self.posterior_threshold), self.posterior_alpha * torch.exp(-entropy)
        )
        parents = proposal.batched_parents().to(scores.device)
        tokens = proposal.tokens.to(scores.device)
        col = parents + 1  # the distribution each node is scored under
        node_logp = logp.gather(1, col[..., None].expand(-1, -1, logp.shape[-1])).gather(-1, tokens[..., None])
        node_logp = node_logp.squeeze(-1)
        ok = node_logp.exp() > threshold.gather(1, col)
        if proposal.is_linear:
            n = accepted_prefix_length(ok & proposal.node_valid().to(ok.device))
            best = scores.argmax(dim=-1)
            out = torch.cat([tokens, best[:, -1:]], dim=1)
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            out[rows, n] = best[rows, n]
            return VerificationResult(num_accepted=n, tokens=out)
        # Trees: the deepest accepted path, ties broken by the path's total log-probability.
        anc = tree_structure(proposal, scores.device)[2][:, 1:, 1:]
        path_logp = (anc.float() * node_logp[:, None, :]).sum(-1)
        n, leaf, path, _, _ = best_tree_path(proposal, ok, rank=path_logp)
        bonus = scores.argmax(dim=-1).gather(1, (leaf + 1)[:, None]).squeeze(1)
        return tree_path_result(proposal, n, path, bonus)
