"""Configuration of the Medusa drafter."""

from __future__ import annotations

from ...configuration_utils import DrafterConfig, fill_heads_defaults, validate_heads

__all__ = ["MedusaConfig", "Medusa2Config"]


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
        fill_heads_defaults(self)
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]  # the final hidden state, the LM head's input

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(f"{name}.num_layers must be a non-negative integer, got {self.num_layers!r}.")
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise ValueError(f"{name}.loss_decay must be in (0, 1], got {self.loss_decay!r}.")
        validate_heads(self, require_complete, "Medusa heads read the target's hidden state")


class Medusa2Config(MedusaConfig):
    r"""Configuration of :class:`Medusa2ForDrafting` (Medusa-2: heads trained jointly with a LoRA adapter on the
    target, Cai et al. 2024).

    The loss is ``KL(p_orig || p_adapted) + λ · Σ_k decay^(k-1) CE_k``: the unadapted target is the teacher of the
    adapted one (self-distillation keeps its outputs), and ``λ`` ramps linearly from 0 to ``lambda_max`` over the
    first ``lambda_ramp`` share of training (the heads warm up while the backbone barely moves). The heads train at
    the run's learning rate, the adapter at ``1 / head_lr_ratio`` of it. Generation needs the adapted target:
    ``target = drafter.adapt_target(target)`` (the adapter is saved next to the drafter, and a target without it is
    refused). The λ ramp and learning-rate ratio are design choices, not the paper's values.

    Args:
        lora_r (`int`, defaults to 8), lora_alpha (`int`, defaults to 16), lora_dropout (`float`, defaults to 0.0),
        lora_target_modules (`list[str]`, defaults to the attention projections): the adapter on the target.
        lambda_max (`float`, defaults to 0.2), lambda_ramp (`float`, defaults to 0.5): the heads' loss weight ramp.
        head_lr_ratio (`float`, defaults to 4.0): head learning rate over adapter learning rate.
        Other arguments: see :class:`MedusaConfig`.
    """

    model_type = "medusa2_drafter"

    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | None = None
    lambda_max: float = 0.2
    lambda_ramp: float = 0.5
    head_lr_ratio: float = 4.0

    def __post_init__(self, **kwargs):
        if self.lora_target_modules is None:
            self.lora_target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
        super().__post_init__(**kwargs)

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 1:
            raise ValueError(f"{name}.lora_r must be a positive integer, got {self.lora_r!r}.")
        if not 0.0 <= float(self.lambda_max):
            raise ValueError(f"{name}.lambda_max must be >= 0, got {self.lambda_max!r}.")
        if not 0.0 <= float(self.lambda_ramp) <= 1.0:
            raise ValueError(f"{name}.lambda_ramp must be a share of training in [0, 1], got {self.lambda_ramp!r}.")
        if not float(self.head_lr_ratio) > 0:
            raise ValueError(f"{name}.head_lr_ratio must be > 0, got {self.head_lr_ratio!r}.")
        if not self.lora_target_modules:
            raise ValueError(f"{name}.lora_target_modules must name the target modules the adapter adapts.")
