"""EAGLE-3 checkpoint layouts of other projects (import / export), registered with :mod:`hf_specdec.convert`.

* ``eagle3`` (import and export): SafeAILab EAGLE / SpecForge. A Llama-style ``config.json``
  (``LlamaForCausalLMEagle3`` or ``LlamaForCausalLM``, ``draft_vocab_size``, optional ``target_hidden_size``) and
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` weights, optionally ``embed_tokens``. This is also
  what SGLang loads. The export runs in SafeAILab's own runtime (``eagle/model/cnets.py``): that runtime loads the
  target's embeddings itself only when the config has no ``target_hidden_size``, and then only from a sharded
  target checkpoint; otherwise it keeps whatever ``embed_tokens.weight`` the drafter file holds (random ones if
  none). So the export writes ``target_hidden_size`` *and* the target's ``embed_tokens.weight``. That runtime has
  one draft layer: the export refuses deeper drafters.
* ``eagle3-vllm`` (import and export): ``layers.0.*`` instead of ``midlayer.*``, ``d2t`` without ``t2d``; a drafter
  with ``num_hidden_layers > 1`` stacks plain layers ``layers.{i}.*`` after it, as vLLM's EAGLE-3 model builds them
  (hf_specdec's ``upper_layers.{i - 1}``; the ``hidden_norm`` vLLM builds in each of them, unread, is dropped).
* ``eagle3-modelopt`` (import): NVIDIA ModelOpt exports (``layers.0.*``, ``input_embeds_norm``, ``hidden_norm``,
  ``eagle_lm_head``, no ``t2d``; feature layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``).

Every key of a foreign ``config.json`` is read, known to be inert at inference (metadata: names, token ids, dtypes,
generation defaults; dropout), or refused: flags that would change the forward pass in a way this drafter does not
implement (``logit_scale``, sliding windows, ModelOpt's layer-norm and parallel-draft
options away from their EAGLE-3 values, ...) and unknown keys raise an error naming them.

The optional norms map to :class:`Eagle3Config` fields: vLLM's ``norm_before_residual``; EAGLE-3.1's ``fc_norm`` (one
RMSNorm per target state before ``fc``, tensors ``fc_norm.{i}.weight``, as in SpecForge, speculators and vLLM);
speculators' / vLLM's ``norm_before_fc`` (one RMSNorm over their concatenation, ``input_norm.weight``). The projects
disagree on ``norm_output``: in SpecForge (``LlamaForCausalLMEagle3.compute_logits``) ``false`` drops the final norm
before the LM head (:attr:`Eagle3Config.norm_output`); in vLLM, SGLang, TensorRT-LLM and speculators ``true`` feeds the
normed state back to the next draft step (EAGLE-3.1's post-norm feedback, :attr:`Eagle3Config.norm_feedback`). The
``eagle3`` layout (what SpecForge writes) reads SpecForge's meaning; ``eagle3-vllm`` and ``eagle3-modelopt`` (what
vLLM and TensorRT-LLM serve) read vLLM's, and the ``eagle3-vllm`` export writes vLLM's.

Foreign configs do not record the target's depth (hence the default feature layers). Without ``target_config`` the
imported drafter leaves them unresolved; :meth:`~hf_specdec.DrafterPreTrainedModel.bind_target` resolves and checks
them against the target, as vLLM does when it loads the drafter next to its target.
"""

from __future__ import annotations

import json
import os
import re

import torch

from ...convert import METADATA_KEYS, Layout, register_layout, write_checkpoint
from ...layers import rope_scaling_from_config
from ...speculators_format import target_embedding
from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3ForDrafting

__all__ = ["load_eagle3", "save_eagle3", "eagle3_tensors", "eagle3_config_dict"]

_LAYER_KEYS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_MODELOPT_RENAMES = (
    ("eagle_module.", ""),
    ("layers.0.", "midlayer."),
    ("input_embeds_norm.", "midlayer.input_layernorm."),
    ("eagle_lm_head.", "lm_head."),
)
_VLLM_RENAMES = (("layers.0.", "midlayer."),)

