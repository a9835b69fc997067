"""Strict verifiers: greedy (token-identical to the target's greedy decoding) and lossless speculative sampling.

Both verify chains (vectorised over the draft) and trees (vectorised over the batch, looping over the
tree depth and sibling count only), and honour variable-length proposals (``Proposal.lengths``).
"""

from __future__ import annotations

import torch

from ..tree.structure import children_table, path_nodes, tree_structure
from ..types import Proposal
from .base import VerificationResult, Verifier, register_verifier

__all__ = [
    "GreedyVerifier",
    "SpeculativeSamplingVerifier",
    "accepted_prefix_length",
    "tree_path_result",
    "best_tree_path",
]


def accepted_prefix_length(ok: torch.Tensor) -> torch.LongTensor:
    """Length of the all-true prefix of each row of a ``(batch, n)`` bool tensor (O(n), no Python loop)."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(dim=1).sum(dim=1)


def _nothing_accepted(scores: torch.Tensor) -> torch.LongTensor:
    return torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)


def best_tree_path(proposal: Proposal, node_ok: torch.BoolTensor, rank: torch.Tensor | None = None):
    """The deepest node whose whole root path is ``node_ok``; ties go to the highest ``rank``, then the first node.

    Returns ``(num_accepted, leaf, path, anc, depths)`` with ``leaf = -1`` where nothing is accepted and ``path``
    the ``(batch, max_accepted)`` nodes of the accepted path (``-1`` padded).
    """
    _, depths, anc_root = tree_structure(proposal, node_ok.device)
    anc = anc_root[:, 1:, 1:]
    ok = node_ok & proposal.node_valid().to(node_ok.device)
    path_ok = ~(anc & ~ok[:, None, :]).any(-1)  # every node on the root path is ok
    value = torch.where(path_ok, depths, torch.zeros_like(depths)).to(torch.float64)
    if rank is not None:
        # Depth first; the rank only breaks ties between equally deep paths (it is scaled into (0, 1)).
        r = rank.to(torch.float64)
        r = (r - r.min()) / (r.max() - r.min() + 1.0) * 0.5
        value = value + torch.where(path_ok, r, torch.zeros_like(r))
    n = torch.where(path_ok, depths, torch.zeros_like(depths)).max(dim=1).values if depths.shape[1] else depths.sum(1)
    leaf = value.argmax(dim=1) if depths.shape[1] else torch.zeros_like(n)
    leaf = torch.where(n > 0, leaf, torch.full_like(leaf, -1))
    path = path_nodes(anc, depths, leaf, int(n.max()) if n.numel() else 0)
    return n, leaf, path, anc, depths


def tree_path_result(
    proposal: Proposal, n: torch.LongTensor, path: torch.LongTensor, bonus: torch.LongTensor, stats=None
) -> VerificationResult:
    """Builds a :class:`VerificationResult` from an accepted tree path and the token that follows it."""
    bsz = n.shape[0]
    tokens = proposal.tokens.to(path.device)
    path_tokens = tokens.gather(1, path.clamp_min(0)) if path.shape[1] else tokens[:, :0]
    out = torch.cat([path_tokens, bonus[:, None]], dim=1)
    out[torch.arange(bsz, device=path.device), n] = bonus
    return VerificationResult(num_accepted=n, tokens=out, path=path, stats=stats or {})


def _tree_greedy(proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
    target = scores.argmax(dim=-1)  # (batch, N + 1): column 0 after the root, column i + 1 after node i
    parents = proposal.batched_parents().to(target.device)
    tokens = proposal.tokens.to(target.device)
    correct = tokens == target.gather(1, parents + 1)
    n, leaf, path, _, _ = best_tree_path(proposal, correct)
    bonus = target.gather(1, (leaf + 1)[:, None]).squeeze(1)
    return tree_path_result(proposal, n, path, bonus)


@register_verifier
class GreedyVerifier(Verifier):
    """Keeps the longest draft prefix (chains) or root path (trees) that equals the target's argmax; the bonus token
    is the argmax after it.

    With greedy decoding this reproduces the target's own output token for token.
    """

    name = "greedy"
    supports_sampling = False

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        if not proposal.is_linear:
            return _tree_greedy(proposal, scores)
        target_tokens = scores.argmax(dim=-1)  # (batch, n + 1)
        if proposal.num_nodes == 0:  # a plain step
            return VerificationResult(num_accepted=_nothing_accepted(scores), tokens=target_tokens)
        draft = proposal.tokens.to(target_tokens.device)
        ok = (draft == target_tokens[:, :-1]) & proposal.node_valid().to(draft.device)
        n = accepted_prefix_length(ok)
        # Accepted draft tokens equal the target's argmax, so the committed tokens are the argmax row itself.
        return VerificationResult(num_accepted=n, tokens=target_tokens)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``; falls back to ``p`` where the residual has no mass (a rejection of probability 0)."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


@register_verifier
class SpeculativeSamplingVerifier(Verifier):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023), for chains and trees.

    Chains: token ``x_i`` drawn from the draft distribution ``q_i`` is accepted with probability
    ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection a token is drawn from ``norm(max(0, p_i - q_i))``; if
    every token is accepted the bonus token is drawn from ``p_{n+1}``.

    Trees (multi-draft recursive rejection, Miao et al. 2024; Li et al. 2024): at each node, its children are tried in order.
    Child ``x`` (drawn from ``q_x``) is accepted with probability ``min(1, r(x) / q_x(x))`` where ``r`` starts as
    the target distribution at the node; on rejection ``r <- norm(max(0, r - q_x))``. The first accepted child
    becomes the current node; when every child is rejected the next token is drawn from ``r``.

    Deterministic drafts (``draft_probs is None``, e.g. top-k children) are point masses. The output is distributed
    exactly as the target's own sampling.
    """

    name = "sampling"
    supports_sampling = True
    supports_greedy = False

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        probs = torch.softmax(scores, dim=-1)  # (batch, n + 1, vocab)
        if proposal.num_nodes == 0:  # a plain step: the token is drawn from the target's distribution
            tokens = torch.multinomial(probs[:, 0], 1)
            return VerificationResult(num_accepted=_nothing_accepted(scores), tokens=tokens)
        if not proposal.is_linear:
            return self._verify_tree(proposal, probs)
        bsz, n_nodes = proposal.tokens.shape
        draft = proposal.tokens.to(probs.device)
        rows = torch.arange(bsz, device=probs.device)
        lengths = (
            proposal.lengths.to(probs.device)
            if proposal.lengths is not None
            else torch.full((bsz,), n_nodes, dtype=torch.long, device=probs.device)
        )
        if n_nodes:
            p_x = probs[:, :-1].gather(-1, draft[..., None]).squeeze(-1)
            if proposal.draft_probs is not None:
                q = proposal.draft_probs.to(probs.device, torch.float32)
                q_x = q.gather(-1, draft[..., None]).squeeze(-1)
            else:
                q = None
                q_x = torch.ones_like(p_x)
            u = torch.rand(p_x.shape, device=probs.device)
            # u < p/q  <=>  u * q < p (no division by a zero q; q_x > 0 for sampled tokens anyway)
            n = accepted_prefix_length((u * q_x < p_x) & proposal.node_valid().to(probs.device))
        else:
            q = None
            n = torch.zeros(bsz, dtype=torch.long, device=probs.device)

        # Distribution of the token after the kept prefix: the residual at a rejection, p itself after a full accept.
        p_next = probs[rows, n]
        rejected = n < lengths
        if n_nodes:
            idx = n.clamp(max=n_nodes - 1)
            if q is not None:
                q_next = q[rows, idx]
            else:
                q_next = torch.zeros_like(p_next)
                q_next[rows, draft[rows, idx]] = 1.0
            p_next = torch.where(rejected[:, None], _residual(p_next, q_next), p_next)
        bonus = torch.multinomial(p_next, 1).squeeze(-1)
        tokens = torch.cat([draft, bonus[:, None]], dim=1)
        tokens[rows, n] = bonus
        return VerificationResult(num_accepted=n, tokens=tokens)

    def _verify_tree(self, proposal: Proposal, probs: torch.Tensor) -> VerificationResult:
        dev = probs.device
        bsz, n_nodes = proposal.tokens.shape
        rows = torch.arange(bsz, device=dev)
        tokens = proposal.tokens.to(dev)
        parents = proposal.batched_parents().to(dev)
        valid = proposal.node_valid().to(dev)
        table = children_table(parents, valid)  # (bsz, N + 1, C)
        depths = tree_structure(proposal, dev)[1]
        max_depth = int(depths.max()) if n_nodes else 0
        q_all = proposal.draft_probs.to(dev, torch.float32) if proposal.draft_probs is not None else None
        cur = torch.zeros(bsz, dtype=torch.long, device=dev)  # table row of the current node (0: root)
        r = probs[:, 0].clone()
        alive = torch.ones(bsz, dtype=torch.bool, device=dev)
        n = torch.zeros(bsz, dtype=torch.long, device=dev)
        path = torch.full((bsz, max(max_depth, 0)), -1, dtype=torch.long, device=dev)
        for _ in range(max_depth):
            moved = torch.zeros(bsz, dtype=torch.bool, device=dev)
            for s in range(table.shape[2]):
                child = table[rows, cur, s]
                trying = alive & ~moved & (child >= 0)
                if not bool(trying.any()):
                    continue
                c = child.clamp_min(0)
                x = tokens[rows, c]
                r_x = r.gather(1, x[:, None]).squeeze(1)
                if q_all is not None:
                    q = q_all[rows, c]
                    q_x = q.gather(1, x[:, None]).squeeze(1)
                else:
                    q = torch.zeros_like(r)
                    q[rows, x] = 1.0
                    q_x = torch.ones_like(r_x)
                u = torch.rand(bsz, device=dev)
                acc = trying & (u * q_x < r_x)
                rej = trying & ~acc
                r = torch.where(rej[:, None], _residual(r, q), r)
                r = torch.where(acc[:, None], probs[rows, c + 1], r)
                path[rows[acc], n[acc]] = c[acc]
                n = n + acc.long()
                cur = torch.where(acc, c + 1, cur)
                moved |= acc
            alive &= moved
            if not bool(alive.any()):
                break
        bonus = torch.multinomial(r, 1).squeeze(-1)
        width = int(n.max()) if bsz else 0
        return tree_path_result(proposal, n, path[:, :width], bonus)
