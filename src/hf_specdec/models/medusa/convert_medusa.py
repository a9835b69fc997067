"""Medusa checkpoint layouts of other projects: FasterDecoding/Medusa heads and vLLM's Medusa model.

* ``medusa-fasterdecoding``: ``config.json`` with ``medusa_num_heads`` / ``medusa_num_layers`` /
  ``base_model_name_or_path``; weights ``{h}.{l}.linear.weight`` / ``.bias`` for the residual blocks and
  ``{h}.{num_layers}.weight`` for each head's vocabulary projection (full vocabulary).
* ``medusa-vllm``: vLLM's ``MedusaModel``: ``config.json`` with ``num_heads``, ``num_hidden_layers`` (blocks per
  head), ``hidden_size``, ``vocab_size``, ``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``; weights
  ``blocks.{h}.layers.{l}.weight`` (/ ``.bias``), ``lm_heads.{h}.weight`` and, with a truncated vocabulary,
  ``token_map`` (target id of each draft id). A ``medusa_heads.`` prefix is accepted on import.
* ``medusa-full-model``: a Medusa-2 model FasterDecoding ships whole (``MedusaModelLlama`` / ``MedusaModelMistral``,
  e.g. ``FasterDecoding/medusa-1.0-vicuna-7b-v1.5``): the target's ``config.json`` plus ``medusa_num_heads`` /
  ``medusa_num_layers``; the target's own ``model.*`` / ``lm_head.*`` next to ``medusa_head.{h}.{l}.linear.*`` and
  ``medusa_head.{h}.{num_layers}.weight``. Only the heads are read (import only); the checkpoint itself is the
  target the heads were trained with (load it with ``AutoModelForCausalLM``, which skips ``medusa_head.*``).

FasterDecoding's configs may undercount the heads (``FasterDecoding/medusa-vicuna-7b-v1.3`` says
``medusa_num_heads: 2`` and its ``medusa_lm_head.pt`` holds 5; Medusa's loader forces 5): the weights decide, with a
warning naming both numbers.
"""

from __future__ import annotations

import re
import warnings

import torch

from ...convert import Layout, register_layout, write_checkpoint
from .configuration_medusa import MedusaConfig
from .modeling_medusa import MedusaForDrafting

_FD_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_FD_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_HEAD = re.compile(r"^lm_heads\.(\d+)\.weight$")
_FULL_PREFIX = "medusa_head."  # FasterDecoding's full Medusa-2 models: the heads next to the target's weights
_FULL_BLOCK = re.compile(r"^medusa_head\.\d+\.\d+\.linear\.weight$")


def _strip(state: dict) -> dict:
    return {k[len("medusa_heads.") :] if k.startswith("medusa_heads.") else k: v for k, v in state.items()}


def _detect_fasterdecoding(config: dict, keys: set) -> bool:
    return "medusa_num_heads" in config and any(_FD_BLOCK.match(k) for k in keys)


def _detect_full_model(config: dict, keys: set) -> bool:
    return "medusa_num_heads" in config and any(_FULL_BLOCK.match(k) for k in keys)


def _head_tensors(config: dict, keys: set) -> set:
    """The heads' tensors: the target's own weights in the same checkpoint are never read."""
    return {k for k in keys if k.startswith(_FULL_PREFIX)}


def _detect_vllm(config: dict, keys: set) -> bool:
    keys = {k[len("medusa_heads.") :] if k.startswith("medusa_heads.") else k for k in keys}
    return any(_VLLM_HEAD.match(k) for k in keys) and str(config.get("model_type", "")) in ("medusa", "")


def _build(heads: int, layers: int, hidden: int, vocab: int, draft_vocab: int, bias: bool, target: dict, name):
    if target.get("hidden_size") not in (None, hidden):
        raise ValueError(
            f"The Medusa heads read a {hidden}-wide hidden state; the target's is {target['hidden_size']}."
        )
    if target.get("vocab_size") not in (None, vocab):
        raise ValueError(f"The Medusa heads cover a {vocab}-token vocabulary; the target's is {target['vocab_size']}.")
    config = MedusaConfig(
        target_model_name_or_path=target.get("name_or_path") or name,
        target_model_type=target.get("model_type"),
        target_hidden_size=hidden,
        target_num_hidden_layers=target.get("num_hidden_layers"),
        target_vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        num_heads=heads,
        num_layers=layers,
        residual_bias=bias,
    )
    return MedusaForDrafting(config)


