"""Import and export of other projects' drafter checkpoints, as a registry of layouts.

A :class:`Layout` knows how to recognise a foreign checkpoint folder, turn it into an hf_specdec drafter, and/or
write an hf_specdec drafter in that layout. Drafter families add their layouts with :func:`register_layout`; nothing
here switches on family names.

EAGLE-3 layouts (see ``docs/formats.md`` of the project):

* ``eagle3`` (import and export): SafeAILab EAGLE / SpecForge. A Llama-style ``config.json``
  (``LlamaForCausalLMEagle3`` or ``LlamaForCausalLM``, ``draft_vocab_size``, optional ``target_hidden_size``) and
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` weights, optionally ``embed_tokens``. This is also
  what SGLang loads.
* ``eagle3-modelopt`` (import): NVIDIA ModelOpt exports (``layers.0.*``, ``input_embeds_norm``, ``hidden_norm``,
  ``eagle_lm_head``, no ``t2d``; feature layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``).
* ``eagle3-vllm`` (import and export): ``layers.0.*`` instead of ``midlayer.*``, ``d2t`` without ``t2d``.

Foreign EAGLE-3 configs do not say how deep the target is, which hf_specdec needs to check the drafter against a
target; pass the target's config (or its number of layers) when importing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Layout", "LAYOUTS", "register_layout", "detect_layout", "import_drafter", "export_drafter"]


@dataclass
class Layout:
    """A checkpoint layout of another project.

    Attributes:
        name: registry key (``hf-specdec convert --from/--to NAME``).
        family: the hf_specdec drafter family (``model_type``) it maps to.
        description: one line for ``hf-specdec convert --list``.
        detect: ``(config_dict, weight_names) -> bool`` for auto-detection on import (``None``: never auto-detected).
        load: ``(config_dict, state_dict, target_info) -> drafter`` (``None``: export only).
        save: ``(drafter, out_dir) -> None`` (``None``: import only).
    """

    name: str
    family: str
    description: str
    detect: Callable[[dict, set], bool] | None = None
    load: Callable[[dict, dict, dict], object] | None = None
    save: Callable[[object, str], None] | None = None


LAYOUTS: dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Adds a layout to the registry (a family's conversion module calls this at import time)."""
    if not layout.name:
        raise ValueError("A layout needs a name.")
    LAYOUTS[layout.name] = layout
    return layout