# config.json keys that are read below.
_READ_KEYS = {
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_residual",
    "norm_output",
    "fc_norm",
    "norm_before_fc",
    "num_eagle_features",  # TensorRT-LLM: the number of target states fc fuses (checked against fc.weight)
    "attention_bias",
    "num_hidden_layers",
    "target_model_type",
    "hf_specdec",
}
# Keys with no effect on the draft forward at inference: metadata (names, token ids, dtypes, generation defaults),
# dropout and init, tensor-parallel slicing, tied embeddings (the layout always has its own lm_head), and
# sliding-window sizes while sliding windows are off.
_INERT_KEYS = METADATA_KEYS | {
    "initializer_range",
    "attention_dropout",
    "hidden_dropout",
    "pretraining_tp",
    "tie_word_embeddings",
    "sliding_window",
    "max_window_layers",
    "bias",  # SafeAILab's flag for EAGLE-1's fc; its EAGLE-3 model ignores it (biases show up as tensors)
}
# Flags that change the forward pass: accepted at the value that means "as the reference EAGLE-3 layer".
_NEUTRAL_FLAGS = {
    "logit_scale": (1, 1.0, None),
    "use_sliding_window": (False, None),
    "mlp_bias": (False, None),
    "qkv_bias": (False, None),
    "parallel_drafting": (False, None),
}
# eagle_config (ModelOpt, TensorRT-LLM) keys: ``None`` = any value; else the values that mean the EAGLE-3 layer
# (ModelOpt writes ``None`` for an option its model does not record). From ModelOpt's export and its EAGLE module:
# the embeddings' input norm, the final norm before the LM head, no MTP norms, no parallel draft heads.
_NEUTRAL_EAGLE_CONFIG = {
    "use_aux_hidden_state": (True, None),
    "eagle_aux_hidden_state_layer_ids": None,  # read
    "norm_before_fc": None,  # read (vLLM reads it here too)
    "use_input_layernorm_in_first_layer": (True, None),
    "use_last_layernorm": (True, None),
    "use_mtp_layernorm": (False, None),
    "next_layer_regular": (True, None),
    "parallel_draft_step": (1, None),
    "parallel_draft_heads_num_layers": None,  # the depth of parallel draft heads, which parallel_draft_step 1 has none of
}


def _is_eagle3_config(config: dict) -> bool:
    arch = config.get("architectures") or []
    return "LlamaForCausalLMEagle3" in arch or ("LlamaForCausalLM" in arch and "draft_vocab_size" in config)


def _detect(config: dict, keys: set) -> bool:
    return _is_eagle3_config(config) and "fc.weight" in keys and any(k.startswith("midlayer.") for k in keys)


def _detect_vllm(config: dict, keys: set) -> bool:
    return (
        _is_eagle3_config(config)
        and "fc.weight" in keys
        and "layers.0.hidden_norm.weight" in keys
        and "eagle_lm_head.weight" not in keys
    )


def _detect_modelopt(config: dict, keys: set) -> bool:
    has_renamed = any(k.startswith(("eagle_lm_head.", "input_embeds_norm.", "eagle_module.")) for k in keys)
    return has_renamed and ("eagle_config" in config or _is_eagle3_config(config))


def check_config_keys(config: dict) -> None:
    """Raises `ValueError` for config keys that would change the forward pass in a way not implemented here."""
    problems = []
    for key, value in config.items():
        if key in _READ_KEYS or key in _INERT_KEYS:
            continue
        if key in _NEUTRAL_FLAGS:
            if value not in _NEUTRAL_FLAGS[key]:
                problems.append(f"{key}={value!r}")
            continue
        problems.append(f"{key}={value!r} (unknown)")
    nested = config.get("eagle_config") or {}
    for key, value in nested.items():
        allowed = _NEUTRAL_EAGLE_CONFIG.get(key, ())
        if allowed is None or value in allowed:
            continue
        problems.append(f"eagle_config.{key}={value!r}" + ("" if key in _NEUTRAL_EAGLE_CONFIG else " (unknown)"))
    layers = config.get("num_hidden_layers", 1)
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1):
        problems.append(f"num_hidden_layers={layers!r} (the number of draft layers: an integer >= 1)")
    if problems:
        raise ValueError(
            "This EAGLE-3 config.json sets flags that change the draft forward pass in ways hf_specdec's EAGLE-3 "
            f"drafter does not implement: {', '.join(problems)}. Importing it anyway would draft with a different "
            "model. If a key is only metadata, remove it from config.json and import again."
        )


