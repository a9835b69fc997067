"""Configuration of the MTP (multi-token prediction) drafter."""

from __future__ import annotations

from transformers import PretrainedConfig

from ...configuration_utils import (
    DecoderDrafterConfig,
    DrafterConfig,
    validate_decoder_layer,
)

__all__ = ["MtpConfig", "NativeMtpConfig", "native_mtp_refusal"]


class MtpConfig(DecoderDrafterConfig):
    r"""Configuration of :class:`MtpForDrafting`, DeepSeek-V3-style multi-token prediction modules (arXiv 2412.19437
    §2.2) trained post hoc for any target.

    Module ``k`` (``k = 1..D``) at position ``i``: ``h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])``
    (``eh_proj``: ``2 * hidden -> hidden``, no bias), ``h^k_i = post_norm(Block_k(h'_i))`` with one Llama-style
    decoder layer, and the target's LM head (shared, borrowed) on ``h^k`` predicts ``t_{i+k+1}``. ``h^0`` is the
    target's final hidden state. The embedding and LM head are the target's and are never saved.

    Drafting: token 0 comes from module 1 on the verified context; draft token ``j >= 1`` from module
    ``min(j + 1, D)`` on the previous step's output and the embedding of draft token ``j - 1``, so past ``D`` the last
    module is reused autoregressively (as DeepSeek-V3 and vLLM do for longer drafts). Each module keeps its own KV
    cache of the verified context, computed from the target's features, and sees its own earlier draft slots; training
    unrolls the same computation (``ttt_steps``), so the loss is what decoding runs.

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling_parameters / max_position_embeddings / attention_bias: the
            decoder layer of each module, shaped like one of the target's by :meth:`for_target`.
        num_mtp_modules (`int`, defaults to 1): ``D``, the number of chained modules (DeepSeek-V3 uses 1).
        ttt_steps (`int`, *optional*): draft steps unrolled in the loss (default ``D``: each module trained at its own
            depth, DeepSeek's objective); more train the reuse of the last module for longer drafts.
        ttt_decay (`float`, defaults to 1.0): weight ``ttt_decay ** j`` of step ``j``; the loss is divided by the
            number of steps (DeepSeek's ``λ / D`` with ``λ = 1``: the target is frozen, so ``λ`` only scales the lr).
        loss_labels (`str`, defaults to ``"soft"``): ``"soft"`` distils the target's distribution, ``"hard"`` is the
            paper's cross-entropy on the data's tokens.
        hidden_states_first (`bool`, defaults to `False`): ``eh_proj`` reads ``[hnorm(h); enorm(e)]`` instead of
            DeepSeek's ``[enorm(e); hnorm(h)]`` (some checkpoints order it so; transformers' ``mtp_hidden_states_first``).
        qkv_bias (`bool`, defaults to `False`): biases on the attention's q/k/v projections only, as Qwen2's
            attention has them (MiMo's MTP layers); ``attention_bias`` puts one on ``o_proj`` too (Llama's flag).
        use_post_norm (`bool`, defaults to `True`): each module ends with its own RMSNorm before the shared head
            (DeepSeek's ``shared_head.norm``, transformers' ``post_norm``).
        draft_vocab_size (`int`, *optional*): restrict the target's LM head to the most frequent tokens of the training
            data (cheaper drafting; ``init_from_data``).
    """

    model_type = "mtp_drafter"

    num_mtp_modules: int = 1
    ttt_steps: int | None = None
    ttt_decay: float = 1.0
    loss_labels: str = "soft"
    hidden_states_first: bool = False
    qkv_bias: bool = False
    use_post_norm: bool = True
    num_draft_tokens: int = 4

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]  # h^0: the target's final hidden state, the LM head's input

    @property
    def unrolled_steps(self) -> int:
        return int(self.ttt_steps) if self.ttt_steps is not None else int(self.num_mtp_modules)

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        for key in ("num_mtp_modules", "ttt_steps"):
            value = getattr(self, key)
            if value is None and key == "ttt_steps":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}.")
        if float(self.ttt_decay) <= 0:
            raise ValueError(f"{name}.ttt_decay must be > 0, got {self.ttt_decay!r}.")
        if self.loss_labels not in ("soft", "hard"):
            raise ValueError(f"{name}.loss_labels must be 'soft' or 'hard', got {self.loss_labels!r}.")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        validate_decoder_layer(self, "an MTP module reads the target's final hidden state")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != 1:
            raise ValueError(
                f"{name}.target_layer_ids must name one target state (h^0, the final hidden state), got "
                f"{self.target_layer_ids}."
            )


