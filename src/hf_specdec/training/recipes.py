"""High-level training entry points (what ``hf-specdec train`` calls)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .trainer import DrafterTrainer, DrafterTrainingArguments

__all__ = ["load_target", "make_drafter", "build_datasets", "train_drafter", "add_lora"]


def load_target(path: str, dtype: str = "auto", device_map: str | None = None, trust_remote_code: bool = False):
    """Loads a target causal LM and its tokenizer (local folder or Hub id)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    if device_map:
        kwargs["device_map"] = device_map
    try:
        target = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    except StrictDataclassError as err:  # a config.json field of the wrong type or value
        raise ValueError(
            f"The target config in {path} is not valid: {_one_line(err)}. Fix or replace its config.json."
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return target, tokenizer


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def make_drafter(target, drafter: Any = None, **config_overrides):
    """A drafter for ``target``: a family name (fresh, sized with ``for_target``; ``None``: the registry's default
    family), a path / Hub id of a trained drafter (checked against the target), or an existing drafter instance."""
    from ..auto import AutoModelForDrafting
    from ..modeling_utils import DrafterPreTrainedModel
    from ..registry import DRAFTERS, default_drafter_spec

    if drafter is None:
        drafter = default_drafter_spec().name
    if isinstance(drafter, DrafterPreTrainedModel):
        model = drafter
    elif isinstance(drafter, str) and drafter in DRAFTERS:
        config_class = DRAFTERS[drafter].config_class
        known = {k for cls in config_class.__mro__ for k in getattr(cls, "__annotations__", {})}
        unknown = sorted(set(config_overrides) - known)
        if unknown:  # a PretrainedConfig would keep a misspelt field silently
            raise ValueError(
                f"{config_class.__name__} has no field(s) {unknown}; its fields: {sorted(k for k in known if not k.startswith('_'))}."
            )
        config = config_class.for_target(target.config, **config_overrides)
        model = AutoModelForDrafting.from_config(config)
    elif isinstance(drafter, (str, os.PathLike)):
        _refuse_an_unknown_family_name(str(drafter), sorted(DRAFTERS))
        if config_overrides:
            raise ValueError("Architecture overrides only apply to a fresh drafter (a family name), not to a path.")
        model = AutoModelForDrafting.from_pretrained(drafter)
    else:
        raise ValueError(f"Unknown drafter {drafter!r}: pass a family name ({sorted(DRAFTERS)}), a path or a model.")
    model.check_target_compatibility(target)
    return model


def _refuse_an_unknown_family_name(drafter: str, families: list[str]) -> None:
    """A bare word that is neither a family nor a folder here is a mistyped family name: said at once, with the
    nearest names, instead of after the Hub's retries (a drafter on the Hub is named ``namespace/name``)."""
    import difflib

    if "/" in drafter or os.sep in drafter or os.path.exists(drafter):
        return
    near = difflib.get_close_matches(drafter.lower(), families, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    raise ValueError(
        f"{drafter!r} is not a drafter family and no folder {drafter!r} exists here.{hint} Families: "
        f"{', '.join(families)}; or give a drafter folder, or a Hub id as 'namespace/name'."
    )


def build_datasets(
    data: str | list, tokenizer, max_length: int = 2048, eval_fraction: float = 0.05, seed: int = 0
) -> tuple[Any, Any, dict]:
    """Tokenises a JSONL file (or list of records) and splits off a held-out set."""
    from .data import DrafterDataset, load_records, split_train_eval

    records = load_records(data) if isinstance(data, (str, os.PathLike)) else list(data)
    if not records:
        raise ValueError(
            f"{data!s} holds no training records: give one JSON object per line (see `hf-specdec train -h`)."
        )
    dataset = DrafterDataset.from_records(records, tokenizer, max_length=max_length)
    if len(dataset) == 0:
        raise ValueError(f"No usable training examples in {data!s} (all had no loss tokens).")
    train, held_out = split_train_eval(dataset, eval_fraction, seed=seed) if eval_fraction > 0 else (dataset, None)
    info = {
        "source": str(data) if isinstance(data, (str, os.PathLike)) else "in-memory records",
        "records": len(records),
        "examples": len(dataset),
        "dropped_without_loss_tokens": dataset.num_dropped,
        "tokens": dataset.num_tokens,
        "loss_tokens": dataset.num_loss_tokens,
        "max_length": max_length,
        "eval_fraction": eval_fraction,
    }
    return train, held_out, info


def train_drafter(
    target,
    tokenizer,
    data: str | list | None,
    args: DrafterTrainingArguments,
    drafter: Any = None,
    drafter_overrides: dict | None = None,
    features_dir: str | None = None,
    max_length: int = 2048,
    eval_fraction: float = 0.05,
    resume: bool = False,
    lora: dict | None = None,
    eval_features_dir: str | None = None,
    max_train_examples: int | None = None,
    eval_data: str | list | None = None,
) -> tuple[Any, dict]:
    """Trains a drafter for ``target`` and writes it (plus checkpoints and a training record) to ``args.output_dir``.

    With ``features_dir`` (written by ``hf-specdec dump-features``) the target's features are read from disk instead
    of being recomputed every step; ``data`` is then not needed. With ``lora`` (e.g. ``{"r": 8, "lora_alpha": 16}``)
    the drafter is adapted with a LoRA adapter (peft) instead of trained in full: ``output_dir`` then holds the
    adapter, loaded with ``PeftModel.from_pretrained(base_drafter, output_dir)``.

    ``eval_features_dir`` (offline) or ``eval_data`` (online, records like ``data``) is a separate held-out set
    (``eval_fraction`` is then not used), so runs on different amounts of training data, or offline and online runs,
    are scored on the same examples; ``max_train_examples`` trains on the first N training examples only (a
    data-scaling run on a prefix of one dump or data file).

    ``drafter_overrides={"draft_vocab_size": N}`` with a trained drafter (a path or a model) widens its draft
    vocabulary to ``N`` before fine-tuning (:meth:`~hf_specdec.DrafterPreTrainedModel.widened_draft_vocabulary`:
    the training data's most frequent other tokens join it, every trained weight is kept), and
    ``{"num_hidden_layers": N}`` deepens a trained drafter whose family stacks draft layers to ``N`` of them (its
    ``with_draft_layers``: the added layers start as identities), and ``{"context_vocabulary": True}`` gives a trained
    drafter a context vocabulary (its family's ``with_context_vocabulary``: the map fitted to its LM head); no other
    override applies to a trained drafter.

    Returns:
        ``(drafter, training_record)``.
    """
    from transformers import set_seed

    set_seed(args.seed)  # a fresh drafter's initialisation is part of a reproducible run
    overrides = dict(drafter_overrides or {})
    widen_to, deepen_to, context = _trained_drafter_changes(drafter, overrides)
    model = _deepened(make_drafter(target, drafter, **overrides), deepen_to)
    if context:
        model = _with_context_vocabulary(model, target)
    train, held_out, collate, info = _training_data(
        model, target, tokenizer, data, features_dir, eval_features_dir, max_train_examples, max_length,
        eval_fraction, args.seed, eval_data,
    )  # fmt: skip
    if widen_to is not None and widen_to != model.config.draft_vocab_size:
        from .data import loss_token_counts

        counts = loss_token_counts(train, model.config.target_vocab_size)
        model = model.widened_draft_vocabulary(widen_to, counts, target)
    if lora:
        model = add_lora(model, **lora)
    trainer = DrafterTrainer(model, target, args, train, held_out, collate_fn=collate, data_info=info)
    record = trainer.train(resume_from_checkpoint=resume)
    return trainer.unwrapped_drafter, record


def _trained_drafter_changes(drafter, overrides: dict) -> tuple[int | None, int | None, bool]:
    """``(draft vocabulary, draft layers, context vocabulary)`` asked for a trained drafter (``draft_vocab_size`` /
    ``num_hidden_layers`` / ``context_vocabulary`` among the overrides of a drafter given by path or as a model,
    taken out of them); ``None`` (``False``) for a fresh drafter or no such override."""
    from ..registry import DRAFTERS

    fresh = drafter is None or (isinstance(drafter, str) and drafter in DRAFTERS)
    if fresh:
        return None, None, False
    sizes = [
        None if overrides.get(k) is None else int(overrides.pop(k)) for k in ("draft_vocab_size", "num_hidden_layers")
    ]
    return sizes[0], sizes[1], bool(overrides.pop("context_vocabulary", False))


def _with_context_vocabulary(model, target):
    """``model`` with a context vocabulary (its family's ``with_context_vocabulary``)."""
    if not hasattr(model, "with_context_vocabulary"):
        raise ValueError(
            f"{type(model).__name__} has no context vocabulary: context_vocabulary applies to a drafter of a family "
            "that can draft from one (its config has a context_vocabulary field)."
        )
    return model.with_context_vocabulary(target)


def _deepened(model, layers: int | None):
    """``model`` with ``layers`` draft layers (its family's ``with_draft_layers``); itself when no depth is asked or
    it has that depth already."""
    if layers is None or layers == getattr(model.config, "num_hidden_layers", None):
        return model
    if not hasattr(model, "with_draft_layers"):
        raise ValueError(
            f"{type(model).__name__} cannot be deepened (it has no with_draft_layers): num_hidden_layers applies to "
            "a trained drafter of a family that stacks draft layers, or to a fresh drafter of a family with that field."
        )
    return model.with_draft_layers(layers)


def _training_data(model, target, tokenizer, data, features_dir, eval_features_dir, max_train_examples, max_length,
                   eval_fraction, seed, eval_data=None):  # fmt: skip
    """``(train, held_out, collate, info)``: offline features from ``features_dir``, else records from ``data``; the
    held-out set is ``eval_features_dir`` / ``eval_data`` when given, else an ``eval_fraction`` split."""
    if features_dir:
        if eval_data is not None:
            raise ValueError("eval_data is the held-out set of online training (data); with features_dir pass "
                             "eval_features_dir, a dump of the held-out records.")  # fmt: skip
        train, held_out, collate, info = _offline_data(model, target, tokenizer, features_dir, eval_features_dir,
                                                       eval_fraction, seed)  # fmt: skip
    else:
        if data is None:
            raise ValueError("Pass training data (a JSONL file) or an offline features directory.")
        if eval_features_dir:
            raise ValueError("eval_features_dir is the held-out dump of offline training (features_dir); with data "
                             "pass eval_data, the held-out records.")  # fmt: skip
        train, held_out, info = _online_data(data, eval_data, tokenizer, max_length, eval_fraction, seed)
        collate = None
    if max_train_examples is not None:
        train = torch.utils.data.Subset(train, range(min(max_train_examples, len(train))))
        info["max_train_examples"] = max_train_examples
    return train, held_out, collate, info


def _online_data(data, eval_data, tokenizer, max_length, eval_fraction, seed):
    """``(train, held_out, info)`` from records: ``eval_data`` is the held-out set, else an ``eval_fraction`` split."""
    split = 0.0 if eval_data is not None else eval_fraction
    train, held_out, info = build_datasets(data, tokenizer, max_length, split, seed)
    if eval_data is not None:
        held_out, _, eval_info = build_datasets(eval_data, tokenizer, max_length, 0.0)
        info["held_out"] = {"source": eval_info["source"], "examples": eval_info["examples"]}
    return train, held_out, info


def _offline_data(model, target, tokenizer, features_dir, eval_features_dir, eval_fraction, seed):
    """``(train, held_out, collate, info)`` from dumped features, checked against the target (the trainer serves
    each dump the drafter's layers)."""
    from .data import split_train_eval
    from .offline import OfflineFeatureDataset, collate_offline

    dataset = OfflineFeatureDataset(features_dir)
    dataset.check_target(target, tokenizer)
    if eval_features_dir:
        train, held_out = dataset, OfflineFeatureDataset(eval_features_dir)
        held_out.check_target(target, tokenizer)
    else:
        train, held_out = _split_indices(dataset, eval_fraction, seed, split_train_eval)
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0

    def collate(items):
        return collate_offline(items, pad)

    return train, held_out, collate, {"source": str(features_dir), "offline_features": True, **dataset.metadata}


def add_lora(drafter, r: int = 8, lora_alpha: int = 16, lora_dropout: float = 0.0, target_modules=None):
    """Wraps ``drafter`` with a LoRA adapter (peft) on the family's ``lora_target_modules``."""
    from peft import LoraConfig, get_peft_model

    modules = target_modules or list(getattr(drafter, "lora_target_modules", ()))
    if not modules:
        raise ValueError(f"{type(drafter).__name__} declares no `lora_target_modules`; pass target_modules.")
    config = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=modules)
    return get_peft_model(drafter, config)


def _split_indices(dataset, eval_fraction, seed, split_fn):
    """Held-out split for datasets that are not `DrafterDataset`s (index subsets, same rule)."""
    if eval_fraction <= 0:
        return dataset, None
    n = len(dataset)
    n_eval = min(max(1, round(n * eval_fraction)), n - 1) if n >= 2 else 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    eval_idx, train_idx = sorted(perm[:n_eval]), sorted(perm[n_eval:])
    return torch.utils.data.Subset(dataset, train_idx), torch.utils.data.Subset(dataset, eval_idx)