def _feature_ids(config: dict) -> list[int] | None:
    nested = config.get("eagle_config") or {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    if ids:  # output-of-layer numbering (0-based) -> hidden_states index
        return [int(i) + 1 for i in ids]
    return None


def _norm_flags(config: dict, vllm_norm_output: bool) -> dict:
    """The optional norms a config sets, as :class:`Eagle3Config` fields (``norm_output`` in the meaning of the
    project the layout comes from: vLLM's post-norm feedback, or SpecForge's final norm before the LM head)."""
    nested = config.get("eagle_config") or {}
    flags = {
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_before_fc": bool(nested.get("norm_before_fc", config.get("norm_before_fc", False))),
    }
    if flags["fc_norm"] and flags["norm_before_fc"]:
        raise ValueError(
            "This EAGLE-3 config.json sets both fc_norm=True (one norm per target state) and norm_before_fc=True (one "
            "norm over their concatenation), which speculators defines as mutually exclusive: keep the one the "
            "weights were trained with (fc_norm.{i}.weight or input_norm.weight) and import again."
        )
    if vllm_norm_output:
        return {**flags, "norm_output": True, "norm_feedback": bool(config.get("norm_output", False))}
    return {**flags, "norm_output": bool(config.get("norm_output", True)), "norm_feedback": False}


def _upper_layer_name(key: str) -> str:
    """vLLM's ``layers.{i}.*`` (``i >= 1``: the plain layers after the first) as hf_specdec's ``upper_layers.{i-1}.*``."""
    match = re.match(r"layers\.(\d+)\.", key)
    if match is None or match.group(1) == "0":
        return key
    return f"upper_layers.{int(match.group(1)) - 1}." + key[match.end() :]


def _vllm_layer_name(key: str) -> str:
    """hf_specdec's ``upper_layers.{i}.*`` as vLLM's ``layers.{i+1}.*`` (the inverse of :func:`_upper_layer_name`)."""
    match = re.match(r"upper_layers\.(\d+)\.", key)
    if match is None:
        return key
    return f"layers.{int(match.group(1)) + 1}." + key[match.end() :]


def _renamed(state: dict, renames) -> dict:
    """The state dict under hf_specdec's names: layout prefixes renamed, the target's embeddings and a zero fc bias
    dropped (the embeddings are bound at generation time; hf_specdec's fc has no bias), and the ``hidden_norm`` that
    vLLM builds in every draft layer but reads in the first only."""
    weights = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
        key = _upper_layer_name(key)
        if key.startswith("upper_layers.") and key.endswith(".hidden_norm.weight"):
            continue
        weights[key] = value
    if "hidden_norm.weight" in weights and "midlayer.hidden_norm.weight" not in weights:
        weights["midlayer.hidden_norm.weight"] = weights.pop("hidden_norm.weight")
    weights.pop("embed_tokens.weight", None)
    if "fc.bias" in weights:
        if torch.count_nonzero(weights["fc.bias"]):
            raise ValueError("This EAGLE-3 checkpoint has a non-zero fc.bias; hf_specdec's fc has no bias.")
        weights.pop("fc.bias")
    return weights


def _check_tensor_names(weights: dict, norms: dict, n_feats: int, layers: int) -> None:
    """Refuses missing tensors and tensors the drafter would not use, naming them (and the flag behind a norm)."""
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + [f"midlayer.{k}" for k in _LAYER_KEYS]
    upper_keys = [k for k in _LAYER_KEYS if k != "hidden_norm.weight"]
    required += [f"upper_layers.{i}.{k}" for i in range(layers - 1) for k in upper_keys]
    if norms["fc_norm"]:
        required += [f"fc_norm.{i}.weight" for i in range(n_feats)]
    if norms["norm_before_fc"]:
        required.append("input_norm.weight")
    missing = [k for k in required if k not in weights]
    if missing:
        hint = ""
        if any(k.startswith("upper_layers.") for k in missing):
            hint = f" Its config.json says num_hidden_layers={layers}; the tensors hold fewer draft layers."
        raise ValueError(f"The EAGLE-3 checkpoint is missing tensors {missing[:8]}; it cannot be imported.{hint}")
    unknown = sorted(set(weights) - set(required) - {"d2t", "t2d"})
    if unknown:
        hint = ""
        if any(k.startswith(("fc_norm.", "input_norm.")) for k in unknown):
            hint = " Its config.json does not set the flag (fc_norm / norm_before_fc) that uses them: set it."
        if any(k.startswith("upper_layers.") for k in unknown):
            hint += f" Its config.json says num_hidden_layers={layers}; the tensors hold more draft layers: fix it."
        raise ValueError(f"The EAGLE-3 checkpoint has tensors hf_specdec does not know: {unknown[:8]}.{hint}")


def _check_target_facts(target: dict, target_hidden: int, vocab: int) -> None:
    if target.get("hidden_size") not in (None, target_hidden):
        raise ValueError(
            f"The drafter reads {target_hidden}-wide target states but the target's hidden size is "
            f"{target['hidden_size']}: this drafter was trained for another target."
        )
    if target.get("vocab_size") not in (None, vocab):
        raise ValueError(
            f"The drafter's vocabulary ({vocab}) differs from the target's ({target['vocab_size']}): this drafter was "
            "trained for another target."
        )


def _feature_layers(config: dict, fc_in: int, target_hidden: int, depth, feature_ids) -> tuple[int, list | None]:
    """``(number of target states fc fuses, their output_hidden_states ids or None while the depth is unknown)``,
    checked against the config's feature layers and TensorRT-LLM's ``num_eagle_features``."""
    if fc_in % target_hidden:
        raise ValueError(f"fc.weight reads {fc_in} features, not a multiple of the target width {target_hidden}.")
    n_feats = fc_in // target_hidden
    declared = config.get("num_eagle_features")
    if declared is not None and int(declared) != n_feats:
        raise ValueError(
            f"This EAGLE-3 config.json sets num_eagle_features={declared!r}, but fc.weight fuses {n_feats} target "
            f"states: fix num_eagle_features to {n_feats} (or remove it) and import again."
        )
    layer_ids = _feature_ids(config) if feature_ids is None else [int(i) for i in feature_ids]
    if layer_ids is None and depth is not None:
        layer_ids = Eagle3Config.default_target_layer_ids(int(depth))
    if layer_ids is not None and len(layer_ids) != n_feats:
        raise ValueError(f"fc.weight fuses {n_feats} target states but the config names {len(layer_ids)} layers.")
    if layer_ids is None and n_feats != Eagle3Config.num_default_target_features:
        raise ValueError(
            f"fc.weight fuses {n_feats} target states; the config does not say which, and the default is "
            f"{Eagle3Config.num_default_target_features}. Add eagle_config.eagle_aux_hidden_state_layer_ids."
        )
    return n_feats, layer_ids


def _vocabulary_maps(weights: dict, draft_vocab: int, vocab: int) -> None:
    """Fills in ``d2t`` (identity for a full vocabulary) and ``t2d`` (rebuilt from ``d2t`` when the layout has none)."""
    if "d2t" not in weights:
        if draft_vocab != vocab:
            raise ValueError("The checkpoint has a reduced draft vocabulary but no d2t map; it cannot be imported.")
        weights["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    if "t2d" not in weights:  # ModelOpt / vLLM layouts: rebuild it from d2t
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + weights["d2t"].long()] = True
        weights["t2d"] = t2d
    weights["d2t"] = weights["d2t"].long()
    weights["t2d"] = weights["t2d"].bool()


def _load_weights(model: Eagle3ForDrafting, weights: dict) -> None:
    expected = model.state_dict()
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"Tensor {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)} from the config."
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()}, strict=True)