class NativeMtpConfig(DrafterConfig):
    r"""Configuration of :class:`NativeMtpForDrafting`: the MTP layers a target ships in its own checkpoint (configs
    with ``num_mtp_layers``: DeepSeek-V3, GLM-4.5-MoE, ...), built as transformers builds them (``MtpModel``): one
    ``MtpLayer`` around the target's own decoder-layer class (MLA attention, mixture-of-experts MLP).

    Args:
        target_text_config (`dict`): the target's text config (``to_dict()``); the MTP layer is built from it.
        num_draft_tokens (`int`, defaults to 1): one token per MTP layer, as transformers' ``MTPCandidateGenerator``
            drafts; longer chains and trees reuse the layer on its own output (DeepSeek-V3 / SGLang style).
    """

    model_type = "native_mtp_drafter"

    target_text_config: dict | None = None
    num_draft_tokens: int = 1

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]  # the target's final (normed) hidden state, what MTPCandidateGenerator feeds

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig, **overrides) -> NativeMtpConfig:
        """The drafter of ``target_config``'s own MTP layers (refused when hf_specdec cannot run them)."""
        text = target_config.get_text_config()
        refusal = native_mtp_refusal(text)
        if refusal:
            raise ValueError(refusal)
        return cls.for_target(target_config, target_text_config=text.to_dict(), **overrides)

    def build_target_config(self) -> PretrainedConfig:
        """The target's text config, rebuilt from ``target_text_config``."""
        from transformers import AutoConfig

        fields = dict(self.target_text_config)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        if not require_complete and not self.is_bound_to_target_facts:
            return
        if not isinstance(self.target_text_config, dict) or "model_type" not in self.target_text_config:
            raise ValueError(f"{type(self).__name__}.target_text_config must be the target's text config as a dict.")


def native_mtp_refusal(text_config) -> str | None:
    """Why hf_specdec cannot run a target config's own MTP layers (``None`` when it can)."""
    name = getattr(text_config, "model_type", "?")
    layers = getattr(text_config, "num_mtp_layers", None)
    if not layers:
        return f"The {name} config declares no MTP layers (num_mtp_layers)."
    if int(layers) != 1:
        return (
            f"This {name} target has {layers} MTP layers. hf_specdec runs a target's own MTP layers when there is one "
            "(DeepSeek-V3, GLM-4.5); with more, transformers chains layer k over layer k-1's outputs at every "
            "verified position, each layer with its own cache k tokens ahead, which hf_specdec's slot caches (batch "
            "> 1, trees) do not reproduce. Use generate(use_mtp=True) at batch 1 for these targets."
        )
    for key in ("mtp_layer_types", "layer_types"):
        kinds = set(getattr(text_config, key, None) or ())
        if kinds - {"full_attention"}:
            return (
                f"This {name} target's MTP layer has {sorted(kinds - {'full_attention'})} attention ({key}): "
                "hf_specdec rolls the MTP layer's cache back slot by slot, which needs full attention over a key/value "
                "cache (linear-attention state and sliding windows cannot drop rejected draft slots)."
            )
    if getattr(text_config, "mtp_per_layer_config", None) or getattr(text_config, "quantization_config", None):
        return (
            f"This {name} target's MTP layer is quantized or has per-layer overrides, which hf_specdec does not load."
        )
    return None
