"""DFlash and DSpark in the speculators format (vllm-project/speculators ``DFlashSpeculatorConfig`` /
``DSparkSpeculatorConfig``, what vLLM serves natively): layouts ``dflash-speculators`` and ``dspark-speculators``,
import and export.

``config.json``: the shared speculators envelope (:mod:`hf_specdec.speculators_format`) with
``speculators_model_type`` ``"dflash"`` / ``"dspark"``, ``architectures`` ``["DFlashSpeculator"]`` /
``["DSparkSpeculator"]``, a ``transformer_layer_config`` (speculators builds Qwen3-style layers with ``q_norm`` /
``k_norm`` from it whatever its ``model_type``; Qwen3's config class when it names none), and the fields
(speculators' defaults when absent): ``draft_vocab_size`` (32000), ``block_size`` (8), ``target_hidden_size``,
``aux_hidden_state_layer_ids`` (required; ``output_hidden_states`` indices, z-lab's layer id + 1, as hf_specdec's
``target_layer_ids``), ``mask_token_id`` (required), ``sliding_window_non_causal`` (false) and
``sample_from_anchor`` (DFlash false: slot ``i >= 1`` predicts the token at its position, ``block_size - 1`` drafts;
DSpark true: the anchor slot drafts too, ``block_size`` drafts, as hf_specdec's DSpark). DSpark adds
``markov_rank`` (256), ``markov_head_type`` (vanilla), ``enable_confidence_head`` and ``confidence_head_with_markov``
(true).

Tensors: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``, for DSpark ``markov_head.markov_w{1,2}`` and
``confidence_head.proj``, ``d2t`` / ``t2d`` when the draft vocabulary is reduced, and copies of the target's
``embed_tokens`` and LM head (``lm_head``, the draft vocabulary's rows; speculators keeps it frozen). The copies are
ignored on import (hf_specdec borrows the target's); exports write them when the target is at hand.

Sliding-window layers are refused both ways: speculators bounds a block's context by the window from the *anchor*,
hf_specdec's by the window from each query.
"""

from __future__ import annotations

from ...convert import Layout, register_layout, write_checkpoint
from ...speculators_format import (
    check_speculators_keys,
    layer_config_dict,
    read_draft_vocab_size,
    read_speculators_config,
    refuse_field,
    speculators_config_dict,
    speculators_type,
    target_embedding,
)
from .configuration_dflash import DFlashConfig
from .configuration_dspark import DSparkConfig
from .convert_dflash import check_dspark_heads, check_vocabulary_resolved, load_dflash_backbone
from .modeling_dflash import DFlashForDrafting
from .modeling_dspark import DSparkForDrafting

__all__ = ["load_dflash_speculators", "load_dspark_speculators", "save_dflash_speculators", "save_dspark_speculators"]

_DFLASH_FIELDS = {
    "draft_vocab_size",
    "block_size",
    "target_hidden_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sliding_window_non_causal",
    "sample_from_anchor",
}
_DSPARK_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def _refuse_sliding(layer_types, exporting: bool = False) -> None:
    if "sliding_attention" in list(layer_types or []) and exporting:
        raise ValueError(
            f"This drafter has sliding-window layers (layer_types={list(layer_types)}), which the speculators layout "
            "cannot hold: speculators bounds a sliding layer's context by the window from the block's anchor, "
            "hf_specdec's sliding layers by the window from each query. Export it in another layout "
            "(hf-specdec convert --list), or train one with full-attention layers only."
        )
    if "sliding_attention" in list(layer_types or []):
        raise refuse_field(
            "transformer_layer_config.layer_types",
            list(layer_types),
            "speculators bounds a sliding layer's context by the window from the block's anchor, hf_specdec's "
            "sliding layers by the window from each query",
            "Use full-attention layers only.",
        )


