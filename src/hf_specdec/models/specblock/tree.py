"""The rank tree: SpecBlock's own tree builder (``generate(..., tree="rank")``)."""

from __future__ import annotations

from ...tree.policies import TreePolicy
from ...types import Proposal

__all__ = ["RankTree"]


class RankTree(TreePolicy):
    """Trees from repeated block passes whose branching the rank head sets (see
    :meth:`SpecBlockForDrafting.rank_tree`).

    Args:
        depth: block passes (the paper's evaluation: 2).
        top_k: widest branching (the first slot's, and the cap of the buckets' widths) and the number of
            continuations drafted per pass (the paper: 10).
        total_tokens: draft nodes kept, by path log-probability (the paper: 90 on a GPU).
    """

    name = "rank"

    def __init__(self, depth: int = 2, top_k: int = 10, total_tokens: int = 32):
        for label, value in (("tree_depth", depth), ("tree_top_k", top_k), ("tree_total_tokens", total_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}.")
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.block_size: int | None = None

    @property
    def max_nodes(self) -> int:
        return self.total_tokens

    @property
    def max_depth(self) -> int:
        # a block pass adds at most block_size levels, and a tree is never deeper than its node count (the loop reads
        # this before the first proposal, when the drafter's block size is not known yet)
        if self.block_size is None:
            return self.total_tokens
        return min(self.total_tokens, self.depth * self.block_size)

    def propose(self, drafter, state) -> Proposal:
        if not hasattr(drafter, "rank_tree"):
            raise ValueError(
                f"tree='rank' is the rank-head tree of a family that has one; {type(drafter).__name__} has none. "
                "Use tree='eagle2' or a static tree."
            )
        self.block_size = drafter.block_size
        return drafter.rank_tree(state, self.depth, self.top_k, self.total_tokens)
