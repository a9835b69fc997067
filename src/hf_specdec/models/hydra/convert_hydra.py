"""zankner/Hydra's checkpoint layout (``hydra-zankner``; the ``ankner/hydra-vicuna-*`` releases).

``config.json`` (Hydra's ``HydraConfig``): ``hydra_num_heads``, ``hydra_num_layers``, ``hydra_head_arch``,
``grounded_heads``, ``hidden_state_offset``, ``base_model_name_or_path``. Weights: ``hydra_lm_head.pt``, the
``torch.save``\\ d state dict of Hydra's head module:

* head ``h``'s first block ``hydra_mlp.{h}.{i}.linear.*`` (``W``, ``b``) and ``.res_connection.*`` (``P`` and its
  bias), on ``[h_t; E(x_{t+1}); ...; E(x_{t+h+1})]``; its other blocks ``hydra_mlp.{h}.{j}.linear.*``. The indices
  count Hydra's ``nn.Sequential`` entries: ``0, 1, 2, ...`` for ``"mlp"`` heads, ``1, 3, 5, ...`` for
  ``"prefix-mlp"`` heads (a dropout sits before each block). Hydra builds the blocks after the first as one module
  repeated (``[ResBlock(d)] * (n - 1)``), so their tensors are equal.
* head ``h``'s vocabulary projection, with a bias: ``hydra_lm_head.{h}.*`` (``"mlp"``), ``hydra_lm_head.{h}.1.*``
  (``"prefix-mlp"``).
* ``"prefix-mlp"`` only: ``prefix_embeding_layer.*`` (sic), a one-layer ``LlamaModel`` over the target's states:
  ``layers.0.*`` (a Llama decoder layer; ``self_attn.rotary_emb.inv_freq`` gives its head size), ``norm.weight``
  (its final norm) and an unused ``embed_tokens.weight`` (never read).

Hydra's heads read the target's ``hidden_states[-(hidden_state_offset + 1)]``, i.e. ``target_layer_ids
[L - hidden_state_offset]``. Its prefix layer rotates with RoPE base 10000 (its Llama code ignores ``rope_theta``)
and takes its norm epsilon, RoPE scaling and activation from the target's config: given ``target_config`` they are
set on import, else when the drafter is bound to its target. What hf_specdec's Hydra cannot run is refused by field:
another ``hydra_head_arch`` (``cross-attn``, ``eagle-attn``), ``grounded_heads`` false.
"""

from __future__ import annotations

import json
import os

import torch

from ...configuration_utils import decoder_layer_defaults, get_text_config
from ...convert import Layout, register_layout
from .configuration_hydra import HydraConfig
from .modeling_hydra import HydraForDrafting

WEIGHTS_NAME = "hydra_lm_head.pt"  # the file Hydra's HydraModel.from_pretrained reads
ARCHS = ("mlp", "prefix-mlp")  # the head architectures hf_specdec's Hydra runs (prefix-mlp: with prefix_layer)
ROPE_THETA = 10000.0  # Hydra's Llama rotary embedding has no rope_theta: always base 10000
_PREFIX = "prefix_embeding_layer."
_LAYER = _PREFIX + "layers.0."
_INV_FREQ = _LAYER + "self_attn.rotary_emb.inv_freq"
_UNUSED = (_PREFIX + "embed_tokens.weight",)  # the prefix LlamaModel's embeddings: it is fed inputs_embeds
_LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
)


def _block(arch: str, head: int, block: int) -> str:
    return f"hydra_mlp.{head}.{2 * block + 1 if arch == 'prefix-mlp' else block}."


def _lm_head(arch: str, head: int) -> str:
    return f"hydra_lm_head.{head}.1." if arch == "prefix-mlp" else f"hydra_lm_head.{head}."


def _names(arch: str, num_heads: int, num_layers: int) -> dict[str, str]:
    """Hydra's tensor names -> hf_specdec's, for a checkpoint of this shape."""
    names = {}
    for h in range(num_heads):
        first = _block(arch, h, 0)
        for kind in ("weight", "bias"):
            names[first + f"linear.{kind}"] = f"heads.{h}.first.{kind}"
            names[first + f"res_connection.{kind}"] = f"heads.{h}.proj.{kind}"
            names[_lm_head(arch, h) + kind] = f"heads.{h}.lm_head.{kind}"
            for j in range(1, num_layers):
                names[_block(arch, h, j) + f"linear.{kind}"] = f"heads.{h}.blocks.{j - 1}.{kind}"
    if arch == "prefix-mlp":
        names.update({_LAYER + key: "prefix." + key for key in _LAYER_KEYS})
        names[_PREFIX + "norm.weight"] = "prefix.norm.weight"
    return names


def _detect(config: dict, keys: set) -> bool:
    # Hydra's config names the head architecture, so heads of other architectures are detected (and refused) too.
    return "hydra_num_heads" in config and (
        "hydra_head_arch" in config or any(k.startswith("hydra_mlp.") for k in keys)
    )


