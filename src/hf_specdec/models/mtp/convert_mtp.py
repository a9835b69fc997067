"""MTP checkpoint layout: MTP layers stored after a target's main layers, as DeepSeek-V3-style checkpoints ship them
(and vLLM's ``DeepSeekMTP`` reads them).

``config.json`` is the target's (``num_hidden_layers`` ``L``, ``num_nextn_predict_layers`` or ``num_mtp_layers`` ``D``,
attention shape, ``rms_norm_eps``, ``rope_theta``, ...); module ``k`` is ``model.layers.{L + k}.``: ``enorm``,
``hnorm``, ``eh_proj`` (``2H -> H``, no bias), ``shared_head.norm`` and a decoder layer (``input_layernorm``,
``self_attn.{q,k,v,o}_proj``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``). The embedding and the
shared head (``embed_tokens``, ``shared_head.head``) are the target's and are ignored on import, never written on
export. So a checkpoint of a target that ships dense MTP layers imports as its own drafter
(``hf-specdec convert --from mtp-layers <target folder>``); MLA attention and mixture-of-experts MLPs (DeepSeek-V3's
own layers) have no place in hf_specdec's dense module and are refused.
"""

from __future__ import annotations

import re

from ...configuration_utils import decoder_layer_config_dict, decoder_layer_fields
from ...convert import Layout, register_layout, write_checkpoint
from ...speculators_format import register_speculators_refusal
from .configuration_mtp import MtpConfig
from .modeling_mtp import MtpForDrafting

# layout name (inside model.layers.{L + k}.) -> hf_specdec name (inside layers.{k}.)
_RENAME = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "post_norm.weight",
    "input_layernorm.weight": "mtp_block.input_layernorm.weight",
    "post_attention_layernorm.weight": "mtp_block.post_attention_layernorm.weight",
}
for _name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    for _kind in ("weight", "bias"):
        _RENAME[f"self_attn.{_name}.{_kind}"] = f"mtp_block.self_attn.{_name}.{_kind}"
for _name in ("gate_proj", "up_proj", "down_proj"):
    _RENAME[f"mlp.{_name}.weight"] = f"mtp_block.mlp.{_name}.weight"
_IGNORED = ("shared_head.head.weight", "embed_tokens.weight")


def _num_modules(config: dict) -> int:
    for key in ("num_nextn_predict_layers", "num_mtp_layers"):
        if config.get(key):
            return int(config[key])
    return 0


def _detect(config: dict, keys: set) -> bool:
    layers = config.get("num_hidden_layers")
    return bool(_num_modules(config)) and layers is not None and f"model.layers.{int(layers)}.eh_proj.weight" in keys


def _mtp_tensors(config: dict, keys: set) -> set:
    """The MTP modules' tensors: a target checkpoint's other weights (its own layers) are never read."""
    depth = int(config["num_hidden_layers"])
    prefixes = tuple(f"model.layers.{depth + k}." for k in range(_num_modules(config)))
    return {k for k in keys if k.startswith(prefixes)}


def load_mtp_layers(config: dict, state: dict, target: dict) -> MtpForDrafting:
    depth, num = int(config["num_hidden_layers"]), _num_modules(config)
    if not num:
        raise ValueError("This config declares no MTP layers (num_nextn_predict_layers / num_mtp_layers).")
    if target.get("num_hidden_layers") not in (None, depth):
        raise ValueError(
            f"These MTP layers follow a {depth}-layer target; the target has {target['num_hidden_layers']} layers."
        )
    own: dict = {}
    for k in range(num):
        prefix = f"model.layers.{depth + k}."
        mine = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
        if not mine:
            raise ValueError(f"MTP module {k} ({prefix}*) is missing from the checkpoint.")
        exotic = sorted(n for n in mine if n not in _RENAME and n not in _IGNORED)
        if exotic:
            kind = "mixture-of-experts MLP" if any("expert" in n or n.startswith("mlp.gate.") for n in exotic) else ""
            kind = kind or ("MLA attention" if any(re.search(r"(q_a|kv_a|q_b|kv_b)_", n) for n in exotic) else "")
            raise ValueError(
                f"MTP module {k} has weights hf_specdec's dense MTP module cannot hold ({kind or 'unknown'}: "
                f"{exotic[:4]}). Only dense Llama-style MTP layers import; train an MTP drafter for this target "
                "instead (hf-specdec train --drafter mtp)."
            )
        own.update({f"layers.{k}.{_RENAME[n]}": t for n, t in mine.items() if n in _RENAME})
    hidden = int(config["hidden_size"])
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(f"These MTP layers are {hidden} wide; the target's states are {target['hidden_size']}.")
    cfg = MtpConfig(
        target_model_name_or_path=target.get("name_or_path"),
        target_model_type=target.get("model_type") or config.get("model_type"),
        target_hidden_size=hidden,
        target_num_hidden_layers=depth,
        target_vocab_size=int(target.get("vocab_size") or config["vocab_size"]),
        **{**decoder_layer_fields(config), "attention_bias": any(n.endswith("self_attn.q_proj.bias") for n in own)},
        num_mtp_modules=num,
        hidden_states_first=bool(config.get("mtp_hidden_states_first", False)),
        use_post_norm=any(n.endswith("post_norm.weight") for n in own),
    )
    drafter = MtpForDrafting(cfg)
    mine = drafter.state_dict()
    missing = sorted(k for k in mine if k not in own and k not in ("d2t", "t2d"))
    if missing:
        raise ValueError(f"Not a complete MTP checkpoint: missing {missing[:4]}.")
    drafter.load_state_dict({**mine, **{k: v.to(mine[k].dtype) for k, v in own.items()}})
    return drafter.eval()


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


register_speculators_refusal(
    "mtp",
    "speculators builds its MTP layer from the target's own decoder layer class (Qwen3 with q_norm / k_norm, or the "
    "hybrid Qwen3-Next / Qwen3.5 layers) with hidden_layernorm / token_layernorm / input_proj / final_layernorm, which "
    "hf_specdec's MTP module (a dense Llama-style layer) does not reproduce; a target with its own MTP layers runs "
    "them with transformers' own MTP support (use_mtp)",
)
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
