"""DFlash checkpoint layouts.

* ``dflash-zlab``: z-lab ``DFlashDraftModel`` (also what vLLM and SGLang load): ``config.json`` with ``architectures``
  ``["DFlashDraftModel"]``, ``block_size``, ``num_target_layers``, ``layer_types``, ``dflash_config``
  ``{mask_token_id, target_layer_ids}`` and the Qwen3 layer fields; weights ``fc``, ``hidden_norm``, ``layers.{i}.*``
  (with ``q_norm`` / ``k_norm``) and ``norm``, no embeddings and no LM head.
* ``muse-glimmer``: transformers' ``MuseGlimmerAssistantModel`` (``model_type`` ``muse_glimmer_assistant``): the same
  layers, ``encoder.fc`` / ``encoder.output_norm_enc`` for ``fc`` / ``hidden_norm``, sliding-window layer types. A
  drafter exported here also runs in transformers' own DFlash path
  (``generate(assistant_model=..., speculation_type="dflash")``, batch size 1).
* ``dspark-deepspec`` / ``dspark-specforge``: DSpark (the DFlash backbone plus ``markov_head`` and
  ``confidence_head``), DeepSpec's flat config with copies of the target's embeddings and LM head, or SpecForge's
  ``dflash_config`` holding the DSpark fields and no target weights.

All record ``target_layer_ids`` as 0-based target *layer* ids (the layer's output is ``output_hidden_states[i + 1]``);
hf_specdec's config holds the ``output_hidden_states`` indices.
"""

from __future__ import annotations

from ...configuration_utils import decoder_layer_fields
from ...convert import Layout, register_layout, write_checkpoint
from ...speculators_format import speculators_type
from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashForDrafting

_ENCODER = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}


def _detect_zlab(config: dict, keys: set) -> bool:
    if _is_dspark(config, keys):  # DSpark's backbone is DFlash's: its own layouts below take it
        return False
    return "DFlashDraftModel" in (config.get("architectures") or []) or (
        isinstance(config.get("dflash_config"), dict) and "fc.weight" in keys and "hidden_norm.weight" in keys
    )


def _detect_muse(config: dict, keys: set) -> bool:
    return config.get("model_type") == "muse_glimmer_assistant" or "encoder.output_norm_enc.weight" in keys


def load_dflash_backbone(
    config: dict,
    state: dict,
    target: dict,
    block: dict,
    config_class=DFlashConfig,
    model_class=DFlashForDrafting,
    **extra,
) -> DFlashForDrafting:
    """Builds the drafter from the layer fields of ``config`` and ``block`` (``block_size``, ``mask_token_id``,
    ``target_layer_ids`` as layer ids) and loads ``state`` (hf_specdec names)."""
    hidden = int(config["hidden_size"])
    layer_ids = [int(i) for i in block["target_layer_ids"]]
    if state["fc.weight"].shape[1] != len(layer_ids) * hidden:
        raise ValueError(
            f"fc.weight reads {state['fc.weight'].shape[1]} features; {len(layer_ids)} target layers of width {hidden} "
            f"give {len(layer_ids) * hidden}. The checkpoint's target_layer_ids do not match its weights."
        )
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(
            f"This DFlash drafter reads {hidden}-wide target states; the target's are {target['hidden_size']}."
        )
    depth = target.get("num_hidden_layers") or config.get("num_target_layers")
    if depth is not None and max(layer_ids) >= int(depth):
        raise ValueError(f"target_layer_ids {layer_ids} name layers beyond the target's {depth}.")
    layers = int(config["num_hidden_layers"])
    cfg = config_class(
        target_model_name_or_path=target.get("name_or_path"),
        target_model_type=target.get("model_type"),
        target_hidden_size=hidden,
        target_num_hidden_layers=None if depth is None else int(depth),
        target_vocab_size=_vocab_size(config, target),
        target_layer_ids=[i + 1 for i in layer_ids],
        **decoder_layer_fields(config),
        num_hidden_layers=layers,
        block_size=int(block["block_size"]),
        mask_token_id=int(block["mask_token_id"]),
        layer_types=list(config.get("layer_types") or ["full_attention"] * layers),
        sliding_window=config.get("sliding_window"),
        **extra,
    )
    drafter = model_class(cfg)
    own = drafter.state_dict()
    wanted = {k: v for k, v in state.items() if k in own}
    missing = sorted(k for k in own if k not in wanted and k not in ("d2t", "t2d"))
    unexpected = sorted(k for k in state if k not in own and not k.startswith(("embed_tokens.", "lm_head.")))
    if missing or unexpected:
        raise ValueError(
            f"Not a {model_class.__name__} checkpoint hf_specdec can load: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}."
        )
    drafter.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in wanted.items()}})
    return drafter.eval()


