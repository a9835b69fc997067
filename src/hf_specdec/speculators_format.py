"""The speculators checkpoint format (vllm-project/speculators, the format vLLM serves natively): the parts every
speculators model type shares. Each family reads and writes its own type's fields in its ``convert_*`` module.

``config.json`` (what ``SpeculatorModelConfig`` in speculators' ``src/speculators/config.py`` saves):

* ``speculators_model_type`` (the type), ``speculators_version``, ``architectures`` (e.g. ``["<Type>Speculator"]``);
* ``transformer_layer_config``: a nested Hugging Face config with its own ``model_type``, saved as a *diff* against
  its config class (speculators reads it back as ``AutoConfig.for_model(model_type)(**dict)``, so absent keys take
  that class's defaults, which :func:`read_speculators_config` applies the same way); its ``vocab_size`` is the
  target's vocabulary;
* the type's own fields at the top level (sizes, flags, the target layers read);
* ``speculators_config``: ``algorithm``, ``proposal_methods`` ``[{proposal_type: "greedy", speculative_tokens,
  verifier_accept_k, accept_tolerance}]``, ``default_proposal_method`` and ``verifier`` ``{name_or_path,
  architectures}``. vLLM takes ``num_speculative_tokens`` from the first proposal method.

An ``auto_map`` may be present; it is never run. Unknown keys are refused (they may change the draft forward pass),
except transformers' own generic config keys, which are metadata. A speculators type hf_specdec does not import is
refused by name (:func:`unsupported_speculators_type`), with the family's reason where it registered one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SPECULATORS_VERSION",
    "LAYOUT_SUFFIX",
    "SpeculatorsHeader",
    "speculators_type",
    "read_speculators_config",
    "read_draft_vocab_size",
    "refuse_field",
    "check_speculators_keys",
    "speculators_config_dict",
    "verifier_of",
    "layer_config_dict",
    "target_embedding",
    "register_speculators_refusal",
    "unsupported_speculators_type",
]

# The speculators release whose schema the exports follow (v0.7.0 is the first with every type written here).
SPECULATORS_VERSION = "0.7.0"
# The names of the layouts families register for speculators types end with this (how the refusal lists them).
LAYOUT_SUFFIX = "-speculators"
# Keys of the envelope, read here; the families read their type's fields.
_ENVELOPE_KEYS = {
    "speculators_model_type",
    "speculators_version",
    "architectures",
    "transformer_layer_config",
    "speculators_config",
    "hf_specdec",  # provenance of an hf_specdec export (the target's depth); ignored by speculators and vLLM
}
# Metadata every transformers config may carry (speculators' config is a PretrainedConfig): no effect on drafting.
_METADATA_KEYS = {
    "_name_or_path",
    "auto_map",
    "chunk_size_feed_forward",
    "dtype",
    "has_no_defaults_at_init",
    "id2label",
    "is_encoder_decoder",
    "label2id",
    "model_type",
    "output_attentions",
    "output_hidden_states",
    "problem_type",
    "return_dict",
    "tie_word_embeddings",
    "torch_dtype",
    "transformers_version",
    "use_cache",
}
# Reasons families give for speculators types they cannot import (register_speculators_refusal).
_REFUSALS: dict[str, str] = {}


@dataclass
class SpeculatorsHeader:
    """What the shared part of a speculators ``config.json`` says.

    Attributes:
        layer: ``transformer_layer_config`` with its config class's defaults filled in (a full config dict).
        speculative_tokens: tokens drafted per step (the default proposal method's ``speculative_tokens``).
        verifier: the target it was made for, ``{"name_or_path", "architectures"}``.
        target_num_hidden_layers: the target's depth, when an hf_specdec export recorded it.
    """

    layer: dict
    speculative_tokens: int
    verifier: dict
    target_num_hidden_layers: int | None = None


def speculators_type(config: dict) -> str | None:
    """The ``speculators_model_type`` of a ``config.json`` (``None`` for any other checkpoint)."""
    kind = config.get("speculators_model_type")
    return kind if isinstance(kind, str) and isinstance(config.get("speculators_config"), dict) else None


def refuse_field(field: str, value, why: str, fix: str) -> ValueError:
    """The one wording of a refused speculators field: which field, its value, why, and what to do."""
    return ValueError(f"This speculators checkpoint sets {field}={value!r}: {why}. {fix}")


def check_speculators_keys(config: dict, type_keys: set[str]) -> None:
    """Refuses top-level keys that are neither the envelope, the type's fields (``type_keys``) nor metadata."""
    unknown = sorted(set(config) - _ENVELOPE_KEYS - _METADATA_KEYS - set(type_keys))
    if unknown:
        kind = config.get("speculators_model_type")
        raise refuse_field(
            unknown[0],
            config[unknown[0]],
            f"hf_specdec does not know {'these keys' if len(unknown) > 1 else 'this key'} of a speculators "
            f"{kind!r} config ({', '.join(unknown)}), which may change the draft forward pass",
            "If a key is only metadata, remove it from config.json and import again.",
        )


def read_speculators_config(config: dict, default_layer_type: str) -> SpeculatorsHeader:
    """Checks the shared part of a speculators ``config.json`` and reads it.

    Args:
        config: the parsed ``config.json``.
        default_layer_type: the ``model_type`` speculators assumes for a ``transformer_layer_config`` without one
            (its type's config class default, e.g. ``"qwen3"``).
    """
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise refuse_field(
            "transformer_layer_config", layer, "it must be a config dict", "Re-save it with speculators."
        )
    spec = config.get("speculators_config")
    if not isinstance(spec, dict):
        raise refuse_field("speculators_config", spec, "it must be a dict", "Re-save it with speculators.")
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method", "greedy")
    method = next((m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default), None)
    if method is None:
        raise refuse_field(
            "speculators_config.default_proposal_method",
            default,
            f"it names none of the proposal_methods {methods!r}",
            "Fix speculators_config.",
        )
    _check_proposal(method)
    verifier = spec.get("verifier") or {}
    provenance = config.get("hf_specdec") or {}
    return SpeculatorsHeader(
        layer=_full_layer_config(layer, default_layer_type),
        speculative_tokens=int(method.get("speculative_tokens", 5)),  # speculators' greedy default
        verifier={
            "name_or_path": verifier.get("name_or_path"),
            "architectures": list(verifier.get("architectures") or []),
        },
        target_num_hidden_layers=provenance.get("target_num_hidden_layers"),
    )


def read_draft_vocab_size(config: dict, vocab_size: int, tensors) -> int:
    """``draft_vocab_size`` (speculators' default when absent: 32000); refused when it is smaller than the target's
    vocabulary ``vocab_size`` but the checkpoint's ``tensors`` (names) have no ``d2t`` / ``t2d`` id maps."""
    draft = int(config.get("draft_vocab_size", 32000))
    if draft != int(vocab_size) and not {"d2t", "t2d"} <= set(tensors):
        raise refuse_field(
            "draft_vocab_size",
            draft,
            f"it differs from the target's {vocab_size} tokens (transformer_layer_config.vocab_size) but the "
            "checkpoint has no d2t / t2d id maps",
            "Add the maps, or set draft_vocab_size to the target's vocabulary if the checkpoint drafts over all of it.",
        )
    return draft


def _check_proposal(method: dict) -> None:
    """hf_specdec drafts a chain and verifies it with its own verifiers (chosen at ``generate`` time): a greedy
    proposal method with exact top-1 acceptance is what it can honour."""
    if method.get("proposal_type") != "greedy":
        raise refuse_field(
            "speculators_config.proposal_methods[].proposal_type",
            method.get("proposal_type"),
            "hf_specdec reads the greedy chain proposal only",
            "Add a greedy proposal method and make it the default.",
        )
    for key, exact in (("verifier_accept_k", 1), ("accept_tolerance", 0.0)):
        if method.get(key, exact) != exact:
            raise refuse_field(
                f"speculators_config.proposal_methods[].{key}",
                method[key],
                "accepting drafts outside the target's top token is not one of hf_specdec's verifiers (greedy, "
                "lossless sampling, typical acceptance, ASD, chosen at generate time)",
                f"Set {key} to {exact} to import it, and pick a verifier when generating.",
            )


def _full_layer_config(layer: dict, default_type: str) -> dict:
    """``transformer_layer_config`` as speculators reads it: its config class built from the dict, defaults and all."""
    from transformers import AutoConfig

    kind = layer.get("model_type") or default_type
    try:
        built = AutoConfig.for_model(kind, **{k: v for k, v in layer.items() if k != "model_type"})
    except ValueError as err:
        raise refuse_field(
            "transformer_layer_config.model_type", kind, f"transformers does not know it ({err})", "Fix the config."
        ) from err
    return built.to_dict()


def verifier_of(drafter, target=None) -> dict:
    """``speculators_config.verifier``: the bound or given target's name and architectures, else the target the
    drafter's config names (architectures unknown then)."""
    config = getattr(target, "config", None)
    name = getattr(config, "_name_or_path", None) or drafter.config.target_model_name_or_path or None
    return {"name_or_path": name, "architectures": list(getattr(config, "architectures", None) or [])}


def speculators_config_dict(
    kind: str, architectures: list[str], layer: dict, fields: dict, drafter, target=None
) -> dict:
    """The ``config.json`` of a speculators export.

    Args:
        kind: ``speculators_model_type``.
        architectures: the speculators class that loads it.
        layer: ``transformer_layer_config`` (:func:`layer_config_dict`).
        fields: the type's own fields.
        drafter: the drafter (its ``num_draft_tokens`` is ``speculative_tokens``, its dtype the checkpoint's).
        target: the target model (the verifier's name and architectures), if at hand.
    """
    cfg = drafter.config
    greedy = {"proposal_type": "greedy", "speculative_tokens": int(cfg.num_draft_tokens), "verifier_accept_k": 1,
              "accept_tolerance": 0.0}  # fmt: skip
    return {
        "architectures": list(architectures),
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        **fields,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [greedy],
            "default_proposal_method": "greedy",
            "verifier": verifier_of(drafter, target),
        },
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
        "hf_specdec": {"target_num_hidden_layers": cfg.target_num_hidden_layers},
    }