def _read_checkpoint(path: str) -> tuple[dict, dict]:
    """``config.json`` and all weights of a checkpoint folder (safetensors, sharded or not, or ``pytorch_model.bin``)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint folder at {path!r}.")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json; a drafter checkpoint folder needs one.")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for name in files:
            try:
                state.update(load_file(os.path.join(path, name)))
            except Exception as err:  # safetensors raises its own error types
                msg = f"Cannot read {os.path.join(path, name)}: {err}. The file is corrupt or truncated."
                raise ValueError(msg) from err
    else:
        bins = sorted(f for f in os.listdir(path) if f.endswith(".bin") or f.endswith(".pt"))
        if not bins:
            raise ValueError(f"{path} holds no weights (*.safetensors, pytorch_model.bin).")
        for name in bins:
            state.update(torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
    return config, state


def detect_layout(path: str) -> str | None:
    """Name of the registered layout a checkpoint folder is in, or ``None`` (e.g. an hf_specdec checkpoint)."""
    config, state = _read_checkpoint(path)
    if str(config.get("model_type", "")).endswith("_drafter"):
        return None
    for layout in LAYOUTS.values():
        if layout.detect is not None and layout.detect(config, set(state)):
            return layout.name
    return None


def _target_info(target_config=None, target_num_hidden_layers: int | None = None) -> dict:
    info: dict = {}
    if target_config is not None:
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        info = {
            "num_hidden_layers": int(text.num_hidden_layers),
            "hidden_size": int(text.hidden_size),
            "vocab_size": int(text.vocab_size),
            "model_type": getattr(target_config, "model_type", None),
            "name_or_path": getattr(target_config, "_name_or_path", None) or None,
        }
    if target_num_hidden_layers is not None:
        info["num_hidden_layers"] = int(target_num_hidden_layers)
    return info


def import_drafter(path: str, layout: str = "auto", target_config=None, target_num_hidden_layers: int | None = None):
    """Loads a checkpoint written by another project as an hf_specdec drafter.

    Args:
        path: the checkpoint folder.
        layout: a registered layout name, or ``"auto"`` to detect it.
        target_config: the target's config (checks vocabulary and hidden size; gives its depth).
        target_num_hidden_layers: the target's depth, when its config is not at hand.
    """
    config, state = _read_checkpoint(path)
    if layout == "auto":
        found = None
        for candidate in LAYOUTS.values():
            if candidate.detect is not None and candidate.detect(config, set(state)):
                found = candidate
                break
        if found is None:
            raise ValueError(
                f"{path} is not in a known layout. Known: {sorted(LAYOUTS)}; pass layout= (--from) explicitly if "
                "it is one of them, or load hf_specdec checkpoints with AutoModelForDrafting.from_pretrained."
            )
        spec = found
    elif layout in LAYOUTS:
        spec = LAYOUTS[layout]
    else:
        raise ValueError(f"Unknown layout {layout!r}. Known layouts: {sorted(LAYOUTS)}.")
    if spec.load is None:
        raise ValueError(f"Layout {spec.name!r} is export-only; importable: {_names(lambda x: x.load)}.")
    return spec.load(config, state, _target_info(target_config, target_num_hidden_layers))


def export_drafter(drafter, out_dir: str, layout: str) -> str:
    """Writes ``drafter`` in another project's layout (``config.json`` + ``model.safetensors``); returns ``out_dir``."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}. Known layouts: {sorted(LAYOUTS)}.")
    spec = LAYOUTS[layout]
    if spec.save is None:
        raise ValueError(f"Layout {layout!r} is import-only; exportable: {_names(lambda x: x.save)}.")
    if drafter.config.model_type != spec.family:
        raise ValueError(
            f"Layout {layout!r} holds {spec.family} drafters; got a {drafter.config.model_type}. Exportable "
            f"layouts for it: {_names(lambda x: x.save and x.family == drafter.config.model_type)}."
        )
    os.makedirs(out_dir, exist_ok=True)
    spec.save(drafter, out_dir)
    return out_dir


def _names(pred) -> list[str]:
    return sorted(name for name, layout in LAYOUTS.items() if pred(layout))


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3
# ---------------------------------------------------------------------------------------------------------------
_EAGLE3_LAYER_KEYS = (
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


def _is_eagle3_config(config: dict) -> bool:
    arch = config.get("architectures") or []
    return "LlamaForCausalLMEagle3" in arch or ("LlamaForCausalLM" in arch and "draft_vocab_size" in config)


def _detect_eagle3(config: dict, keys: set) -> bool:
    return _is_eagle3_config(config) and "fc.weight" in keys and any(k.startswith("midlayer.") for k in keys)


def _detect_eagle3_vllm(config: dict, keys: set) -> bool:
    return (
        _is_eagle3_config(config)
        and "fc.weight" in keys
        and "layers.0.hidden_norm.weight" in keys
        and "eagle_lm_head.weight" not in keys
    )


def _detect_eagle3_modelopt(config: dict, keys: set) -> bool:
    has_renamed = any(k.startswith(("eagle_lm_head.", "input_embeds_norm.", "eagle_module.")) for k in keys)
    return has_renamed and ("eagle_config" in config or _is_eagle3_config(config))


def _eagle3_feature_ids(config: dict, num_layers: int) -> list[int]:
    nested = config.get("eagle_config") or {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    if ids:  # output-of-layer numbering (0-based) -> hidden_states index
        return [int(i) + 1 for i in ids]
    from .models.eagle3 import Eagle3Config

    return Eagle3Config.default_target_layer_ids(num_layers)


def _rope_theta(config: dict) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    if isinstance(params, dict) and params.get("rope_type") not in (None, "default", "linear"):
        raise ValueError(f"RoPE scaling {params!r} is not supported by hf_specdec's EAGLE-3 drafter yet.")
    return float(config.get("rope_theta", 10000.0))


def _load_eagle3(config: dict, state: dict, target: dict, renames=()) -> object:
    from .models.eagle3 import Eagle3Config, Eagle3ForDrafting

    weights = {}
    for key, value in state.items():
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
        weights[key] = value
    if "hidden_norm.weight" in weights and "midlayer.hidden_norm.weight" not in weights:
        weights["midlayer.hidden_norm.weight"] = weights.pop("hidden_norm.weight")
    weights.pop("embed_tokens.weight", None)  # the target's embeddings are bound at generation time
    if "fc.bias" in weights:
        if torch.count_nonzero(weights["fc.bias"]):
            raise ValueError("This EAGLE-3 checkpoint has a non-zero fc.bias; hf_specdec's fc has no bias.")
        weights.pop("fc.bias")
    required = ["fc.weight", "norm.weight", "lm_head.weight"] + [f"midlayer.{k}" for k in _EAGLE3_LAYER_KEYS]
    missing = [k for k in required if k not in weights]
    if missing:
        raise ValueError(f"The EAGLE-3 checkpoint is missing tensors {missing}; it cannot be imported.")
    unknown = sorted(set(weights) - set(required) - {"d2t", "t2d"})
    if unknown:
        raise ValueError(f"The EAGLE-3 checkpoint has tensors hf_specdec does not know: {unknown[:8]}.")
    if "num_hidden_layers" not in target:
        raise ValueError(
            "Foreign EAGLE-3 configs do not record the target's depth: pass target_config= (hf-specdec convert "
            "--target PATH) or target_num_hidden_layers= (--target-num-layers N)."
        )
    hidden = int(config["hidden_size"])
    vocab = int(config.get("vocab_size", target.get("vocab_size", 0)))
    draft_vocab = int(config.get("draft_vocab_size") or weights["lm_head.weight"].shape[0])
    target_hidden = int(config.get("target_hidden_size") or hidden)
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
    heads = int(config["num_attention_heads"])
    cfg = Eagle3Config(
        target_hidden_size=target_hidden,
        target_num_hidden_layers=target["num_hidden_layers"],
        target_vocab_size=vocab,
        target_model_type=target.get("model_type") or config.get("model_type"),
        target_model_name_or_path=target.get("name_or_path"),
        target_layer_ids=_eagle3_feature_ids(config, target["num_hidden_layers"]),
        draft_vocab_size=draft_vocab,
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        hidden_act=config.get("hidden_act", "silu"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
    )
    model = Eagle3ForDrafting(cfg)
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
    expected = model.state_dict()
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"Tensor {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)} from the config."
            )
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in weights.items()}, strict=True)
    model.check_draft_vocab()
    return model.eval()


