"""MTP checkpoint layouts: MTP layers shipped in a target's own checkpoint, after its main layers.

* ``mtp-layers``: DeepSeek-V3 style (what vLLM's ``DeepSeekMTP`` reads). ``config.json`` is the target's
  (``num_hidden_layers`` ``L``, ``num_nextn_predict_layers`` or ``num_mtp_layers`` ``D``, attention shape,
  ``rms_norm_eps``, ``rope_theta``, ...); module ``k`` is ``model.layers.{L + k}.``: ``enorm``, ``hnorm``, ``eh_proj``
  (``2H -> H``, no bias), ``shared_head.norm`` and a decoder layer (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
  ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``). The embedding and the shared head (``embed_tokens``,
  ``shared_head.head``) are the target's and are ignored on import, never written on export. MLA attention and
  mixture-of-experts MLPs have no place in hf_specdec's dense module and are refused here.
* ``native-mtp`` (import only, detected first): the same names in the checkpoint of a target whose transformers
  config declares ``num_mtp_layers`` (DeepSeek-V3, GLM-4.5-MoE, ...): the layer is built from the target's own
  decoder-layer class, MLA and MoE included, as transformers' ``MtpLayer`` (:class:`NativeMtpForDrafting`), and loaded
  with transformers' weight conversions. Targets it cannot run (more than one MTP layer, non-full attention,
  quantized checkpoints) are refused from ``config.json`` before any tensor is read.
* ``mimo-mtp`` (import only): XiaomiMiMo's MiMo (``model_type`` ``mimo``, a Qwen2 target): module ``k`` is
  ``model.mtp_layers.{k}.``: ``token_layernorm`` / ``hidden_layernorm`` (hf_specdec's ``enorm`` / ``hnorm``),
  ``input_proj`` over ``[hidden; embedding]`` (``eh_proj`` with ``hidden_states_first``), a Qwen2 decoder layer
  (biases on q/k/v only: ``qkv_bias``) and ``final_layernorm`` (``post_norm``), on the target's final normed state,
  with the target's embeddings and LM head, as MiMo's ``modeling_mimo.py`` and vLLM's ``MiMoMTP`` run it.

So a checkpoint of a target that ships dense MTP layers imports as its own drafter (``hf-specdec convert <target
folder> OUT``). Qwen3-Next / Qwen3.5 (``mtp.*``) MTP layers are refused by name: see :func:`refuse_qwen3_next_mtp`.
"""

from __future__ import annotations

import re

import torch

from ...configuration_utils import decoder_layer_config_dict, decoder_layer_fields
from ...convert import Layout, register_layout, register_refusal, write_checkpoint
from ...speculators_format import register_speculators_refusal
from .configuration_mtp import MtpConfig, NativeMtpConfig, native_mtp_refusal
from .modeling_mtp import MtpForDrafting
from .modeling_native_mtp import NativeMtpForDrafting

# a decoder layer's names inside an MTP module -> hf_specdec's (inside layers.{k}.)
_BLOCK = {name: f"mtp_block.{name}" for name in ("input_layernorm.weight", "post_attention_layernorm.weight")}
for _name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    for _kind in ("weight", "bias"):
        _BLOCK[f"self_attn.{_name}.{_kind}"] = f"mtp_block.self_attn.{_name}.{_kind}"
for _name in ("gate_proj", "up_proj", "down_proj"):
    _BLOCK[f"mlp.{_name}.weight"] = f"mtp_block.mlp.{_name}.weight"
# DeepSeek-V3 names (inside model.layers.{L + k}.) -> hf_specdec's
_RENAME = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "post_norm.weight",
    **_BLOCK,
}
_IGNORED = ("shared_head.head.weight", "embed_tokens.weight")
# MiMo names (inside model.mtp_layers.{k}.) -> hf_specdec's
_MIMO_PREFIX = "model.mtp_layers."
_MIMO_RENAME = {
    "token_layernorm.weight": "enorm.weight",
    "hidden_layernorm.weight": "hnorm.weight",
    "input_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "post_norm.weight",
    **_BLOCK,
}


