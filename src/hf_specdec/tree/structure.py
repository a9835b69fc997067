"""Tree arithmetic on ``parents`` arrays: depths, ancestor masks, children tables and paths.

A tree proposal lists ``N`` draft nodes per row in topological order: ``parents[b, i]`` is the index of node ``i``'s
parent (``-1`` for a child of the last committed token, the *root*), and every parent comes before its children.
Rows may hold fewer real nodes than ``N`` (``lengths``); the nodes past a row's length are padding that no verifier
accepts. Everything here is vectorised over the batch; loops run over the tree depth or the sibling count only.
"""

from __future__ import annotations

import torch

__all__ = [
    "tree_structure",
    "as_batched_parents",
    "validate_parents",
    "node_depths",
    "ancestor_matrix",
    "children_table",
    "path_nodes",
]


def as_batched_parents(parents: torch.Tensor, batch_size: int) -> torch.LongTensor:
    """``(N,)`` or ``(batch, N)`` parents as a ``(batch, N)`` long tensor."""
    parents = torch.as_tensor(parents, dtype=torch.long)
    if parents.dim() == 1:
        parents = parents[None].expand(batch_size, -1)
    if parents.dim() != 2 or parents.shape[0] != batch_size:
        raise ValueError(f"Tree parents must have shape (N,) or (batch, N); got {tuple(parents.shape)}.")
    return parents


def validate_parents(parents: torch.LongTensor) -> None:
    """Raises if a node's parent is not ``-1`` or an earlier node (the order the loop and verifiers rely on)."""
    n = parents.shape[-1]
    idx = torch.arange(n, device=parents.device)
    bad = (parents < -1) | (parents >= idx)
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"Invalid tree: node {i} of row {b} has parent {int(parents[b, i])}; a parent must be -1 (the last "
            "committed token) or an earlier node. List tree nodes in topological order (parents first)."
        )


def node_depths(parents: torch.LongTensor) -> torch.LongTensor:
    """``(batch, N)`` depth of each node (children of the root have depth 1)."""
    bsz, n = parents.shape
    depth = torch.zeros(bsz, n + 1, dtype=torch.long, device=parents.device)  # slot 0: the root
    idx = parents + 1
    # Depth d is right for every node of depth <= d after d rounds; a tree of N nodes is at most N deep.
    for _ in range(n):
        new = depth.gather(1, idx) + 1
        if torch.equal(new, depth[:, 1:]):
            break
        depth[:, 1:] = new
    return depth[:, 1:]


def ancestor_matrix(parents: torch.LongTensor, include_root: bool = False) -> torch.BoolTensor:
    """``anc[b, i, j]``: node ``j`` is node ``i`` or one of its ancestors.

    With ``include_root`` the matrix covers ``[root, node 0, ..., node N-1]`` (size ``N + 1``), so that it can serve
    directly as the attention pattern of a target pass over the root token followed by the nodes.
    """
    bsz, n = parents.shape
    eye = torch.eye(n + 1, dtype=torch.bool, device=parents.device)[None].expand(bsz, -1, -1)
    anc = eye.clone()
    idx = (parents + 1)[:, :, None].expand(-1, -1, n + 1)  # row of each node's parent in `anc`
    for _ in range(n):
        new = eye[:, 1:] | anc.gather(1, idx)
        new[..., 0] = True  # every node descends from the root
        if torch.equal(new, anc[:, 1:]):
            break
        anc[:, 1:] = new
    return anc if include_root else anc[:, 1:, 1:]


def children_table(parents: torch.LongTensor, valid: torch.BoolTensor | None = None) -> torch.LongTensor:
    """``(batch, N + 1, C)`` children of ``[root, node 0, ...]`` in node order, ``-1`` padded (C = most children).

    Entries are node indices (``0..N-1``); nodes with ``valid == False`` are left out.
    """
    bsz, n = parents.shape
    dev = parents.device
    if n == 0:
        return torch.full((bsz, 1, 0), -1, dtype=torch.long, device=dev)
    owner = parents + 1  # (bsz, n) row of the parent in the table
    if valid is not None:
        owner = torch.where(valid, owner, torch.full_like(owner, n + 1))  # a dummy owner past the table
    onehot = owner[:, :, None] == torch.arange(n + 2, device=dev)[None, None]  # (bsz, n, n + 2)
    rank = onehot.long().cumsum(1) - 1  # rank of each node among its siblings
    rank = (rank * onehot).sum(-1)  # (bsz, n)
    width = int(onehot[:, :, : n + 1].sum(1).max()) if n else 0
    table = torch.full((bsz, n + 2, max(width, 1)), -1, dtype=torch.long, device=dev)
    nodes = torch.arange(n, device=dev)[None].expand(bsz, n)
    keep = owner <= n
    b_idx = torch.arange(bsz, device=dev)[:, None].expand(bsz, n)
    table[b_idx[keep], owner[keep], rank[keep]] = nodes[keep]
    return table[:, : n + 1, :width]


def path_nodes(
    anc: torch.BoolTensor, depths: torch.LongTensor, leaf: torch.LongTensor, length: int
) -> torch.LongTensor:
    """``(batch, length)`` nodes on the root-to-``leaf`` path, ordered by depth, ``-1`` padded.

    ``leaf`` is ``-1`` for an empty path (nothing accepted). ``anc`` is :func:`ancestor_matrix` without the root.
    """
    bsz, n = depths.shape
    dev = depths.device
    out = torch.full((bsz, length), -1, dtype=torch.long, device=dev)
    if length == 0 or n == 0:
        return out
    rows = torch.arange(bsz, device=dev)
    on_path = anc[rows, leaf.clamp_min(0)] & (leaf >= 0)[:, None]  # (bsz, n)
    slot = torch.where(on_path, depths - 1, torch.full_like(depths, length))  # depth d sits at column d - 1
    slot = slot.clamp(max=length)
    buf = torch.full((bsz, length + 1), -1, dtype=torch.long, device=dev)
    nodes = torch.arange(n, device=dev)[None].expand(bsz, n)
    buf.scatter_(1, slot, torch.where(on_path, nodes, torch.full_like(nodes, -1)))
    out[:] = buf[:, :length]
    return out


def tree_structure(proposal, device: torch.device | None = None):
    """``(parents, depths, ancestors_with_root)`` of a tree proposal, computed once per proposal.

    The loop's target pass, the scoring of processors and the verifier all need the depths and the ancestor
    matrix; computing them costs a few host syncs (the loops stop early), so the result is kept on the proposal.
    ``ancestors_with_root`` covers ``[root, node 0, ...]``; ``[:, 1:, 1:]`` is :func:`ancestor_matrix` without it.
    """
    cache = proposal.__dict__.get("_tree_structure")
    if cache is None:
        parents = proposal.batched_parents()
        if device is not None:
            parents = parents.to(device)
        cache = (parents, node_depths(parents), ancestor_matrix(parents, include_root=True))
        proposal.__dict__["_tree_structure"] = cache
    if device is not None and cache[0].device != torch.device(device):
        return tuple(t.to(device) for t in cache)
    return cache
