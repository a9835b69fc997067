"""`DrafterConfig`: the facts about a target model that every drafter needs.

Hidden-state indexing convention used throughout hf_specdec: ``target_layer_ids`` index the tuple returned by a
transformers causal LM with ``output_hidden_states=True``. Index ``0`` is the embedding output and index ``i + 1`` is
the output of decoder layer ``i`` (0-based), so a target with ``L`` decoder layers has valid ids ``0..L``. (Index ``L``
is the final hidden state, after the final norm for Llama-style models.)
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = [
    "DrafterConfig",
    "DecoderDrafterConfig",
    "decoder_layer_fields",
    "decoder_layer_config_dict",
    "get_text_config",
    "decoder_layer_defaults",
    "fill_decoder_layer_defaults",
    "validate_decoder_layer",
    "fill_heads_defaults",
    "validate_heads",
]


def get_text_config(config: PretrainedConfig) -> PretrainedConfig:
    """Returns the decoder text config of ``config`` (the config itself for plain causal LMs)."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # older signature without `decoder`
        return getter()


def _require_int(name: str, value: Any, minimum: int, cls_name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{cls_name}.{name} must be an integer >= {minimum}, got {value!r}. "
            f"Build the config with `{cls_name}.for_target(target.config)` to fill target facts automatically."
        )