def load_eagle3(
    config: dict, state: dict, target: dict, renames=(), feature_ids=None, vllm_norm_output: bool = False
) -> Eagle3ForDrafting:
    """Builds an :class:`Eagle3ForDrafting` from a foreign config dict and state dict (see the module docstring).

    Args:
        feature_ids: the target layers read, as ``output_hidden_states`` indices, for layouts that record them in
            their own way (default: from the config's ``eagle_aux_hidden_state_layer_ids``, output-of-layer numbering).
        vllm_norm_output: the config's ``norm_output`` is vLLM's (post-norm feedback), not SpecForge's.
    """
    check_config_keys(config)
    weights = _renamed(state, renames)
    if "fc.weight" not in weights:
        raise ValueError("The EAGLE-3 checkpoint is missing tensors ['fc.weight']; it cannot be imported.")
    hidden = int(config["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    # Depth: from the target, else from an hf_specdec export's provenance; else resolved by bind_target.
    depth = target.get("num_hidden_layers") or (config.get("hf_specdec") or {}).get("target_num_hidden_layers")
    n_feats, layer_ids = _feature_layers(config, weights["fc.weight"].shape[1], target_hidden, depth, feature_ids)
    norms = _norm_flags(config, vllm_norm_output)
    layers = int(config.get("num_hidden_layers") or 1)
    _check_tensor_names(weights, norms, n_feats, layers)
    vocab = int(config.get("vocab_size") or target.get("vocab_size") or 0)
    draft_vocab = int(config.get("draft_vocab_size") or weights["lm_head.weight"].shape[0])
    _check_target_facts(target, target_hidden, vocab)
    heads = int(config["num_attention_heads"])
    max_pos = int(config.get("max_position_embeddings", 4096))
    rope_theta, rope_scaling = rope_scaling_from_config(dict(config, max_position_embeddings=max_pos))
    cfg = Eagle3Config(
        target_hidden_size=target_hidden,
        target_num_hidden_layers=None if depth is None else int(depth),
        target_vocab_size=vocab,
        target_model_type=target.get("model_type") or config.get("target_model_type"),
        target_model_name_or_path=target.get("name_or_path"),
        target_layer_ids=layer_ids,
        draft_vocab_size=draft_vocab,
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling_parameters=rope_scaling,
        max_position_embeddings=max_pos,
        attention_bias=bool(config.get("attention_bias", False)),
        num_hidden_layers=layers,
        **norms,
    )
    model = Eagle3ForDrafting(cfg)
    _vocabulary_maps(weights, draft_vocab, vocab)
    _load_weights(model, weights)
    model.check_draft_vocab()
    return model.eval()


def eagle3_config_dict(drafter: Eagle3ForDrafting, with_t2d: bool) -> dict:
    """The ``config.json`` of an export: Llama-style keys the foreign loaders read, plus provenance. The optional
    norms are written as vLLM reads them (``norm_output``: post-norm feedback); SafeAILab's runtime has none of them,
    so that export refuses drafters that use one."""
    cfg = drafter.config
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        # Provenance, ignored by the foreign loaders.
        "hf_specdec": {"target_num_hidden_layers": cfg.target_num_hidden_layers, "t2d": with_t2d},
    }
    if cfg.rope_scaling_parameters is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling_parameters)
    if cfg.target_layer_ids is not None:
        out["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in cfg.target_layer_ids],
            "use_aux_hidden_state": True,
        }
    flags = {
        "norm_before_residual": cfg.norm_before_residual,
        "fc_norm": cfg.fc_norm,
        "norm_before_fc": cfg.norm_before_fc,
        "norm_output": cfg.norm_feedback,  # vLLM's norm_output; SpecForge's (norm_output=False) has no vLLM form
    }
    return {**out, **{key: True for key, on in flags.items() if on}}