def _vocab_size(config: dict, target: dict) -> int | None:
    """The target's vocabulary, from the target or the checkpoint; ``None`` when neither says it (transformers'
    ``MuseGlimmerAssistantConfig`` has no ``vocab_size``): ``bind_target`` resolves it from the target then."""
    vocab = target.get("vocab_size") or config.get("vocab_size")
    return None if vocab is None else int(vocab)


def load_zlab(config: dict, state: dict, target: dict) -> DFlashForDrafting:
    block = dict(config.get("dflash_config") or {})
    block.setdefault("block_size", config.get("block_size", 16))
    if "target_layer_ids" not in block or "mask_token_id" not in block:
        raise ValueError("A z-lab DFlash config needs dflash_config.target_layer_ids and dflash_config.mask_token_id.")
    return load_dflash_backbone(config, state, target, block)


def load_muse(config: dict, state: dict, target: dict) -> DFlashForDrafting:
    state = {_ENCODER.get(k, k): v for k, v in state.items()}
    return load_dflash_backbone(config, state, target, config)


def check_vocabulary_resolved(drafter) -> None:
    """Refuses to export a drafter whose target vocabulary is still unresolved (imported from a checkpoint that did
    not record it, never bound)."""
    if drafter.config.target_vocab_size is None:
        raise ValueError(
            "This drafter's target vocabulary is unresolved (its checkpoint did not record it): bind it to its target "
            "first (drafter.bind_target(target), or pass --target to hf-specdec convert), then export it."
        )


def _fields(drafter: DFlashForDrafting) -> dict:
    cfg = drafter.config
    check_vocabulary_resolved(drafter)
    if drafter.reduced_vocabulary:
        raise ValueError(
            "The DFlash layouts draft over the target's full LM head; this drafter restricts it to "
            f"{cfg.draft_vocab_size} tokens. Train one with the full vocabulary to export it."
        )
    if cfg.attention_bias:
        raise ValueError("The DFlash layouts have no attention biases; this drafter has them.")
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            **(cfg.rope_scaling_parameters or {}),
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "vocab_size": cfg.target_vocab_size,
        "block_size": cfg.block_size,
    }


def _weights(drafter: DFlashForDrafting) -> dict:
    return {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}


def save_zlab(drafter: DFlashForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_fields(drafter),
        "num_target_layers": cfg.target_num_hidden_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
        },
    }
    write_checkpoint(out_dir, config, _weights(drafter))


def save_muse(drafter: DFlashForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    back = {v: k for k, v in _ENCODER.items()}
    config = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        **_fields(drafter),
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
    }
    if config["sliding_window"] is None:  # transformers' config wants an int; no layer is a sliding one
        config["sliding_window"] = cfg.max_position_embeddings
    write_checkpoint(out_dir, config, {back.get(k, k): v for k, v in _weights(drafter).items()})


register_layout(
    Layout(
        name="dflash-zlab",
        family=DFlashConfig.model_type,
        description="z-lab DFlashDraftModel (fc, hidden_norm, Qwen3 layers; dflash_config), as vLLM / SGLang load it",
        detect=_detect_zlab,
        load=load_zlab,
        save=save_zlab,
    )
)
register_layout(
    Layout(
        name="muse-glimmer",
        family=DFlashConfig.model_type,
        description="transformers MuseGlimmerAssistantModel (encoder.fc, encoder.output_norm_enc; runs in its DFlash path)",
        detect=_detect_muse,
        load=load_muse,
        save=save_muse,
    )
)


# -- DSpark (DeepSpec and SpecForge DSparkDraftModel) -------------------------------------------------------------------
_DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_CONTEXT_ATTENTION = ("gqa", "mha")  # SpecForge's modes that are plain softmax attention over [context; block]
_OLD_HEAD_PREFIX = "logit_head."  # early SpecForge checkpoints kept the Markov / confidence heads under this name