class DrafterConfig(PretrainedConfig):
    r"""Base configuration of every drafter family.

    Besides the drafter's own architecture (defined by each family), a drafter records the facts about the target
    it was made for, so that binding it to another target fails early with a clear message.

    Args:
        target_model_name_or_path (`str`, *optional*):
            Hub id or path of the target the drafter was made for (informational; also used by model cards).
        target_model_type (`str`, *optional*):
            `model_type` of the target's text config (e.g. ``"llama"``).
        target_hidden_size (`int`):
            Hidden size of the target model.
        target_num_hidden_layers (`int`):
            Number of decoder layers of the target model. ``None`` when a checkpoint does not record it (another
            project's layout); :meth:`~hf_specdec.DrafterPreTrainedModel.bind_target` then resolves it, and the
            default ``target_layer_ids``, from the target.
        target_vocab_size (`int`):
            Size of the target's LM head output (its vocabulary, including any padding rows). ``None`` when a
            checkpoint does not record it, for families whose class sets ``resolves_target_vocab_at_bind`` (none of
            their weights is sized by it); :meth:`~hf_specdec.DrafterPreTrainedModel.bind_target` then resolves it.
        target_layer_ids (`list[int]`, *optional*):
            Which target hidden states the drafter reads, in the convention of the module docstring
            (``output_hidden_states[j]``; 0 = embeddings, ``i + 1`` = output of decoder layer ``i``).
        draft_vocab_size (`int`, *optional*):
            Size of the drafter's output vocabulary. Defaults to ``target_vocab_size``; smaller values use a
            reduced draft vocabulary mapped to target ids.
        num_draft_tokens (`int`, *optional*, defaults to 5):
            Default number of draft tokens proposed per decoding step (``num_assistant_tokens`` overrides it).
        target_adapter (`dict`, *optional*):
            A peft adapter the target must carry for this drafter (families that train one with the drafter):
            ``{"subfolder": ..., "fingerprint": ...}``, the folder next to the drafter's weights that holds it and
            a hash of its weights. Written by the trainer; checked when the drafter is bound to a target.
    """

    model_type = "drafter"
    # True for a family none of whose weights is sized by the target's vocabulary when it drafts over all of it (it
    # borrows the target's LM head): a checkpoint that does not record the vocabulary (transformers'
    # MuseGlimmerAssistantModel) then loads with `target_vocab_size` None, resolved by `bind_target`.
    resolves_target_vocab_at_bind = False

    # Fields are declared as annotated class attributes because transformers 5 configs are dataclasses.
    target_model_name_or_path: str | None = None
    target_model_type: str | None = None
    target_hidden_size: int | None = None
    target_num_hidden_layers: int | None = None
    target_vocab_size: int | None = None
    target_layer_ids: list[int] | None = None
    draft_vocab_size: int | None = None
    num_draft_tokens: int = 5
    target_adapter: dict | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.target_vocab_size
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate_drafter()

    # -- validation -----------------------------------------------------------------------------------------------
    @property
    def is_bound_to_target_facts(self) -> bool:
        """False for a template config whose target facts are not filled in yet."""
        return not (
            self.target_hidden_size is None and self.target_num_hidden_layers is None and self.target_vocab_size is None
        )

    def validate_drafter(self, require_complete: bool = False) -> None:
        """Checks the target facts; raises `ValueError` naming the offending field.

        A config whose target facts are all unset is a template (transformers builds such configs internally); it
        passes unless ``require_complete`` is set, which models do when they are built.
        """
        name = type(self).__name__
        _require_int("num_draft_tokens", self.num_draft_tokens, 1, name)
        if not require_complete and not self.is_bound_to_target_facts:
            return
        _require_int("target_hidden_size", self.target_hidden_size, 1, name)
        # None: not recorded (foreign checkpoints); resolved from the target by `bind_target`.
        _require_int("target_num_hidden_layers", self.target_num_hidden_layers, 1, name, allow_none=True)
        self._validate_vocabulary(name)
        if self.target_layer_ids is not None and self.target_num_hidden_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i <= self.target_num_hidden_layers]
            if bad or not self.target_layer_ids:
                raise ValueError(
                    f"{name}.target_layer_ids={self.target_layer_ids} is invalid: ids index output_hidden_states "
                    f"(0 = embeddings, i + 1 = output of decoder layer i), so each must be in "
                    f"[0, target_num_hidden_layers={self.target_num_hidden_layers}]."
                )

    def _validate_vocabulary(self, name: str) -> None:
        if self.target_vocab_size is None and self.resolves_target_vocab_at_bind:
            # Not recorded (a foreign checkpoint): `bind_target` resolves it, and a full draft vocabulary with it.
            if self.draft_vocab_size is not None:
                raise ValueError(
                    f"{name}.draft_vocab_size ({self.draft_vocab_size}) needs target_vocab_size, which is unset."
                )
            return
        _require_int("target_vocab_size", self.target_vocab_size, 1, name)
        _require_int("draft_vocab_size", self.draft_vocab_size, 1, name)
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(
                f"{name}.draft_vocab_size ({self.draft_vocab_size}) cannot exceed target_vocab_size "
                f"({self.target_vocab_size})."
            )

    # -- construction from a target ----------------------------------------------------------------------------------
    @classmethod
    def target_facts(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        """Extracts the target facts recorded by every drafter config from a target config."""
        text = get_text_config(target_config)
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if getattr(text, k, None) is None]
        if missing:
            raise ValueError(
                f"Cannot size a drafter for target config {type(target_config).__name__}: it has no {missing}. "
                "Pass the config of a decoder-only causal LM (or its text config)."
            )
        return {
            "target_model_name_or_path": getattr(target_config, "_name_or_path", None) or None,
            "target_model_type": getattr(text, "model_type", None),
            "target_hidden_size": int(text.hidden_size),
            "target_num_hidden_layers": int(text.num_hidden_layers),
            "target_vocab_size": int(text.vocab_size),
        }

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int] | None:
        """Family default for `target_layer_ids` given the target depth (None: the family reads no features)."""
        return None

    @classmethod
    def architecture_defaults(cls, text_config: PretrainedConfig) -> dict[str, Any]:
        """Family defaults copied from the target text config (sizes, norms, RoPE)."""
        return {}

    @classmethod
    def for_target(cls, target_config: PretrainedConfig, **overrides) -> DrafterConfig:
        """Builds a config sized for ``target_config``; keyword arguments override any field.

        Example:
            >>> config = MyDrafterConfig.for_target(target.config, num_draft_tokens=6)
        """
        facts = cls.target_facts(target_config)
        kwargs: dict[str, Any] = dict(facts)
        layer_ids = cls.default_target_layer_ids(facts["target_num_hidden_layers"])
        if layer_ids is not None:
            kwargs["target_layer_ids"] = layer_ids
        kwargs.update(cls.architecture_defaults(get_text_config(target_config)))
        kwargs.update(overrides)
        return cls(**kwargs)