def _eagle3_config_dict(drafter, with_t2d: bool) -> dict:
    cfg = drafter.config
    return {
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
        "num_hidden_layers": 1,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in cfg.target_layer_ids],
            "use_aux_hidden_state": True,
        },
        # Provenance, ignored by the loaders.
        "hf_specdec": {"target_num_hidden_layers": cfg.target_num_hidden_layers, "t2d": with_t2d},
    }


def _save_eagle3(drafter, out_dir: str, layer_prefix: str, with_t2d: bool) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for key, value in drafter.state_dict().items():
        if key == "t2d" and not with_t2d:
            continue
        if key.startswith("midlayer."):
            key = layer_prefix + key[len("midlayer.") :]
        tensors[key] = value.detach().cpu().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(_eagle3_config_dict(drafter, with_t2d), fh, indent=2)


register_layout(
    Layout(
        name="eagle3",
        family="eagle3_drafter",
        description="SafeAILab EAGLE / SpecForge EAGLE-3 (midlayer.*, d2t, t2d); what SGLang loads",
        detect=_detect_eagle3,
        load=lambda config, state, target: _load_eagle3(config, state, target),
        save=lambda drafter, out: _save_eagle3(drafter, out, "midlayer.", with_t2d=True),
    )
)
register_layout(
    Layout(
        name="eagle3-vllm",
        family="eagle3_drafter",
        description="EAGLE-3 as vLLM loads it (layers.0.*, d2t, no t2d)",
        detect=_detect_eagle3_vllm,
        load=lambda config, state, target: _load_eagle3(config, state, target, renames=(("layers.0.", "midlayer."),)),
        save=lambda drafter, out: _save_eagle3(drafter, out, "layers.0.", with_t2d=False),
    )
)
register_layout(
    Layout(
        name="eagle3-modelopt",
        family="eagle3_drafter",
        description="NVIDIA ModelOpt EAGLE-3 export (layers.0.*, input_embeds_norm, eagle_lm_head, no t2d)",
        detect=_detect_eagle3_modelopt,
        load=lambda config, state, target: _load_eagle3(config, state, target, renames=_MODELOPT_RENAMES),
    )
)
