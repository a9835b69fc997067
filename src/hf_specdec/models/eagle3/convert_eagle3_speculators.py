"""EAGLE-3 in the speculators format (vllm-project/speculators ``Eagle3SpeculatorConfig`` / ``Eagle3DraftModel``,
what vLLM serves natively): layout ``eagle3-speculators``, import and export.

``config.json``: the shared speculators envelope (:mod:`hf_specdec.speculators_format`) with
``speculators_model_type`` ``"eagle3"``, ``architectures`` ``["Eagle3Speculator"]``, a ``transformer_layer_config``
of ``model_type`` ``"llama"`` (one layer; speculators' default class when it names none is Qwen3's), and the fields
(speculators' defaults when absent): ``draft_vocab_size`` (32000), ``norm_before_residual`` (false; vLLM reads an
absent key as true, so exports always write it), ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``
(``output_hidden_states`` indices, as hf_specdec's ``target_layer_ids``; absent: speculators' default
``[2, N // 2, N - 3]``, resolved when the drafter is bound), ``norm_before_fc`` / ``fc_norm`` (mutually exclusive:
one RMSNorm over the concatenated target states, ``input_norm.weight``, or one per state, ``fc_norm.{i}.weight``),
``norm_output`` (false) and ``embed_requires_grad`` (training only).

Tensors: ``fc.weight``, ``layers.0.*`` (``q/k/v_proj`` over ``2H``, ``hidden_norm``), ``norm.weight``,
``lm_head.weight`` (draft vocabulary), ``d2t`` / ``t2d`` when the draft vocabulary is reduced, and a copy of the
target's ``embed_tokens.weight`` (ignored on import: the drafter borrows the target's).

Speculators' ``norm_output`` is not hf_specdec's flag of the same name: speculators' (as vLLM's) feeds the *normed*
state back to the next draft step (its LM head always reads ``norm(h)``), which is hf_specdec's ``norm_feedback``;
hf_specdec's ``norm_output=False`` (SpecForge's flag) drops the norm before the LM head and has no speculators form.
"""

from __future__ import annotations

from ...convert import METADATA_KEYS, Layout, register_layout, write_checkpoint
from ...speculators_format import (
    check_speculators_keys,
    layer_config_dict,
    read_draft_vocab_size,
    read_speculators_config,
    refuse_field,
    register_speculators_refusal,
    speculators_config_dict,
    speculators_type,
)
from .configuration_eagle3 import Eagle3Config
from .convert_eagle3 import eagle3_tensors, load_eagle3
from .modeling_eagle3 import Eagle3ForDrafting

__all__ = ["load_eagle3_speculators", "save_eagle3_speculators"]

KIND = "eagle3"
_FIELDS = {
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "embed_requires_grad",
}
# transformer_layer_config fields the draft layer is built from (the rest of a Llama config is inert here).
_LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "num_hidden_layers",
)
_RENAMES = (("layers.0.", "midlayer."),)


def _detect(config: dict, keys: set) -> bool:
    return speculators_type(config) == KIND


def _eagle3_dict(config: dict, layer: dict, depth: int | None, tensors) -> dict:
    """The speculators fields as the Llama-style dict :func:`load_eagle3` reads (defaults: speculators')."""
    if layer["model_type"] != "llama":
        raise refuse_field(
            "transformer_layer_config.model_type",
            layer["model_type"],
            "speculators builds that EAGLE-3 layer from its own decoder layer (Qwen3's has q_norm / k_norm), while "
            "hf_specdec's EAGLE-3 layer is Llama's",
            "Import a drafter with a Llama layer, or retrain one with hf_specdec.",
        )
    fields = {k: layer[k] for k in _LAYER_FIELDS if k in layer}
    return {
        **fields,
        "draft_vocab_size": read_draft_vocab_size(config, layer["vocab_size"], tensors),
        "target_hidden_size": config.get("target_hidden_size"),
        "norm_before_residual": bool(config.get("norm_before_residual", False)),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_before_fc": bool(config.get("norm_before_fc", False)),
        "norm_output": bool(config.get("norm_output", False)),  # speculators' (and vLLM's) meaning
        "hf_specdec": {"target_num_hidden_layers": depth},
    }


def load_eagle3_speculators(config: dict, state: dict, target: dict) -> Eagle3ForDrafting:
    """Builds an :class:`Eagle3ForDrafting` from a speculators EAGLE-3 checkpoint (see the module docstring)."""
    check_speculators_keys(config, _FIELDS | METADATA_KEYS)
    header = read_speculators_config(config, default_layer_type="qwen3")
    llama = _eagle3_dict(config, header.layer, header.target_num_hidden_layers, state)
    weights = {k: v for k, v in state.items() if not k.startswith("verifier_")}  # training-only copies, if any
    named = {**target, "name_or_path": target.get("name_or_path") or header.verifier["name_or_path"]}
    ids = config.get("eagle_aux_hidden_state_layer_ids") or None
    drafter = load_eagle3(llama, weights, named, renames=_RENAMES, feature_ids=ids, vllm_norm_output=True)
    drafter.config.num_draft_tokens = header.speculative_tokens
    return drafter


def _check_exportable(drafter: Eagle3ForDrafting) -> None:
    cfg = drafter.config
    if not cfg.norm_output:
        raise ValueError(
            "This EAGLE-3 drafter feeds its layer output to the LM head without the final norm (norm_output=False); "
            "speculators' EAGLE-3 always applies it (its own norm_output flag means something else), so this drafter "
            "has no speculators form. Train one with norm_output=True to publish it in this layout."
        )
    depth, ids = cfg.target_num_hidden_layers, cfg.target_layer_ids
    if depth is not None and ids is not None and max(ids) >= int(depth):
        raise ValueError(
            f"This drafter reads output_hidden_states{list(ids)}; vLLM collects the inputs of the target's layers "
            f"0..{int(depth) - 1} only (index {depth} is the final, normed state). Retrain on other layers."
        )


def save_eagle3_speculators(drafter: Eagle3ForDrafting, out_dir: str, target=None) -> None:
    """Writes ``config.json`` + ``model.safetensors`` in the speculators EAGLE-3 layout."""
    _check_exportable(drafter)
    cfg = drafter.config
    fields = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": bool(cfg.norm_before_residual),  # always written: the tools' defaults differ
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_fc": bool(cfg.norm_before_fc),
        "fc_norm": bool(cfg.fc_norm),
        "norm_output": bool(cfg.norm_feedback),  # speculators' norm_output: post-norm feedback
        "embed_requires_grad": False,
    }
    if cfg.target_layer_ids is not None:
        fields["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in cfg.target_layer_ids]
    layer = layer_config_dict("llama", cfg, num_hidden_layers=cfg.num_hidden_layers, mlp_bias=False)
    config = speculators_config_dict(KIND, ["Eagle3Speculator"], layer, fields, drafter, target)
    maps = ("d2t", "t2d") if drafter.reduced_vocabulary else ()  # speculators has no maps for a full vocabulary
    write_checkpoint(out_dir, config, eagle3_tensors(drafter, "layers.0.", maps, target))


register_speculators_refusal(
    "peagle",
    "P-EAGLE drafts all its tokens in one pass over mask tokens, which hf_specdec's EAGLE-3 drafter (token by token) "
    "does not do",
)
register_layout(
    Layout(
        name="eagle3-speculators",
        family=Eagle3Config.model_type,
        description="vllm-project/speculators EAGLE-3 (speculators_model_type eagle3, layers.0.*), vLLM's native format",
        detect=_detect,
        load=load_eagle3_speculators,
        save=save_eagle3_speculators,
    )
)