def _read_tensors(config: dict, keys: set) -> set:
    return {k for k in keys if k not in _UNUSED}


def _supported_arch(config: dict) -> str:
    """The head architecture, refused unless hf_specdec's Hydra runs it (defaults as Hydra's ``HydraConfig``)."""
    arch = config.get("hydra_head_arch", "mlp")
    if arch not in ARCHS:
        raise ValueError(
            f"hydra_head_arch={arch!r}: hf_specdec's Hydra runs the MLP heads ({', '.join(map(repr, ARCHS))}; "
            "prefix-mlp with its prefix attention layer), not Hydra's attention heads."
        )
    if not config.get("grounded_heads", False):
        raise ValueError(
            "grounded_heads=false: these Hydra heads read only the target's state, not the draft path's tokens; "
            "hf_specdec's Hydra heads always read the path (Hydra's grounded heads). Ungrounded heads are Medusa "
            "heads with biased projections, which hf_specdec's Medusa does not hold."
        )
    return arch


def _state(config: dict, state: dict, arch: str) -> dict:
    """The checkpoint's tensors under hf_specdec's names, refused where the shape fields disagree with them."""
    num_heads, num_layers = int(config.get("hydra_num_heads", 4)), int(config.get("hydra_num_layers", 1))
    found = sorted({int(k.split(".")[1]) for k in state if k.startswith("hydra_lm_head.")})
    if found != list(range(num_heads)):
        raise ValueError(f"config.json says hydra_num_heads={num_heads}; the weights hold heads {found}.")
    names = _names(arch, num_heads, num_layers)
    missing = sorted(set(names) - set(state))
    unknown = sorted(set(state) - set(names) - {_INV_FREQ, *_UNUSED})
    if missing or unknown:
        raise ValueError(
            f"These weights are not Hydra {arch!r} heads with hydra_num_layers={num_layers} blocks: missing "
            f"{missing[:4]}, not read {unknown[:4]}."
        )
    return {names[k]: v for k, v in state.items() if k in names}


def _prefix_shape(state: dict, target: dict) -> dict:
    """The prefix layer's sizes, from its weights (the head size from Hydra's saved rotary frequencies, else the
    target's config)."""
    q, k = state[_LAYER + "self_attn.q_proj.weight"], state[_LAYER + "self_attn.k_proj.weight"]
    if _INV_FREQ in state:
        head_dim = 2 * state[_INV_FREQ].numel()
    elif target.get("config") is not None:
        facts = decoder_layer_defaults(target["config"])
        head_dim = facts.get("head_dim") or facts["hidden_size"] // facts["num_attention_heads"]
    else:
        raise ValueError(
            f"hydra_head_arch='prefix-mlp': the weights lack {_INV_FREQ}, so the prefix layer's head size is unknown; "
            "pass the target's config (target_config=)."
        )
    return {
        "prefix_layer": True,
        "prefix_norm": True,
        "intermediate_size": state[_LAYER + "mlp.gate_proj.weight"].shape[0],
        "num_attention_heads": q.shape[0] // head_dim,
        "num_key_value_heads": k.shape[0] // head_dim,
        "head_dim": head_dim,
        "rope_theta": ROPE_THETA,
    }


def _feature_layer(config: dict, target: dict) -> dict:
    """``target_layer_ids`` from ``hidden_state_offset`` (resolved on binding when the target's depth is unknown)."""
    offset, depth = int(config.get("hidden_state_offset", 0)), target.get("num_hidden_layers")
    if depth is None:
        if offset:
            raise ValueError(
                f"hidden_state_offset={offset}: the heads read the state {offset} layers before the target's last, "
                "so the target's depth is needed; pass target_config= (or target_num_hidden_layers=)."
            )
        return {}
    return {"target_num_hidden_layers": depth, "target_layer_ids": [depth - offset]}


