"""Blockwise parallel decoding drafter (Stern, Shazeer and Uszkoreit 2018, arXiv 1811.03115)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...heads import ParallelHeadsMixin
from ...layers import ACT2FN_SIMPLE
from ...modeling_utils import DrafterPreTrainedModel
from .configuration_blockwise import BlockwiseConfig

__all__ = ["BlockwiseForDrafting", "BlockwiseHead"]


class BlockwiseHead(nn.Module):
    """``h + W_out act(W_in h)``: one residual feed-forward layer between the target's state and its LM head."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.down = nn.Linear(intermediate_size, hidden_size)
        self.down.zero_init = True  # a fresh head adds only its bias: it starts at the target's head
        self.act = ACT2FN_SIMPLE[act]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(self.act(self.up(h)))


class BlockwiseForDrafting(ParallelHeadsMixin, DrafterPreTrainedModel):
    """Blockwise parallel decoding: ``num_heads`` residual feed-forward heads sharing the target's LM head.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(BlockwiseConfig.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter)
    """

    config_class = BlockwiseConfig
    borrows_target_lm_head = True
    lora_target_modules = ("up", "down")
    _no_split_modules = ["BlockwiseHead"]

    def __init__(self, config: BlockwiseConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(
            BlockwiseHead(config.hidden_size, config.intermediate_size, config.hidden_act)
            for _ in range(config.num_heads)
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def _shared_head(self):
        head = self._borrowed("lm_head")
        weight, bias = head.weight, getattr(head, "bias", None)
        if self.reduced_vocabulary:
            ids = self.draft_token_ids.to(weight.device)
            weight = weight[ids]
            bias = None if bias is None else bias[ids]
        return weight, bias

    def heads_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self._shared_head()
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        states = torch.stack([head(hidden) for head in self.heads], dim=-2)
        return F.linear(states.to(weight.dtype), weight, bias).to(states.device)

    def forward(self, target_hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """``(batch, seq, hidden)`` target final hidden states -> ``(batch, seq, num_heads, draft_vocab)`` logits
        (needs a bound target for its LM head)."""
        return self.heads_forward(target_hidden_states)

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """Equal-weight cross-entropy of every head (labels per ``config.loss_labels``)."""
        weights = [1.0] * self.num_heads
        return self.heads_loss(batch, features, target_head, weights, self.config.loss_labels, **loss_kwargs)
