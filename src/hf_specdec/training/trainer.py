"""`DrafterTrainer`: trains any drafter family for a frozen target, on one CPU or many GPUs (accelerate).

The trainer never branches on the family: it asks the drafter for ``compute_loss(batch, features, target_head,
**loss_kwargs)`` (only the loss kwargs the family declares in ``loss_kwargs``; ramped ones come from its
``loss_schedule``), for its optimizer groups (``optimizer_param_groups``) and for its data-dependent initialisation
(``init_from_data``). Target features come either from the batch (offline features dumped with ``hf-specdec
dump-features``) or from running the target inside the step (online). A family with ``trains_target_adapter`` gets
its peft adapter (``target_adapter_config()``) put on the target and trained with it: features then carry gradients
through the adapter, the teacher is the target under ``disable_adapter()``, and the adapter is checkpointed and saved
(``target_adapter/``) with the drafter.

Metrics are sums (``DraftLossOutput.metrics``) reduced key by key over batches and processes; rates (per-depth
accuracy, the walked simulated τ) are derived from the sums at the end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import random
import re
import resource
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..features import TargetFeatures, logit_softcap
from .features import capture_target_features

__all__ = ["DrafterTrainingArguments", "DrafterTrainer", "TrainingMetrics", "find_latest_checkpoint"]

CHECKPOINT_PREFIX = "checkpoint-"
LATEST_FILE = "latest_checkpoint"
ADAPTER_DIR = "target_adapter"
RECORD_FILE = "training_record.json"


@dataclass
class DrafterTrainingArguments:
    """Options of :class:`DrafterTrainer` (the ``hf-specdec train`` flags map onto these)."""

    output_dir: str
    num_train_epochs: float = 1.0
    max_steps: int = -1  # optimizer steps; > 0 overrides num_train_epochs
    batch_size: int = 8  # per process
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    warmup_ratio: float = 0.03
    warmup_steps: int = 0  # > 0 overrides warmup_ratio
    lr_scheduler_type: str = "cosine"  # any transformers scheduler name: linear, cosine, constant_with_warmup, ...
    max_grad_norm: float = 0.5
    mixed_precision: str = "no"  # no | bf16 | fp16
    loss_kwargs: dict | None = None  # fixed keyword arguments of compute_loss (must be declared by the family)
    save_steps: int = 200
    save_total_limit: int | None = 2
    eval_steps: int = 100
    logging_steps: int = 10
    seed: int = 0
    group_by_length: bool = True
    report_to: str = "auto"  # none | tensorboard | wandb | auto (whatever is installed)
    progress: bool = True
    stop_after_steps: int = -1  # > 0: stop (with a checkpoint) after this step; --resume continues the same schedule
    overwrite_output_dir: bool = False  # a fresh run into a folder holding another run clears that run first

    def __post_init__(self):
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be no, bf16 or fp16, got {self.mixed_precision!r}.")
        for name in ("batch_size", "gradient_accumulation_steps", "save_steps", "eval_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("Set max_steps > 0 or num_train_epochs > 0.")


@dataclass
class TrainingMetrics:
    """Aggregated draft metrics: the mean loss, the family's summed metrics and the rates derived from them.

    ``sums`` holds ``DraftLossOutput.metrics`` summed key by key (float64, CPU); ``rates`` the family's
    ``name -> (numerator, denominator)`` definitions (``acc`` per depth, ``simulated_tau`` from the walk).
    """

    loss_sum: float = 0.0
    batches: int = 0
    tokens: int = 0
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    rates: dict[str, tuple[str, str]] = field(default_factory=dict)

    def add(self, out, tokens: int) -> None:
        self.add_sums({k: v.detach().double().cpu() for k, v in out.metrics.items()})
        self.loss_sum += float(out.loss.detach())
        self.batches += 1
        self.tokens += tokens
        self.rates.update(out.rates)

    def add_sums(self, sums: dict[str, torch.Tensor]) -> None:
        for key, value in sums.items():
            if key in self.sums and self.sums[key].shape != value.shape:
                raise ValueError(
                    f"Metric {key!r} changed shape from {tuple(self.sums[key].shape)} to {tuple(value.shape)}; a "
                    "family's metrics must keep one shape per key."
                )
        for key, value in sums.items():
            self.sums[key] = value.clone() if key not in self.sums else self.sums[key] + value

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.batches)

    def rate(self, name: str) -> float | list[float] | None:
        """A derived rate (a list for a vector numerator); ``None`` when its sums are missing or the denominator is 0."""
        num_key, den_key = self.rates.get(name, (None, None))
        if num_key not in self.sums or den_key not in self.sums:
            return None
        num, den = self.sums[num_key], self.sums[den_key]
        if num.dim() == 0:
            return float(num / den) if float(den) > 0 else None
        return (num / den.clamp(min=1)).tolist()

    @property
    def accuracy(self) -> list[float]:
        """Per-depth accuracy ``acc_j`` (teacher forced)."""
        value = self.rate("acc")
        return [] if value is None else ([value] if isinstance(value, float) else value)

    @property
    def simulated_tau(self) -> float:
        """τ of the sequences walked pass by pass as the decoding loop does (greedy, teacher forced): mean committed
        tokens per pass (``nan`` when no pass was walked)."""
        value = self.rate("simulated_tau")
        return float("nan") if value is None else float(value)

    def as_dict(self, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {f"{prefix}loss": round(self.loss, 5)}
        for name in self.rates:
            value = self.rate(name)
            if isinstance(value, list):
                for j, v in enumerate(value):
                    out[f"{prefix}{name}_{j}"] = round(v, 4)
            else:
                out[f"{prefix}{name}"] = None if value is None else round(value, 4)
        return out


# The files of a complete checkpoint, besides its weights (``model.safetensors``, or ``adapter_model.safetensors`` for
# a LoRA-adapted drafter).
CHECKPOINT_FILES = ("optimizer.pt", "scheduler.pt", "rng_state.pt", "trainer_state.json")
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


def checkpoint_missing_files(path: str) -> list[str]:
    """The files a complete checkpoint has and ``path`` lacks (all of them when ``path`` is not a folder)."""
    if not os.path.isdir(path):
        return [*CHECKPOINT_FILES, WEIGHT_FILES[0]]
    missing = [f for f in CHECKPOINT_FILES if not os.path.isfile(os.path.join(path, f))]
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


def _fresh_accelerator(args: DrafterTrainingArguments, log_with):
    """An ``Accelerator`` for one trainer. accelerate keeps one AcceleratorState per process; a trainer built after
    another one (e.g. with other mixed-precision or accumulation settings) starts from a fresh one. The process group
    (PartialState) stays."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    # Several processes on a machine without accelerators: accelerate needs `cpu=True` to set up gloo DDP.
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    return Accelerator(
        cpu=multi_cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=log_with or None,
        project_dir=args.output_dir,
    )