def _block_fields(config: dict, layer: dict, anchor_drafts: bool) -> dict:
    """``block_size``, ``mask_token_id`` and the target layers (z-lab layer ids, as :func:`load_dflash_backbone` reads them)."""
    if bool(config.get("sample_from_anchor", anchor_drafts)) != anchor_drafts:
        raise refuse_field(
            "sample_from_anchor",
            config["sample_from_anchor"],
            f"this family's anchor slot {'drafts the next token' if anchor_drafts else 'predicts nothing'}",
            "Import it with the family whose anchor slot does what this checkpoint's does (DFlash: false, DSpark: "
            "true).",
        )
    for key in ("mask_token_id", "aux_hidden_state_layer_ids"):
        if config.get(key) is None:
            raise refuse_field(key, None, "it is required (speculators and vLLM need it too)", "Add it to config.json.")
    hidden = int(layer["hidden_size"])
    if config.get("target_hidden_size") not in (None, hidden):
        raise refuse_field(
            "target_hidden_size",
            config["target_hidden_size"],
            f"the layers are {hidden} wide and read target states of their own width",
            "Import a drafter made for this target's width.",
        )
    aux = [int(i) for i in config["aux_hidden_state_layer_ids"]]
    return {"block_size": int(config.get("block_size", 8)), "mask_token_id": int(config["mask_token_id"]),
            "target_layer_ids": [i - 1 for i in aux]}  # fmt: skip


def _load_speculators(config, state, target, fields, anchor_drafts, config_class, model_class, **extra):
    """Builds the drafter from a speculators DFlash-backbone checkpoint (the shared part of both types)."""
    check_speculators_keys(config, fields)
    header = read_speculators_config(config, default_layer_type="qwen3")
    layer = header.layer
    _refuse_sliding(layer.get("layer_types"))
    block = _block_fields(config, layer, anchor_drafts)
    vocab = int(layer["vocab_size"])
    if target.get("vocab_size") not in (None, vocab):
        raise ValueError(
            f"This drafter's target vocabulary (transformer_layer_config.vocab_size {vocab}) differs from the "
            f"target's ({target['vocab_size']}): it was trained for another target."
        )
    draft_vocab = read_draft_vocab_size(config, vocab, state)
    drafts = block["block_size"] - (0 if anchor_drafts else 1)
    if not 1 <= header.speculative_tokens <= drafts:
        raise refuse_field(
            "speculators_config.proposal_methods[].speculative_tokens",
            header.speculative_tokens,
            f"one block of {block['block_size']} drafts {drafts} tokens",
            f"Set it to at most {drafts}.",
        )
    flat = {**layer, "sliding_window": None, "num_target_layers": header.target_num_hidden_layers}
    weights = {k: v for k, v in state.items() if not k.startswith("verifier_")}  # training-only copies, if any
    named = {**target, "name_or_path": target.get("name_or_path") or header.verifier["name_or_path"]}
    drafter = load_dflash_backbone(flat, weights, named, block, config_class, model_class,
                                   draft_vocab_size=draft_vocab, num_draft_tokens=header.speculative_tokens, **extra)  # fmt: skip
    drafter.check_draft_vocab()
    return drafter


def load_dflash_speculators(config: dict, state: dict, target: dict) -> DFlashForDrafting:
    """A speculators ``dflash`` checkpoint as a :class:`DFlashForDrafting` (see the module docstring)."""
    return _load_speculators(config, state, target, _DFLASH_FIELDS, False, DFlashConfig, DFlashForDrafting)


def load_dspark_speculators(config: dict, state: dict, target: dict) -> DSparkForDrafting:
    """A speculators ``dspark`` checkpoint as a :class:`DSparkForDrafting` (see the module docstring)."""
    rank = check_dspark_heads(config, default_rank=256)  # speculators' defaults for absent head fields
    fields = _DFLASH_FIELDS | set(_DSPARK_HEADS)
    return _load_speculators(config, state, target, fields, True, DSparkConfig, DSparkForDrafting, markov_rank=rank)