def _num_modules(config: dict) -> int:
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if config.get(key):
            return int(config[key])
    return 0


def _native_text_config(config: dict):
    """The target's text config when transformers builds MTP layers for its model type (``num_mtp_layers``)."""
    from transformers import CONFIG_MAPPING

    model_type = str(config.get("model_type", ""))
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if config_class is None or "num_mtp_layers" not in getattr(config_class, "__annotations__", {}):
        return None
    return config_class.from_dict(config).get_text_config()


def _detect_native(config: dict, keys: set) -> bool:
    return _native_text_config(config) is not None and _detect(config, keys)


def _native_tensors(config: dict, keys: set) -> set:
    """The MTP layer's tensors, once the config says hf_specdec can run it (refused before any tensor is read)."""
    refusal = native_mtp_refusal(_native_text_config(config))
    if config.get("quantization_config"):
        refusal = (
            refusal or "This target checkpoint is quantized (quantization_config); hf_specdec loads plain tensors."
        )
    if refusal:
        raise ValueError(refusal)
    return _mtp_tensors(config, keys)


def load_native_mtp(config: dict, state: dict, target: dict) -> NativeMtpForDrafting:
    """A target's own MTP layer (DeepSeek-V3, GLM-4.5-MoE, ...), built from its decoder-layer class as transformers'
    ``MtpModel`` builds it, with transformers' weight conversions."""
    text = _native_text_config(config)
    native = NativeMtpConfig.from_target_config(text, target_model_name_or_path=target.get("name_or_path"))
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if target.get(key) not in (None, getattr(text, key)):
            raise ValueError(f"These MTP layers follow a target with {key} {getattr(text, key)}; got {target[key]}.")
    with torch.device("meta"):  # the weights come from the checkpoint: allocate nothing before
        drafter = NativeMtpForDrafting(native)
    return drafter.load_checkpoint_tensors(state)


def _detect(config: dict, keys: set) -> bool:
    layers = config.get("num_hidden_layers")
    return bool(_num_modules(config)) and layers is not None and f"model.layers.{int(layers)}.eh_proj.weight" in keys


def _mtp_tensors(config: dict, keys: set) -> set:
    """The MTP modules' tensors: a target checkpoint's other weights (its own layers) are never read."""
    depth = int(config["num_hidden_layers"])
    prefixes = tuple(f"model.layers.{depth + k}." for k in range(_num_modules(config)))
    return {k for k in keys if k.startswith(prefixes)}


def _module_tensors(state: dict, prefix: str, rename: dict, k: int) -> dict:
    """MTP module ``k``'s tensors (under ``prefix``) with hf_specdec's names; refuses weights it has no place for."""
    mine = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
    if not mine:
        raise ValueError(f"MTP module {k} ({prefix}*) is missing from the checkpoint.")
    exotic = sorted(n for n in mine if n not in rename and n not in _IGNORED)
    if exotic:
        kind = "mixture-of-experts MLP" if any("expert" in n or n.startswith("mlp.gate.") for n in exotic) else ""
        kind = kind or ("MLA attention" if any(re.search(r"(q_a|kv_a|q_b|kv_b)_", n) for n in exotic) else "")
        raise ValueError(
            f"MTP module {k} has weights hf_specdec's dense MTP module cannot hold ({kind or 'unknown'}: "
            f"{exotic[:4]}). Only dense Llama-style MTP layers import here; train an MTP drafter for this target "
            "instead (hf-specdec train --drafter mtp). A target whose transformers config declares num_mtp_layers "
            "(DeepSeek-V3, GLM-4.5-MoE) loads its own MTP layer as it is (layout native-mtp)."
        )
    return {f"layers.{k}.{rename[n]}": t for n, t in mine.items() if n in rename}