def _pad_token_id(target) -> int:
    pad = getattr(target.config, "pad_token_id", None)
    if pad is None:
        eos = getattr(target.config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return int(pad)


def _atomic_write_text(path: str, text: str) -> None:
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
def _saving(output_dir: str, what: str, tmp: str | None):
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


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _UnsafeCheckpointError(Exception):
    pass


def _rng_safe_globals() -> list:
    """The only non-tensor types a checkpoint's state files hold: numpy's RNG state (an ``ndarray`` of ``uint32``)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _load_plain_state(checkpoint: str, name: str):
    """Loads ``optimizer.pt`` / ``scheduler.pt`` / ``rng_state.pt`` without unpickling arbitrary objects.

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
            raise _UnsafeCheckpointError(
                f"Refusing to resume from {checkpoint}: {name} holds a Python object ({what}) besides tensors and "
                "plain data, and loading it could run arbitrary code. hf-specdec never writes such objects, so the "
                "file was not written by hf-specdec or was tampered with; it was not loaded. Do not resume from this "
                f"checkpoint: delete it (and the '{LATEST_FILE}' pointer) to resume from an earlier one, or start a "
                "new run."
            ) from None
        detail = text.split("WeightsUnpickler error:", 1)[-1].split("Check the documentation")[0].strip()
        raise pickle.UnpicklingError(f"{name} is not a readable state file: {detail or 'unreadable pickle'}") from None


class _LossModule(nn.Module):
    """Routes features and loss through ``forward`` so DDP/FSDP wrappers see the call (gradient synchronisation).

    A trained target adapter is a submodule here (the peft-wrapped target), so its gradients are synchronised too.
    """

    def __init__(self, drafter, adapted_target=None):
        super().__init__()
        self.drafter = drafter
        if adapted_target is not None:
            self.adapted_target = adapted_target

    def forward(self, batch, features_fn, target_head, loss_kwargs):
        return self.drafter.compute_loss(batch, features_fn(batch), target_head, **loss_kwargs)


def _target_vocab_size(target, drafter) -> int:
    """The number of token ids ``target`` embeds (and the drafter counts): the smaller of its embedding rows and the
    drafter's ``target_vocab_size``."""
    sizes = []
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    if getattr(embeddings, "num_embeddings", None) is not None:
        sizes.append(int(embeddings.num_embeddings))
    declared = getattr(getattr(drafter, "config", None), "target_vocab_size", None)
    if declared is not None:
        sizes.append(int(declared))
    if not sizes:
        raise ValueError(f"Cannot tell the vocabulary size of {type(target).__name__}.")
    return min(sizes)


def _loggable(values: dict) -> dict:
    """Trackers take numbers only: a rate without data (``None``) is left out."""
    return {k: v for k, v in values.items() if v is not None}


def _is_offline(dataset) -> bool:
    return dataset is not None and len(dataset) > 0 and "target_hidden_states" in dataset[0]


class DrafterTrainer:
    """Trains ``drafter`` to draft for the frozen ``target``.

    Args:
        drafter: a :class:`~hf_specdec.DrafterPreTrainedModel` (fresh or pretrained).
        target: the target causal LM; frozen (``requires_grad_(False)``) and never modified, except for a family with
            ``trains_target_adapter``: its peft adapter is injected into ``target`` (in place) and trained, and
            ``trainer.target`` is then the peft model.
        args: :class:`DrafterTrainingArguments`.
        train_dataset / eval_dataset: datasets of dicts with ``input_ids``, ``loss_mask`` (and, for offline features,
            ``target_hidden_states`` / ``target_last_hidden``).
        collate_fn: batches items; defaults to right padding with the target's pad id.
        data_info: free-form description of the data, stored in the training record.
        on_step: called as ``on_step(step, metrics_dict)`` after every optimizer step (e.g. for custom logging).
    """

    def __init__(
        self,
        drafter,
        target,
        args: DrafterTrainingArguments,
        train_dataset,
        eval_dataset=None,
        collate_fn: Callable | None = None,
        data_info: dict | None = None,
        on_step: Callable[[int, dict], None] | None = None,
    ):
        from .data import DataCollator, ResumableBatchSampler, check_has_loss_tokens, check_token_ids

        self.args = args
        self.drafter = drafter
        # A PEFT-wrapped drafter (LoRA adaptation): only adapter weights train and are saved.
        self.is_peft = hasattr(drafter, "peft_config")
        self.target = target
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.data_info = data_info or {}
        self.on_step = on_step
        log_with = self._trackers(args.report_to)
        self.log_with = log_with
        self.accelerator = _fresh_accelerator(args, log_with)
        self.collate_fn = collate_fn or DataCollator(pad_token_id=_pad_token_id(target))

        self.loss_kwarg_names = tuple(getattr(drafter, "loss_kwargs", ()))
        unknown = sorted(set(args.loss_kwargs or {}) - set(self.loss_kwarg_names))
        if unknown:
            raise ValueError(
                f"{type(self._base_drafter(drafter)).__name__} does not take the loss kwargs {unknown}; it declares "
                f"{list(self.loss_kwarg_names) or 'none'}."
            )
        self.trains_adapter = bool(getattr(drafter, "trains_target_adapter", False))
        target.requires_grad_(False)
        target.eval()
        if not getattr(target, "hf_device_map", None):
            target.to(self.accelerator.device)
        base_target = target
        if self.trains_adapter:
            target = self._add_target_adapter(drafter, target, train_dataset, eval_dataset)
            self.target = target
        drafter.bind_target(base_target)
        drafter.to(self.accelerator.device)
        self.target_head = target.get_output_embeddings()

        check_has_loss_tokens(train_dataset)
        # An id the target does not have fails deep inside it (or is miscounted): refuse it here, naming its line.
        vocab = _target_vocab_size(base_target, drafter)
        lengths = check_token_ids(train_dataset, vocab, "training")
        if eval_dataset is not None:
            check_token_ids(eval_dataset, vocab, "held-out")
        self.sampler = ResumableBatchSampler(
            lengths, args.batch_size, shuffle=True, seed=args.seed, group_by_length=args.group_by_length
        )
        world = self.accelerator.num_processes
        if len(self.sampler) < world:
            raise ValueError(
                f"The training data gives {len(self.sampler)} batches per epoch, fewer than the {world} processes; "
                "add data or lower the batch size."
            )
        per_epoch = max(1, len(self.sampler) // world)
        self.micro_batches_per_epoch = per_epoch
        if args.max_steps > 0:
            self.total_steps = args.max_steps
        else:
            self.total_steps = max(1, math.ceil(args.num_train_epochs * per_epoch / args.gradient_accumulation_steps))
        warmup = args.warmup_steps if args.warmup_steps > 0 else int(args.warmup_ratio * self.total_steps)

        self.optimizer = torch.optim.AdamW(
            self._param_groups(drafter, target), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2)
        )
        from transformers import get_scheduler

        self.scheduler = get_scheduler(
            args.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup, num_training_steps=self.total_steps
        )
        self.loss_module, self.optimizer, self.scheduler = self.accelerator.prepare(
            _LossModule(drafter, target if self.trains_adapter else None), self.optimizer, self.scheduler
        )
        self.step = 0
        self.history: list[dict] = []
        self.eval_history: list[dict] = []

    # ------------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _trackers(report_to: str) -> list[str]:
        import importlib.util

        if report_to == "none":
            return []
        available = [
            name for name, mod in (("tensorboard", "tensorboard"), ("wandb", "wandb")) if importlib.util.find_spec(mod)
        ]
        if report_to == "auto":
            return available[:1]
        if report_to not in ("tensorboard", "wandb"):
            raise ValueError(f"report_to must be none, auto, tensorboard or wandb; got {report_to!r}.")
        if report_to not in available:
            raise ValueError(f"report_to={report_to!r} but the {report_to} package is not installed.")
        return [report_to]

    @property
    def unwrapped_drafter(self):
        return self.accelerator.unwrap_model(self.loss_module).drafter

    @staticmethod
    def _base_drafter(drafter):
        """The family model under a peft-wrapped drafter (``--lora``), the drafter itself otherwise."""
        get_base = getattr(drafter, "get_base_model", None)
        return get_base() if callable(get_base) else drafter

    def _add_target_adapter(self, drafter, target, train_dataset, eval_dataset):
        """Puts the family's trainable peft adapter on ``target``; returns the peft model."""
        name = type(self._base_drafter(drafter)).__name__
        if self.is_peft:
            raise ValueError(f"{name} trains a target adapter; LoRA adaptation of the drafter itself is not supported.")
        if hasattr(target, "peft_config"):
            raise ValueError(
                f"{name} trains its own target adapter: pass the plain target model, not a peft model (the trainer "
                "adds the adapter from the family's target_adapter_config())."
            )
        if _is_offline(train_dataset) or _is_offline(eval_dataset):
            raise ValueError(
                f"{name} trains a target adapter, so the target's features change during training: offline "
                "features (hf-specdec dump-features) cannot be used. Train with online features (--data)."
            )
        from peft import get_peft_model

        config = self._base_drafter(drafter).target_adapter_config()
        torch.manual_seed(self.args.seed)  # the adapter's initialisation is part of a reproducible run
        adapted = get_peft_model(target, config)
        head = adapted.get_output_embeddings()
        if any("lora_" in n for n, _ in head.named_parameters()) or not isinstance(head, nn.Linear):
            raise ValueError(
                f"{name}'s target adapter must not adapt the LM head: the teacher's soft labels and the drafter read "
                "the target's head."
            )
        if not any(p.requires_grad for p in adapted.parameters()):
            raise ValueError(f"{name}'s target adapter config matches no module of {type(target).__name__}.")
        adapted.eval()
        return adapted

    def _param_groups(self, drafter, target) -> list[dict]:
        """The family's optimizer groups, checked to cover every trainable parameter exactly once."""
        adapter = [p for p in target.parameters() if p.requires_grad] if self.trains_adapter else None
        groups = drafter.optimizer_param_groups(self.args.learning_rate, self.args.weight_decay, adapter)
        names = {id(p): n for n, p in drafter.named_parameters() if p.requires_grad}
        if adapter:
            names.update({id(p): f"target.{n}" for n, p in target.named_parameters() if p.requires_grad})
        if not names:
            raise ValueError("The drafter has no trainable parameters.")
        seen: dict[int, int] = {}
        for group in groups:
            group["params"] = list(group["params"])
            for p in group["params"]:
                seen[id(p)] = seen.get(id(p), 0) + 1
        twice = [names.get(i, "<unknown>") for i, c in seen.items() if c > 1]
        missing = [n for i, n in names.items() if i not in seen]
        foreign = [i for i in seen if i not in names]
        if twice or missing or foreign:
            raise ValueError(
                f"optimizer_param_groups of {type(self._base_drafter(drafter)).__name__} must list every trainable "
                f"parameter exactly once: missing {missing[:5]}, repeated {twice[:5]}, "
                f"{len(foreign)} frozen or unknown parameters."
            )
        return groups

    def loss_kwargs_at(self, step: int) -> dict:
        """The loss kwargs of optimizer step ``step`` (0-based): the family's schedule, then the fixed ones."""
        kwargs = dict(self._base_drafter(self.unwrapped_drafter).loss_schedule(step, self.total_steps))
        undeclared = sorted(set(kwargs) - set(self.loss_kwarg_names))
        if undeclared:
            raise ValueError(f"loss_schedule returned {undeclared}, which the family does not declare in loss_kwargs.")
        kwargs.update(self.args.loss_kwargs or {})
        return kwargs

    def _features(self, batch: dict) -> TargetFeatures:
        softcap = logit_softcap(self.target.config)
        if "target_hidden_states" in batch:
            hs = batch["target_hidden_states"]
            hs = list(hs) if isinstance(hs, (list, tuple)) else list(hs.unbind(1))
            dtype = next(self.unwrapped_drafter.parameters()).dtype
            feats = TargetFeatures(hidden_states=hs, last_hidden=batch["target_last_hidden"], softcap=softcap)
            return feats.to(self.accelerator.device, dtype)
        layer_ids = self.unwrapped_drafter.config.target_layer_ids or []
        ids = batch["input_ids"]
        return capture_target_features(
            self.target,
            ids,
            batch.get("attention_mask"),
            layer_ids,
            with_grad=self.trains_adapter,
            teacher_without_adapter=self.trains_adapter,
        )

    def _to_device(self, batch: dict) -> dict:
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.to(self.accelerator.device)
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                out[key] = [v.to(self.accelerator.device) for v in value]
            else:
                out[key] = value
        return out

    def _micro_batches(self):
        """Endless stream of this process's batches.

        Every process draws the same ``world`` global batches per micro-step and keeps its own, so the sampler state
        (the data position saved in checkpoints) is identical on all processes after every micro-step.
        """
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        while True:
            group = []
            for indices in self.sampler:  # the rest of the current epoch, then the sampler moves to the next one
                group.append(indices)
                if len(group) == world:
                    yield self.collate_fn([self.train_dataset[j] for j in group[rank]])
                    group = []

    # ------------------------------------------------------------------------------------------------ data init
    def token_counts(self) -> torch.Tensor:
        """Counts of loss tokens in the training data over the target vocabulary."""
        vocab = self.unwrapped_drafter.config.target_vocab_size
        counts = torch.zeros(vocab, dtype=torch.long)
        for i in range(len(self.train_dataset)):
            item = self.train_dataset[i]
            ids = torch.as_tensor(item["input_ids"])
            mask = torch.as_tensor(item["loss_mask"]).bool()
            counts += torch.bincount(ids[mask], minlength=vocab)  # ids are checked against the vocabulary in __init__
        return counts

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _declare_adapter(self) -> None:
        """Records the trained target adapter (folder and weight fingerprint) in the drafter's config, so that
        generation refuses a target without it (``DrafterPreTrainedModel.check_target_adapter``)."""
        if self.trains_adapter:
            from ..modeling_utils import adapter_fingerprint

            self.unwrapped_drafter.config.target_adapter = {
                "subfolder": ADAPTER_DIR,
                "fingerprint": adapter_fingerprint(self.target),
            }

    def save_checkpoint(self) -> str:
        """Writes ``checkpoint-{step}`` atomically (temp folder, then rename) and updates the latest pointer. A write
        that fails (a full disk, most often) removes its temporaries and leaves the previous checkpoint in place."""
        acc = self.accelerator
        acc.wait_for_everyone()
        name = f"{CHECKPOINT_PREFIX}{self.step}"
        final = os.path.join(self.args.output_dir, name)
        if acc.is_main_process:
            os.makedirs(self.args.output_dir, exist_ok=True)
            tmp = os.path.join(self.args.output_dir, f".{name}.tmp-{os.getpid()}")
            with _saving(self.args.output_dir, name, tmp):
                self._write_checkpoint_files(tmp)
            self._put_in_place(tmp, final, name)
            self._rotate_checkpoints()
        acc.wait_for_everyone()
        return final

    def _write_checkpoint_files(self, folder: str) -> None:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        self._declare_adapter()
        self.unwrapped_drafter.save_pretrained(folder)
        if self.trains_adapter:
            self.target.save_pretrained(os.path.join(folder, ADAPTER_DIR))
        torch.save(self.optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
        torch.save(self.scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        torch.save(_rng_state(), os.path.join(folder, "rng_state.pt"))
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "sampler": self.sampler.state_dict(),
            "history": self.history,
            "eval_history": self.eval_history,
            "args": asdict(self.args),
        }
        with open(os.path.join(folder, "trainer_state.json"), "w") as fh:
            json.dump(state, fh, indent=1)

    def _put_in_place(self, tmp: str, final: str, name: str) -> None:
        """Renames the written ``tmp`` to ``final``. Saving a step again: the old folder is renamed aside first and
        deleted only once the new one is in place, so a complete copy of the step exists at every moment (resume
        falls back to it after a crash)."""
        out = self.args.output_dir
        aside = None
        if os.path.exists(final):
            aside = os.path.join(out, f".{name}{_ASIDE_TAG}{os.getpid()}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        with _saving(out, LATEST_FILE, None):
            _atomic_write_text(os.path.join(out, LATEST_FILE), name)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        for stale in os.listdir(out):  # copies left aside by earlier, interrupted re-saves
            if stale.startswith("." + CHECKPOINT_PREFIX) and _ASIDE_TAG in stale:
                shutil.rmtree(os.path.join(out, stale), ignore_errors=True)

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        names = [
            n
            for n in os.listdir(self.args.output_dir)
            if n.startswith(CHECKPOINT_PREFIX) and n[len(CHECKPOINT_PREFIX) :].isdigit()
        ]
        names.sort(key=lambda n: int(n[len(CHECKPOINT_PREFIX) :]))
        for old in names[:-limit]:
            shutil.rmtree(os.path.join(self.args.output_dir, old), ignore_errors=True)

    def load_checkpoint(self, path: str) -> None:
        """Restores drafter, optimizer, scheduler, RNG and data position from ``path``."""
        from safetensors.torch import load_file

        weights_file = "adapter_model.safetensors" if self.is_peft else "model.safetensors"
        required = [weights_file, *CHECKPOINT_FILES]
        adapter_file = os.path.join(ADAPTER_DIR, "adapter_model.safetensors")
        if self.trains_adapter:
            required.append(adapter_file)
        missing = [f for f in required if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise ValueError(f"Checkpoint {path} is incomplete (missing {missing}); resume from another checkpoint.")
        try:
            with open(os.path.join(path, "trainer_state.json")) as fh:
                state = json.load(fh)
            weights = load_file(os.path.join(path, weights_file), device=str(self.accelerator.device))
            adapter_weights = (
                load_file(os.path.join(path, adapter_file), device=str(self.accelerator.device))
                if self.trains_adapter
                else None
            )
            opt_state = _load_plain_state(path, "optimizer.pt")
            sched_state = _load_plain_state(path, "scheduler.pt")
            rng = _load_plain_state(path, "rng_state.pt")
        except _UnsafeCheckpointError as err:
            raise ValueError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
            raise ValueError(
                f"Checkpoint {path} is corrupt ({type(err).__name__}: {err}). Delete it (and the "
                f"'{LATEST_FILE}' pointer) to resume from an earlier checkpoint."
            ) from err
        drafter = self.unwrapped_drafter
        if self.is_peft:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(drafter, weights)
            missing = [k for k in result.missing_keys if "lora_" in k]  # base weights are not in an adapter file
        else:
            result = drafter.load_state_dict(weights, strict=False)
            missing = list(result.missing_keys)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"Checkpoint {path} does not match this drafter (missing {missing}, unexpected "
                f"{result.unexpected_keys}); it was written for another drafter configuration."
            )
        if adapter_weights is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.target, adapter_weights)
            if result.unexpected_keys or [k for k in result.missing_keys if "lora_" in k]:
                raise ValueError(
                    f"The target adapter in checkpoint {path} does not match this family's adapter config "
                    f"(unexpected {result.unexpected_keys})."
                )
        self.optimizer.load_state_dict(opt_state)
        self.scheduler.load_state_dict(sched_state)
        _set_rng_state(rng)
        self.sampler.load_state_dict(state["sampler"])
        self.step = int(state["step"])
        self.history = state.get("history", [])
        self.eval_history = state.get("eval_history", [])

    # ------------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, dataset=None) -> TrainingMetrics:
        """Loss, per-depth accuracy and simulated τ on ``dataset`` (default: the held-out split)."""
        dataset = dataset if dataset is not None else self.eval_dataset
        metrics = TrainingMetrics()
        if dataset is None or len(dataset) == 0:
            return metrics
        module = self.loss_module
        module.eval()
        loss_kwargs = self.loss_kwargs_at(max(self.step - 1, 0))
        order = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        for start in range(0, len(order), self.args.batch_size):
            if (start // self.args.batch_size) % world != rank:
                continue
            batch = self._to_device(self.collate_fn([dataset[i] for i in order[start : start + self.args.batch_size]]))
            out = module(batch, self._features, self.target_head, loss_kwargs)
            metrics.add(out, int(batch["attention_mask"].sum()))
        module.train()
        if self.accelerator.num_processes > 1:
            metrics = self._all_reduce(metrics)
        return metrics

    def _all_reduce(self, metrics: TrainingMetrics) -> TrainingMetrics:
        """Sums evaluation metrics over processes key by key (each evaluated its own share of the held-out set)."""
        from accelerate.utils import gather_object

        payload = {
            "head": [metrics.loss_sum, metrics.batches, metrics.tokens],
            "sums": {k: v.tolist() for k, v in metrics.sums.items()},
            "rates": metrics.rates,
        }
        out = TrainingMetrics()
        for part in gather_object([payload]):
            out.loss_sum += float(part["head"][0])
            out.batches += int(part["head"][1])
            out.tokens += int(part["head"][2])
            out.add_sums({k: torch.tensor(v, dtype=torch.float64) for k, v in part["sums"].items()})
            out.rates.update({k: tuple(v) for k, v in part["rates"].items()})
        return out

    # ------------------------------------------------------------------------------------------------ training
    def train(self, resume: bool | str = False) -> dict:
        """Runs training; ``resume=True`` continues from the latest checkpoint in ``output_dir`` (or a path).

        Returns the training record (also written to ``output_dir/training_record.json``).
        """
        args, acc = self.args, self.accelerator
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        finished = self._begin(resume)
        if finished is not None:
            return finished
        if self.log_with:
            acc.init_trackers("hf_specdec", config={k: v for k, v in asdict(args).items() if v is not None})

        from tqdm.auto import tqdm

        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not (args.progress and acc.is_main_process),
            desc="training drafter",
        )
        module = self.loss_module
        module.train()
        stream = self._micro_batches()
        window = TrainingMetrics()
        t0, tokens0 = time.perf_counter(), 0
        while self.step < self.total_steps:
            step_metrics = TrainingMetrics()
            loss_kwargs = self.loss_kwargs_at(self.step)
            for _ in range(args.gradient_accumulation_steps):
                batch = self._to_device(next(stream))
                with acc.accumulate(module):
                    out = module(batch, self._features, self.target_head, loss_kwargs)
                    acc.backward(out.loss)
                    if acc.sync_gradients and args.max_grad_norm:
                        acc.clip_grad_norm_(module.parameters(), args.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                n_tok = int(batch["attention_mask"].sum())
                step_metrics.add(out, n_tok)
                window.add(out, n_tok)
                tokens0 += n_tok
            self.step += 1
            lrs = self.scheduler.get_last_lr()
            record = {"step": self.step, "lr": lrs[0], **step_metrics.as_dict()}
            if len(set(lrs)) > 1:
                record["group_lrs"] = list(lrs)
            if loss_kwargs:
                record["loss_kwargs"] = {
                    k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)
                    for k, v in loss_kwargs.items()
                }
            self.history.append(record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{step_metrics.loss:.3f}",
                acc0=f"{step_metrics.accuracy[0]:.2f}" if step_metrics.accuracy else "-",
                tau=f"{window.simulated_tau:.2f}",
            )
            if self.step % args.logging_steps == 0:
                if acc.trackers:
                    acc.log(_loggable(window.as_dict("train/")), step=self.step)
                window = TrainingMetrics()
            if self.eval_dataset is not None and self.step % args.eval_steps == 0:
                ev = self.evaluate()
                self.eval_history.append({"step": self.step, **ev.as_dict()})
                bar.write(f"step {self.step}: eval " + json.dumps(ev.as_dict()))
                if acc.trackers:
                    acc.log(_loggable(ev.as_dict("eval/")), step=self.step)
            if self.on_step is not None:
                self.on_step(self.step, record)
            if self.step % args.save_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()
            if 0 < args.stop_after_steps <= self.step < self.total_steps:
                if self.step % args.save_steps != 0:
                    self.save_checkpoint()
                bar.close()
                if acc.trackers:
                    acc.end_training()
                return {"steps": self.step, "total_steps": self.total_steps, "stopped_early": True}
        bar.close()
        elapsed = time.perf_counter() - t0
        return self._finish(elapsed, tokens0)

    def _begin(self, resume: bool | str) -> dict | None:
        """Loads the checkpoint to resume from (returning the record of a run that had already finished), or starts
        a fresh run: another run's files in ``output_dir`` are refused (or cleared with ``overwrite_output_dir``),
        and a fresh drafter is initialised from the data and the target."""
        args = self.args
        if resume:
            path = resume if isinstance(resume, str) else find_latest_checkpoint(args.output_dir)
            if path is None:
                raise ValueError(f"--resume: no checkpoint found in {args.output_dir}.")
            self.load_checkpoint(path)
            return self._finished_record(path)
        prepare_fresh_output_dir(args.output_dir, args.overwrite_output_dir, remove=self.accelerator.is_main_process)
        self.accelerator.wait_for_everyone()
        if self.step == 0 and not self.is_peft and not self.unwrapped_drafter.config._name_or_path:
            # A fresh drafter only (a loaded one keeps its draft vocabulary and weights when fine-tuned on new data).
            # Data first: a family's target initialisation may depend on it (e.g. the draft vocabulary's rows).
            self.unwrapped_drafter.init_from_data(self.token_counts())
            self.unwrapped_drafter.init_from_target(self.target)
        return None

    def _finished_record(self, checkpoint: str) -> dict | None:
        """The training record of a run that had already finished (resumed from its intact last checkpoint), else
        ``None``: a finished run is not finished again, so its record keeps its timings. (Resumed from a copy set
        aside by an interrupted save, it is finished again, which puts its last checkpoint back.)"""
        path = os.path.join(self.args.output_dir, RECORD_FILE)
        intact = os.path.basename(checkpoint) == f"{CHECKPOINT_PREFIX}{self.step}"
        if self.step < self.total_steps or not intact or not os.path.isfile(path):
            return None
        warnings.warn(
            f"{self.args.output_dir} had already finished (step {self.step} of {self.total_steps}): nothing to "
            "resume; its training record is kept as it is.",
            stacklevel=3,
        )
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)

    def _finish(self, elapsed: float, tokens: int) -> dict:
        acc, args = self.accelerator, self.args
        final_eval = self.evaluate() if self.eval_dataset is not None else None
        self.save_checkpoint()
        record = None
        if acc.is_main_process:
            drafter = self.unwrapped_drafter
            self._declare_adapter()
            with _saving(args.output_dir, "the trained drafter", None):
                drafter.save_pretrained(args.output_dir)
                if self.trains_adapter:
                    self.target.save_pretrained(os.path.join(args.output_dir, ADAPTER_DIR))
            peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            cfg = drafter.config
            from .. import __version__

            record = {
                "hf_specdec_version": __version__,
                "family": cfg.model_type,
                "lora_adapter": self.is_peft,
                "target_adapter": ADAPTER_DIR if self.trains_adapter else None,
                "target": {
                    "name_or_path": cfg.target_model_name_or_path,
                    "model_type": cfg.target_model_type,
                    "num_hidden_layers": cfg.target_num_hidden_layers,
                    "hidden_size": cfg.target_hidden_size,
                },
                "data": self.data_info,
                "steps": self.step,
                "total_steps": self.total_steps,
                "train_examples": len(self.train_dataset),
                "eval_examples": 0 if self.eval_dataset is None else len(self.eval_dataset),
                "final_train": self.history[-1] if self.history else None,
                "final_eval": None if final_eval is None else final_eval.as_dict(),
                "eval_history": self.eval_history,
                "tokens_per_second": round(tokens / elapsed, 1) if elapsed > 0 else None,
                "wall_time_s": round(elapsed, 2),
                "peak_rss_mb": round(peak_rss_mb, 1),
                "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)
                if torch.cuda.is_available()
                else None,
                "processes": acc.num_processes,
                "args": asdict(args),
            }
            _atomic_write_text(os.path.join(args.output_dir, RECORD_FILE), json.dumps(record, indent=1))
        if acc.trackers:
            acc.end_training()
        acc.wait_for_everyone()
        return record or {}