def load_zankner(config: dict, state: dict, target: dict) -> HydraForDrafting:
    arch = _supported_arch(config)
    mine = _state(config, state, arch)
    vocab, hidden = mine["heads.0.lm_head.weight"].shape
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(f"The Hydra heads read a {hidden}-wide hidden state; the target's is {target['hidden_size']}.")
    if target.get("vocab_size") not in (None, vocab):
        raise ValueError(f"The Hydra heads cover a {vocab}-token vocabulary; the target's is {target['vocab_size']}.")
    prefix = _prefix_shape(state, target) if arch == "prefix-mlp" else {}
    if prefix and target.get("num_hidden_layers") is not None and target.get("config") is None:
        raise ValueError(
            "hydra_head_arch='prefix-mlp': the prefix layer takes its norm epsilon and RoPE scaling from the target's "
            "config; pass target_config= rather than target_num_hidden_layers=."
        )
    biases = [name for name in mine if name.endswith((".proj.bias", ".lm_head.bias")) and name.startswith("heads.")]
    head_bias = any(bool(mine[name].any()) for name in biases)  # zero biases are no biases
    cfg = HydraConfig(
        target_model_name_or_path=target.get("name_or_path") or config.get("base_model_name_or_path"),
        target_model_type=target.get("model_type"),
        target_hidden_size=hidden,
        target_vocab_size=vocab,
        num_heads=int(config.get("hydra_num_heads", 4)),
        num_layers=int(config.get("hydra_num_layers", 1)),
        head_bias=head_bias,
        **_feature_layer(config, target),
        **prefix,
    )
    drafter = HydraForDrafting(cfg)
    own = drafter.state_dict()
    mine = {name: value for name, value in mine.items() if name in own}  # zero biases dropped with head_bias=False
    wrong = sorted(name for name, value in mine.items() if value.shape != own[name].shape)
    if wrong:
        raise ValueError(f"Hydra tensors of unexpected shape (for hydra_num_heads / hidden size): {wrong[:4]}.")
    drafter.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in mine.items()}})
    if prefix and target.get("config") is not None:
        drafter.take_prefix_facts(target["config"])
    return drafter.eval()


def _exportable(drafter: HydraForDrafting, target) -> None:
    """Refuses, by field, what Hydra's heads cannot hold."""
    cfg = drafter.config
    if drafter.reduced_vocabulary:
        raise ValueError(
            f"Hydra heads cover the full vocabulary; this drafter's cover {cfg.draft_vocab_size} of "
            f"{cfg.target_vocab_size} tokens (draft_vocab_size)."
        )
    if cfg.num_layers > 2 and any(
        not torch.equal(block.weight, head.blocks[0].weight) or not torch.equal(block.bias, head.blocks[0].bias)
        for head in drafter.heads
        for block in head.blocks
    ):
        raise ValueError(
            f"num_layers={cfg.num_layers}: Hydra's heads repeat one block after the first ([ResBlock] * (n - 1)), so "
            "they cannot hold this drafter's distinct blocks."
        )
    if cfg.prefix_layer and not cfg.prefix_norm:
        raise ValueError(
            "prefix_norm=False: Hydra's prefix layer is a one-layer LlamaModel, which ends with a norm; this drafter's "
            "prefix layer has none."
        )
    if cfg.prefix_layer and (cfg.attention_bias or float(cfg.rope_theta) != ROPE_THETA):
        raise ValueError(
            f"attention_bias={cfg.attention_bias}, rope_theta={cfg.rope_theta}: Hydra's prefix layer has no attention "
            f"biases and rotates with base {ROPE_THETA:g}."
        )
    wrong = (
        drafter.prefix_shape_mismatch(get_text_config(target.config)) if cfg.prefix_layer and target is not None else []
    )
    if wrong:
        raise ValueError(
            f"Hydra builds its prefix layer as one of the target's layers; this drafter's differs: {wrong}."
        )


def _hidden_state_offset(cfg: HydraConfig) -> int:
    if cfg.target_layer_ids is None or cfg.target_num_hidden_layers is None:
        return 0  # the family default: the final state
    return int(cfg.target_num_hidden_layers) - int(cfg.target_layer_ids[0])


def save_zankner(drafter: HydraForDrafting, out_dir: str, target=None) -> None:
    _exportable(drafter, target)
    cfg = drafter.config
    arch = "prefix-mlp" if cfg.prefix_layer else "mlp"
    own = drafter.state_dict()
    state = {}
    for theirs, mine in _names(arch, cfg.num_heads, cfg.num_layers).items():
        value = own.get(mine)
        if value is None:  # a bias this drafter does not have (head_bias=False): Hydra's is zero
            weight = own[mine.removesuffix(".bias") + ".weight"]
            value = torch.zeros(weight.shape[0], dtype=weight.dtype)
        state[theirs] = value.detach().cpu().contiguous().clone()
    if cfg.prefix_layer:
        state[_INV_FREQ] = 1.0 / ROPE_THETA ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    config = {
        "hydra_num_heads": cfg.num_heads,
        "hydra_num_layers": cfg.num_layers,
        "hydra_head_arch": arch,
        "grounded_heads": True,
        "hidden_state_offset": _hidden_state_offset(cfg),
        "base_model_name_or_path": cfg.target_model_name_or_path,
    }
    os.makedirs(out_dir, exist_ok=True)
    torch.save(state, os.path.join(out_dir, WEIGHTS_NAME))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


register_layout(
    Layout(
        name="hydra-zankner",
        family=HydraConfig.model_type,
        description="zankner/Hydra heads (hydra_lm_head.pt: hydra_mlp.{h}.*, hydra_lm_head.{h}.*, prefix_embeding_layer"
        ".*; hydra_head_arch mlp / prefix-mlp, grounded)",
        detect=_detect,
        load=load_zankner,
        save=save_zankner,
        needed_tensors=_read_tensors,
    )
)
