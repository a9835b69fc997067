"""Configuration of the EAGLE-3 drafter."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ...configuration_utils import DrafterConfig

__all__ = ["Eagle3Config"]


def _rope_theta(text_config: PretrainedConfig) -> float | None:
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(text_config, "rope_theta", None)
    return float(theta) if theta is not None else None


class Eagle3Config(DrafterConfig):
    r"""Configuration of :class:`Eagle3ForDrafting` (EAGLE-3, Li et al. 2025, arXiv 2503.01840).

    The drafter fuses three target hidden states (low, mid, high) with ``fc`` (``3·target_hidden_size → hidden_size``),
    then runs one Llama-style decoder layer on ``[RMSNorm(embedding of the next token); RMSNorm(fused feature)]``
    and predicts the token after next through its own LM head over a (possibly reduced) draft vocabulary.

    ``target_layer_ids`` follow hf_specdec's convention (``output_hidden_states[j]``, 0 = embeddings, ``i + 1`` =
    output of decoder layer ``i``). The default, as in the reference implementation, is the *input* of decoder layers
    ``2``, ``L // 2`` and ``L - 3``, i.e. ``output_hidden_states[2], [L // 2], [L - 3]`` (for Llama-3.1-8B:
    ``[2, 16, 29]``; SpecForge writes the same layers as ``[1, L // 2 - 1, L - 4]`` in output-of-layer numbering).
    Ids are clamped to ``[1, L]`` for very shallow targets.

    Args:
        hidden_size (`int`): width of the draft layer; must equal ``target_hidden_size`` because the draft layer
            consumes the target's token embeddings.
        intermediate_size (`int`): MLP width of the draft layer.
        num_attention_heads / num_key_value_heads / head_dim: attention shape of the draft layer.
        hidden_act (`str`, defaults to ``"silu"``), rms_norm_eps (`float`), rope_theta (`float`),
        max_position_embeddings (`int`), attention_bias (`bool`), initializer_range (`float`).
        Other arguments: see :class:`~hf_specdec.DrafterConfig`.
    """

    model_type = "eagle3_drafter"

    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    initializer_range: float = 0.02
    num_draft_tokens: int = 5

    def __post_init__(self, **kwargs):
        if self.hidden_size is None:
            self.hidden_size = self.target_hidden_size
        if self.intermediate_size is None and self.hidden_size is not None:
            self.intermediate_size = 4 * self.hidden_size
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size is not None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None and self.target_num_hidden_layers is not None:
            self.target_layer_ids = self.default_target_layer_ids(self.target_num_hidden_layers)
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3)]

    @classmethod
    def architecture_defaults(cls, text_config: PretrainedConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(text_config, key, None)
            if value is not None:
                out[key] = int(value)
        eps = getattr(text_config, "rms_norm_eps", None)
        if eps is not None:
            out["rms_norm_eps"] = float(eps)
        theta = _rope_theta(text_config)
        if theta is not None:
            out["rope_theta"] = theta
        max_pos = getattr(text_config, "max_position_embeddings", None)
        if max_pos is not None:
            out["max_position_embeddings"] = int(max_pos)
        act = getattr(text_config, "hidden_act", None)
        if act in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
            out["hidden_act"] = act
        return out

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        if not require_complete and not self.is_bound_to_target_facts:
            return
        name = type(self).__name__
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}.")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"{name}.hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): "
                "the EAGLE-3 draft layer consumes the target's token embeddings."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"{name}.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"{name}.head_dim ({self.head_dim}) must be even for rotary embeddings.")
        if not self.target_layer_ids:
            raise ValueError(f"{name}.target_layer_ids must list the target hidden states to fuse.")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
            raise ValueError(
                f"{name}.hidden_act must be one of silu, gelu, gelu_pytorch_tanh, relu; got {self.hidden_act!r}."
            )