def _check_vllm_runtime(drafter: Eagle3ForDrafting) -> None:
    """Refuses drafters vLLM would run differently: its EAGLE-3 head always reads the final norm."""
    if not drafter.config.norm_output:
        raise ValueError(
            "This EAGLE-3 drafter feeds its layer output to the LM head without the final norm (norm_output=False, "
            "SpecForge's flag); vLLM's EAGLE-3 always applies the norm (its own norm_output flag means post-norm "
            "feedback), so this drafter has no eagle3-vllm form. Train one with norm_output=True to serve it in vLLM."
        )


def _save_vllm(drafter: Eagle3ForDrafting, out_dir: str, target) -> None:
    _check_vllm_runtime(drafter)
    save_eagle3(drafter, out_dir, "layers.0.", with_t2d=False)


def _check_safeailab_runtime(drafter: Eagle3ForDrafting) -> None:
    """Refuses drafters SafeAILab's runtime would run differently (it has no such options)."""
    cfg = drafter.config
    problems = []
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        problems.append(f"head_dim {cfg.head_dim} × {cfg.num_attention_heads} heads ≠ hidden_size {cfg.hidden_size}")
    if cfg.attention_bias:
        problems.append("attention biases")
    norms = [
        name for name in ("norm_before_residual", "fc_norm", "norm_before_fc", "norm_feedback") if getattr(cfg, name)
    ]
    norms += [] if cfg.norm_output else ["norm_output=False"]
    if norms:
        problems.append(f"optional norms it does not have ({', '.join(norms)})")
    rope = cfg.rope_scaling_parameters
    if rope is not None and (rope["rope_type"] not in ("linear", "dynamic") or float(rope["factor"]) <= 1.0):
        problems.append(f"RoPE scaling {rope} (SafeAILab's config accepts linear / dynamic with factor > 1 only)")
    if cfg.target_layer_ids is not None and cfg.target_num_hidden_layers is not None:
        if list(cfg.target_layer_ids) != Eagle3Config.default_target_layer_ids(cfg.target_num_hidden_layers):
            problems.append(f"target_layer_ids {cfg.target_layer_ids} (SafeAILab's runtime reads the default layers)")
    if cfg.num_hidden_layers > 1:
        problems.append(f"{cfg.num_hidden_layers} draft layers (its EAGLE-3 model has one, `midlayer`)")
    if problems:
        raise ValueError(
            "This drafter cannot run in SafeAILab EAGLE's runtime, which the 'eagle3' layout targets: "
            + "; ".join(problems)
            + ". Export it to 'eagle3-vllm' instead, or train a drafter without these options."
        )


