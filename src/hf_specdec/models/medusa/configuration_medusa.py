"""Configuration of the Medusa drafter."""

from __future__ import annotations

from ...configuration_utils import DrafterConfig

__all__ = ["MedusaConfig"]


class MedusaConfig(DrafterConfig):
    r"""Configuration of :class:`MedusaForDrafting` (Medusa-1, Cai et al. 2024, arXiv 2401.10774).

    ``num_heads`` heads read the target's final hidden state ``h_t`` (the LM head's input,
    ``output_hidden_states[L]``). Head ``k`` (1-based) is ``num_layers`` residual blocks ``x + SiLU(W x + b)``
    (``W`` zero-initialised) followed by its own vocabulary projection (initialised from the target's LM head by
    ``init_from_target``), and predicts the token ``k + 1`` positions after ``h_t``'s (the target itself gives the
    next one). All heads run once per pass; a chain takes each head's choice, a tree the Cartesian product of their
    top choices (``tree="medusa-63"``, Medusa's default 63-node tree).

    Args:
        num_heads (`int`, defaults to 5): heads, hence the longest chain or deepest tree.
        num_layers (`int`, defaults to 1): residual blocks per head.
        residual_bias (`bool`, defaults to `True`): the blocks' ``b`` (FasterDecoding's heads have it; vLLM's
            ``medusa_fc_bias`` checkpoints may not).
        hidden_size (`int`): must equal ``target_hidden_size``.
        loss_decay (`float`, defaults to 0.8): head ``k`` weighs ``loss_decay ** (k - 1)`` in the loss (the paper's
            ``λ_k = 0.8^k`` up to a constant factor).
        loss_labels (`str`, defaults to ``"soft"``): ``"soft"`` trains each head on the target's distribution of the
            token it predicts (self-distillation); ``"hard"`` on the data's token (the paper's Medusa-1 loss, equal
            to "soft"'s argmax on self-distilled greedy data).
        draft_vocab_size (`int`, *optional*): a reduced vocabulary for the heads' projections (the most frequent
            tokens of the training data, ``init_from_data``); each head then costs ``draft_vocab_size x hidden``
            instead of a full LM head.
        initializer_range (`float`): std of the heads' projections before ``init_from_target``.
        num_draft_tokens (`int`, *optional*): default chain length; at most ``num_heads`` (default ``num_heads``).
        Other arguments: see :class:`~hf_specdec.DrafterConfig`.
    """

    model_type = "medusa_drafter"

    num_heads: int = 5
    num_layers: int = 1
    residual_bias: bool = True
    hidden_size: int | None = None
    loss_decay: float = 0.8
    loss_labels: str = "soft"
    initializer_range: float = 0.02
    num_draft_tokens: int | None = None

    def __post_init__(self, **kwargs):
        if self.hidden_size is None:
            self.hidden_size = self.target_hidden_size
        if self.num_draft_tokens is None:
            self.num_draft_tokens = self.num_heads
        if self.target_layer_ids is None and self.target_num_hidden_layers is not None:
            self.target_layer_ids = self.default_target_layer_ids(self.target_num_hidden_layers)
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]  # the final hidden state, the LM head's input

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        for key in ("num_heads", "num_layers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "num_heads" else 0):
                raise ValueError(
                    f"{name}.{key} must be a {'positive' if key == 'num_heads' else 'non-negative'} "
                    f"integer, got {value!r}."
                )
        if self.num_draft_tokens > self.num_heads:
            raise ValueError(
                f"{name}.num_draft_tokens ({self.num_draft_tokens}) must be at most num_heads ({self.num_heads}): "
                "each head drafts one token."
            )
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise ValueError(f"{name}.loss_decay must be in (0, 1], got {self.loss_decay!r}.")
        if self.loss_labels not in ("soft", "hard"):
            raise ValueError(f"{name}.loss_labels must be 'soft' or 'hard', got {self.loss_labels!r}.")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"{name}.hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): "
                "Medusa heads read the target's hidden state."
            )
        if self.target_layer_ids is not None and len(self.target_layer_ids) != 1:
            raise ValueError(f"{name}.target_layer_ids must name one target state, got {self.target_layer_ids}.")
