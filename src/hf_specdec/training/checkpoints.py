"""Checkpoint folders of a training run: what a complete one holds, which one to resume from, saving atomically.

A run's ``output_dir`` holds ``checkpoint-{step}`` folders (the drafter's weights plus transformers' ``Trainer``
state files), a ``latest_checkpoint`` pointer, and at the end the trained drafter and its ``training_record.json``.
A checkpoint is written into a temporary folder and renamed into place, so a crash never leaves a half-written one
under a checkpoint's name; state files are read back without unpickling arbitrary objects.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import warnings

import torch

CHECKPOINT_PREFIX = "checkpoint-"
LATEST_FILE = "latest_checkpoint"
ADAPTER_DIR = "target_adapter"
RECORD_FILE = "training_record.json"
HISTORY_FILE = "draft_history.json"  # the per-step draft metrics (loss, acc_k, simulated tau) so far

# The files of a complete checkpoint, besides its weights (``model.safetensors``, or ``adapter_model.safetensors`` for
# a LoRA-adapted drafter).
CHECKPOINT_FILES = ("optimizer.pt", "scheduler.pt", "trainer_state.json")
RNG_FILE = "rng_state.pth"  # one process; a distributed run writes rng_state_{rank}.pth
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors")
_ASIDE_TAG = ".old-"  # ``.checkpoint-{step}.old-{pid}``: the previous copy of a step while it is saved again


def _checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder name: ``checkpoint-12`` -> 12, and a copy set aside while step 12 was being
    saved again, ``.checkpoint-12.old-345`` -> 12; ``None`` for any other name."""
    if name.startswith("." + CHECKPOINT_PREFIX) and _ASIDE_TAG in name:
        name = name[1 : name.index(_ASIDE_TAG)]
    if name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX) :].isdigit():
        return int(name[len(CHECKPOINT_PREFIX) :])
    return None


def steps_done(checkpoint: str) -> int:
    """The optimizer steps a checkpoint had taken (its ``trainer_state.json``; the folder's name may be a set-aside
    copy's)."""
    with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as fh:
        return int(json.load(fh)["global_step"])


def checkpoint_missing_files(path: str) -> list[str]:
    """The files a complete checkpoint has and ``path`` lacks (all of them when ``path`` is not a folder)."""
    if not os.path.isdir(path):
        return [*CHECKPOINT_FILES, RNG_FILE, WEIGHT_FILES[0]]
    missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(path, f))]
    if not rng_files(path):
        missing.append(RNG_FILE)
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    return missing


def _newest_complete_checkpoint(output_dir: str, exclude: str | None = None) -> str | None:
    """The complete checkpoint of the highest step in ``output_dir``; at equal steps a ``checkpoint-N`` folder wins
    over a copy set aside by an interrupted re-save of step N."""
    candidates = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        step = _checkpoint_step(name)
        path = os.path.join(output_dir, name)
        if step is None or name == exclude or checkpoint_missing_files(path):
            continue
        candidates.append((step, not name.startswith("."), name))
    return os.path.join(output_dir, max(candidates)[2]) if candidates else None


# What a run leaves in its output folder, besides its checkpoints.
RUN_FILES = (LATEST_FILE, RECORD_FILE, "config.json", "model.safetensors", "adapter_config.json",
             "adapter_model.safetensors", ADAPTER_DIR)  # fmt: skip


def previous_run_files(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that a training run wrote (its checkpoints, pointer, record, final weights)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir) if n in RUN_FILES or _checkpoint_step(n) is not None)


