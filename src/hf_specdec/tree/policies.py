"""Tree policies: how a drafter that can expand tree nodes grows a tree proposal. Trees are data.

A drafter opts in with ``supports_tree_drafting = True`` and two methods (see
:class:`~hf_specdec.DrafterPreTrainedModel`):

* ``tree_start(state) -> (root_logits, vocab_ids)``: the draft distribution after the last committed token,
  ``(batch, draft_vocab)``, and the target ids of the draft vocabulary (``None`` for the full vocabulary; ``(batch,
  draft_vocab)`` per row for a drafter with a context vocabulary, whose padding columns have ``-inf`` logits);
* ``tree_expand(state, expansion: TreeExpansion) -> logits``: the draft distribution after each of ``M`` nodes,
  ``(batch, M, draft_vocab)``. Nodes are expanded depth by depth; every node's ancestors were expanded before it.

Two policies ship:

* :class:`StaticTree`: a fixed tree given as paths of child ranks (the "choices" of Cai et al. 2024): ``(0,)`` is the root's best
  child, ``(0, 1)`` that node's second-best child, and so on. Named presets live in :data:`STATIC_TREES`, and
  :func:`static_tree_from_accuracies` builds the tree that maximises the expected accepted length from measured
  per-depth, per-rank acceptance rates (the calibration recipe of Cai et al. 2024).
* :class:`DynamicTree` (EAGLE-2): each node is valued by the product of draft probabilities along its path; each
  depth expands the ``top_k`` best frontier nodes, each proposing ``top_k`` children; finally the ``total_tokens``
  best nodes of all depths form the tree (an ancestor-closed set, since a child is never worth more than its parent).
  Its nodes are listed best first, so the first ``n`` of them are the tree of ``n`` nodes: one pass tells what any
  smaller tree would have committed, and the adaptive length chooses the tree's size among
  :attr:`TreePolicy.node_budgets` (:meth:`TreePolicy.with_budget` builds each one, drafting only as deep and as wide
  as it needs).

Trees are deterministic functions of the draft distributions (top-k choices), which the lossless sampling verifier
treats as point masses, so sampling stays exact.
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..types import Proposal

__all__ = [
    "TreeExpansion",
    "TreePolicy",
    "StaticTree",
    "DynamicTree",
    "STATIC_TREES",
    "register_static_tree",
    "TREE_OPTIONS",
    "make_tree_policy",
    "static_tree_from_accuracies",
    "register_tree_policy",
]


@dataclass
class TreeExpansion:
    """``M`` nodes (per row) to expand, all at the same depth.

    Attributes:
        tokens: ``(batch, M)`` the nodes' tokens.
        parent: ``(batch, M)`` each node's parent as an index into the nodes expanded before (in expansion order),
            ``-1`` for a child of the root.
        depth: 1-based depth of these nodes (children of the root have depth 1).
        ancestors: ``(batch, M, E)`` which of the ``E`` nodes expanded before are ancestors of each node.
    """

    tokens: torch.LongTensor
    parent: torch.LongTensor
    depth: int
    ancestors: torch.BoolTensor


class TreePolicy:
    """Base class: ``propose(drafter, state)`` returns a tree :class:`Proposal`."""

    name: ClassVar[str] = ""

    def propose(self, drafter, state: Any) -> Proposal:
        raise NotImplementedError

    @property
    def max_nodes(self) -> int:
        raise NotImplementedError

    @property
    def max_depth(self) -> int:
        raise NotImplementedError

    @property
    def node_budgets(self) -> tuple[int, ...]:
        """The tree sizes (draft nodes) the adaptive length chooses among, the largest being :attr:`max_nodes`. A
        policy offers several only when it lists its nodes best first, so that the first ``n`` nodes of a proposal
        are the tree :meth:`with_budget` builds for ``n`` (the loop then learns every size's tokens per pass from
        each pass)."""
        return (self.max_nodes,)

    @property
    def chain_depth(self) -> int | None:
        """The length of the chain this policy proposes when its tree is one node per depth (the drafter's greedy
        chain), else ``None``. The loop drafts such a size through the chain drafting instead (its draft selector:
        n-gram copies, and a draw from the drafter's distribution when sampling), which greedy decoding without
        copies makes the same chain."""
        return None

    def with_budget(self, nodes: int) -> TreePolicy:
        """This policy's tree of ``nodes`` draft nodes, one of :attr:`node_budgets`."""
        if nodes != self.max_nodes:
            raise ValueError(f"{type(self).__name__} builds trees of {self.max_nodes} nodes only, not {nodes}.")
        return self

    def for_vocabulary(self, vocab: int) -> TreePolicy:
        """This policy for a drafter that drafts over ``vocab`` tokens: sizes capped at what that vocabulary can
        fill, or a `ValueError` when the tree cannot be built from it. The loop calls it before sizing buffers."""
        return self


def _to_target(ids: torch.LongTensor, vocab_ids: torch.LongTensor | None) -> torch.LongTensor:
    """Target ids of draft columns ``ids`` (``(batch, ...)``): over one ``(V,)`` vocabulary or per row ``(batch, V)``."""
    if vocab_ids is None:
        return ids
    vocab_ids = vocab_ids.to(ids.device)
    if vocab_ids.dim() == 1:
        return vocab_ids[ids]
    return vocab_ids.gather(1, ids.reshape(ids.shape[0], -1)).reshape(ids.shape)


def _check_drafter(drafter) -> None:
    if not getattr(drafter, "supports_tree_drafting", False):
        raise ValueError(
            f"{type(drafter).__name__} cannot draft trees (it does not implement tree_start / tree_expand). Use its "
            "chain proposals (drop `tree=`), or a drafter family with tree support."
        )


class StaticTree(TreePolicy):
    """A fixed tree of child ranks (``choices``: paths of child ranks)."""

    name = "static"

    def __init__(self, choices):
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
        if not paths:
            raise ValueError("A static tree needs at least one path of child ranks, e.g. [(0,), (0, 0), (1,)].")
        known = set()
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"Static tree path {p} must be a non-empty tuple of ranks >= 0.")
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"Static tree path {p} has no parent path {p[:-1]} in the tree.")
            known.add(p)
        self.paths = paths
        self.index = {p: i for i, p in enumerate(paths)}
        self.parents = [self.index[p[:-1]] if len(p) > 1 else -1 for p in paths]

    @property
    def max_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    def for_vocabulary(self, vocab: int) -> StaticTree:
        too_deep = [p for p in self.paths if max(p) >= vocab]
        if too_deep:
            raise ValueError(
                f"Static tree path {too_deep[0]} asks for child rank {max(too_deep[0])}, but the drafter drafts over "
                f"{vocab} tokens (ranks 0..{vocab - 1}); use ranks below {vocab}."
            )
        return self

    def propose(self, drafter, state) -> Proposal:
        _check_drafter(drafter)
        root_logits, vocab_ids = drafter.tree_start(state)
        bsz = root_logits.shape[0]
        dev = root_logits.device
        n = len(self.paths)
        tokens = torch.zeros(bsz, n, dtype=torch.long, device=dev)
        expanded: list[int] = []  # node ids in expansion order
        logits_of: dict[int, torch.Tensor] = {-1: root_logits}
        for depth in range(1, self.max_depth + 1):
            level = [i for i, p in enumerate(self.paths) if len(p) == depth]
            # Children of each node at this depth: pick them by rank from the parent's distribution.
            for i in level:
                parent = self.parents[i]
                rank = self.paths[i][-1]
                logits = logits_of[parent]
                top = torch.topk(logits.float(), rank + 1, dim=-1).indices[:, rank]
                tokens[:, i] = _to_target(top, vocab_ids)
            to_expand = [i for i in level if any(self.parents[j] == i for j in range(n))]
            if not to_expand:
                continue
            pos = {node: e for e, node in enumerate(expanded)}
            parent_idx = torch.tensor([pos.get(self.parents[i], -1) for i in to_expand], device=dev)
            anc = torch.zeros(len(to_expand), len(expanded), dtype=torch.bool, device=dev)
            for m, i in enumerate(to_expand):
                j = self.parents[i]
                while j >= 0:
                    anc[m, pos[j]] = True
                    j = self.parents[j]
            exp = TreeExpansion(
                tokens=tokens[:, to_expand],
                parent=parent_idx[None].expand(bsz, -1),
                depth=depth,
                ancestors=anc[None].expand(bsz, -1, -1),
            )
            out = drafter.tree_expand(state, exp)
            for m, i in enumerate(to_expand):
                logits_of[i] = out[:, m]
            expanded.extend(to_expand)
        parents = torch.tensor(self.parents, dtype=torch.long, device=dev)
        return Proposal(tokens=tokens, kind="tree", parents=parents)