def layer_config_dict(model_type: str, config, num_hidden_layers: int, **extra) -> dict:
    """``transformer_layer_config`` of an export: every field of the draft decoder layers written out (vLLM builds
    its layers from this dict without the config class's defaults), ``vocab_size`` the target's."""
    from .configuration_utils import decoder_layer_config_dict

    layer = {"model_type": model_type, **decoder_layer_config_dict(config)}
    if layer["rope_scaling"] is None:
        del layer["rope_scaling"]
    return {
        **layer,
        "num_hidden_layers": int(num_hidden_layers),
        "vocab_size": int(config.target_vocab_size),
        "tie_word_embeddings": False,
        **extra,
    }


def target_embedding(drafter, target, name: str = "embed_tokens.weight") -> dict:
    """The target's token embeddings as a tensor of the export (speculators' models carry a copy, and load it from
    the verifier when it is absent); empty without a target."""
    if target is None:
        return {}
    weight = target.get_input_embeddings().weight
    want = (int(drafter.config.target_vocab_size), int(drafter.config.hidden_size))
    if tuple(weight.shape) != want:
        raise ValueError(f"The target's embeddings are {tuple(weight.shape)}; the drafter expects {want}.")
    return {name: weight.detach().to(drafter.dtype)}


def register_speculators_refusal(kind: str, reason: str) -> None:
    """Records why hf_specdec does not import speculators type ``kind`` (a family calls this for a type it knows)."""
    _REFUSALS[kind] = reason


def unsupported_speculators_type(config: dict, where: str, importable: list[str]) -> ValueError | None:
    """The error for a speculators checkpoint whose type no registered layout imports (``None`` for others)."""
    kind = speculators_type(config)
    if kind is None:
        return None
    reason = _REFUSALS.get(kind, "no hf_specdec drafter family implements it")
    return refuse_field(
        "speculators_model_type",
        kind,
        f"{where} is a speculators checkpoint of a type hf_specdec does not import: {reason}",
        f"hf_specdec imports these speculators layouts: {importable}.",
    )