def _load_into(drafter: MedusaForDrafting, blocks: dict, heads: dict, token_map=None) -> MedusaForDrafting:
    sd = {}
    for (h, layer, kind), value in blocks.items():
        sd[f"heads.{h}.blocks.{layer}.linear.{kind}"] = value
    for h, value in heads.items():
        sd[f"heads.{h}.lm_head.weight"] = value
    own = drafter.state_dict()
    missing = sorted(k for k in own if k.startswith("heads.") and k not in sd)
    if missing:
        raise ValueError(f"The Medusa checkpoint lacks {missing[:4]}; it is incomplete or in another layout.")
    drafter.load_state_dict({**own, **{k: v.to(own[k].dtype) for k, v in sd.items()}})
    if token_map is not None:
        drafter.set_draft_vocab(token_map.long())
        if not torch.equal(drafter.draft_token_ids.cpu(), token_map.long().cpu()):
            raise ValueError("token_map must list the draft vocabulary's target ids in increasing order.")
    drafter.check_draft_vocab()
    return drafter.eval()


def _heads_in_weights(config: dict, found: list[int]) -> int:
    """The head count: the weights', warning when ``medusa_num_heads`` says otherwise (FasterDecoding's flagship
    configs undercount, and its own loader then uses the weights' count)."""
    if not found or found != list(range(len(found))):
        raise ValueError(f"The Medusa heads in the weights are numbered {found}; expected 0, 1, ... without gaps.")
    declared = config.get("medusa_num_heads")
    if declared is not None and int(declared) != len(found):
        warnings.warn(
            f"config.json says medusa_num_heads={declared}, but the weights hold {len(found)} heads; using the "
            f"{len(found)} heads of the weights (FasterDecoding's Medusa loader does the same).",
            stacklevel=2,
        )
    return len(found)


def load_fasterdecoding(config: dict, state: dict, target: dict) -> MedusaForDrafting:
    state = _strip(state)
    blocks, heads = {}, {}
    for key, value in state.items():
        if m := _FD_BLOCK.match(key):
            blocks[(int(m[1]), int(m[2]), m[3])] = value
        elif m := _FD_HEAD.match(key):
            heads[(int(m[1]), int(m[2]))] = value
    num_heads = _heads_in_weights(config, sorted({h for h, _, _ in blocks} | {h for h, _ in heads}))
    num_layers = int(config.get("medusa_num_layers", 1))
    proj = {h: v for (h, layer), v in heads.items() if layer == num_layers}
    if not proj and str(config.get("version")) == "2":
        raise ValueError(
            "This Medusa checkpoint (config version '2') has heads without their own vocabulary projection: they "
            "share the target's LM head. hf_specdec's Medusa heads each have one; copy the target's LM head into "
            f"every '{{h}}.{num_layers}.weight' first."
        )
    if len(proj) != num_heads:
        raise ValueError(
            f"Each head needs its projection '{{h}}.{num_layers}.weight' (medusa_num_layers={num_layers}); found "
            f"{sorted(proj)}."
        )
    vocab, hidden = proj[0].shape
    bias = any(kind == "bias" for _, _, kind in blocks)
    drafter = _build(num_heads, num_layers, hidden, vocab, vocab, bias, target, config.get("base_model_name_or_path"))
    return _load_into(drafter, blocks, proj)


def load_full_model(config: dict, state: dict, target: dict) -> MedusaForDrafting:
    """The heads of a full Medusa-2 model; its ``config.json`` is the target's, so it gives the target's facts."""
    own = {
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "model_type": config.get("model_type"),
    }
    target = {**{k: v for k, v in own.items() if v is not None}, **target}
    heads = {k[len(_FULL_PREFIX) :]: v for k, v in state.items() if k.startswith(_FULL_PREFIX)}
    return load_fasterdecoding(config, heads, target)


