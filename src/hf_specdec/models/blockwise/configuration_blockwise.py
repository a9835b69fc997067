"""Configuration of the Blockwise parallel decoding drafter."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ...configuration_utils import DrafterConfig

__all__ = ["BlockwiseConfig"]


class BlockwiseConfig(DrafterConfig):
    r"""Configuration of :class:`BlockwiseForDrafting` (blockwise parallel decoding, Stern et al. 2018,
    arXiv 1811.03115).

    ``num_heads`` heads read the target's final hidden state ``h_t``; head ``j`` (1-based) is one feed-forward
    layer with a residual connection, ``h_t + W_out act(W_in h_t)``, followed by the target's *own* LM head (shared,
    never copied or trained), and predicts the token ``j + 1`` positions after ``h_t``'s (the target is the paper's
    "head 1"). The proposal is each head's choice (a chain), or a tree of each head's top-k.

    Args:
        num_heads (`int`, defaults to 4): heads, hence the longest chain or deepest tree.
        intermediate_size (`int`, *optional*): width of each head's feed-forward layer (default ``2 * hidden``).
        hidden_act (`str`, defaults to ``"relu"``): ``relu`` (the paper's), ``silu`` or ``gelu``.
        hidden_size (`int`): must equal ``target_hidden_size``.
        loss_labels (`str`, defaults to ``"soft"``): ``"soft"`` trains on the target's distribution of each
            predicted token (sequence-level distillation, which the paper found to help); ``"hard"`` on the data's
            tokens. Heads are weighted equally, as in the paper.
        draft_vocab_size (`int`, *optional*): restrict the shared LM head to the most frequent tokens of the
            training data (``init_from_data``) to make each head cheaper.
        initializer_range (`float`): std of ``W_in``; ``W_out`` starts at zero, so a fresh head proposes the target's
            own next token.
        num_draft_tokens (`int`, *optional*): default chain length, at most ``num_heads`` (default ``num_heads``).
    """

    model_type = "blockwise_drafter"

    num_heads: int = 4
    intermediate_size: int | None = None
    hidden_act: str = "relu"
    hidden_size: int | None = None
    loss_labels: str = "soft"
    initializer_range: float = 0.02
    num_draft_tokens: int | None = None

    def __post_init__(self, **kwargs):
        if self.hidden_size is None:
            self.hidden_size = self.target_hidden_size
        if self.intermediate_size is None and self.hidden_size is not None:
            self.intermediate_size = 2 * self.hidden_size
        if self.num_draft_tokens is None:
            self.num_draft_tokens = self.num_heads
        if self.target_layer_ids is None and self.target_num_hidden_layers is not None:
            self.target_layer_ids = self.default_target_layer_ids(self.target_num_hidden_layers)
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]

    @classmethod
    def architecture_defaults(cls, text_config: PretrainedConfig) -> dict[str, Any]:
        return {}

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"{name}.num_heads must be a positive integer, got {self.num_heads!r}.")
        if self.num_draft_tokens > self.num_heads:
            raise ValueError(
                f"{name}.num_draft_tokens ({self.num_draft_tokens}) must be at most num_heads ({self.num_heads}): "
                "each head drafts one token."
            )
        if self.hidden_act not in ("relu", "silu", "gelu"):
            raise ValueError(f"{name}.hidden_act must be relu, silu or gelu; got {self.hidden_act!r}.")
        if self.loss_labels not in ("soft", "hard"):
            raise ValueError(f"{name}.loss_labels must be 'soft' or 'hard', got {self.loss_labels!r}.")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"{name}.hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): "
                "the heads feed the target's LM head."
            )
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise ValueError(f"{name}.intermediate_size must be a positive integer, got {self.intermediate_size!r}.")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != 1:
            raise ValueError(f"{name}.target_layer_ids must name one target state, got {self.target_layer_ids}.")
