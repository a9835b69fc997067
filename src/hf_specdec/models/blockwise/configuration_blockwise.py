"""Configuration of the Blockwise parallel decoding drafter."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ...configuration_utils import DrafterConfig, fill_heads_defaults, validate_heads

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
        fill_heads_defaults(self)
        if self.intermediate_size is None and self.target_hidden_size is not None:
            self.intermediate_size = 2 * self.target_hidden_size
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
        if self.hidden_act not in ("relu", "silu", "gelu"):
            raise ValueError(f"{name}.hidden_act must be relu, silu or gelu; got {self.hidden_act!r}.")
        validate_heads(self, require_complete, "the heads feed the target's LM head")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 1:
            raise ValueError(f"{name}.intermediate_size must be a positive integer, got {self.intermediate_size!r}.")