class DynamicTree(TreePolicy):
    """EAGLE-2's dynamic tree: ``depth`` expansion rounds of ``top_k`` nodes, ``total_tokens`` nodes kept.

    Args:
        depth: number of expansion rounds (the deepest node has this depth).
        top_k: children proposed per expanded node, and nodes expanded per depth.
        total_tokens: draft nodes in the final tree (EAGLE-2 counts the root too: its ``total_token=60`` is 59
            draft nodes here).
        keep_greedy_path: always expand and keep the drafter's greedy chain (its top-1 child at every depth), so
            the tree contains the chain proposal of the same depth and never accepts fewer tokens than it. EAGLE-2
            ranks by path probability only, which drops a right but low-confidence greedy path in favour of shallow
            siblings when the drafter is poorly calibrated. [design choice, not from the paper; ``False`` gives
            EAGLE-2 exactly]
    """

    name = "eagle2"

    def __init__(self, depth: int = 5, top_k: int = 8, total_tokens: int = 48, keep_greedy_path: bool = True):
        for label, value, low in (
            ("tree_depth", depth, 1),
            ("tree_top_k", top_k, 1),
            ("tree_total_tokens", total_tokens, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label} must be an integer >= {low}, got {value!r}.")
        self.depth = depth
        self.top_k = top_k
        self.keep_greedy_path = bool(keep_greedy_path)
        self.total_tokens = min(total_tokens, self._largest_tree(top_k))

    def _largest_tree(self, top_k: int) -> int:
        return top_k + (self.depth - 1) * top_k * top_k

    def for_vocabulary(self, vocab: int) -> DynamicTree:
        if self.top_k <= vocab:
            return self
        capped = copy.copy(self)  # a policy the caller passed is left as it is
        capped.top_k = vocab
        capped.total_tokens = min(self.total_tokens, self._largest_tree(vocab))
        return capped

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def chain_depth(self) -> int | None:
        return self.total_tokens if self.top_k == 1 else None

    @property
    def node_budgets(self) -> tuple[int, ...]:
        """Powers of two below ``total_tokens``, and ``total_tokens``: (1, 2, 4, 8, 16) for a tree of 16 nodes. With
        ``keep_greedy_path``, a size up to ``depth`` is the drafter's greedy chain of that length."""
        powers = [1 << i for i in range(self.total_tokens.bit_length()) if 1 << i < self.total_tokens]
        return (*powers, self.total_tokens)

    def with_budget(self, nodes: int) -> DynamicTree:
        """The best ``nodes`` nodes of this tree, drafted only as deep and as wide as they can reach. A node of the
        best ``n`` has its ancestors among them, so it lies at depth ``n`` at most, and fewer than ``n`` better
        siblings and better nodes at its depth, so expanding ``min(top_k, n)`` nodes per depth, with as many
        children each, finds it. With ``keep_greedy_path`` the greedy chain takes ``d = min(depth, n)`` of the
        nodes and the others are the best ``n - d`` of the rest, so ``1 + n - d`` nodes per depth suffice (one: the
        chain alone). The proposal equals the first ``nodes`` nodes of this policy's own."""
        if not 1 <= nodes <= self.total_tokens:
            raise ValueError(f"A tree budget must lie in [1, {self.total_tokens}], got {nodes}.")
        depth = min(self.depth, nodes)
        wide = 1 + nodes - depth if self.keep_greedy_path else nodes
        budget = copy.copy(self)
        budget.depth, budget.top_k, budget.total_tokens = depth, min(self.top_k, wide), nodes
        return budget

    def propose(self, drafter, state) -> Proposal:
        _check_drafter(drafter)
        root_logits, vocab_ids = drafter.tree_start(state)
        bsz = root_logits.shape[0]
        dev = root_logits.device
        k = min(self.top_k, root_logits.shape[-1])
        logp = torch.log_softmax(root_logits.float(), dim=-1)
        value, ids = torch.topk(logp, k, dim=-1)  # (bsz, k)
        # The candidate pool, in creation order (parents always before children).
        pool_tokens = [_to_target(ids, vocab_ids)]
        pool_value = [value]
        pool_parent = [torch.full((bsz, k), -1, dtype=torch.long, device=dev)]
        greedy = torch.zeros(bsz, k, dtype=torch.bool, device=dev)
        greedy[:, 0] = self.keep_greedy_path  # the root's top-1 child; the frontier keeps it first (below)
        pool_greedy = [greedy]
        pool_size = k
        frontier = torch.arange(k, device=dev)[None].expand(bsz, k)  # pool ids of the nodes to expand next
        frontier_value = value
        expanded_pool_ids: list[torch.Tensor] = []  # (bsz, k) per round, in expansion order
        anc_pool = torch.zeros(bsz, k, 0, dtype=torch.bool, device=dev)  # ancestors (as expansion slots) per pool node
        all_parent = pool_parent[0]
        for depth in range(1, self.depth):
            n_exp = sum(t.shape[1] for t in expanded_pool_ids)
            tokens_pool = torch.cat(pool_tokens, dim=1)
            # Parent of each frontier node, as an expansion slot.
            par_pool = all_parent.gather(1, frontier)
            if expanded_pool_ids:
                exp_ids = torch.cat(expanded_pool_ids, dim=1)  # (bsz, n_exp)
                par_slot = (
                    torch.where(par_pool[:, :, None] == exp_ids[:, None, :], torch.arange(n_exp, device=dev), n_exp)
                    .min(-1)
                    .values
                )
                par_slot = torch.where(par_pool >= 0, par_slot, torch.full_like(par_slot, -1))
            else:
                par_slot = torch.full_like(par_pool, -1)
            anc = anc_pool.gather(1, frontier[:, :, None].expand(-1, -1, anc_pool.shape[2]))
            exp = TreeExpansion(tokens=tokens_pool.gather(1, frontier), parent=par_slot, depth=depth, ancestors=anc)
            logits = drafter.tree_expand(state, exp)  # (bsz, k, V)
            expanded_pool_ids.append(frontier)
            # The new expansion slots: each frontier node is an ancestor of its own children.
            anc_pool = torch.cat([anc_pool, torch.zeros(bsz, pool_size, k, dtype=torch.bool, device=dev)], dim=2)
            own = torch.cat([anc, torch.eye(k, dtype=torch.bool, device=dev)[None].expand(bsz, k, k)], dim=2)
            child_lp, child_ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)  # (bsz, k, k)
            child_value = (frontier_value[:, :, None] + child_lp).reshape(bsz, k * k)
            child_parent = frontier[:, :, None].expand(-1, -1, k).reshape(bsz, k * k)
            pool_tokens.append(_to_target(child_ids.reshape(bsz, k * k), vocab_ids))
            pool_value.append(child_value)
            pool_parent.append(child_parent)
            all_parent = torch.cat([all_parent, child_parent], dim=1)
            anc_pool = torch.cat([anc_pool, own[:, :, None].expand(-1, -1, k, -1).reshape(bsz, k * k, -1)], dim=1)
            # The greedy frontier node sits first; its top-1 child (index 0) continues the greedy chain.
            child_greedy = torch.zeros(bsz, k * k, dtype=torch.bool, device=dev)
            child_greedy[:, 0] = self.keep_greedy_path
            pool_greedy.append(child_greedy)
            rank_value = child_value.masked_fill(child_greedy, float("inf"))
            best = torch.topk(rank_value, k, dim=-1).indices
            best_v = child_value.gather(1, best)
            frontier = pool_size + best
            frontier_value = best_v
            pool_size += k * k
        tokens = torch.cat(pool_tokens, dim=1)
        values = torch.cat(pool_value, dim=1).masked_fill(torch.cat(pool_greedy, dim=1), float("inf"))
        n = min(self.total_tokens, tokens.shape[1])
        # Top-n by value, best first (the greedy chain first); a stable sort keeps a parent before an equally valued
        # child, so every prefix is ancestor-closed (the greedy chain is closed too, and so is the union) and lists
        # parents before their children.
        chosen = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :n]
        new_index = torch.full((bsz, tokens.shape[1]), -1, dtype=torch.long, device=dev)
        new_index.scatter_(1, chosen, torch.arange(n, device=dev)[None].expand(bsz, n))
        old_parent = all_parent.gather(1, chosen)
        parents = torch.where(old_parent >= 0, new_index.gather(1, old_parent.clamp_min(0)), old_parent)
        if bool((parents[old_parent >= 0] < 0).any()):  # pragma: no cover - guarded by the stable sort
            raise RuntimeError("EAGLE-2 tree selection produced a node without its parent.")
        if k == 1:  # one node per depth: the chain it is, whose target pass runs causally, without a tree mask
            return Proposal(tokens=tokens.gather(1, chosen))
        return Proposal(tokens=tokens.gather(1, chosen), kind="tree", parents=parents)