def prepare_fresh_output_dir(output_dir: str, overwrite: bool, remove: bool = True) -> None:
    """Refuses to start a fresh run over another run's files (a later ``--resume`` would restore the old run, and
    checkpoint rotation would delete the new one's), or with ``overwrite`` removes them first (``remove``: this
    process does the removing; the other processes of a distributed run only check)."""
    found = previous_run_files(output_dir)
    if not found:
        return
    if not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise ValueError(
            f"{output_dir} already holds a training run ({shown}). Continue it with --resume "
            "(resume=True), start over with --overwrite-output-dir (overwrite_output_dir=True; its checkpoints "
            "and model are deleted first), or choose another --output-dir."
        )
    for name in found if remove else ():
        path = os.path.join(output_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def find_latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint in ``output_dir`` (``None`` if there is none).

    That is the one the latest-checkpoint pointer names. When it names a folder that is missing or incomplete (a
    crash while a step was saved again, or a folder changed by hand), the newest complete checkpoint is used
    instead, with a warning saying which.
    """
    pointer = os.path.join(output_dir, LATEST_FILE)
    if not os.path.exists(pointer):
        found = _newest_complete_checkpoint(output_dir)
        if found is None and os.path.isdir(output_dir):
            # Only incomplete ones: the newest, so that loading it says what is missing.
            names = [n for n in os.listdir(output_dir) if not n.startswith(".") and _checkpoint_step(n) is not None]
            found = os.path.join(output_dir, max(names, key=_checkpoint_step)) if names else None
        return found
    with open(pointer) as fh:
        name = fh.read().strip()
    path = os.path.join(output_dir, name)
    missing = checkpoint_missing_files(path)
    if not missing:
        return path
    fallback = _newest_complete_checkpoint(output_dir, exclude=name)
    problem = "does not exist" if not os.path.isdir(path) else f"is incomplete (missing {missing})"
    if fallback is None:
        if os.path.isdir(path):
            return path  # loading it reports what is missing
        raise ValueError(
            f"{pointer} names {name!r}, which {problem}, and {output_dir} holds no other complete checkpoint. "
            "Delete the pointer file to start over, or restore the checkpoint."
        )
    warnings.warn(
        f"{pointer} names {name!r}, which {problem}; resuming from {os.path.basename(fallback)!r}, the newest "
        "complete checkpoint, instead.",
        stacklevel=2,
    )
    return fallback


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_DISK_FULL = re.compile(r"No space left|StorageFull|os error 28|code: 28|file write failed|Disk quota", re.IGNORECASE)


@contextlib.contextmanager
def saving(output_dir: str, what: str, tmp: str | None):
    """Writes inside the block go to ``tmp`` (a folder, or ``None`` when the block cleans up itself); if they fail,
    ``tmp`` is removed, and a full disk (``OSError`` ENOSPC, safetensors' ``SafetensorError`` or torch's
    ``file write failed``, each phrased its own way) is said as such, naming what was being saved."""
    try:
        yield
    except Exception as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        full = (isinstance(err, OSError) and err.errno == errno.ENOSPC) or _DISK_FULL.search(str(err))
        if not full:
            raise
        kept = find_latest_checkpoint(output_dir)
        intact = (
            f"the previous checkpoint {os.path.basename(kept)!r} is intact" if kept else "no checkpoint was saved yet"
        )
        raise OSError(
            errno.ENOSPC,
            f"No space left on the device while saving {what} in {output_dir} ({type(err).__name__}); {intact} and "
            "the partial files were removed. Free some space, then rerun with --resume.",
        ) from err


class UnsafeCheckpointError(Exception):
    pass


def _rng_safe_globals() -> list:
    """The only non-tensor types a checkpoint's state files hold: numpy's RNG state (an ``ndarray`` of ``uint32``)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain_state(checkpoint: str, name: str):
    """Loads ``optimizer.pt`` / ``scheduler.pt`` / ``rng_state*.pth`` without unpickling arbitrary objects.

    ``weights_only=True`` accepts tensors and plain Python data only (plus numpy's RNG state, allow-listed), so a
    checkpoint folder from elsewhere cannot run code on ``--resume``: anything else is refused unread.
    """
    import pickle

    path = os.path.join(checkpoint, name)
    try:
        with torch.serialization.safe_globals(_rng_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's message suggests weights_only=False: never pass that advice on. Keep only what was refused.
        text = str(err)
        if "Unsupported global" in text:
            what = text.split("Unsupported global:", 1)[1].split(" was not an allowed global")[0]
            what = what.replace("GLOBAL", "").strip()
            raise UnsafeCheckpointError(
                f"Refusing to resume from {checkpoint}: {name} holds a Python object ({what}) besides tensors and "
                "plain data, and loading it could run arbitrary code. hf-specdec never writes such objects, so the "
                "file was not written by hf-specdec or was tampered with; it was not loaded. Do not resume from this "
                f"checkpoint: delete it (and the '{LATEST_FILE}' pointer) to resume from an earlier one, or start a "
                "new run."
            ) from None
        detail = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation")[0].strip()
        raise pickle.UnpicklingError(f"{name} is not a readable state file: {detail or 'unreadable pickle'}") from None


def rng_files(path: str) -> list[str]:
    """The RNG state files of a checkpoint (``rng_state.pth``, or one ``rng_state_{rank}.pth`` per process)."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "rng_state*.pth")))


def check_state_files(checkpoint: str) -> None:
    """Reads every state file of ``checkpoint`` the pickle-free way before transformers' ``Trainer`` loads them, so a
    tampered file is refused with what to do, and a corrupt one is named."""
    import json

    try:
        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as fh:
            json.load(fh)
        for name in ("optimizer.pt", "scheduler.pt", *rng_files(checkpoint)):
            load_plain_state(checkpoint, name)
    except UnsafeCheckpointError as err:
        raise ValueError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise ValueError(
            f"Checkpoint {checkpoint} is corrupt ({type(err).__name__}: {err}). Delete it (and the "
            f"'{LATEST_FILE}' pointer) to resume from an earlier checkpoint."
        ) from err


def put_in_place(output_dir: str, tmp: str, name: str) -> None:
    """Renames the written ``tmp`` to ``output_dir/name`` and points ``latest_checkpoint`` at it. Saving a step again:
    the old folder is renamed aside first and deleted only once the new one is in place, so a complete copy of the
    step exists at every moment (resume falls back to it after a crash)."""
    final = os.path.join(output_dir, name)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(output_dir, f".{name}{_ASIDE_TAG}{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    with saving(output_dir, LATEST_FILE, None):
        atomic_write_text(os.path.join(output_dir, LATEST_FILE), name)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for stale in os.listdir(output_dir):  # copies left aside by earlier, interrupted re-saves
        if stale.startswith("." + CHECKPOINT_PREFIX) and _ASIDE_TAG in stale:
            shutil.rmtree(os.path.join(output_dir, stale), ignore_errors=True)


def rotate_checkpoints(output_dir: str, limit: int | None) -> None:
    """Keeps the ``limit`` checkpoints of the highest steps (all of them when ``limit`` is falsy)."""
    if not limit:
        return
    names = sorted(
        (n for n in os.listdir(output_dir) if not n.startswith(".") and _checkpoint_step(n) is not None),
        key=_checkpoint_step,
    )
    for old in names[:-limit]:
        shutil.rmtree(os.path.join(output_dir, old), ignore_errors=True)