# -- export ------------------------------------------------------------------------------------------------------------
def _target_head(drafter, target) -> dict:
    """The target's LM head rows of the draft vocabulary (what the drafter borrows), as ``lm_head.weight``."""
    head = target.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("The target's LM head has a bias; speculators' lm_head has none.")
    weight = head.weight[drafter.draft_token_ids.to(head.weight.device)] if drafter.reduced_vocabulary else head.weight
    return {"lm_head.weight": weight.detach().to(drafter.dtype)}


def _tensors(drafter, target) -> dict:
    maps = ("d2t", "t2d") if drafter.reduced_vocabulary else ()  # speculators has no maps for a full vocabulary
    own = {k: v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d") or k in maps}
    if target is None:
        return own
    return {**own, **target_embedding(drafter, target), **_target_head(drafter, target)}


def _check_exportable(drafter, target) -> None:
    cfg = drafter.config
    check_vocabulary_resolved(drafter)
    _refuse_sliding(cfg.layer_types, exporting=True)
    if cfg.target_layer_ids is None:
        raise ValueError("The drafter's target layers are unresolved: bind it to its target first (bind_target).")
    depth = cfg.target_num_hidden_layers
    if depth is not None and max(cfg.target_layer_ids) >= int(depth):
        raise ValueError(
            f"This drafter reads output_hidden_states{list(cfg.target_layer_ids)}; vLLM collects the inputs of the "
            f"target's layers 0..{int(depth) - 1} only (index {depth} is the final, normed state)."
        )
    if drafter.reduced_vocabulary and target is None:
        raise ValueError(
            "A drafter with a reduced draft vocabulary needs its own lm_head in the speculators layout (vLLM would "
            "use the target's whole head otherwise): pass the target (export_drafter(..., target=...), --target)."
        )


def _save_speculators(drafter, out_dir: str, target, kind: str, anchor_drafts: bool, heads: dict) -> None:
    _check_exportable(drafter, target)
    cfg = drafter.config
    fields = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.target_hidden_size,
        "aux_hidden_state_layer_ids": [int(i) for i in cfg.target_layer_ids],
        "mask_token_id": int(cfg.mask_token_id),
        "sliding_window_non_causal": False,  # no sliding layers (refused above); written as speculators' default
        "sample_from_anchor": anchor_drafts,  # always written: it decides which slots draft
        **heads,
    }
    layer = layer_config_dict("qwen3", cfg, cfg.num_hidden_layers, layer_types=list(cfg.layer_types),
                              use_sliding_window=False)  # fmt: skip
    architecture = {"dflash": "DFlashSpeculator", "dspark": "DSparkSpeculator"}[kind]
    config = speculators_config_dict(kind, [architecture], layer, fields, drafter, target)
    write_checkpoint(out_dir, config, _tensors(drafter, target))


def save_dflash_speculators(drafter: DFlashForDrafting, out_dir: str, target=None) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the speculators DFlash layout."""
    _save_speculators(drafter, out_dir, target, "dflash", False, {})


def save_dspark_speculators(drafter: DSparkForDrafting, out_dir: str, target=None) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the speculators DSpark layout."""
    heads = {"markov_rank": drafter.config.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True}  # fmt: skip
    _save_speculators(drafter, out_dir, target, "dspark", True, heads)


register_layout(
    Layout(
        name="dflash-speculators",
        family=DFlashConfig.model_type,
        description="vllm-project/speculators DFlash (speculators_model_type dflash), vLLM's native format",
        detect=lambda config, keys: speculators_type(config) == "dflash",
        load=load_dflash_speculators,
        save=save_dflash_speculators,
    )
)
register_layout(
    Layout(
        name="dspark-speculators",
        family=DSparkConfig.model_type,
        description="vllm-project/speculators DSpark (speculators_model_type dspark), vLLM's native format",
        detect=lambda config, keys: speculators_type(config) == "dspark",
        load=load_dspark_speculators,
        save=save_dspark_speculators,
    )
)