def _build_drafter(config: dict, own: dict, target: dict, hidden_states_first: bool) -> MtpForDrafting:
    """The drafter of ``config``'s MTP modules, loaded with ``own`` (hf_specdec names); biases from the tensors."""
    depth = int(config["num_hidden_layers"])
    if target.get("num_hidden_layers") not in (None, depth):
        raise ValueError(
            f"These MTP layers follow a {depth}-layer target; the target has {target['num_hidden_layers']} layers."
        )
    hidden = int(config["hidden_size"])
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(f"These MTP layers are {hidden} wide; the target's states are {target['hidden_size']}.")
    all_biases = any(n.endswith("self_attn.o_proj.bias") for n in own)
    cfg = MtpConfig(
        target_model_name_or_path=target.get("name_or_path"),
        target_model_type=target.get("model_type") or config.get("model_type"),
        target_hidden_size=hidden,
        target_num_hidden_layers=depth,
        target_vocab_size=int(target.get("vocab_size") or config["vocab_size"]),
        **{**decoder_layer_fields(config), "attention_bias": all_biases},
        qkv_bias=not all_biases and any(n.endswith("self_attn.q_proj.bias") for n in own),
        num_mtp_modules=_num_modules(config),
        hidden_states_first=hidden_states_first,
        use_post_norm=any(n.endswith("post_norm.weight") for n in own),
    )
    drafter = MtpForDrafting(cfg)
    mine = drafter.state_dict()
    missing = sorted(k for k in mine if k not in own and k not in ("d2t", "t2d"))
    if missing:
        raise ValueError(f"Not a complete MTP checkpoint: missing {missing[:4]}.")
    drafter.load_state_dict({**mine, **{k: v.to(mine[k].dtype) for k, v in own.items()}})
    return drafter.eval()


def load_mtp_layers(config: dict, state: dict, target: dict) -> MtpForDrafting:
    depth, num = int(config["num_hidden_layers"]), _num_modules(config)
    if not num:
        raise ValueError("This config declares no MTP layers (num_nextn_predict_layers / num_mtp_layers).")
    own: dict = {}
    for k in range(num):
        own.update(_module_tensors(state, f"model.layers.{depth + k}.", _RENAME, k))
    return _build_drafter(config, own, target, bool(config.get("mtp_hidden_states_first", False)))


def _detect_mimo(config: dict, keys: set) -> bool:
    return bool(_num_modules(config)) and f"{_MIMO_PREFIX}0.input_proj.weight" in keys


def _mimo_tensors(config: dict, keys: set) -> set:
    """MiMo's MTP layers: the target's own weights (``model.layers.*``, embeddings, head) are never read."""
    return {k for k in keys if k.startswith(_MIMO_PREFIX)}


def load_mimo_mtp(config: dict, state: dict, target: dict) -> MtpForDrafting:
    """MiMo's ``model.mtp_layers.{k}`` (``num_nextn_predict_layers`` of them) as an MTP drafter for the MiMo target
    (whose main layers are Qwen2's: it loads with ``Qwen2ForCausalLM``, or MiMo's own code)."""
    if config.get("use_sliding_window"):
        raise ValueError(
            "This MiMo config has use_sliding_window: true; hf_specdec's MTP layer attends to the whole context, so it "
            "would not compute what MiMo's sliding-window MTP layer does."
        )
    own: dict = {}
    for k in range(_num_modules(config)):
        own.update(_module_tensors(state, f"{_MIMO_PREFIX}{k}.", _MIMO_RENAME, k))
    return _build_drafter(config, own, target, hidden_states_first=True)


