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

from ..tree.structure import tree_structure
from ..types import Proposal
from .base import VerificationResult, Verifier, register_verifier
from .standard import accepted_prefix_length, best_tree_path, tree_path_result

__all__ = ["ASDVerifier", "asd_accept", "ASD_OPTION_NAMES"]

# generate() / GenerationConfig option name -> ASDVerifier argument
ASD_OPTION_NAMES = {
    "asd_budget": "budget",
    "asd_gate": "gate",
    "asd_block_cap": "block_cap",
    "asd_normalize_remaining": "normalize_remaining",
    "asd_strict_margin": "strict_margin",
}


def _asd_rule(
    mismatch: torch.BoolTensor,
    regret: torch.Tensor,
    valid: torch.BoolTensor,
    budget_left: torch.Tensor,
    gate: float,
    block_cap: int,
    normalize_remaining: bool,
    strict_margin: bool,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """The acceptance rule on per-position ``mismatch`` / ``regret`` of ``(rows, L)`` paths whose first
    ``valid.sum(1)`` positions are real. Returns the accepted length and the kept positions."""
    length = mismatch.shape[1]
    z = regret
    col = torch.arange(length, device=z.device)[None]
    path_len = valid.long().sum(dim=1, keepdim=True)
    remaining = (path_len - col).clamp_min(1).to(z.dtype)  # q_i = K - i, K = this path's length
    if normalize_remaining:
        remaining = remaining / path_len.clamp_min(1).to(z.dtype)
    # An infeasible exception (regret +inf, e.g. a draft token the processors scored -inf) must not poison the sums.
    finite = torch.isfinite(regret)
    spent = torch.cumsum(torch.where(finite, regret, torch.zeros_like(regret)), dim=1)  # C_i over finite terms
    blocked = torch.cumsum((~finite & mismatch).long(), dim=1) > 0
    count = torch.cumsum(mismatch.long(), dim=1)  # N_i
    left = budget_left.to(z.device, z.dtype)[:, None]
    # An exhausted budget (B - s <= 0) admits no exception at all, not even a zero-regret tie: the rule itself is
    # strict there, without relying on the verifier's strict fast path.
    exception_ok = finite & (regret / remaining <= gate) & (spent <= left) & (left > 0) & ~blocked
    if strict_margin:
        exception_ok &= (spent - torch.where(finite, regret, torch.zeros_like(regret))) < left
    ok = (~mismatch | exception_ok) & (count <= block_cap) & valid
    n = accepted_prefix_length(ok)
    return n, col < n[:, None]


def asd_accept(
    draft: torch.LongTensor,
    scores: torch.Tensor,
    budget_left: torch.Tensor,
    gate: float,
    block_cap: int,
    normalize_remaining: bool = False,
    strict_margin: bool = False,
    lengths: torch.LongTensor | None = None,
    per_token: bool = False,
) -> tuple[torch.LongTensor, torch.LongTensor, dict[str, torch.Tensor]]:
    """The ASD acceptance rule along one path of draft tokens.

    Args:
        draft: ``(batch, L)`` draft tokens along the path (a chain, a block, or the path of a tree).
        scores: ``(batch, L + 1, vocab)`` target scores; ``scores[:, i]`` scores ``draft[:, i]``, the last one gives
            the bonus token.
        budget_left: ``(batch,)`` ``B - s``, the regret the request may still spend.
        gate, block_cap, normalize_remaining, strict_margin: see :class:`ASDVerifier`.
        lengths: ``(batch,)`` real draft tokens per row (variable-length proposals); ``None``: all ``L``.
        per_token: return the statistics per position (``(batch, L)``) instead of per row.

    Returns:
        ``(num_accepted, tokens, stats)``: accepted draft tokens per row; ``(batch, L + 1)`` committed tokens (the
        accepted draft tokens, then the bonus token ``y*_A``); per-row ``regret`` spent, ``exceptions`` accepted and
        ``gained`` tokens over strict greedy verification of the same pass.
    """
    bsz, length = draft.shape
    best = scores.argmax(dim=-1)  # (batch, L + 1), first maximum on ties
    if length == 0:
        n = torch.zeros(bsz, dtype=torch.long, device=scores.device)
        empty = {
            "regret": torch.zeros(bsz, 0, device=scores.device),
            "exceptions": n[:, None][:, :0],
            "gained": n[:, None][:, :0],
        }
        return n, best, (empty if per_token else _row_sums(empty))
    draft = draft.to(best.device)
    z = scores[:, :length].float()
    mismatch = draft != best[:, :length]
    regret = _regret(z, best[:, :length], draft, mismatch)
    col = torch.arange(length, device=z.device)[None]
    valid = torch.ones_like(mismatch) if lengths is None else col < lengths.to(z.device)[:, None]
    n, kept = _asd_rule(mismatch, regret, valid, budget_left, gate, block_cap, normalize_remaining, strict_margin)
    strict_n = accepted_prefix_length(~mismatch & valid)
    tokens = best.clone()
    tokens[:, :length] = torch.where(kept, draft, best[:, :length])
    token_stats = _token_stats(regret, mismatch, kept, strict_n)
    return n, tokens, (token_stats if per_token else _row_sums(token_stats))


def _regret(z: torch.Tensor, best: torch.LongTensor, draft: torch.LongTensor, mismatch: torch.BoolTensor):
    """``z(y*) - z(x)`` at mismatches (``+inf`` for a ``-inf``-scored draft token), 0 elsewhere."""
    z_best = z.gather(-1, best[..., None]).squeeze(-1)
    z_x = z.gather(-1, draft[..., None]).squeeze(-1)
    regret = torch.where(torch.isneginf(z_x), torch.full_like(z_x, float("inf")), (z_best - z_x).clamp_min(0.0))
    return torch.where(mismatch, regret, torch.zeros_like(regret))


def _token_stats(regret, mismatch, kept, strict_n) -> dict[str, torch.Tensor]:
    """Per accepted position: the regret spent, whether it is an exception, whether it is a token gained over strict
    verification. The loop sums them over the tokens it actually commits (EOS and the length limit cut chunks)."""
    col = torch.arange(kept.shape[1], device=kept.device)[None]
    return {
        "regret": torch.where(kept, regret, torch.zeros_like(regret)),
        "exceptions": (mismatch & kept).long(),
        "gained": (kept & (col >= strict_n[:, None])).long(),
    }


def _row_sums(token_stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.sum(dim=1) for key, value in token_stats.items()}


@register_verifier
class ASDVerifier(Verifier):
    """Approximate Speculative Decoding (greedy only): strict greedy verification plus a budget of cheap mismatches.

    Args:
        budget: ``B``, the total regret (target-logit units) one request may accept; ``0`` is strict greedy.
        gate: ``g``, the largest regret per remaining proposal position an exception may have; ``0`` is strict.
        block_cap: ``M``, the most exceptions accepted in one verification pass; ``0`` is strict.
        normalize_remaining: use ``q_i = (K - i) / K`` instead of ``K - i`` in the gate. Source: the reference
            code's DeepSeek-V4 reproduction rule (``Kissmetothemoon/ASD``); the Qwen reference uses ``K - i``. With it the gate ``g`` is on a per-block scale rather than per token.
        strict_margin: also require ``C_i - r_i < B - s``, the same reproduction's rule. Since ``C_i <= B - s`` is
            required anyway, it only matters for a zero-regret tie once earlier exceptions have spent the budget
            exactly: it refuses that tie.

    Units: the regret is measured on the scores the verifier receives, i.e. the target's logits *after* the
    ``generate`` logits processors (repetition penalty, temperature-free warpers, ...). Without processors these are
    the raw target logits, the source's definition; with them, ``B`` and ``g`` are charged in processed units, the
    same scores greedy decoding takes its argmax of.

    Defaults are the paper's Qwen reference setting (``B = 8``, ``g = 0.25``, ``M = 2``). Per-row statistics in
    ``verifier_stats``: ``regret`` spent, ``exceptions`` accepted, ``gained`` tokens over strict verification.
    """

    name = "asd"
    supports_sampling = False
    approximate = True
    generate_options = ASD_OPTION_NAMES
    option_labels = {"budget": "B", "gate": "g", "block_cap": "M"}

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

    def start(self, batch_size, device, do_sample) -> None:
        if do_sample:
            raise ValueError(
                "The 'asd' verifier is greedy-only (Approximate Speculative Decoding relaxes greedy verification); "
                "use do_sample=False, or verifier='sampling' / the default for lossless sampling."
            )
        super().start(batch_size, device, do_sample)
        self.ledger = torch.zeros(batch_size, dtype=torch.float32, device=device)

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        if not proposal.is_linear:
            return self._verify_tree(proposal, scores)
        draft = proposal.tokens
        if self.strict:
            best = scores.argmax(dim=-1)
            ok = (draft.to(best.device) == best[:, :-1]) & proposal.node_valid().to(best.device)
            n = accepted_prefix_length(ok)
            zeros = torch.zeros_like(draft, dtype=torch.long, device=best.device)
            token_stats = {"regret": zeros.float(), "exceptions": zeros, "gained": zeros}
            return VerificationResult(num_accepted=n, tokens=best, token_stats=token_stats)
        n, tokens, token_stats = asd_accept(
            draft,
            scores,
            self.budget - self.ledger.to(scores.device),
            self.gate,
            self.block_cap,
            self.normalize_remaining,
            self.strict_margin,
            lengths=proposal.lengths,
            per_token=True,
        )
        self.ledger = self.ledger + token_stats["regret"].sum(dim=1).to(self.ledger.device)
        return VerificationResult(num_accepted=n, tokens=tokens, token_stats=token_stats)

    def _verify_tree(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        """ASD along a tree: the rule runs on every root-to-leaf path (each path is a chain whose scores the tree pass
        already holds); the path with the most accepted tokens wins, ties going to the smaller regret. With a strict
        setting every path's acceptance is exact matching, so this is strict greedy tree verification.
        """
        dev = scores.device
        best = scores.argmax(dim=-1)  # (batch, N + 1)
        parents = proposal.batched_parents().to(dev)
        tokens = proposal.tokens.to(dev)
        valid = proposal.node_valid().to(dev)
        bsz, n_nodes = tokens.shape
        col = parents + 1
        z_node = scores.gather(1, col[..., None].expand(-1, -1, scores.shape[-1])).float()  # (batch, N, vocab)
        best_node = best.gather(1, col)
        mismatch = (tokens != best_node) & valid
        regret = _regret(z_node, best_node, tokens, mismatch)
        del z_node
        _, depths, anc_root = tree_structure(proposal, dev)
        anc = anc_root[:, 1:, 1:]
        has_child = torch.zeros(bsz, n_nodes + 1, dtype=torch.bool, device=dev)
        has_child.scatter_(1, torch.where(valid, col, torch.zeros_like(col)), valid)
        is_leaf = valid & ~has_child[:, 1:]
        max_depth = int(depths.max()) if n_nodes else 0
        # Every node is a candidate end of a path (a leaf's ancestors are prefixes of its path; using leaves only).
        leaf_idx = torch.arange(n_nodes, device=dev)[None].expand(bsz, n_nodes)
        on_path = anc & is_leaf[:, :, None]  # (batch, N leaves, N)
        slot = torch.where(on_path, depths[:, None, :] - 1, torch.full_like(on_path, max_depth, dtype=torch.long))
        paths = torch.full((bsz, n_nodes, max_depth + 1), -1, dtype=torch.long, device=dev)
        paths.scatter_(2, slot, torch.where(on_path, leaf_idx[:, None, :].expand_as(slot), -1))
        paths = paths[..., :max_depth]  # (batch, leaves, depth): node at each depth, -1 padded
        path_valid = paths >= 0
        flat = paths.clamp_min(0).reshape(bsz, -1)
        mm = mismatch.gather(1, flat).reshape(paths.shape) & path_valid
        rg = regret.gather(1, flat).reshape(paths.shape).masked_fill(~path_valid, 0.0)
        budget_left = (self.budget - self.ledger.to(dev)).repeat_interleave(n_nodes)
        n_p, kept = _asd_rule(
            mm.reshape(bsz * n_nodes, -1),
            rg.reshape(bsz * n_nodes, -1),
            path_valid.reshape(bsz * n_nodes, -1),
            budget_left,
            0.0 if self.strict else self.gate,
            0 if self.strict else self.block_cap,
            self.normalize_remaining,
            self.strict_margin,
        )
        n_p = n_p.reshape(bsz, n_nodes).masked_fill(~is_leaf, -1)
        spent_p = torch.where(kept, rg.reshape(bsz * n_nodes, -1), torch.zeros_like(rg.reshape(bsz * n_nodes, -1)))
        spent_p = spent_p.sum(1).reshape(bsz, n_nodes)
        # Most tokens first; among equals the least regret; then the first leaf.
        key = n_p.double() * 1e6 - spent_p.double().clamp(max=1e5)
        choice = key.argmax(dim=1) if n_nodes else torch.zeros(bsz, dtype=torch.long, device=dev)
        rows = torch.arange(bsz, device=dev)
        n = n_p[rows, choice].clamp_min(0) if n_nodes else torch.zeros(bsz, dtype=torch.long, device=dev)
        width = int(n.max()) if bsz else 0
        path = paths[rows, choice][:, :width] if n_nodes else paths[:, 0, :0]
        path = torch.where(torch.arange(width, device=dev)[None] < n[:, None], path, torch.full_like(path, -1))
        last = path.gather(1, (n - 1).clamp_min(0)[:, None]).squeeze(1) if width else torch.full_like(n, -1)
        last = torch.where(n > 0, last, torch.full_like(last, -1))
        bonus = best.gather(1, (last + 1)[:, None]).squeeze(1)
        kept_sel = kept.reshape(bsz, n_nodes, -1)[rows, choice] if n_nodes else mm[:, 0]
        mm_sel = mm[rows, choice] if n_nodes else mm[:, 0]
        rg_sel = rg[rows, choice] if n_nodes else rg[:, 0]
        strict_n, _, _, _, _ = best_tree_path(proposal, ~mismatch)
        token_stats = _token_stats(rg_sel, mm_sel, kept_sel, strict_n)
        self.ledger = self.ledger + token_stats["regret"].sum(dim=1).to(self.ledger.device)
        result = tree_path_result(proposal, n, path, bonus)
        result.token_stats = token_stats
        return result
