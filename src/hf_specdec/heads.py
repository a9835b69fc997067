"""Drafting with parallel heads: every head reads the target's state at the last verified position.

Shared by the families whose draft token ``j`` (0-based) comes from head ``j`` alone, independently of the draft
tokens before it: one cheap forward of all heads per pass gives every draft
distribution, so a chain is the heads' choices in order and a tree takes each node's children from the head of the
next depth (Cartesian-product trees, e.g. a :class:`~hf_specdec.tree.StaticTree` preset a family registers).

A family mixes :class:`ParallelHeadsMixin` into its :class:`~hf_specdec.DrafterPreTrainedModel` subclass and
implements :meth:`~ParallelHeadsMixin.heads_forward` (``(..., hidden) -> (..., num_heads, draft_vocab)``) and the
``num_heads`` property, and registers its draft vocabulary too (the heads' vocabulary may be a reduced draft
vocabulary: :meth:`~hf_specdec.DrafterPreTrainedModel.register_vocabulary_buffers`); it reads one target state (``config.target_layer_ids``, by default the final hidden state,
the LM head's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .modeling_utils import depthwise_distillation_loss
from .types import DraftInputs, Proposal, TokenSelector

__all__ = ["HeadsDraftState", "ParallelHeadsMixin", "last_verified"]


@dataclass
class HeadsDraftState:
    """The target state at each row's last verified position, and the heads' logits on it (computed once)."""

    last_hidden: torch.Tensor | None = None  # (batch, hidden)
    logits: torch.Tensor | None = None  # (batch, num_heads, draft_vocab)


class ParallelHeadsMixin:
    """Chain and tree proposals, the draft state and the training objective of parallel-head families."""

    requires_target_hidden_states = True
    supports_tree_drafting = True
    max_draft_depth_source = "num_heads"

    # -- the family's part ------------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        raise NotImplementedError

    def heads_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., target_hidden)`` -> ``(..., num_heads, draft_vocab)`` draft logits; head ``j`` at the state of
        position ``p`` predicts the token at ``p + 2 + j``."""
        raise NotImplementedError

    # -- decoding ----------------------------------------------------------------------------------------------------
    @property
    def max_draft_depth(self) -> int:
        return self.num_heads

    def init_draft_state(self, batch_size: int, max_length: int) -> HeadsDraftState:
        return HeadsDraftState()

    def observe(self, state: HeadsDraftState, inputs: DraftInputs) -> None:
        (feats,) = self.select_target_features(inputs.hidden_states)
        state.last_hidden, _ = last_verified(feats, inputs, state.last_hidden)
        state.logits = None

    def _head_logits(self, state: HeadsDraftState) -> torch.Tensor:
        if state.logits is None:
            state.logits = self.heads_forward(state.last_hidden).float()
        return state.logits

    def propose(self, state: HeadsDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """Draft token ``j`` is drawn from head ``j``'s distribution (at most ``num_heads`` tokens)."""
        logits = self._head_logits(state)
        vocab_ids = self.reduced_vocab_ids()
        tokens, probs = [], []
        for depth in range(min(int(num_tokens), self.num_heads)):
            tok, q = select(logits[:, depth], depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
        draft_probs = torch.stack(probs, dim=1) if probs[0] is not None else None
        return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs, kind="chain")

    def tree_start(self, state: HeadsDraftState):
        return self._head_logits(state)[:, 0], self.reduced_vocab_ids()

    def tree_expand(self, state: HeadsDraftState, expansion) -> torch.Tensor:
        """Every node at depth ``d`` has the same children distribution: head ``d``'s (0-based)."""
        depth = int(expansion.depth)
        if depth >= self.num_heads:
            raise ValueError(
                f"{type(self).__name__} has {self.num_heads} heads, so its trees are at most {self.num_heads} deep; "
                f"this tree expands nodes at depth {depth}. Use a shallower tree (tree_depth <= {self.num_heads})."
            )
        logits = self._head_logits(state)[:, depth]
        bsz, m = expansion.tokens.shape
        return logits[:, None].expand(bsz, m, logits.shape[-1])

    # -- training ----------------------------------------------------------------------------------------------------
    def teacher_forced_logits(self, hidden: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """Per head ``j < steps``: ``(batch, seq, draft_vocab)`` logits, anchor ``t`` predicting token ``t + 2 + j``
        (``hidden``: the target state the heads read, over a sequence)."""
        logits = self.heads_forward(hidden)
        steps = self.num_heads if steps is None else min(int(steps), self.num_heads)
        return [logits[:, :, j] for j in range(steps)]

    def heads_loss(self, batch: dict, features, target_head, weights: list[float], labels: str = "soft", **kw):
        """``sum_j weights[j] * CE`` of head ``j`` against the teacher's distribution of the token it predicts
        (``labels="soft"``, self-distillation) or against the data's token (``"hard"``, the papers' objective);
        ``kw``: the loss kwargs the family was called with (checked against its ``loss_kwargs``)."""
        loss_mask, soft, in_vocab, hard = self.loss_targets(batch, features, target_head, kw, labels)
        (hidden,) = features.hidden_states
        step_logits = self.teacher_forced_logits(hidden.to(self.device, self.dtype))
        return depthwise_distillation_loss(
            step_logits, soft, loss_mask, in_vocab, weights[: len(step_logits)], self.num_heads, hard_targets=hard
        )


def last_verified(feats: torch.Tensor, inputs: DraftInputs, previous: tuple | torch.Tensor | None = None):
    """Each row's state at its last verified slot, and the token that follows it: ``(hidden (B, H), token (B,))``.

    A row without a verified slot in ``inputs`` (it finished) keeps ``previous`` (``hidden`` or ``(hidden, token)``).
    """
    valid = inputs.valid.to(feats.device)
    slot = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, slot, -1).max(dim=1).values
    rows = torch.arange(valid.shape[0], device=valid.device)
    hidden = feats[rows, last.clamp(min=0)]
    token = inputs.next_token_ids.to(feats.device)[rows, last.clamp(min=0)]
    if previous is not None:
        old_hidden, old_token = previous if isinstance(previous, tuple) else (previous, None)
        keep = last < 0
        hidden = torch.where(keep[:, None], old_hidden, hidden)
        if old_token is not None:
            token = torch.where(keep, old_token, token)
    return hidden, token