def load_vllm(config: dict, state: dict, target: dict) -> MedusaForDrafting:
    state = _strip(state)
    blocks = {(int(m[1]), int(m[2]), m[3]): v for k, v in state.items() if (m := _VLLM_BLOCK.match(k))}
    heads = {int(m[1]): v for k, v in state.items() if (m := _VLLM_HEAD.match(k))}
    if config.get("original_lm_head"):
        raise ValueError(
            "This vLLM Medusa checkpoint shares the target's LM head across heads (original_lm_head); hf_specdec's "
            "Medusa heads each have a projection. Copy the target's LM head into every lm_heads.{h} first."
        )
    num_heads = int(config.get("num_heads") or len(heads))
    if sorted(heads) != list(range(num_heads)):
        raise ValueError(f"config.json says num_heads={num_heads}, the weights hold lm_heads {sorted(heads)}.")
    num_layers = int(config.get("num_hidden_layers", 1))
    draft_vocab, hidden = heads[0].shape
    vocab = int(config.get("vocab_size") or draft_vocab)
    token_map = state.get("token_map")
    if draft_vocab < vocab and token_map is None:
        raise ValueError(
            f"The heads cover {draft_vocab} of {vocab} tokens but the checkpoint has no token_map saying which."
        )
    bias = bool(config.get("medusa_fc_bias", any(kind == "bias" for _, _, kind in blocks)))
    drafter = _build(num_heads, num_layers, hidden, vocab, draft_vocab, bias, target, None)
    return _load_into(drafter, blocks, heads, token_map if draft_vocab < vocab else None)


def save_fasterdecoding(drafter: MedusaForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    if drafter.reduced_vocabulary:
        raise ValueError(
            f"FasterDecoding Medusa heads cover the full vocabulary; this drafter's heads cover {cfg.draft_vocab_size} "
            f"of {cfg.target_vocab_size} tokens. Export it with --to medusa-vllm (token_map), or train one with the "
            "full vocabulary."
        )
    if not cfg.residual_bias:
        raise ValueError("FasterDecoding Medusa blocks have a bias; this drafter's have none (residual_bias=False).")
    state = {}
    for h, head in enumerate(drafter.heads):
        for layer, block in enumerate(head.blocks):
            state[f"{h}.{layer}.linear.weight"] = block.linear.weight
            state[f"{h}.{layer}.linear.bias"] = block.linear.bias
        state[f"{h}.{cfg.num_layers}.weight"] = head.lm_head.weight
    config = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": cfg.target_model_name_or_path,
    }
    # the file name Medusa's training script writes and TGI / TensorRT-LLM read
    write_checkpoint(out_dir, config, state, weights_name="medusa_lm_head.safetensors")


def save_vllm(drafter: MedusaForDrafting, out_dir: str, target=None) -> None:
    cfg = drafter.config
    state = {}
    for h, head in enumerate(drafter.heads):
        for layer, block in enumerate(head.blocks):
            state[f"blocks.{h}.layers.{layer}.weight"] = block.linear.weight
            if block.linear.bias is not None:
                state[f"blocks.{h}.layers.{layer}.bias"] = block.linear.bias
        state[f"lm_heads.{h}.weight"] = head.lm_head.weight
    if drafter.reduced_vocabulary:
        state["token_map"] = drafter.draft_token_ids
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.target_vocab_size,
        "truncated_vocab_size": cfg.draft_vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "medusa_fc_bias": cfg.residual_bias,
        "original_lm_head": False,
        "logit_scale": 1.0,
    }
    write_checkpoint(out_dir, config, state)


register_layout(
    Layout(
        name="medusa-fasterdecoding",
        family=MedusaConfig.model_type,
        description="FasterDecoding/Medusa heads ({h}.{l}.linear.*, {h}.{L}.weight; medusa_num_heads)",
        detect=_detect_fasterdecoding,
        load=load_fasterdecoding,
        save=save_fasterdecoding,
    )
)
register_layout(
    Layout(
        name="medusa-full-model",
        family=MedusaConfig.model_type,
        description="FasterDecoding's full Medusa-2 models (the target's model.* / lm_head.* and medusa_head.*): "
        "imports the heads only, reading no target weight",
        detect=_detect_full_model,
        load=load_full_model,
        needed_tensors=_head_tensors,
    )
)
register_layout(
    Layout(
        name="medusa-vllm",
        family=MedusaConfig.model_type,
        description="vLLM MedusaModel (blocks.{h}.layers.{l}.*, lm_heads.{h}.weight, token_map)",
        detect=_detect_vllm,
        load=load_vllm,
        save=save_vllm,
    )
)