def decoder_layer_defaults(text_config: PretrainedConfig) -> dict[str, Any]:
    """A draft decoder layer shaped like one of the target's: sizes, attention shape, norm epsilon, RoPE (scaling
    included: the layer sits at the target's positions), context length and activation, read from its text config."""
    from .layers import rope_refusal, rope_scaling_from_config

    out: dict[str, Any] = {}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        value = getattr(text_config, key, None)
        if value is not None:
            out[key] = int(value)
    eps = getattr(text_config, "rms_norm_eps", None)
    if eps is not None:
        out["rms_norm_eps"] = float(eps)
    # The draft layer sits at the target's positions, so it rotates as the target does (scaling included).
    try:
        out["rope_theta"], out["rope_scaling_parameters"] = rope_scaling_from_config(text_config)
    except ValueError as err:  # refused in __post_init__ unless the caller passes its own RoPE
        out["rope_scaling_parameters"] = rope_refusal(err)
    max_pos = getattr(text_config, "max_position_embeddings", None)
    if max_pos is not None:
        out["max_position_embeddings"] = int(max_pos)
    act = getattr(text_config, "hidden_act", None)
    if act in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        out["hidden_act"] = act
    return out


def validate_decoder_layer(config, why_hidden: str) -> None:
    """Checks the draft decoder layer fields of ``config`` (sizes, GQA, even head_dim, activation); ``why_hidden``
    says why ``hidden_size`` must equal the target's."""
    name = type(config).__name__
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}.")
    if config.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"{name}.hidden_size ({config.hidden_size}) must equal target_hidden_size ({config.target_hidden_size}): "
            f"{why_hidden}."
        )
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(
            f"{name}.num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})."
        )
    if config.head_dim % 2 != 0:
        raise ValueError(f"{name}.head_dim ({config.head_dim}) must be even for rotary embeddings.")
    if config.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):
        raise ValueError(
            f"{name}.hidden_act must be one of silu, gelu, gelu_pytorch_tanh, relu; got {config.hidden_act!r}."
        )


def fill_decoder_layer_defaults(config) -> None:
    """Fills a draft decoder layer's unset sizes from its hidden size (the target's by default): ``intermediate_size``
    4x, ``num_key_value_heads`` = heads, ``head_dim`` = hidden / heads; normalises its RoPE scaling and sets the
    family's default ``target_layer_ids``. For a config's ``__post_init__``, before the base class's."""
    from .layers import normalize_rope_scaling

    if config.hidden_size is None:
        config.hidden_size = config.target_hidden_size
    if config.intermediate_size is None and config.hidden_size is not None:
        config.intermediate_size = 4 * config.hidden_size
    if config.num_key_value_heads is None:
        config.num_key_value_heads = config.num_attention_heads
    if config.head_dim is None and config.hidden_size is not None and config.num_attention_heads:
        config.head_dim = config.hidden_size // config.num_attention_heads
    config.rope_scaling_parameters = normalize_rope_scaling(
        config.rope_scaling_parameters, config.max_position_embeddings
    )
    if config.target_layer_ids is None and config.target_num_hidden_layers is not None:
        config.target_layer_ids = config.default_target_layer_ids(config.target_num_hidden_layers)


