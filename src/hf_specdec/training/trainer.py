"""`DrafterTrainer`: trains any drafter family for a frozen target, as a :class:`transformers.Trainer`.

It takes :class:`transformers.TrainingArguments` (or :class:`DrafterTrainingArguments`, the same with this
project's defaults and three drafter options), so ``report_to`` integrations, DeepSpeed/FSDP configs, ``optim``
choices, schedulers and gradient accumulation work as in any Hugging Face trainer.

The trainer never branches on the family: it asks the drafter for ``compute_loss(batch, features, target_head,
**loss_kwargs)`` (only the loss kwargs the family declares in ``loss_kwargs``; ramped ones come from its
``loss_schedule``), for its optimizer groups (``optimizer_param_groups``) and for its data-dependent initialisation
(``init_from_data``). Target features come either from the batch (offline features dumped with ``hf-specdec
dump-features``) or from running the target inside the step (online). A family with ``trains_target_adapter`` gets
its peft adapter (``target_adapter_config()``) put on the target and trained with it: features then carry gradients
through the adapter, the teacher is the target under ``disable_adapter()``, and the adapter is checkpointed and saved
(``target_adapter/``) with the drafter.

What is this project's own on top of ``Trainer``: checkpoints are written to a temporary folder and renamed into
place, with a ``latest_checkpoint`` pointer and a fallback to the newest complete one (``checkpoints.py``); state
files are checked pickle-free before ``Trainer`` reads them; the batch order is a pure function of ``(seed,
epoch)`` (``ResumableBatchSampler``), so a resumed run continues bit for bit; and the draft metrics. Metrics are
sums (``DraftLossOutput.metrics``) reduced key by key over batches and processes; rates (per-depth accuracy, the
walked simulated τ) are derived from the sums, logged with every ``logging_steps`` and evaluation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import resource
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..features import TargetFeatures, logit_softcap
from .checkpoints import (
    ADAPTER_DIR,
    CHECKPOINT_PREFIX,
    HISTORY_FILE,
    RECORD_FILE,
    atomic_write_text,
    check_state_files,
    checkpoint_missing_files,
    find_latest_checkpoint,
    prepare_fresh_output_dir,
    put_in_place,
    rotate_checkpoints,
    saving,
    steps_done,
)
from .features import capture_target_features

__all__ = ["DrafterTrainingArguments", "DrafterTrainer", "TrainingMetrics", "find_latest_checkpoint"]


@dataclass
class DrafterTrainingArguments(TrainingArguments):
    """:class:`transformers.TrainingArguments` with defaults for drafters, plus the drafter options below.

    A plain ``TrainingArguments`` works too (then without these options, and with its own defaults).
    ``warmup_steps`` below 1 is a fraction of the run, as in ``TrainingArguments``. ``report_to="auto"`` reports to
    TensorBoard or W&B, whichever is installed (none if neither is).
    """

    learning_rate: float = 3e-4
    adam_beta2: float = 0.95
    warmup_steps: float = 0.03
    lr_scheduler_type: str = "cosine"
    max_grad_norm: float = 0.5
    per_device_train_batch_size: int = 8
    save_steps: float = 200
    save_total_limit: int | None = 2
    eval_strategy: str = "steps"
    eval_steps: float | None = 100
    logging_steps: float = 10
    remove_unused_columns: bool = False
    report_to: Any = "auto"
    # The drafter options:
    loss_kwargs: dict | None = field(default=None, metadata={"help": "fixed keyword arguments of compute_loss"})
    group_by_length: bool = field(default=True, metadata={"help": "batches of similar lengths (less padding)"})
    stop_after_steps: int = field(
        default=-1, metadata={"help": "> 0: stop (with a checkpoint) after this step; resume continues the schedule"}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "a fresh run into a folder holding another run clears that run first"}
    )

    def __post_init__(self):
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("Set max_steps > 0 or num_train_epochs > 0.")
        if not torch.accelerator.is_available():
            self.use_cpu = True  # what TrainingArguments asks for bf16 on a CPU; nothing else to choose from here
        if self.report_to == "auto":
            installed = [name for name in ("tensorboard", "wandb") if importlib.util.find_spec(name)]
            self.report_to = installed[:1] or "none"
        super().__post_init__()


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


def _pad_token_id(target) -> int:
    pad = getattr(target.config, "pad_token_id", None)
    if pad is None:
        eos = getattr(target.config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return int(pad)


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


class _DraftSteps(TrainerCallback):
    """Hands each finished optimizer step to the trainer (its draft-metrics record) and stops after
    ``stop_after_steps`` with a checkpoint."""

    def __init__(self, trainer: DrafterTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._record_step()
        if 0 < args.stop_after_steps <= state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True
        return control


def _loggable(values: dict) -> dict:
    """Trackers take numbers only: a rate without data (``None``) is left out."""
    return {k: v for k, v in values.items() if v is not None}


def _read_weights(checkpoint: str, name: str) -> dict:
    from safetensors.torch import load_file

    try:
        return load_file(os.path.join(checkpoint, name))
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise ValueError(
            f"Checkpoint {checkpoint} is corrupt ({type(err).__name__}: {err}). Delete it (and the "
            "'latest_checkpoint' pointer) to resume from an earlier checkpoint."
        ) from err


def _drafter_arguments(args: TrainingArguments, has_eval_data: bool) -> DrafterTrainingArguments:
    """``args`` as :class:`DrafterTrainingArguments` (a plain ``TrainingArguments`` keeps its values, and gets the
    drafter options' defaults), without evaluation when there is no held-out data."""
    _refuse_unsupported(args)
    if not isinstance(args, DrafterTrainingArguments):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
        args = DrafterTrainingArguments(**values)
    if not has_eval_data and args.eval_strategy != "no":
        args = dataclasses.replace(args, eval_strategy="no")
    return args


def _refuse_unsupported(args) -> None:
    """``Trainer`` options whose work this trainer's own checkpointing replaces, refused rather than ignored."""
    if args.load_best_model_at_end:
        raise ValueError(
            "load_best_model_at_end is not supported for drafters: every checkpoint's eval metrics are in its "
            f"trainer_state.json and {HISTORY_FILE}; load the checkpoint you want with from_pretrained."
        )
    if args.push_to_hub:
        raise ValueError(
            "push_to_hub is not supported while training a drafter: push the trained drafter with its model card "
            "afterwards (`hf-specdec push` or drafter.push_to_hub)."
        )


def _is_offline(dataset) -> bool:
    return dataset is not None and len(dataset) > 0 and "target_hidden_states" in dataset[0]


def _serve_drafter_layers(dataset, drafter_config) -> None:
    """Dumped target features (an ``OfflineFeatureDataset``, or an index subset of one) serve the drafter's
    ``target_layer_ids`` in its order, checked here however the dump reaches the trainer: a dump handed over directly
    is otherwise read with the layers it happens to store, and a drafter of other layers trains or scores on the wrong
    states without an error. (Which target the dump came from is checked where it is opened, with the tokenizer:
    ``train_drafter``.)"""
    while hasattr(dataset, "dataset") and not hasattr(dataset, "check_compatible"):
        dataset = dataset.dataset  # torch.utils.data.Subset
    if hasattr(dataset, "check_compatible"):
        dataset.check_compatible(drafter_config)


class DrafterTrainer(Trainer):
    """Trains ``drafter`` to draft for the frozen ``target``: a :class:`transformers.Trainer`.

    Args:
        drafter: a :class:`~hf_specdec.DrafterPreTrainedModel` (fresh or pretrained), or a peft-wrapped one (LoRA).
        target: the target causal LM; frozen (``requires_grad_(False)``) and never modified, except for a family with
            ``trains_target_adapter``: its peft adapter is injected into ``target`` (in place) and trained, and
            ``trainer.target`` is then the peft model.
        args: :class:`DrafterTrainingArguments` or :class:`transformers.TrainingArguments`.
        train_dataset / eval_dataset: datasets of dicts with ``input_ids``, ``loss_mask`` (and, for offline features,
            ``target_hidden_states`` / ``target_last_hidden``).
        collate_fn: batches items; defaults to right padding with the target's pad id.
        data_info: free-form description of the data, stored in the training record.
        on_step: called as ``on_step(step, record)`` after every optimizer step (e.g. for custom logging).
        callbacks: more :class:`transformers.TrainerCallback` s.

    ``train()`` returns the training record (also written to ``output_dir/training_record.json``); ``evaluate()``
    returns ``Trainer``'s metrics dict (``eval_loss``, ``eval_acc_0``, ..., ``eval_simulated_tau``) and
    :meth:`draft_metrics` the :class:`TrainingMetrics` behind it.
    """

    def __init__(self, drafter, target, args: TrainingArguments, train_dataset, eval_dataset=None,
                 collate_fn: Callable | None = None, data_info: dict | None = None,
                 on_step: Callable[[int, dict], None] | None = None, callbacks: list | None = None):  # fmt: skip
        from .data import DataCollator, ResumableBatchSampler

        args = _drafter_arguments(args, eval_dataset is not None)
        self.is_peft = hasattr(drafter, "peft_config")  # a LoRA-adapted drafter: only adapter weights train and save
        self.trains_adapter = bool(getattr(drafter, "trains_target_adapter", False))
        self.loss_kwarg_names = self._checked_loss_kwargs(drafter, args.loss_kwargs)
        self.data_info, self.on_step = data_info or {}, on_step
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._step_metrics, self._window, self._tokens = TrainingMetrics(), TrainingMetrics(), 0
        self._started, self._earlier_wall_time, self._resumed_at = time.perf_counter(), 0.0, None
        target.requires_grad_(False)
        target.eval()
        self.target = target
        if self.trains_adapter:
            self.target = self._add_target_adapter(drafter, target, train_dataset, eval_dataset, args.seed)
        drafter.bind_target(target)
        self._optimizer_groups = self._param_groups(drafter, self.target, args)
        lengths = self._checked_data(train_dataset, eval_dataset, target, drafter)
        self.sampler = ResumableBatchSampler(
            lengths, args.per_device_train_batch_size, shuffle=True, seed=args.seed,
            group_by_length=args.group_by_length,
        )  # fmt: skip
        super().__init__(
            model=_LossModule(drafter, self.target if self.trains_adapter else None),
            args=args,
            data_collator=collate_fn or DataCollator(pad_token_id=_pad_token_id(target)),
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=[_DraftSteps(self), *(callbacks or [])],
        )
        if not getattr(target, "hf_device_map", None):
            target.to(self.args.device)
        self.target_head = self.target.get_output_embeddings()
        if len(self.sampler) < self.args.world_size:
            raise ValueError(
                f"The training data gives {len(self.sampler)} batches per epoch, fewer than the "
                f"{self.args.world_size} processes; add data or lower the batch size."
            )

    # ------------------------------------------------------------------------------------------------ set-up checks
    @classmethod
    def _checked_loss_kwargs(cls, drafter, fixed: dict | None) -> tuple[str, ...]:
        names = tuple(getattr(drafter, "loss_kwargs", ()))
        unknown = sorted(set(fixed or {}) - set(names))
        if unknown:
            raise ValueError(
                f"{type(cls._base_drafter(drafter)).__name__} does not take the loss kwargs {unknown}; it declares "
                f"{list(names) or 'none'}."
            )
        return names

    @staticmethod
    def _checked_data(train_dataset, eval_dataset, target, drafter) -> list[int]:
        """The training examples' lengths, once the data has loss tokens and only ids the target has (an id the
        target does not have fails deep inside it, or is miscounted: it is refused here, naming its line)."""
        from .data import check_has_loss_tokens, check_token_ids

        for dataset in (train_dataset, eval_dataset):
            _serve_drafter_layers(dataset, DrafterTrainer._base_drafter(drafter).config)
        check_has_loss_tokens(train_dataset)
        vocab = _target_vocab_size(target, drafter)
        lengths = check_token_ids(train_dataset, vocab, "training")
        if eval_dataset is not None:
            check_token_ids(eval_dataset, vocab, "held-out")
        return lengths

    @property
    def unwrapped_drafter(self):
        return self.model.drafter

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.global_step

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run (``Trainer``'s count: epochs of ``ceil(batches / accumulation)``)."""
        if self.state.max_steps > 0:
            return self.state.max_steps
        if self.args.max_steps > 0:
            return self.args.max_steps
        batches = -(-len(self.sampler) // self.args.world_size)
        per_epoch = max(-(-batches // self.args.gradient_accumulation_steps), 1)
        return max(1, math.ceil(self.args.num_train_epochs * per_epoch))

    @staticmethod
    def _base_drafter(drafter):
        """The family model under a peft-wrapped drafter (``--lora``), the drafter itself otherwise."""
        get_base = getattr(drafter, "get_base_model", None)
        return get_base() if callable(get_base) else drafter

    def _add_target_adapter(self, drafter, target, train_dataset, eval_dataset, seed: int):
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
        torch.manual_seed(seed)  # the adapter's initialisation is part of a reproducible run
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

    def _param_groups(self, drafter, target, args) -> list[dict]:
        """The family's optimizer groups, checked to cover every trainable parameter exactly once."""
        adapter = [p for p in target.parameters() if p.requires_grad] if self.trains_adapter else None
        groups = drafter.optimizer_param_groups(args.learning_rate, args.weight_decay, adapter)
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

    # ------------------------------------------------------------------------------------------------ Trainer hooks
    def get_train_dataloader(self):
        """Batches in the sampler's order, a pure function of ``(seed, epoch)``: on resume ``Trainer`` skips the
        batches already trained on and gets exactly the ones the interrupted run would have had next."""
        from torch.utils.data import DataLoader

        loader = DataLoader(
            self.train_dataset, batch_sampler=self.sampler, collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory and not self.args.use_cpu,
        )  # fmt: skip
        return self.accelerator.prepare(loader)

    def create_optimizer(self, model=None):
        """``args.optim``'s optimizer over the family's parameter groups."""
        if self.optimizer is None:
            optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = optimizer_cls(self._optimizer_groups, **kwargs)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(inputs, self._features, self.target_head, self.loss_kwargs_at(self.state.global_step))
        tokens = int(inputs["attention_mask"].sum())
        self._step_metrics.add(out, tokens)
        self._window.add(out, tokens)
        self._tokens += tokens
        return (out.loss, out) if return_outputs else out.loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer``'s training logs, with the draft metrics (acc_k, simulated τ) since the last log added."""
        if "loss" in logs and self._window.batches:
            logs = {**logs, **{k: v for k, v in _loggable(self._window.as_dict()).items() if k != "loss"}}
            self._window = TrainingMetrics()
        super().log(logs, start_time)

    def _record_step(self) -> None:
        """The history record of the optimizer step just done (called by :class:`_DraftSteps`)."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        record = {"step": self.state.global_step, "lr": lrs[0], **self._step_metrics.as_dict()}
        if len(set(lrs)) > 1:
            record["group_lrs"] = lrs
        loss_kwargs = self.loss_kwargs_at(self.state.global_step - 1)
        if loss_kwargs:
            record["loss_kwargs"] = {
                k: v if isinstance(v, (bool, int, float, str, type(None))) else repr(v) for k, v in loss_kwargs.items()
            }
        self.history.append(record)
        self._step_metrics = TrainingMetrics()
        if self.on_step is not None:
            self.on_step(self.state.global_step, record)

    # ------------------------------------------------------------------------------------------------ the family
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

    def token_counts(self) -> torch.Tensor:
        """Counts of loss tokens in the training data over the target vocabulary."""
        from .data import loss_token_counts

        return loss_token_counts(self.train_dataset, self.unwrapped_drafter.config.target_vocab_size)

    def _declare_adapter(self) -> None:
        """Records the trained target adapter (folder and weight fingerprint) in the drafter's config, so that
        generation refuses a target without it (``DrafterPreTrainedModel.check_target_adapter``)."""
        if self.trains_adapter:
            from ..modeling_utils import adapter_fingerprint

            self.unwrapped_drafter.config.target_adapter = {
                "subfolder": ADAPTER_DIR,
                "fingerprint": adapter_fingerprint(self.target),
            }

    # ------------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """``Trainer``'s evaluation: the draft metrics on ``eval_dataset`` (default: the held-out split), logged and
        returned as ``{prefix}_loss``, ``{prefix}_acc_0``, ..., ``{prefix}_simulated_tau``."""
        metrics = self.draft_metrics(eval_dataset)
        logs = {f"{metric_key_prefix}_{k}": v for k, v in _loggable(metrics.as_dict()).items()}
        if self.is_in_train:
            self.eval_history.append({"step": self.state.global_step, **metrics.as_dict()})
        self.log(logs)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, logs)
        return logs

    @torch.no_grad()
    def draft_metrics(self, dataset=None) -> TrainingMetrics:
        """Loss, per-depth accuracy and simulated τ on ``dataset`` (default: the held-out split)."""
        dataset = dataset if dataset is not None else self.eval_dataset
        metrics = TrainingMetrics()
        if dataset is None or len(dataset) == 0:
            return metrics
        was_training = self.model.training
        self.model.eval()
        loss_kwargs = self.loss_kwargs_at(max(self.state.global_step - 1, 0))
        size, rank, world = self.args.per_device_eval_batch_size, self.args.process_index, self.args.world_size
        order = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
        for start in range(rank * size, len(order), size * world):
            batch = self._prepare_inputs(self.data_collator([dataset[i] for i in order[start : start + size]]))
            with self.autocast_smart_context_manager():
                out = self.model(batch, self._features, self.target_head, loss_kwargs)
            metrics.add(out, int(batch["attention_mask"].sum()))
        self.model.train(was_training)
        return self._all_reduce(metrics) if world > 1 else metrics

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

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial) -> None:
        self.save_checkpoint()

    def save_checkpoint(self) -> str:
        """Writes ``checkpoint-{step}`` with ``Trainer``'s state files into a temporary folder, then renames it into
        place and updates the latest pointer. A write that fails (a full disk, most often) removes its temporaries
        and leaves the previous checkpoint in place."""
        out, name = self.args.output_dir, f"{CHECKPOINT_PREFIX}{self.state.global_step}"
        tmp = os.path.join(out, f".{name}.tmp")
        if self.args.should_save:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.accelerator.wait_for_everyone()
        with saving(out, name, tmp):
            self._write_checkpoint_files(tmp)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            put_in_place(out, tmp, name)
            rotate_checkpoints(out, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()
        return os.path.join(out, name)

    def _write_checkpoint_files(self, folder: str) -> None:
        self.store_flos()
        self.save_model(folder, _internal_call=True)
        self._save_optimizer_and_scheduler(folder)
        self._save_scaler(folder)
        self._save_rng_state(folder)
        if self.args.should_save:
            self.state.save_to_json(os.path.join(folder, "trainer_state.json"))
            history = {"history": self.history, "eval_history": self.eval_history}
            history.update(wall_time_s=self._wall_time(), tokens=self._tokens)
            with open(os.path.join(folder, HISTORY_FILE), "w", encoding="utf-8") as fh:
                json.dump(history, fh, indent=1)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The drafter (``save_pretrained``: its config and weights, or its LoRA adapter) and a trained target
        adapter in ``target_adapter/``."""
        output_dir = output_dir or self.args.output_dir
        self._declare_adapter()
        if state_dict is None:  # the gathered weights, where Trainer gathers them (FSDP, DeepSpeed)
            self.unwrapped_drafter.save_pretrained(output_dir)
        else:
            prefix = "drafter."
            own = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
            self.unwrapped_drafter.save_pretrained(output_dir, state_dict=own)
        if self.trains_adapter:
            self.target.save_pretrained(os.path.join(output_dir, ADAPTER_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Restores the drafter's weights (and a trained target adapter) from a checkpoint, checking they fit."""
        from peft import set_peft_model_state_dict

        path = resume_from_checkpoint
        weights = _read_weights(path, "adapter_model.safetensors" if self.is_peft else "model.safetensors")
        drafter = self.unwrapped_drafter
        if self.is_peft:
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
        if self.trains_adapter:
            adapter = _read_weights(path, os.path.join(ADAPTER_DIR, "adapter_model.safetensors"))
            result = set_peft_model_state_dict(self.target, adapter)
            if result.unexpected_keys or [k for k in result.missing_keys if "lora_" in k]:
                raise ValueError(
                    f"The target adapter in checkpoint {path} does not match this family's adapter config "
                    f"(unexpected {result.unexpected_keys})."
                )
        history_file = os.path.join(path, HISTORY_FILE)
        if os.path.isfile(history_file):
            with open(history_file, encoding="utf-8") as fh:
                saved = json.load(fh)
            self.history, self.eval_history = saved["history"], saved["eval_history"]
            # The time and tokens of the steps before the checkpoint count in the record of the finished run.
            self._earlier_wall_time, self._tokens = saved.get("wall_time_s", 0.0), saved.get("tokens", 0)

    def _checked_checkpoint(self, resume: bool | str) -> str:
        """The checkpoint to resume from (``True``: the latest in ``output_dir``), complete and safe to read."""
        path = resume if isinstance(resume, str) else find_latest_checkpoint(self.args.output_dir)
        if path is None:
            raise ValueError(f"--resume: no checkpoint found in {self.args.output_dir}.")
        missing = checkpoint_missing_files(path)
        weights = "adapter_model.safetensors" if self.is_peft else "model.safetensors"
        missing = [f for f in missing if f not in ("model.safetensors", "adapter_model.safetensors")]
        missing += [f for f in (weights, *([f"{ADAPTER_DIR}/adapter_model.safetensors"] if self.trains_adapter else []))
                    if not os.path.exists(os.path.join(path, f))]  # fmt: skip
        if missing:
            raise ValueError(f"Checkpoint {path} is incomplete (missing {missing}); resume from another checkpoint.")
        check_state_files(path)
        return path

    # ------------------------------------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: bool | str | None = None, **kwargs) -> dict:
        """Runs training; ``resume_from_checkpoint=True`` continues from the latest checkpoint in ``output_dir``
        (or from a path). Returns the training record (also written to ``output_dir/training_record.json``)."""
        checkpoint = self._checked_checkpoint(resume_from_checkpoint) if resume_from_checkpoint else None
        if checkpoint is not None:
            finished = self._finished_record(checkpoint)
            if finished is not None:
                return finished
        else:
            self._start_fresh()
        self._started, self._tokens = time.perf_counter(), 0
        self._resumed_at = steps_done(checkpoint) if checkpoint else None
        super().train(resume_from_checkpoint=checkpoint, **kwargs)
        if self.state.global_step < self.state.max_steps:
            return {"steps": self.state.global_step, "total_steps": self.state.max_steps, "stopped_early": True}
        return self._finish()

    def _wall_time(self) -> float:
        """Seconds spent training this drafter so far: this process's, and those of the runs it resumed (up to the
        checkpoint it resumed from; the steps redone after an interruption count once)."""
        return self._earlier_wall_time + time.perf_counter() - self._started

    def _start_fresh(self) -> None:
        """Refuses another run's files in ``output_dir`` (or clears them with ``overwrite_output_dir``), and
        initialises a fresh drafter from the data and the target."""
        prepare_fresh_output_dir(self.args.output_dir, self.args.overwrite_output_dir, remove=self.args.should_save)
        self.accelerator.wait_for_everyone()
        if not self.is_peft and not self.unwrapped_drafter.config._name_or_path:
            # A fresh drafter only (a loaded one keeps its draft vocabulary and weights when fine-tuned on new data).
            # Data first: a family's target initialisation may depend on it (e.g. the draft vocabulary's rows).
            self.unwrapped_drafter.init_from_data(self.token_counts())
            self.unwrapped_drafter.init_from_target(self.target)

    def _finished_record(self, checkpoint: str) -> dict | None:
        """The training record of a run that had already finished (resumed from its intact last checkpoint), else
        ``None``: a finished run is not finished again, so its record keeps its timings. (Resumed from a copy set
        aside by an interrupted save, it is finished again, which puts its last checkpoint back.)"""
        step, total = steps_done(checkpoint), self.total_steps
        path = os.path.join(self.args.output_dir, RECORD_FILE)
        intact = os.path.basename(checkpoint) == f"{CHECKPOINT_PREFIX}{step}"
        if step < total or not intact or not os.path.isfile(path):
            return None
        warnings.warn(
            f"{self.args.output_dir} had already finished (step {step} of {total}): nothing to resume; its training "
            "record is kept as it is.",
            stacklevel=3,
        )
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)

    def _finish(self) -> dict:
        """Saves the trained drafter to ``output_dir`` and writes its training record (and the last checkpoint, when a
        run resumed at its last step from a copy set aside by an interrupted save: that puts the checkpoint back)."""
        elapsed = self._wall_time()  # training only: the final evaluation and saving do not count
        last = os.path.join(self.args.output_dir, f"{CHECKPOINT_PREFIX}{self.state.global_step}")
        if checkpoint_missing_files(last):
            self.save_checkpoint()
        final_eval = self.draft_metrics() if self.eval_dataset is not None else None
        record = None
        if self.args.should_save:
            with saving(self.args.output_dir, "the trained drafter", None):
                self._save(self.args.output_dir)
            record = self._training_record(final_eval, elapsed)
            atomic_write_text(os.path.join(self.args.output_dir, RECORD_FILE), json.dumps(record, indent=1))
        self.accelerator.wait_for_everyone()
        return record or {}

    def _training_record(self, final_eval: TrainingMetrics | None, elapsed: float) -> dict:
        from .. import __version__

        cfg = self.unwrapped_drafter.config
        gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        return {
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
            "steps": self.state.global_step,
            "total_steps": self.state.max_steps,
            "train_examples": len(self.train_dataset),
            "eval_examples": 0 if self.eval_dataset is None else len(self.eval_dataset),
            "final_train": self.history[-1] if self.history else None,
            "final_eval": None if final_eval is None else final_eval.as_dict(),
            "eval_history": self.eval_history,
            "tokens": self._tokens,
            "tokens_per_second": round(self._tokens / elapsed, 1) if elapsed > 0 else None,
            "wall_time_s": round(elapsed, 2),
            "resumed_at_step": self._resumed_at,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "peak_gpu_mb": None if gpu_mb is None else round(gpu_mb, 1),
            "processes": self.args.world_size,
            "args": self.args.to_dict(),
        }