# Named static trees (paths of child ranks). "chain-N" is a plain chain of N best children.
STATIC_TREES: dict[str, list[tuple[int, ...]]] = {
    "chain-4": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    # Two candidates at the first two depths, then a chain on the best path: 10 nodes, depth 5.
    "fork-10": [
        (0,),
        (1,),
        (0, 0),
        (0, 1),
        (1, 0),
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 0, 0),
    ],
    # A wider tree of 24 nodes, depth 5, for drafters whose second and third choices are often right.
    "wide-24": [
        (0,),
        (1,),
        (2,),
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
        (2, 0),
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 0),
        (0, 2, 0),
        (2, 0, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 1, 0, 0),
        (1, 0, 0, 0),
        (0, 0, 0, 0, 0),
        (0, 0, 0, 0, 1),
        (0, 0, 0, 1, 0),
        (0, 1, 0, 0, 0),
    ],
}


def static_tree_from_accuracies(accuracy, num_nodes: int) -> list[tuple[int, ...]]:
    """The static tree of ``num_nodes`` nodes with the largest expected accepted length.

    ``accuracy[d][r]`` is the measured probability that the rank-``r`` draft at depth ``d + 1`` is the right token
    (given a right path so far). A node's value is the product of its path's accuracies; the expected accepted
    length of a tree is the sum of its nodes' values, so adding nodes best-first (children only after their parent)
    is optimal. This is how Cai et al. (2024) choose a sparse tree from calibration data.
    """
    acc = [[float(a) for a in row] for row in accuracy]
    if num_nodes < 1 or not acc or not acc[0]:
        raise ValueError("static_tree_from_accuracies needs num_nodes >= 1 and a non-empty accuracy table.")
    heap = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < num_nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        depth = len(path)
        if depth < len(acc):
            for r, a in enumerate(acc[depth]):
                value = -neg * a
                if value > 0 and math.isfinite(value):
                    heapq.heappush(heap, (-value, (*path, r)))
    return chosen


