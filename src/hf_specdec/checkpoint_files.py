"""A checkpoint's files, in a local folder or a Hub repository, downloaded only as far as a caller needs them.

:func:`open_checkpoint` takes a folder or a Hub repo id (with ``subfolder``, ``revision``, ``token``, ``cache_dir``
and ``local_files_only``, as ``from_pretrained`` does) and gives a :class:`CheckpointFiles`:

* ``config``: the parsed ``config.json``;
* ``weight_map``: which file holds each tensor, from the weight index (``model.safetensors.index.json`` /
  ``pytorch_model.bin.index.json``) when there is one, else from the safetensors headers (pickled weights have no
  header: their names need the file);
* :meth:`CheckpointFiles.load`: the tensors asked for, read from the files that hold them.

From the Hub nothing is fetched before it is needed: ``config.json``, then the folder's file listing, then the index or
each safetensors header (read with an HTTP range request, not cached), then only the weight files holding the tensors
loaded (into the usual Hugging Face cache, through transformers' ``cached_file``). With downloads off
(``local_files_only=True`` or ``HF_HUB_OFFLINE=1``) a repo is its cached snapshot folder, read like any local folder:
what an earlier load downloaded is there.
"""

from __future__ import annotations

import json
import os
import pickle
import posixpath
import re
from functools import cached_property

import torch

__all__ = ["CheckpointFiles", "open_checkpoint", "HUB_OPTIONS"]

# The from_pretrained keyword arguments that say where a checkpoint's files are.
HUB_OPTIONS = ("subfolder", "revision", "token", "cache_dir", "local_files_only")

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


def open_checkpoint(
    path_or_repo_id,
    *,
    subfolder: str = "",
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
) -> CheckpointFiles:
    """The files of a checkpoint folder or Hub repository; only ``config.json`` is fetched here (from the Hub).

    Args:
        path_or_repo_id: a local folder, or a Hub repo id (``"org/name"``).
        subfolder: the checkpoint's folder inside the folder or repo.
        revision: branch, tag or commit of the repo (default: its main branch).
        token: Hub token for private or gated repos.
        cache_dir: the Hugging Face cache to download into and read from.
        local_files_only: read the repo from the cache only (as ``HF_HUB_OFFLINE=1`` does).
    """
    path = os.fspath(path_or_repo_id)
    subfolder = subfolder or ""
    if not _is_repo_id(path):
        return LocalCheckpoint(os.path.join(path, subfolder))
    _refuse_a_mistyped_local_path(path)
    from huggingface_hub import is_offline_mode

    if local_files_only or is_offline_mode():
        return _cached_snapshot(path, subfolder, revision, cache_dir)
    return HubCheckpoint(path, subfolder, revision, token, cache_dir)


def _refuse_a_mistyped_local_path(path: str) -> None:
    """``runs/my-drafter`` is also a valid Hub id; when ``runs/`` is a folder here, it is a local path with a typo, and
    is said so at once rather than after the Hub's retries."""
    parent = os.path.dirname(path)
    if not parent or not os.path.isdir(parent):
        return
    near = sorted(os.listdir(parent))
    shown = ", ".join(near[:8]) + (", ..." if len(near) > 8 else "") if near else "nothing"
    raise FileNotFoundError(
        f"No folder {path!r} exists here ({os.path.abspath(path)}); {parent}/ holds: {shown}. Check the path (to load "
        f"the Hub repository {path!r} instead, run from a folder without a {parent}/ folder)."
    )


