"""Configuration of the DFlash block drafter."""

from __future__ import annotations

from ...configuration_utils import (
    DecoderDrafterConfig,
    validate_decoder_layer,
)

__all__ = ["DFlashConfig"]

# DFlash's position decay per block size (SpecForge's loss_decay_gamma); other sizes use block_size / 2.
_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


class DFlashConfig(DecoderDrafterConfig):
    r"""Configuration of :class:`DFlashForDrafting` (DFlash, Chen, Liang and Liu, arXiv 2602.06036).

    A block ``[anchor, MASK, ..., MASK]`` of ``block_size`` tokens (the anchor is the last verified token, MASK the
    target's embedding of ``mask_token_id``) is filled in one non-causal pass of ``num_hidden_layers`` decoder
    layers. The target's states at ``target_layer_ids`` are fused into ``H_ctx = hidden_norm(fc([H_1; ...; H_n]))``
    and injected into the keys and values of *every* layer: ``K = [W_K H_ctx; W_K H_blk]`` (``k_norm`` and RoPE at the
    true positions), queries from the block only. Slot ``i >= 1`` predicts the token at its own position through the
    target's LM head (borrowed), so one pass drafts ``block_size - 1`` tokens.

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling_parameters / max_position_embeddings / attention_bias: the draft
            layers (Qwen3-style, with ``q_norm`` / ``k_norm``), shaped like the target's by :meth:`for_target`.
        num_hidden_layers (`int`, defaults to 2): draft decoder layers (the paper: 5 for an 8B target).
        block_size (`int`, defaults to 8): tokens per block, anchor included (the released drafters: 16).
        mask_token_id (`int`, *optional*): the target token whose embedding fills the masked slots; by default the
            target's last vocabulary id (a rarely used token; Qwen3 drafters use ``<|MASK|>``).
        loss_decay_gamma (`float`, *optional*): weight ``exp(-(k - 1) / gamma)`` of block slot ``k`` in the loss
            (default 7 / 5 / 4 for blocks of 16 / 10 / 8, else ``block_size / 2``).
        num_anchors (`int`, defaults to 64): random anchors (blocks) per training sequence (evaluation uses every
            anchor).
        loss_labels (`str`, defaults to ``"soft"``): ``"soft"`` distils the target's distribution, ``"hard"`` is the
            paper's cross-entropy on the data's tokens.
        sliding_window (`int`, *optional*) / layer_types (`list[str]`, *optional*): layers of type
            ``"sliding_attention"`` see only keys within ``sliding_window`` positions of the query (transformers'
            ``MuseGlimmerAssistantModel``); default: every layer ``"full_attention"``.
        draft_vocab_size (`int`, *optional*): restrict the target's LM head to the most frequent tokens.
    """

    model_type = "dflash_drafter"
    # Full-vocabulary DFlash borrows the target's embeddings and LM head: no weight is sized by the vocabulary, so a
    # checkpoint without it (transformers' MuseGlimmerAssistantModel) leaves it to `bind_target`.
    resolves_target_vocab_at_bind = True

    num_hidden_layers: int = 2
    block_size: int = 8
    mask_token_id: int | None = None
    loss_decay_gamma: float | None = None
    num_anchors: int = 64
    loss_labels: str = "soft"
    sliding_window: int | None = None
    layer_types: list | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self, **kwargs):
        if self.num_draft_tokens is None and isinstance(self.block_size, int) and self.block_size >= 2:
            self.num_draft_tokens = self.drafts_per_block
        if self.layer_types is None and isinstance(self.num_hidden_layers, int):
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.mask_token_id is None and self.target_vocab_size:
            self.mask_token_id = int(self.target_vocab_size) - 1
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        """Three target layers spaced evenly from layer 1 to layer ``L - 3`` (DFlash's rule), as
        ``output_hidden_states`` indices (layer ``i``'s output is index ``i + 1``)."""
        last = max(num_layers - 3, 1)
        ids = sorted({round(1 + (last - 1) * i / 2) for i in range(3)})
        return [min(i + 1, num_layers) for i in ids]

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block pass drafts: the masked slots (the anchor slot predicts nothing)."""
        return int(self.block_size) - 1

    @property
    def decay_gamma(self) -> float:
        if self.loss_decay_gamma is not None:
            return float(self.loss_decay_gamma)
        return _GAMMA.get(int(self.block_size), self.block_size / 2)

    def validate_drafter(self, require_complete: bool = False) -> None:
        name = type(self).__name__
        for key, minimum in (("num_hidden_layers", 1), ("block_size", 2), ("num_anchors", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}.{key} must be an integer >= {minimum}, got {value!r}.")
        super().validate_drafter(require_complete)
        if self.num_draft_tokens is not None and self.num_draft_tokens > self.drafts_per_block:
            raise ValueError(
                f"{name}.num_draft_tokens ({self.num_draft_tokens}) cannot exceed the {self.drafts_per_block} drafts "
                f"of one block pass (block_size {self.block_size})."
            )
        if self.loss_decay_gamma is not None and float(self.loss_decay_gamma) <= 0:
            raise ValueError(f"{name}.loss_decay_gamma must be > 0, got {self.loss_decay_gamma!r}.")
        types = list(self.layer_types or [])
        if len(types) != self.num_hidden_layers or set(types) - {"full_attention", "sliding_attention"}:
            raise ValueError(
                f"{name}.layer_types must give 'full_attention' or 'sliding_attention' for each of the "
                f"{self.num_hidden_layers} layers, got {self.layer_types!r}."
            )
        if "sliding_attention" in types and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"{name}.sliding_window must be a positive integer for sliding layers, got {self.sliding_window!r}."
            )
        if self.loss_labels not in ("soft", "hard"):
            raise ValueError(f"{name}.loss_labels must be 'soft' or 'hard', got {self.loss_labels!r}.")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        validate_decoder_layer(self, "the fused target states are injected into every draft layer")
        mask, vocab = self.mask_token_id, self.target_vocab_size  # vocab None: unresolved, checked at bind_target
        if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0 or (vocab is not None and mask >= vocab):
            raise ValueError(
                f"{name}.mask_token_id must be a target token id in [0, {vocab or 'the target vocabulary'}), got "
                f"{self.mask_token_id!r}."
            )
