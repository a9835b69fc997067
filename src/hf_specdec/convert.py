"""Import and export of other projects' drafter checkpoints, as a registry of layouts.

A :class:`Layout` knows how to recognise a foreign checkpoint folder, turn it into an hf_specdec drafter, and/or
write an hf_specdec drafter in that layout. Each drafter family registers its layouts from its own folder
(``models/<family>/convert_<family>.py`` calling :func:`register_layout`); nothing here knows a family.

Detection reads only ``config.json`` and the tensor names (``safetensors.safe_open``), never the weights.
Foreign configs often leave target facts out (e.g. the target's depth); a layout's loader then leaves them
unresolved, and :meth:`~hf_specdec.DrafterPreTrainedModel.bind_target` fills them in from the target (``generate``
binds it). ``hf-specdec convert --list`` lists the registered layouts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "Layout",
    "LAYOUTS",
    "register_layout",
    "read_checkpoint_header",
    "detect_layout",
    "import_drafter",
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
            ``name_or_path``; any may be missing).
        save: ``(drafter, out_dir, target) -> None`` (``None``: import only); ``target`` is the target model passed
            to :func:`export_drafter` or the one the drafter is bound to (``None`` if neither), for layouts that
            must ship target weights (e.g. embeddings).
    """

    name: str
    family: str
    description: str
    detect: Callable[[dict, set], bool] | None = None
    load: Callable[[dict, dict, dict], object] | None = None
    save: Callable[[object, str, object], None] | None = None


LAYOUTS: dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Adds a layout to the registry (a family's conversion module calls this at import time)."""
    if not layout.name:
        raise ValueError("A layout needs a name.")
    LAYOUTS[layout.name] = layout
    return layout


def write_checkpoint(out_dir: str, config: dict, tensors: dict) -> None:
    """Writes a foreign-layout checkpoint: ``config.json`` and ``model.safetensors`` (CPU, contiguous tensors)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint folder at {path!r}.")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json; a drafter checkpoint folder needs one.")
    with open(config_path, encoding="utf-8") as fh:
        return json.load(fh)


def _read_checkpoint(path: str) -> tuple[dict, dict]:
    """``config.json`` and all weights of a checkpoint folder (safetensors, sharded or not, or ``pytorch_model.bin``)."""
    config = _read_config(path)
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


def read_checkpoint_header(path: str) -> tuple[dict, set[str]]:
    """``config.json`` and the tensor names of a checkpoint folder, without loading the weights.

    Safetensors names come from the file headers (``safe_open``); a ``pytorch_model.bin`` is memory-mapped.
    """
    config = _read_config(path)
    names: set[str] = set()
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        from safetensors import safe_open

        for name in files:
            try:
                with safe_open(os.path.join(path, name), framework="pt") as fh:
                    names.update(fh.keys())
            except Exception as err:  # safetensors raises its own error types
                msg = f"Cannot read {os.path.join(path, name)}: {err}. The file is corrupt or truncated."
                raise ValueError(msg) from err
        return config, names
    for name in sorted(f for f in os.listdir(path) if f.endswith(".bin") or f.endswith(".pt")):
        file = os.path.join(path, name)
        try:
            names.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except RuntimeError:  # legacy (non-zip) pickles cannot be memory-mapped
            names.update(torch.load(file, map_location="cpu", weights_only=True))
    return config, names


def _find_layout(config: dict, names: set[str]) -> Layout | None:
    if str(config.get("model_type", "")).endswith("_drafter"):  # an hf_specdec checkpoint
        return None
    for layout in LAYOUTS.values():
        if layout.detect is not None and layout.detect(config, names):
            return layout
    return None


def detect_layout(path: str) -> str | None:
    """Name of the registered layout a checkpoint folder is in, or ``None`` (e.g. an hf_specdec checkpoint).

    Reads ``config.json`` and the tensor names only.
    """
    found = _find_layout(*read_checkpoint_header(path))
    return None if found is None else found.name


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
        target_config: the target's config (checks vocabulary and hidden size; gives its depth). Optional: facts
            the checkpoint does not record are then resolved when the drafter is bound to its target.
        target_num_hidden_layers: the target's depth, when its config is not at hand.
    """
    if layout == "auto":
        found = _find_layout(*read_checkpoint_header(path))
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
    config, state = _read_checkpoint(path)
    return spec.load(config, state, _target_info(target_config, target_num_hidden_layers))


def export_drafter(drafter, out_dir: str, layout: str, target=None) -> str:
    """Writes ``drafter`` in another project's layout (``config.json`` + ``model.safetensors``); returns ``out_dir``.

    Args:
        drafter: an hf_specdec drafter.
        out_dir: output folder (created).
        layout: a registered layout name (``hf-specdec convert --list``).
        target: the target model, for layouts that ship target weights the drafter only borrows (e.g. the token
            embeddings); defaults to the target the drafter is bound to.
    """
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
    spec.save(drafter, out_dir, target if target is not None else getattr(drafter, "bound_target", None))
    return out_dir


def _names(pred) -> list[str]:
    return sorted(name for name, layout in LAYOUTS.items() if pred(layout))
