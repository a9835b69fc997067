"""EAGLE-1 checkpoint layout: SafeAILab EAGLE ``cnets1.py`` / vLLM ``EagleLlamaForCausalLM``.

``config.json`` is a Llama config of the draft layer (``hidden_size``, ``intermediate_size``, attention shape,
``rms_norm_eps``, ``rope_theta``, ``vocab_size``, ``num_hidden_layers`` 1, ``bias`` for ``fc``, ``qkv_bias`` for
Qwen2-style drafters, whose attention has biases on q/k/v but not on ``o_proj``); the weights are ``fc.weight``
(+ ``fc.bias``) ``2H -> H`` and ``layers.0.*`` (a Llama decoder layer without ``input_layernorm``). The embedding and
LM head are the target's (an ``embed_tokens.weight`` in the file is ignored).
"""

from __future__ import annotations

from ...configuration_utils import decoder_layer_config_dict, decoder_layer_fields
from ...convert import Layout, register_layout, write_checkpoint
from .configuration_eagle1 import Eagle1Config
from .modeling_eagle1 import Eagle1ForDrafting

_LAYER = "layers.0."


def _detect(config: dict, keys: set) -> bool:
    return (
        "fc.weight" in keys
        and any(k.startswith(_LAYER) for k in keys)
        and not any(k.startswith("midlayer.") or k.startswith("layers.0.hidden_norm") for k in keys)
        and f"{_LAYER}input_layernorm.weight" not in keys
        and "d2t" not in keys
    )


def load_eagle1(config: dict, state: dict, target: dict) -> Eagle1ForDrafting:
    if int(config.get("num_hidden_layers", 1)) != 1 or any(k.startswith("layers.1.") for k in state):
        raise ValueError("hf_specdec's EAGLE-1 has one decoder layer; this checkpoint has more.")
    hidden = int(config.get("hidden_size") or state["fc.weight"].shape[0])
    if state["fc.weight"].shape != (hidden, 2 * hidden):
        raise ValueError(
            f"fc.weight has shape {tuple(state['fc.weight'].shape)}; EAGLE-1's is ({hidden}, {2 * hidden})."
        )
    vocab = int(target.get("vocab_size") or config.get("vocab_size"))
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(
            f"This EAGLE-1 drafter reads {hidden}-wide features; the target's are {target['hidden_size']}."
        )
    layer = decoder_layer_fields(config)
    layer["intermediate_size"] = layer["intermediate_size"] or state[f"{_LAYER}mlp.gate_proj.weight"].shape[0]
    cfg = Eagle1Config(
        target_model_name_or_path=target.get("name_or_path"),
        target_model_type=target.get("model_type"),
        target_hidden_size=hidden,
        target_num_hidden_layers=target.get("num_hidden_layers"),
        target_vocab_size=vocab,
        **{**layer, "hidden_size": hidden},
        fc_bias="fc.bias" in state,
        qkv_bias=bool(config.get("qkv_bias", False)),  # SafeAILab's cnets1.py: biases on q/k/v only
    )
    drafter = Eagle1ForDrafting(cfg)
    own = drafter.state_dict()
    wanted = {k: v for k, v in state.items() if k in own}
    missing = sorted(k for k in own if k not in wanted and k not in ("d2t", "t2d"))
    extra = sorted(k for k in state if k not in own and k != "embed_tokens.weight")
    if missing or extra:
        raise ValueError(
            f"Not an EAGLE-1 checkpoint hf_specdec can load: missing {missing[:4]}, unexpected {extra[:4]}."
        )
    drafter.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in wanted.items()}})
    return drafter.eval()


def save_eagle1(drafter: Eagle1ForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    if drafter.reduced_vocabulary:
        raise ValueError(
            "The EAGLE-1 layout drafts over the target's full LM head; this drafter restricts it to "
            f"{cfg.draft_vocab_size} tokens. Train one with the full vocabulary to export it."
        )
    state = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_layer_config_dict(cfg),
        "num_hidden_layers": 1,
        "vocab_size": cfg.target_vocab_size,
        "bias": cfg.fc_bias,
        "qkv_bias": cfg.qkv_bias,
    }
    write_checkpoint(out_dir, config, state)


register_layout(
    Layout(
        name="eagle1",
        family=Eagle1Config.model_type,
        description="SafeAILab EAGLE-1 / vLLM EagleLlamaForCausalLM (fc 2H->H, layers.0.* without input norm)",
        detect=_detect,
        load=load_eagle1,
        save=save_eagle1,
    )
)