def _is_repo_id(path: str) -> bool:
    """A path that exists, or that no repo id looks like (``/abs/path``, ``./x``, ``a/b/c``), is a local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(path):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _describe(repo_id: str, subfolder: str, revision: str | None) -> str:
    where = f"{repo_id}/{subfolder}" if subfolder else repo_id
    return f"{where} (revision {revision})" if revision else where


class CheckpointFiles:
    """One checkpoint's files; :class:`LocalCheckpoint` and :class:`HubCheckpoint` say where they come from.

    Attributes:
        where: the folder or repo, for messages.
        missing_hint: said after "has no FILE" (e.g. why a cached snapshot lacks it).
    """

    def __init__(self, where: str, missing_hint: str = ""):
        self.where = where
        self.missing_hint = missing_hint

    # ------------------------------------------------------------------------- what each source provides
    def list_files(self) -> list[str]:
        """Names of the files directly in the checkpoint's folder."""
        raise NotImplementedError

    def local_path(self, name: str) -> str:
        """A local path to the file ``name`` (downloaded first if needed)."""
        raise NotImplementedError

    def safetensors_names(self, name: str) -> list[str]:
        """The tensor names in the header of the safetensors file ``name``."""
        return _safetensors_keys(self.local_path(name))

    # ------------------------------------------------------------------------------------------ shared
    @cached_property
    def config(self) -> dict:
        """The parsed ``config.json``."""
        return _read_json(self.local_path("config.json"))

    @cached_property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it; read from the weight index or the file headers, not the weights."""
        index, files = _weight_files(self.list_files())
        if index is not None:
            return dict(_read_json(self.local_path(index))["weight_map"])
        if not files:
            raise ValueError(f"{self.where} holds no weights (*.safetensors, pytorch_model.bin){self.missing_hint}.")
        found: dict[str, str] = {}
        for name in files:
            if name.endswith(".safetensors"):
                keys = self.safetensors_names(name)
            else:  # a pickle has no header: its names need the file
                keys = list(_read_pickle(self.local_path(name)))
            found.update(dict.fromkeys(keys, name))
        return found

    def load(self, names=None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (all of them by default), fetching only the files that hold them."""
        by_file: dict[str, list[str]] = {}
        for tensor, file in self.weight_map.items():
            if names is None or tensor in names:
                by_file.setdefault(file, []).append(tensor)
        state: dict[str, torch.Tensor] = {}
        for file, tensors in sorted(by_file.items()):
            state.update(_read_tensors(self.local_path(file), file.endswith(".safetensors"), tensors))
        return state


def _weight_files(listing: list[str]) -> tuple[str | None, list[str]]:
    """The weight index of a folder (if it has one), else its weight files; safetensors before pickles."""
    for index, suffixes in ((SAFETENSORS_INDEX, (".safetensors",)), (PICKLE_INDEX, (".bin", ".pt"))):
        if index in listing:
            return index, []
        files = sorted(name for name in listing if name.endswith(suffixes))
        if files:
            return None, files
    return None, []