def _safeailab_rope_scaling(cfg: Eagle3Config) -> dict | None:
    rope = cfg.rope_scaling_parameters
    return None if rope is None else {"type": rope["rope_type"], "factor": float(rope["factor"])}


def eagle3_tensors(drafter: Eagle3ForDrafting, layer_prefix: str, maps: tuple[str, ...], target=None) -> dict:
    """The drafter's tensors with the first draft layer under ``layer_prefix`` (the layers after it, if any, as
    vLLM's ``layers.{i}``), of the vocabulary maps only ``maps`` (``d2t`` / ``t2d``); with ``target``, the target's
    token embeddings too."""
    tensors = {}
    for key, value in drafter.state_dict().items():
        if key in ("d2t", "t2d") and key not in maps:
            continue
        if key.startswith("midlayer."):
            key = layer_prefix + key[len("midlayer.") :]
        tensors[_vllm_layer_name(key)] = value
    return {**tensors, **target_embedding(drafter, target)}


def save_eagle3(drafter: Eagle3ForDrafting, out_dir: str, layer_prefix: str, with_t2d: bool, target=None) -> None:
    """Writes ``config.json`` + ``model.safetensors``; with ``target``, the target's token embeddings too."""
    maps = ("d2t", "t2d") if with_t2d else ("d2t",)
    write_checkpoint(
        out_dir, eagle3_config_dict(drafter, with_t2d), eagle3_tensors(drafter, layer_prefix, maps, target)
    )


def _save_safeailab(drafter: Eagle3ForDrafting, out_dir: str, target) -> None:
    _check_safeailab_runtime(drafter)
    if target is None:
        raise ValueError(
            "The 'eagle3' layout must ship the target's token embeddings: SafeAILab's runtime drafts with random "
            "ones otherwise. Bind the drafter to its target first (drafter.bind_target(target)), pass "
            "export_drafter(..., target=target), or `hf-specdec convert --to eagle3 --target PATH`."
        )
    save_eagle3(drafter, out_dir, "midlayer.", with_t2d=True, target=target)
    path = os.path.join(out_dir, "config.json")
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    config.pop("rope_scaling", None)
    rope = _safeailab_rope_scaling(drafter.config)
    if rope is not None:  # SafeAILab's EConfig takes exactly {"type", "factor"}
        config["rope_scaling"] = rope
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


register_layout(
    Layout(
        name="eagle3",
        family=Eagle3Config.model_type,
        description="SafeAILab EAGLE / SpecForge EAGLE-3 (midlayer.*, d2t, t2d, target embeddings); what SGLang loads",
        detect=_detect,
        load=lambda config, state, target: load_eagle3(config, state, target),
        save=_save_safeailab,
    )
)
register_layout(
    Layout(
        name="eagle3-vllm",
        family=Eagle3Config.model_type,
        description="EAGLE-3 as vLLM loads it (layers.0.*, d2t, no t2d)",
        detect=_detect_vllm,
        load=lambda config, state, target: load_eagle3(
            config, state, target, renames=_VLLM_RENAMES, vllm_norm_output=True
        ),
        save=_save_vllm,
    )
)
register_layout(
    Layout(
        name="eagle3-modelopt",
        family=Eagle3Config.model_type,
        description="NVIDIA ModelOpt EAGLE-3 export (layers.0.*, input_embeds_norm, eagle_lm_head, no t2d)",
        detect=_detect_modelopt,
        load=lambda config, state, target: load_eagle3(
            config, state, target, renames=_MODELOPT_RENAMES, vllm_norm_output=True
        ),
    )
)
