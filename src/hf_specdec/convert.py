"""Import and export of other projects' drafter checkpoints, as a registry of layouts.

A :class:`Layout` knows how to recognise a foreign checkpoint folder, turn it into an hf_specdec drafter, and/or
write an hf_specdec drafter in that layout. Each drafter family registers its layouts from its own folder
(``models/<family>/convert_<family>.py`` calling :func:`register_layout`); nothing here knows a family.

A checkpoint is a local folder or a Hub repo (``hf_specdec.checkpoint_files`` finds and fetches its files).
Detection reads only ``config.json`` and the tensor names (weight index or safetensors headers), never the weights.
Foreign configs often leave target facts out (e.g. the target's depth); a layout's loader then leaves them
unresolved, and :meth:`~hf_specdec.DrafterPreTrainedModel.bind_target` fills them in from the target (``generate``
binds it). ``hf-specdec convert --list`` lists the registered layouts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from .checkpoint_files import CheckpointFiles, open_checkpoint
from .speculators_format import LAYOUT_SUFFIX, unsupported_speculators_type

__all__ = [
    "Layout",
    "LAYOUTS",
    "METADATA_KEYS",
    "register_layout",
    "register_refusal",
    "read_checkpoint_header",
    "detect_layout",
    "import_drafter",
    "not_a_known_layout",
    "export_drafter",
    "write_checkpoint",
]


@dataclass
class Layout:
    """A checkpoint layout of another project.

    Attributes:
        name: registry key (``hf-specdec convert --from/--to NAME``).
        family: the hf_specdec drafter family (``model_type``) it maps to.
        description: one line for ``hf-specdec convert --list``.
        detect: ``(config_dict, weight_names) -> bool`` for auto-detection on import (``None``: never auto-detected).
        load: ``(config_dict, state_dict, target_info) -> drafter`` (``None``: export only). ``target_info`` holds
            what is known of the target (``num_hidden_layers``, ``hidden_size``, ``vocab_size``, ``model_type``,
            ``name_or_path``, ``config``: its text config; any may be missing).
        save: ``(drafter, out_dir, target) -> None`` (``None``: import only); ``target`` is the target model passed
            to :func:`export_drafter` or the one the drafter is bound to (``None`` if neither), for layouts that
            must ship target weights (e.g. embeddings).
        needed_tensors: ``(config_dict, weight_names) -> names`` of the tensors ``load`` reads (``None``: all of
            them), for layouts that take a few tensors of a large checkpoint (a few layers of a target checkpoint):
            only the files holding them are read, and downloaded from the Hub.
    """

    name: str
    family: str
    description: str
    detect: Callable[[dict, set], bool] | None = None
    load: Callable[[dict, dict, dict], object] | None = None
    save: Callable[[object, str, object], None] | None = None
    needed_tensors: Callable[[dict, set], set] | None = None


LAYOUTS: dict[str, Layout] = {}

# Keys any transformers config may carry that never change a drafter's forward pass (names and bookkeeping, dtypes,
# token ids, generation defaults, output switches): layouts that refuse the config keys they do not read skip these.
METADATA_KEYS = frozenset(
    {
        # names and bookkeeping
        "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "auto_map", "finetuning_task",
        "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
        "attn_implementation", "_attn_implementation", "_attn_implementation_autoset",
        # dtypes
        "torch_dtype", "dtype", "use_bfloat16",
        # token ids
        "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id",
        "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
        "begin_suppress_tokens", "bad_words_ids",
        # generation defaults
        "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
        "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
        "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "num_return_sequences", "output_scores",
        "return_dict_in_generate", "remove_invalid_values", "exponential_decay_length_penalty",
        # output switches and run-time options
        "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "use_cache",
        "chunk_size_feed_forward", "tf_legacy_loss", "gradient_checkpointing",
    }
)  # fmt: skip


def register_layout(layout: Layout) -> Layout:
    """Adds a layout to the registry (a family's conversion module calls this at import time)."""
    if not layout.name:
        raise ValueError("A layout needs a name.")
    LAYOUTS[layout.name] = layout
    return layout


# Checks for checkpoints hf_specdec recognises but cannot import (register_refusal).
_REFUSALS: list[Callable[[dict, set], str | None]] = []


def register_refusal(check: Callable[[dict, set], str | None]) -> None:
    """Adds ``check(config_dict, weight_names)``: why hf_specdec cannot import a checkpoint it recognises (naming
    the model family, what is not supported and what to do instead), or ``None`` for other checkpoints. A family's
    conversion module calls this at import time; a checkpoint no layout recognises is refused with the reason, from
    ``config.json`` and the tensor names alone."""
    _REFUSALS.append(check)


def write_checkpoint(out_dir: str, config: dict, tensors: dict, weights_name: str = "model.safetensors") -> None:
    """Writes a foreign-layout checkpoint: ``config.json`` and the tensors (CPU, contiguous) as ``weights_name``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, weights_name), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def read_checkpoint_header(path, **hub_options) -> tuple[dict, set[str]]:
    """``config.json`` and the tensor names of a checkpoint folder or Hub repo, without loading the weights.

    Names come from the weight index or the safetensors headers (read remotely for a Hub repo); a
    ``pytorch_model.bin`` without an index is memory-mapped (downloaded first from the Hub). ``hub_options``:
    ``subfolder``, ``revision``, ``token``, ``cache_dir``, ``local_files_only``, as in ``from_pretrained``.
    """
    files = open_checkpoint(path, **hub_options)
    return files.config, set(files.weight_map)


def _find_layout(config: dict, names: set[str]) -> Layout | None:
    if str(config.get("model_type", "")).endswith("_drafter"):  # an hf_specdec checkpoint
        return None
    for layout in LAYOUTS.values():
        if layout.detect is not None and layout.detect(config, names):
            return layout
    return None


def detect_layout(source, **hub_options) -> str | None:
    """Name of the registered layout a checkpoint is in, or ``None`` (e.g. an hf_specdec checkpoint).

    Args:
        source: a checkpoint folder, a Hub repo id, or a :class:`~hf_specdec.checkpoint_files.CheckpointFiles`.
        hub_options: ``subfolder``, ``revision``, ``token``, ``cache_dir``, ``local_files_only``.

    Reads ``config.json`` and the tensor names only (from a Hub repo: the weight index or the safetensors headers).
    """
    files = _checkpoint_files(source, hub_options)
    found = _find_layout(files.config, set(files.weight_map))
    return None if found is None else found.name


def _checkpoint_files(source, hub_options: dict) -> CheckpointFiles:
    return source if isinstance(source, CheckpointFiles) else open_checkpoint(source, **hub_options)


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
            "config": text,
        }
    if target_num_hidden_layers is not None:
        info["num_hidden_layers"] = int(target_num_hidden_layers)
    return info


def import_drafter(
    source, layout: str = "auto", target_config=None, target_num_hidden_layers: int | None = None, **hub_options
):
    """Loads a checkpoint written by another project as an hf_specdec drafter.

    Args:
        source: the checkpoint folder, a Hub repo id, or a :class:`~hf_specdec.checkpoint_files.CheckpointFiles`.
        layout: a registered layout name, or ``"auto"`` to detect it.
        target_config: the target's config (checks vocabulary and hidden size; gives its depth). Optional: facts
            the checkpoint does not record are then resolved when the drafter is bound to its target.
        target_num_hidden_layers: the target's depth, when its config is not at hand.
        hub_options: ``subfolder``, ``revision``, ``token``, ``cache_dir``, ``local_files_only``, as in
            ``from_pretrained``. From the Hub, only the weight files holding tensors the layout reads are downloaded.
    """
    files = _checkpoint_files(source, hub_options)
    spec = _layout_of(files, layout)
    if spec.load is None:
        raise ValueError(f"Layout {spec.name!r} is export-only; importable: {_names(lambda x: x.load)}.")
    wanted = None if spec.needed_tensors is None else spec.needed_tensors(files.config, set(files.weight_map))
    state = files.load(wanted)
    try:
        drafter = spec.load(files.config, state, _target_info(target_config, target_num_hidden_layers))
    except (KeyError, IndexError) as err:  # a layout named by hand that the checkpoint is not in
        raise _not_in_layout(files, spec, err) from None
    drafter.refuse_non_finite_weights(files.where)
    return drafter


def _not_in_layout(files: CheckpointFiles, spec: Layout, err: Exception) -> ValueError:
    found = _find_layout(files.config, set(files.weight_map))
    looks = f"it looks like the {found.name!r} layout" if found else "no registered layout recognises it"
    return ValueError(
        f"{files.where} is not in the {spec.name!r} layout ({spec.description}): {type(err).__name__} {err} while "
        f"reading it; {looks}. Name the layout it is in (`--from`), or let it be detected (`--from auto`)."
    )


def _layout_of(files: CheckpointFiles, layout: str) -> Layout:
    if layout != "auto":
        if layout not in LAYOUTS:
            raise ValueError(f"Unknown layout {layout!r}. Known layouts: {sorted(LAYOUTS)}.")
        return LAYOUTS[layout]
    found = _find_layout(files.config, set(files.weight_map))
    if found is None:
        raise not_a_known_layout(files)
    return found


def not_a_known_layout(files: CheckpointFiles) -> ValueError:
    """The error for a checkpoint that no registered layout recognises."""
    speculators = _names(lambda x: x.load and x.name.endswith(LAYOUT_SUFFIX))
    refused = unsupported_speculators_type(files.config, files.where, speculators)
    if refused is not None:
        return refused
    for check in _REFUSALS:
        reason = check(files.config, set(files.weight_map))
        if reason:
            return ValueError(f"{files.where}: {reason}")
    model_type = str(files.config.get("model_type") or "")
    if model_type.endswith("_drafter"):
        return ValueError(
            f"{files.where} is an hf_specdec drafter checkpoint (model_type {model_type!r}), not another project's "
            "layout: load it with AutoModelForDrafting.from_pretrained."
        )
    found = f"model_type {model_type!r}" if model_type else "no model_type"
    return ValueError(
        f"{files.where} is not an hf_specdec drafter (its config.json has {found}; hf_specdec drafters have "
        "'<family>_drafter') and is in none of the other projects' checkpoint layouts hf_specdec recognises: "
        f"{_names(lambda x: x.load)} (`hf-specdec convert --list` describes them). If it is in one of them all the "
        "same, name the layout: `hf-specdec convert SRC OUT --from LAYOUT` or "
        "`hf_specdec.convert.import_drafter(SRC, layout=LAYOUT)`. A target model loads with AutoModelForCausalLM."
    )


def exportable_layout(layout: str) -> Layout:
    """The registered layout ``layout``, refused with the exportable names when it is unknown or import-only."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown layout {layout!r}. Known layouts: {sorted(LAYOUTS)}.")
    if LAYOUTS[layout].save is None:
        raise ValueError(f"Layout {layout!r} is import-only; exportable: {_names(lambda x: x.save)}.")
    return LAYOUTS[layout]