def _is_dspark(config: dict, keys: set) -> bool:
    if speculators_type(config) is not None:  # speculators' DSpark has the same heads: its own layout takes it
        return False
    return (
        "DSparkDraftModel" in (config.get("architectures") or [])
        or config.get("model_type") == "dspark"
        or any(k.endswith("markov_head.markov_w1.weight") for k in keys)
    )


def _detect_dspark(config: dict, keys: set) -> bool:
    return _is_dspark(config, keys) and not isinstance(config.get("dflash_config"), dict)


def _detect_dspark_specforge(config: dict, keys: set) -> bool:
    return _is_dspark(config, keys) and isinstance(config.get("dflash_config"), dict)


def check_dspark_heads(fields: dict, default_rank: int = 0) -> int:
    """Checks the DSpark head fields (``markov_head_type``, ``markov_rank``, ``enable_confidence_head``,
    ``confidence_head_with_markov``; absent ones take the source tool's defaults: vanilla, ``default_rank``, true,
    true) against hf_specdec's heads (a vanilla Markov head, a confidence head on ``[h; W1[x]]``); returns the rank."""
    kind = str(fields.get("markov_head_type", "vanilla")).lower()
    rank = int(fields.get("markov_rank", default_rank) or 0)
    if kind != "vanilla" or rank <= 0:
        raise ValueError(
            f"hf_specdec's DSpark has the vanilla Markov head; this checkpoint has markov_head_type={kind!r}, "
            f"markov_rank={rank}."
        )
    if not fields.get("enable_confidence_head", True) or not fields.get("confidence_head_with_markov", True):
        raise ValueError(
            "hf_specdec's DSpark needs the confidence head on [h; W1[x]] (its scheduler reads it); this checkpoint "
            "has none or reads h alone (enable_confidence_head / confidence_head_with_markov false). Retrain the "
            "head (hf-specdec train --drafter dspark starting from it)."
        )
    return rank


def _dspark_options(config: dict) -> dict:
    """The DSpark fields of a flat (DeepSpec) or nested (SpecForge ``dflash_config``) config, checked against what
    hf_specdec's DSpark is: a vanilla Markov head, a confidence head on ``[h; W1[x]]``, non-causal softmax attention
    over ``[context; block]``, the full vocabulary, labels not shifted."""
    nested = config.get("dflash_config") or {}
    merged = {**config, **nested}
    rank = check_dspark_heads(merged)
    modes = nested.get("attention_modes") or [nested.get("attention_mode", "gqa")]
    odd = sorted({str(m).lower() for m in modes} - set(_CONTEXT_ATTENTION))
    if odd:
        raise ValueError(
            f"This DSpark checkpoint has {odd} attention layers; hf_specdec's DSpark layers are softmax attention "
            f"({'/'.join(_CONTEXT_ATTENTION)})."
        )
    if config.get("is_causal") or nested.get("is_causal"):
        raise ValueError("This DSpark checkpoint was trained with causal attention inside the block; hf_specdec's is "
                         "non-causal (every slot sees the whole block).")  # fmt: skip
    if nested.get("projector_type") not in (None, "dspark"):
        raise ValueError(f"Unknown DSpark projector_type {nested['projector_type']!r}; hf_specdec reads 'dspark'.")
    if int(nested.get("pure_draft_prefix_len") or 0) or nested.get("shift_label"):
        raise ValueError("This DSpark checkpoint uses pure_draft_prefix_len / shift_label, which hf_specdec lacks.")
    vocab = int(config["vocab_size"])
    if int(config.get("draft_vocab_size") or vocab) != vocab:
        raise ValueError(
            f"This DSpark checkpoint drafts over {config['draft_vocab_size']} of {vocab} tokens; hf_specdec imports "
            "full-vocabulary DSpark checkpoints only."
        )
    block = {"block_size": merged.get("block_size", 7)}
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in merged:
            raise ValueError(f"This DSpark config lacks {key} (top level or dflash_config).")
        block[key] = merged[key]
    return {"block": block, "markov_rank": rank}