class DecoderDrafterConfig(DrafterConfig):
    r"""Base of the families whose drafter runs decoder layers at the target's width (feature-level and block drafters):
    the layer fields, shaped like one of the target's by :meth:`for_target` (sizes, attention shape, norm epsilon,
    RoPE with its scaling, context length, activation) and filled from the hidden size where unset.

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling_parameters / max_position_embeddings / attention_bias: the draft
            decoder layer(s).
        initializer_range (`float`, defaults to 0.02): std of the weights' normal initialisation.
    """

    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    rope_scaling_parameters: dict | None = None
    attention_bias: bool = False
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        fill_decoder_layer_defaults(self)
        super().__post_init__(**kwargs)

    @classmethod
    def architecture_defaults(cls, text_config: PretrainedConfig) -> dict[str, Any]:
        return decoder_layer_defaults(text_config)


def decoder_layer_fields(config: dict) -> dict[str, Any]:
    """The draft decoder layer fields of a :class:`DecoderDrafterConfig` read from another project's ``config.json``
    (a Llama / Qwen3 style dict; RoPE from transformers-5 ``rope_parameters`` or the legacy keys). Converters override
    what their weights say otherwise (e.g. biases)."""
    from .layers import rope_scaling_from_config

    heads = int(config["num_attention_heads"])
    theta, rope = rope_scaling_from_config(config)
    return {
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": None if config.get("intermediate_size") is None else int(config["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
        "head_dim": config.get("head_dim"),
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling_parameters": rope,
        "max_position_embeddings": int(config.get("max_position_embeddings", 4096)),
        "hidden_act": config.get("hidden_act", "silu"),
        "attention_bias": bool(config.get("attention_bias", False)),
    }


def decoder_layer_config_dict(config: DecoderDrafterConfig) -> dict[str, Any]:
    """The draft decoder layer of ``config`` as a Llama-style ``config.json`` fragment (legacy RoPE keys), for
    converters that export to other projects' layouts."""
    return {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling_parameters,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": config.hidden_act,
        "attention_bias": config.attention_bias,
    }


def fill_heads_defaults(config) -> None:
    """Head families (one draft token per head, reading one target state): ``hidden_size`` = the target's,
    ``num_draft_tokens`` = ``num_heads``, the family's default ``target_layer_ids``."""
    if config.hidden_size is None:
        config.hidden_size = config.target_hidden_size
    if config.num_draft_tokens is None:
        config.num_draft_tokens = config.num_heads
    if config.target_layer_ids is None and config.target_num_hidden_layers is not None:
        config.target_layer_ids = config.default_target_layer_ids(config.target_num_hidden_layers)


def validate_heads(config, require_complete: bool, what: str) -> None:
    """Checks a head family's ``num_heads``, ``num_draft_tokens <= num_heads``, ``loss_labels`` and, once target facts
    are known, ``hidden_size == target_hidden_size`` (``what`` says why) and a single ``target_layer_ids`` entry."""
    name = type(config).__name__
    if isinstance(config.num_heads, bool) or not isinstance(config.num_heads, int) or config.num_heads < 1:
        raise ValueError(f"{name}.num_heads must be a positive integer, got {config.num_heads!r}.")
    if config.num_draft_tokens > config.num_heads:
        raise ValueError(
            f"{name}.num_draft_tokens ({config.num_draft_tokens}) must be at most num_heads ({config.num_heads}): "
            "each head drafts one token."
        )
    if config.loss_labels not in ("soft", "hard"):
        raise ValueError(f"{name}.loss_labels must be 'soft' or 'hard', got {config.loss_labels!r}.")
    if not require_complete and not config.is_bound_to_target_facts:
        return
    if config.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"{name}.hidden_size ({config.hidden_size}) must equal target_hidden_size ({config.target_hidden_size}): "
            f"{what}."
        )
    if config.target_layer_ids is not None and len(config.target_layer_ids) != 1:
        raise ValueError(f"{name}.target_layer_ids must name one target state, got {config.target_layer_ids}.")