def export_drafter(drafter, out_dir: str, layout: str, target=None) -> str:
    """Writes ``drafter`` in another project's layout (``config.json`` + ``model.safetensors``); returns ``out_dir``.

    Args:
        drafter: an hf_specdec drafter.
        out_dir: output folder (created).
        layout: a registered layout name (``hf-specdec convert --list``).
        target: the target model, for layouts that ship target weights the drafter only borrows (e.g. the token
            embeddings); defaults to the target the drafter is bound to.
    """
    spec = exportable_layout(layout)
    if drafter.config.model_type != spec.family:
        raise ValueError(
            f"Layout {layout!r} holds {spec.family} drafters; got a {drafter.config.model_type}. Exportable "
            f"layouts for it: {_names(lambda x: x.save and x.family == drafter.config.model_type)}."
        )
    if getattr(drafter.config, "context_vocabulary", False):
        raise ValueError(
            f"Layout {layout!r} has no context vocabulary, and this drafter drafts from one: other runtimes could not "
            "run it as trained. Share it in hf_specdec's own format (`save_pretrained` / `hf-specdec push`)."
        )
    os.makedirs(out_dir, exist_ok=True)
    spec.save(drafter, out_dir, target if target is not None else getattr(drafter, "bound_target", None))
    return out_dir


def _names(pred) -> list[str]:
    return sorted(name for name, layout in LAYOUTS.items() if pred(layout))
