"""Data passed between the decoding loop, drafters and verifiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["Proposal", "TokenSelector", "DraftInputs"]

PROPOSAL_KINDS = ("chain", "tree", "block")


@dataclass
class Proposal:
    """Draft tokens proposed for one decoding step of a batch.

    Attributes:
        tokens: ``(batch, num_nodes)`` proposed target-vocabulary token ids.
        draft_probs: ``(batch, num_nodes, vocab)`` the distribution ``q`` each token was drawn from, in the target
            vocabulary after logits processing; ``None`` when the draft is deterministic (greedy decoding).
        kind: ``"chain"`` (node ``i`` follows node ``i - 1``), ``"block"`` (a chain produced in one pass) or
            ``"tree"`` (structure in ``parents``).
        parents: for trees, ``(num_nodes,)`` or ``(batch, num_nodes)`` index of each node's parent, ``-1`` for
            children of the last committed token. ``None`` for chains and blocks.
    """

    tokens: torch.LongTensor
    draft_probs: torch.FloatTensor | None = None
    kind: str = "chain"
    parents: torch.LongTensor | None = None
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in PROPOSAL_KINDS:
            raise ValueError(f"Proposal.kind must be one of {PROPOSAL_KINDS}, got {self.kind!r}")
        if self.kind == "tree" and self.parents is None:
            raise ValueError("A tree proposal needs `parents`.")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_linear(self) -> bool:
        return self.kind in ("chain", "block")


@dataclass
class DraftInputs:
    """Verified context handed to a drafter after each target pass (and after the prefill).

    Slot ``t`` of row ``b`` pairs the target state at position ``position_ids[b, t]`` with the token that follows it,
    ``next_token_ids[b, t]``; slots with ``valid[b, t] == False`` are padding (left padding of the prompt, or
    rejected draft tokens of rows that accepted fewer tokens than others).

    Attributes:
        next_token_ids: ``(batch, slots)`` token at position ``p + 1`` for the target state at position ``p``.
        position_ids: ``(batch, slots)`` target positions of the states.
        valid: ``(batch, slots)`` bool.
        hidden_states: the target's ``output_hidden_states`` tuple restricted to these slots (``None`` if the
            drafter declared it needs none).
        logits: ``(batch, slots, vocab)`` raw target logits for these slots, when available.
    """

    next_token_ids: torch.LongTensor
    position_ids: torch.LongTensor
    valid: torch.BoolTensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    logits: torch.Tensor | None = None


class TokenSelector(Protocol):
    """Turns draft logits into draft tokens, consistently with the verifier (supplied by the loop)."""

    do_sample: bool

    def __call__(
        self, logits: torch.Tensor, depth: int, vocab_ids: torch.LongTensor | None = None
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """Selects one token per row.

        Args:
            logits: ``(batch, vocab)`` draft logits in the *target* vocabulary, or, with ``vocab_ids``, over a
                reduced draft vocabulary.
            depth: 0-based index of this token in the proposal (the loop uses it to build the logits processors'
                prefix: the committed tokens plus the ``depth`` draft tokens before it).
            vocab_ids: ``(draft_vocab,)`` target ids of the columns of ``logits`` when they cover a reduced draft
                vocabulary (tokens outside it get probability 0). Lets greedy decoding skip building a
                full-vocabulary tensor.

        Returns:
            ``(tokens, probs)``: ``(batch,)`` token ids and the ``(batch, vocab)`` distribution they were drawn from
            (``None`` when decoding greedily).
        """
        ...