class LocalCheckpoint(CheckpointFiles):
    """A checkpoint in a local folder (also a repo's cached snapshot, when downloads are off)."""

    def __init__(self, folder: str, where: str | None = None, missing_hint: str = ""):
        super().__init__(where or folder, missing_hint)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"No checkpoint folder at {folder!r}: check the path.")
        self.folder = folder

    def list_files(self) -> list[str]:
        return sorted(n for n in os.listdir(self.folder) if os.path.isfile(os.path.join(self.folder, n)))

    def local_path(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        if os.path.isfile(path):
            return path
        if name == "config.json" and not self.missing_hint:
            raise ValueError(f"{self.where} has no config.json; a drafter checkpoint folder needs one.")
        raise ValueError(f"{self.where} has no {name}{self.missing_hint}.")


def _cached_snapshot(repo_id: str, subfolder: str, revision: str | None, cache_dir) -> LocalCheckpoint:
    """The cached snapshot folder of a repo revision, found through its ``config.json``."""
    from huggingface_hub import try_to_load_from_cache

    where = _describe(repo_id, subfolder, revision)
    off = "downloads are off (local_files_only=True or HF_HUB_OFFLINE=1)"
    config = posixpath.join(subfolder, "config.json") if subfolder else "config.json"
    found = try_to_load_from_cache(repo_id, config, cache_dir=cache_dir, revision=revision)
    if not isinstance(found, str):
        raise OSError(
            f"{where} is not in the local Hugging Face cache{f' ({cache_dir})' if cache_dir else ''} and {off}. "
            "Load it once with downloads on (it is cached then), or pass the path of a local folder."
        )
    hint = f" in the local cache, and {off}: load it once with downloads on"
    return LocalCheckpoint(os.path.dirname(found), where=where, missing_hint=hint)


class HubCheckpoint(CheckpointFiles):
    """A checkpoint in a Hub repository: listing and headers are read remotely, files downloaded into the cache."""

    def __init__(self, repo_id: str, subfolder: str, revision: str | None, token, cache_dir):
        super().__init__(_describe(repo_id, subfolder, revision))
        self.repo_id, self.subfolder, self.revision = repo_id, subfolder, revision
        self.token, self.cache_dir = token, cache_dir

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(token=self.token)

    def _in_repo(self, name: str) -> str:
        return posixpath.join(self.subfolder, name) if self.subfolder else name

    def list_files(self) -> list[str]:
        from huggingface_hub import RepoFile

        entries = self._api().list_repo_tree(self.repo_id, self.subfolder or None, revision=self.revision)
        return sorted(posixpath.basename(e.path) for e in entries if isinstance(e, RepoFile))

    def local_path(self, name: str) -> str:
        from transformers.utils import cached_file

        try:
            path = cached_file(
                self.repo_id,
                name,
                subfolder=self.subfolder,
                revision=self.revision,
                token=self.token,
                cache_dir=self.cache_dir,
            )
        except OSError as err:
            raise OSError(
                f"{self.repo_id!r} is no local folder, so it was taken for a Hub repository id, and {name} could not "
                f"be fetched from it: {err} If you meant a local folder, check the path; with no network, set "
                "HF_HUB_OFFLINE=1 to read the Hub cache only."
            ) from err
        if path is None:  # cached_file answers None (no error) for a missing config.json
            raise ValueError(f"{self.where} has no {name}; a drafter checkpoint needs one.")
        return path

    def safetensors_names(self, name: str) -> list[str]:
        from huggingface_hub.errors import SafetensorsParsingError

        try:
            header = self._api().parse_safetensors_file_metadata(
                self.repo_id, self._in_repo(name), revision=self.revision
            )
        except SafetensorsParsingError as err:
            raise _corrupt(f"{self.where}: {name}", err) from err
        return list(header.tensors)


# ---------------------------------------------------------------------------------------------- file readers
def _read_json(path: str) -> dict:
    """A JSON object file (``config.json``, a weight index), refused naming the file, line and column when it is not
    JSON, and naming what it holds when it is not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); fix or replace the file."
        ) from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}): it is not a JSON file; replace it.") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} holds a JSON {type(data).__name__}, not an object of named fields; a config or index file must "
            "be a JSON object ({...})."
        )
    return data


def _corrupt(what: str, err: Exception) -> ValueError:
    return ValueError(f"Cannot read {what}: {err}. The file is corrupt or truncated.")


def _safetensors_keys(path: str) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            return list(fh.keys())
    except Exception as err:  # safetensors raises its own error types
        raise _corrupt(path, err) from err


def _read_pickle(path: str) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin`` / ``.pt`` state dict, memory-mapped where the format allows; only ever unpickled with
    ``weights_only=True`` (tensors and plain containers), so a pickle that would run code is refused, not run."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) pickles cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _unsafe_pickle(path, err) from err


def _unsafe_pickle(path: str, err: Exception) -> ValueError:
    found = re.search(r"Unsupported [^\n]*?(?=\. |\n|$)", str(err))  # torch's "Unsupported global: GLOBAL ..."
    what = found.group(0) if found else "objects it would construct"
    return ValueError(
        f"{path} is a pickle holding more than tensors ({what}), so hf_specdec does not read it: it unpickles other "
        "projects' .bin / .pt files only with torch.load(weights_only=True), since unpickling anything else can run code. If you trust its source, convert "
        "the checkpoint to safetensors: e.g. `state = torch.load(PATH, weights_only=False)` then "
        "`safetensors.torch.save_file({k: v for k, v in state.items() if isinstance(v, torch.Tensor)}, "
        "'model.safetensors')`, put model.safetensors next to config.json instead of the pickle, and load that folder."
    )


def _read_tensors(path: str, is_safetensors: bool, names: list[str]) -> dict[str, torch.Tensor]:
    if not is_safetensors:
        state = _read_pickle(path)
        return {name: state[name] for name in names if name in state}
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as fh:
            present = set(fh.keys())
            return {name: fh.get_tensor(name) for name in names if name in present}
    except Exception as err:  # safetensors raises its own error types
        raise _corrupt(path, err) from err
