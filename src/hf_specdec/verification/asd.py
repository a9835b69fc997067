"""Approximate Speculative Decoding (ASD): greedy verification that may accept a few cheap mismatches.

Feng et al., "Approximate Speculative Decoding" (2026). Strict greedy verification stops at the first draft token
that differs from the target's argmax and throws away the draft behind it, even when the target scored that token
almost as high as its argmax and the rest of the draft is exactly what the target would write next. ASD accepts such
a mismatch ("exception") when it is cheap, within three limits, and keeps the suffix behind it:

* local regret ``r_i = z_i(y*_i) - z_i(x_i)`` of draft token ``x_i`` under the target's scores ``z_i`` (from the
  ordinary verification pass, conditioned on the realized draft prefix ``x_{<i}``), ``y*_i = argmax z_i``;
* gate: ``r_i / q_i <= g`` with ``q_i`` the remaining proposal length (``K - i``, or ``(K - i) / K`` normalised), so
  an exception must pay for itself with the suffix it can unlock;
* block cap: at most ``M`` exceptions per verification pass;
* budget: a per-request ledger ``s`` of the regret spent so far; a prefix is feasible only while its cumulative
  regret ``C_i <= B - s``. The ledger persists across passes and is reset per ``generate`` call.

The accepted length is the longest all-feasible prefix (cumulative sums and products, O(K), vectorised over the
batch), followed by the usual greedy bonus token ``y*_A``. Draft tokens behind an accepted exception that equal the
target's argmax were scored under the realized prefix (exception included), so they are exactly what the target would
generate next and are committed without another target pass ("realized-prefix suffix reuse").

``B = 0``, ``M = 0`` or ``g = 0`` is strict greedy verification, token for token. Outputs are flagged approximate.

Use::

    out = target.generate(**inputs, assistant_model=drafter, verifier="asd",
                          asd_budget=8.0, asd_gate=0.25, asd_block_cap=2)
"""

from __future__ import annotations

import math

import torch

from ..generation.proposals import Proposal
from .base import VerificationResult, Verifier, register_verifier
from .standard import accepted_prefix_length

__all__ = ["ASDVerifier", "asd_accept", "ASD_OPTION_NAMES"]

# generate() / GenerationConfig option name -> ASDVerifier argument
ASD_OPTION_NAMES = {
    "asd_budget": "budget",
    "asd_gate": "gate",
    "asd_block_cap": "block_cap",
    "asd_normalize_remaining": "normalize_remaining",
    "asd_strict_margin": "strict_margin",
}


def asd_accept(
    draft: torch.LongTensor,
    scores: torch.Tensor,
    budget_left: torch.Tensor,
    gate: float,
    block_cap: int,
    normalize_remaining: bool = False,
    strict_margin: bool = False,
) -> tuple[torch.LongTensor, torch.LongTensor, dict[str, torch.Tensor]]:
    """The ASD acceptance rule along one path of draft tokens.

    Args:
        draft: ``(batch, L)`` draft tokens along the path (a chain, a block, or the path of a tree).
        scores: ``(batch, L + 1, vocab)`` target scores; ``scores[:, i]`` scores ``draft[:, i]``, the last one gives
            the bonus token.
        budget_left: ``(batch,)`` ``B - s``, the regret the request may still spend.
        gate, block_cap, normalize_remaining, strict_margin: see :class:`ASDVerifier`.

    Returns:
        ``(num_accepted, tokens, stats)``: accepted draft tokens per row; ``(batch, L + 1)`` committed tokens (the
        accepted draft tokens, then the bonus token ``y*_A``); per-row ``regret`` spent, ``exceptions`` accepted and
        ``gained`` tokens over strict greedy verification of the same pass.
    """
    bsz, length = draft.shape
    best = scores.argmax(dim=-1)  # (batch, L + 1), first maximum on ties
    if length == 0:
        zeros = torch.zeros(bsz, device=scores.device)
        n = torch.zeros(bsz, dtype=torch.long, device=scores.device)
        return n, best, {"regret": zeros, "exceptions": n.clone(), "gained": n.clone()}
    draft = draft.to(best.device)
    z = scores[:, :length].float()
    mismatch = draft != best[:, :length]
    regret = (z.gather(-1, best[:, :length, None]) - z.gather(-1, draft[..., None])).squeeze(-1)
    regret = torch.where(mismatch, regret.clamp_min(0.0), torch.zeros_like(regret))
    remaining = torch.arange(length, 0, -1, device=z.device, dtype=z.dtype)[None]  # q_i = K - i
    if normalize_remaining:
        remaining = remaining / length
    spent = torch.cumsum(regret, dim=1)  # C_i
    count = torch.cumsum(mismatch.long(), dim=1)  # N_i
    left = budget_left.to(z.device, z.dtype)[:, None]
    exception_ok = (regret / remaining <= gate) & (spent <= left)
    if strict_margin:
        exception_ok &= (spent - regret) < left
    ok = (~mismatch | exception_ok) & (count <= block_cap)
    n = accepted_prefix_length(ok)
    strict_n = accepted_prefix_length(~mismatch)
    col = torch.arange(length, device=z.device)[None]
    kept = col < n[:, None]
    tokens = best.clone()
    tokens[:, :length] = torch.where(kept, draft, best[:, :length])
    stats = {
        "regret": (regret * kept).sum(dim=1),
        "exceptions": (mismatch & kept).long().sum(dim=1),
        "gained": n - strict_n,
    }
    return n, tokens, stats