def register_static_tree(name: str, paths) -> None:
    """Adds a named static tree (paths of child ranks, checked by :class:`StaticTree`), e.g. a family's calibrated
    default tree, so that ``generate(tree=name)`` finds it."""
    tree = StaticTree(paths)  # validates
    if name in STATIC_TREES and STATIC_TREES[name] != tree.paths:
        raise ValueError(f"A different static tree named {name!r} is already registered.")
    STATIC_TREES[name] = tree.paths


# Tree policies a drafter family brings (its own tree builder): name -> factory(depth=, top_k=, total_tokens=).
TREE_POLICIES: dict[str, Any] = {}


def register_tree_policy(name: str, factory) -> None:
    """Makes ``generate(tree=name)`` build ``factory(**options)`` with the given ``tree_depth`` / ``tree_top_k`` /
    ``tree_total_tokens`` (as ``depth`` / ``top_k`` / ``total_tokens``); a family registers its own tree builder."""
    if name in ("eagle2", "dynamic", "static") or name in STATIC_TREES:
        raise ValueError(f"Tree name {name!r} is taken by a built-in tree.")
    if name in TREE_POLICIES and TREE_POLICIES[name] is not factory:
        raise ValueError(f"A different tree policy named {name!r} is already registered.")
    TREE_POLICIES[name] = factory


