"""Configuration of the Hydra drafter."""

from __future__ import annotations

from ...configuration_utils import DecoderDrafterConfig, fill_heads_defaults, validate_decoder_layer, validate_heads

__all__ = ["HydraConfig"]


class HydraConfig(DecoderDrafterConfig):
    r"""Configuration of :class:`HydraForDrafting` (Hydra, Ankner et al. 2024, arXiv 2402.05109).

    Sequentially dependent heads on the target's final hidden state ``h_t``: head ``k`` (1-based) reads
    ``[h_t; E(x_{t+1}); ...; E(x_{t+k})]``, the target's next token ``x_{t+1}`` and the ``k - 1`` draft tokens on the
    path so far (``E``: the target's token embeddings, borrowed), and predicts ``x_{t+k+1}``. Each head is a first
    block ``P x + SiLU(W x + b)`` from ``(k + 1) * hidden`` to ``hidden`` (``W`` zero-initialised, ``P`` a linear
    residual projection), ``num_layers - 1`` residual blocks ``x + SiLU(W x + b)`` and its own vocabulary projection
    (initialised from the target's LM head). Chains draft head by head; trees run head ``d + 1`` on every node of
    depth ``d``.

    Args:
        num_heads (`int`, defaults to 4): heads, hence the longest chain or deepest tree.
        num_layers (`int`, defaults to 1): blocks per head (Hydra++: 4).
        hidden_size (`int`): must equal ``target_hidden_size``.
        loss_labels (`str`, defaults to ``"soft"``): ``"soft"`` is Hydra++'s teacher loss (the target's
            distribution); ``"hard"`` the data's tokens.
        loss_decay (`float`, defaults to 1.0): head ``k`` weighs ``loss_decay ** (k - 1)``.
        dropout (`float`, defaults to 0.0): dropout on the blocks' outputs in training (Hydra++: 0.2).
        draft_vocab_size (`int`, *optional*): a reduced vocabulary for the heads' projections (``init_from_data``).
        initializer_range (`float`): std of the residual projections and vocabulary projections before
            ``init_from_target``.
        num_draft_tokens (`int`, *optional*): default chain length, at most ``num_heads`` (default ``num_heads``).
        prefix_layer (`bool`, defaults to `False`): Hydra++'s prefix attention: one decoder layer over the target's
            hidden states (causal, with its own KV cache) whose output replaces ``h_t`` for the heads. Its shape
            (``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_act``,
            ``rms_norm_eps``, RoPE, ``attention_bias``) is one of the target's layers by :meth:`for_target`.
        prefix_norm (`bool`, defaults to `False`): an RMSNorm on the prefix layer's output (zankner/Hydra's prefix is
            a one-layer ``LlamaModel``, which ends with its final norm; set by the ``hydra-zankner`` import).
        head_bias (`bool`, defaults to `False`): biases on each head's residual projection ``P`` and vocabulary
            projection (zankner/Hydra's heads have both; set by the ``hydra-zankner`` import when they are nonzero).
    """

    model_type = "hydra_drafter"

    # the decoder-layer fields (DecoderDrafterConfig) shape the prefix layer (used with prefix_layer=True)
    num_heads: int = 4
    num_layers: int = 1
    loss_labels: str = "soft"
    loss_decay: float = 1.0
    dropout: float = 0.0
    num_draft_tokens: int | None = None
    prefix_layer: bool = False
    prefix_norm: bool = False
    head_bias: bool = False

    def __post_init__(self, **kwargs):
        fill_heads_defaults(self)
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"{name}.num_layers must be a positive integer, got {self.num_layers!r}.")
        if not 0.0 < float(self.loss_decay) <= 1.0:
            raise ValueError(f"{name}.loss_decay must be in (0, 1], got {self.loss_decay!r}.")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"{name}.dropout must be in [0, 1), got {self.dropout!r}.")
        validate_heads(self, require_complete, "Hydra heads read the target's hidden state and token embeddings")
        if self.prefix_layer and (require_complete or self.is_bound_to_target_facts):
            validate_decoder_layer(self, "the prefix layer reads the target's hidden states")