def _load_dspark(config: dict, state: dict, target: dict):
    from .configuration_dspark import DSparkConfig
    from .modeling_dspark import DSparkForDrafting

    opts = _dspark_options(config)
    state = {(k[len(_OLD_HEAD_PREFIX) :] if k.startswith(_OLD_HEAD_PREFIX) else k): v for k, v in state.items()}
    vocab = int(target.get("vocab_size") or config["vocab_size"])
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        if name in state and state[name].shape[0] != vocab:
            raise ValueError(
                f"This DSpark checkpoint's {name} has {state[name].shape[0]} rows, the target's vocabulary {vocab}: "
                "it was trained for another target (or a restricted draft vocabulary without its id map)."
            )
    state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    return load_dflash_backbone(
        config, state, target, opts["block"], DSparkConfig, DSparkForDrafting, markov_rank=opts["markov_rank"]
    )


def load_dspark(config: dict, state: dict, target: dict):
    """DeepSpec's ``DSparkDraftModel``: a flat Qwen3 config with ``block_size``, ``mask_token_id``,
    ``target_layer_ids`` (layer ids), ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
    ``confidence_head_with_markov``; the DFlash backbone weights plus ``markov_head.markov_w{1,2}`` and
    ``confidence_head.proj``, and its own copies of the target's ``embed_tokens`` / ``lm_head`` (ignored: hf_specdec
    borrows the target's)."""
    return _load_dspark(config, state, target)


def load_dspark_specforge(config: dict, state: dict, target: dict):
    """SpecForge's ``DSparkDraftModel`` (a ``Qwen3Config`` with ``block_size``, ``num_target_layers`` and a
    ``dflash_config`` holding ``mask_token_id``, ``target_layer_ids`` (layer ids), ``projector_type`` ``"dspark"``,
    ``attention_mode(s)``, ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``,
    ``confidence_head_with_markov``, ``confidence_head_alpha``); the same weights as DeepSpec's without embeddings or
    LM head (early checkpoints: the heads under ``logit_head.``)."""
    return _load_dspark(config, state, target)


def _dspark_fields(drafter) -> dict:
    cfg = drafter.config
    return {
        "markov_rank": cfg.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }


def save_dspark(drafter, out_dir: str, target=None) -> None:
    if target is None:
        raise ValueError("The DSpark layout ships the target's embeddings and LM head: pass the target (--target).")
    cfg = drafter.config
    config = {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        **_fields(drafter),
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
        "num_target_layers": cfg.target_num_hidden_layers,
        **_dspark_fields(drafter),
    }
    weights = _weights(drafter)
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight
    weights["lm_head.weight"] = target.get_output_embeddings().weight
    write_checkpoint(out_dir, config, weights)


def save_dspark_specforge(drafter, out_dir: str, target=None) -> None:
    cfg = drafter.config
    heads = _dspark_fields(drafter)
    config = {
        "architectures": ["DSparkDraftModel"],
        "auto_map": {"AutoModel": "dspark.DSparkDraftModel"},
        "model_type": "qwen3",
        **_fields(drafter),
        "num_target_layers": cfg.target_num_hidden_layers,
        "attention_bias": False,
        "use_sliding_window": any(t == "sliding_attention" for t in cfg.layer_types),
        "tie_word_embeddings": False,
        **heads,  # SpecForge's DSparkConfig reads these at the top level, its training configs nest them
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": [i - 1 for i in cfg.target_layer_ids],
            "projector_type": "dspark",
            "attention_mode": "gqa",
            "confidence_head_alpha": 1.0,
            **heads,
        },
    }
    write_checkpoint(out_dir, config, _weights(drafter))


register_layout(
    Layout(
        name="dspark-deepspec",
        family="dspark_drafter",
        description="DeepSpec DSparkDraftModel (DFlash backbone + markov_head.markov_w1/w2 + confidence_head.proj, flat "
        "Qwen3 config; ships copies of the target's embeddings and LM head)",
        detect=_detect_dspark,
        load=load_dspark,
        save=save_dspark,
    )
)
register_layout(
    Layout(
        name="dspark-specforge",
        family="dspark_drafter",
        description="SpecForge DSparkDraftModel (the same weights, no embeddings or LM head; Qwen3 config with the "
        "DSpark fields in dflash_config, attention_mode gqa)",
        detect=_detect_dspark_specforge,
        load=load_dspark_specforge,
        save=save_dspark_specforge,
    )
)