@register_verifier
class ASDVerifier(Verifier):
    """Approximate Speculative Decoding (greedy only): strict greedy verification plus a budget of cheap mismatches.

    Args:
        budget: ``B``, the total regret (target-logit units) one request may accept; ``0`` is strict greedy.
        gate: ``g``, the largest regret per remaining proposal position an exception may have; ``0`` is strict.
        block_cap: ``M``, the most exceptions accepted in one verification pass; ``0`` is strict.
        normalize_remaining: use ``q_i = (K - i) / K`` (the DeepSeek reproduction) instead of ``K - i`` (the Qwen
            reference) in the gate.
        strict_margin: also require ``C_i - r_i < B - s`` (the DeepSeek reproduction's rule).

    Defaults are the paper's Qwen/DSpark setting (``B = 8``, ``g = 0.25``, ``M = 2``). Per-row statistics in
    ``verifier_stats``: ``regret`` spent, ``exceptions`` accepted, ``gained`` tokens over strict verification.
    """

    name = "asd"
    supports_sampling = False
    approximate = True

    def __init__(
        self,
        budget: float = 8.0,
        gate: float = 0.25,
        block_cap: int = 2,
        normalize_remaining: bool = False,
        strict_margin: bool = False,
    ):
        for label, value in (("budget (asd_budget)", budget), ("gate (asd_gate)", gate)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"ASD {label} must be a finite number >= 0, got {value!r}.")
        if isinstance(block_cap, bool) or not isinstance(block_cap, int) or block_cap < 0:
            raise ValueError(f"ASD block_cap (asd_block_cap) must be an integer >= 0, got {block_cap!r}.")
        self.budget = float(budget)
        self.gate = float(gate)
        self.block_cap = int(block_cap)
        self.normalize_remaining = bool(normalize_remaining)
        self.strict_margin = bool(strict_margin)
        self.ledger: torch.Tensor | None = None

    @property
    def strict(self) -> bool:
        return self.budget == 0 or self.gate == 0 or self.block_cap == 0

    def start(self, batch_size, device, do_sample, generator) -> None:
        if do_sample:
            raise ValueError(
                "The 'asd' verifier is greedy-only (Approximate Speculative Decoding relaxes greedy verification); "
                "use do_sample=False, or verifier='sampling' / the default for lossless sampling."
            )
        super().start(batch_size, device, do_sample, generator)
        self.ledger = torch.zeros(batch_size, dtype=torch.float32, device=device)

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        if not proposal.is_linear:
            raise NotImplementedError(
                "ASD on tree proposals applies the rule along the verified path (hf_specdec.verification.asd."
                "asd_accept); no tree drafter exists in this release yet."
            )
        draft = proposal.tokens
        if self.strict:
            best = scores.argmax(dim=-1)
            n = accepted_prefix_length(draft.to(best.device) == best[:, :-1])
            zeros = torch.zeros_like(n)
            stats = {"regret": torch.zeros_like(self.ledger), "exceptions": zeros, "gained": zeros}
            return VerificationResult(num_accepted=n, tokens=best, stats=stats)
        n, tokens, stats = asd_accept(
            draft,
            scores,
            self.budget - self.ledger.to(scores.device),
            self.gate,
            self.block_cap,
            self.normalize_remaining,
            self.strict_margin,
        )
        self.ledger = self.ledger + stats["regret"].to(self.ledger.device)
        return VerificationResult(num_accepted=n, tokens=tokens, stats=stats)