# ``generate`` options of tree drafting (routed by the generate hook, checked here).
TREE_OPTIONS = ("tree", "tree_depth", "tree_top_k", "tree_total_tokens", "tree_choices")


def make_tree_policy(
    tree=None, tree_depth=None, tree_top_k=None, tree_total_tokens=None, tree_choices=None
) -> TreePolicy | None:
    """Resolves the ``tree=...`` options of ``generate`` into a policy (``None``: chain proposals).

    ``tree`` is ``"eagle2"`` / ``"dynamic"`` (with ``tree_depth``, ``tree_top_k``, ``tree_total_tokens``), a named
    static tree from :data:`STATIC_TREES`, ``"static"`` with ``tree_choices``, or a :class:`TreePolicy` instance.
    """
    dynamic_opts = {"tree_depth": tree_depth, "tree_top_k": tree_top_k, "tree_total_tokens": tree_total_tokens}
    if tree is None or tree is False:
        given = [k for k, v in {**dynamic_opts, "tree_choices": tree_choices}.items() if v is not None]
        if given:
            raise ValueError(f"{given} are tree options: pass tree='eagle2' (or a static tree) as well.")
        return None
    if isinstance(tree, TreePolicy):
        return tree
    if tree in ("eagle2", "dynamic"):
        if tree_choices is not None:
            raise ValueError("tree_choices is for static trees; the EAGLE-2 tree takes tree_depth/top_k/total_tokens.")
        kwargs = {k[len("tree_") :]: v for k, v in dynamic_opts.items() if v is not None}
        return DynamicTree(**kwargs)
    if tree in TREE_POLICIES:
        if tree_choices is not None:
            raise ValueError(f"tree_choices is for static trees; tree={tree!r} takes tree_depth/top_k/total_tokens.")
        return TREE_POLICIES[tree](**{k[len("tree_") :]: v for k, v in dynamic_opts.items() if v is not None})
    given = [k for k, v in dynamic_opts.items() if v is not None]
    if given:
        raise ValueError(f"{given} apply to tree='eagle2' only, not to the static tree {tree!r}.")
    if tree == "static":
        if tree_choices is None:
            raise ValueError("tree='static' needs tree_choices=[(0,), (0, 0), (1,), ...] (paths of child ranks).")
        return StaticTree(tree_choices)
    if tree_choices is not None:
        raise ValueError("Pass tree_choices with tree='static'.")
    if tree in STATIC_TREES:
        return StaticTree(STATIC_TREES[tree])
    raise ValueError(
        f"Unknown tree {tree!r}: use 'eagle2', 'static' (with tree_choices), or one of "
        f"{sorted([*STATIC_TREES, *TREE_POLICIES])}."
    )