_MTP_PREFIX_FAMILIES = {"qwen3_next": "Qwen3-Next", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"}


def refuse_qwen3_next_mtp(config: dict, keys: set) -> str | None:
    """Why Qwen3-Next / Qwen3.5 MTP layers (``mtp.fc``, ``mtp.pre_fc_norm_embedding`` / ``_hidden``,
    ``mtp.layers.{i}``, ``mtp.norm``) do not import (``None`` for other checkpoints)."""
    if "mtp.fc.weight" not in keys:
        return None
    model_type = str(config.get("model_type") or "")
    family = _MTP_PREFIX_FAMILIES.get(model_type, f"This model (model_type {model_type!r})")
    return (
        f"{family}'s MTP layer (tensors mtp.*: fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.*, norm) is "
        "not supported: its decoder layer has gated attention with partial rotary embeddings and zero-centred "
        "(1 + weight) RMSNorms (in the MoE models also a mixture-of-experts MLP), which hf_specdec's MTP module, one "
        "dense Llama-style layer, cannot compute, and transformers does not load these weights either. Serve its own "
        "MTP layer with vLLM or SGLang, or train an hf_specdec drafter for this target (hf-specdec train --drafter "
        "mtp, or eagle3); the target itself loads with AutoModelForCausalLM."
    )


def save_mtp_layers(drafter: MtpForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    if drafter.reduced_vocabulary:
        raise ValueError(
            "The MTP layout drafts over the target's full LM head; this drafter restricts it to "
            f"{cfg.draft_vocab_size} tokens. Train one with the full vocabulary to export it."
        )
    if not cfg.use_post_norm:
        raise ValueError("The MTP layout has a shared_head.norm per module; this drafter has none (use_post_norm).")
    back = {v: k for k, v in _RENAME.items()}
    depth = int(cfg.target_num_hidden_layers)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        _, k, rest = name.split(".", 2)
        state[f"model.layers.{depth + int(k)}.{back[rest]}"] = tensor
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": cfg.target_model_type or "llama",
        **decoder_layer_config_dict(cfg),
        "num_hidden_layers": depth,
        "num_nextn_predict_layers": cfg.num_mtp_modules,
        "mtp_hidden_states_first": cfg.hidden_states_first,
        "vocab_size": cfg.target_vocab_size,
    }
    write_checkpoint(out_dir, config, state)


register_layout(  # before mtp-layers: the same tensor names, for targets transformers builds MTP layers for
    Layout(
        name="native-mtp",
        family=NativeMtpConfig.model_type,
        description="a target's own MTP layers (model.layers.{L}: enorm, hnorm, eh_proj, shared_head.norm and its own "
        "decoder layer, MLA / MoE included) for configs with num_mtp_layers (DeepSeek-V3, GLM-4.5-MoE), run as "
        "transformers' MtpLayer",
        detect=_detect_native,
        load=load_native_mtp,
        needed_tensors=_native_tensors,
    )
)
register_speculators_refusal(
    "mtp",
    "speculators builds its MTP layer from the target's own decoder layer class (Qwen3 with q_norm / k_norm, or the "
    "hybrid Qwen3-Next / Qwen3.5 layers) with hidden_layernorm / token_layernorm / input_proj / final_layernorm, which "
    "hf_specdec's MTP module (a dense Llama-style layer) does not reproduce; a target with its own MTP layers runs "
    "them with transformers' own MTP support (use_mtp)",
)
register_refusal(refuse_qwen3_next_mtp)
register_layout(
    Layout(
        name="mtp-layers",
        family=MtpConfig.model_type,
        description="MTP layers after the target's own (model.layers.{L+k}: enorm, hnorm, eh_proj, shared_head.norm, "
        "dense decoder layer), DeepSeek-V3 style / vLLM DeepSeekMTP; a target shipping them imports as its drafter",
        detect=_detect,
        load=load_mtp_layers,
        save=save_mtp_layers,
        needed_tensors=_mtp_tensors,
    )
)
register_layout(
    Layout(
        name="mimo-mtp",
        family=MtpConfig.model_type,
        description="XiaomiMiMo MiMo's MTP layers (model.mtp_layers.{k}: token/hidden_layernorm, input_proj over "
        "[hidden; embedding], Qwen2 decoder layer, final_layernorm), imported from the MiMo target's checkpoint",
        detect=_detect_mimo,
        load=load_mimo_mtp,
        needed_tensors=_mimo_tensors,
    )
)
