"""The `train` command: a drafter for a target, online or from dumped features."""

from __future__ import annotations

import argparse

from .common import add_target_args, drafter_overrides, json_or_text, load_target


def _loss_kwargs(args) -> dict | None:
    """``--loss-kwarg KEY=VALUE`` (VALUE read as JSON, else a string) and ``--ttt-steps N`` (loss kwarg ``steps``)."""

    out = {}
    for item in getattr(args, "loss_kwarg", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--loss-kwarg expects KEY=VALUE, got {item!r}")
        out[key] = json_or_text(value)
    if getattr(args, "ttt_steps", None):
        out["steps"] = args.ttt_steps
    return out or None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text}")
    return value


def _leave_process_group() -> None:
    """Ends the process group a launcher (``torchrun``, ``accelerate launch``) started, on every rank: a process that
    exits with it still up can abort in its communication threads ("terminate called without an active exception")
    and fail the whole launch after a finished run. accelerate's state knows which group is its to end."""
    from accelerate import PartialState

    PartialState().destroy_process_group()


def _train(args) -> int:
    try:
        return _run_training(args)
    finally:
        _leave_process_group()


def _run_training(args) -> int:
    from ..training.recipes import train_drafter
    from ..training.trainer import DrafterTrainingArguments

    target, tokenizer = load_target(args)
    targs = DrafterTrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_ratio,  # below 1: TrainingArguments reads it as a fraction of the run
        lr_scheduler_type=args.scheduler,
        max_grad_norm=args.max_grad_norm,
        bf16=args.mixed_precision == "bf16",
        fp16=args.mixed_precision == "fp16",
        loss_kwargs=_loss_kwargs(args),
        stop_after_steps=args.stop_after_steps,
        overwrite_output_dir=args.overwrite_output_dir,
        save_steps=args.save_steps,
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        report_to=args.report_to,
    )
    drafter, record = train_drafter(
        target,
        tokenizer,
        args.data,
        targs,
        drafter=args.drafter,
        drafter_overrides=drafter_overrides(args),
        features_dir=args.features,
        eval_features_dir=args.eval_features,
        eval_data=args.eval_data,
        max_train_examples=args.max_train_examples,
        max_length=args.max_length,
        eval_fraction=args.eval_fraction,
        resume=args.resume,
        lora={"r": args.lora_r, "lora_alpha": args.lora_alpha} if args.lora else None,
    )
    if record.get("stopped_early"):
        print(f"stopped after step {record['steps']} of {record['total_steps']}; continue with --resume")
    elif record:
        ev = record.get("final_eval") or {}
        print(
            f"saved {type(drafter).__name__} to {args.output_dir}: {record['steps']} steps, "
            f"{record.get('tokens_per_second')} tokens/s, held-out simulated tau {ev.get('simulated_tau')}"
        )
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("train", help="train a drafter for a target (online or offline target features)")
    add_target_args(p)
    p.add_argument(
        "--drafter", default=None, help="family name (fresh drafter; default: the default family) or a drafter path"
    )
    p.add_argument("--data", default=None, help="JSONL training data (chat, prompt/response, text or token ids)")
    p.add_argument("--features", default=None, help="offline features directory from dump-features")
    p.add_argument("--eval-features", default=None, help="a separate dump that is the held-out set (with --features)")
    p.add_argument("--eval-data", default=None, help="a separate JSONL file that is the held-out set (with --data)")
    p.add_argument("--max-train-examples", type=int, default=None, help="train on this many leading examples")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--overwrite-output-dir", action="store_true", help="start over in a folder holding another run")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=_fraction, default=0.03, help="warmup, as a fraction of the run (< 1)")
    p.add_argument("--scheduler", default="cosine")
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--ttt-steps", type=int, default=None, help="unrolled draft steps in the loss (loss kwarg steps)")
    p.add_argument("--loss-kwarg", action="append", metavar="KEY=VALUE", help="a loss kwarg the family declares")
    p.add_argument("--stop-after-steps", type=int, default=-1, help="stop after this step; --resume goes on")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="a fresh drafter's draft vocabulary; with a trained --drafter, widen its vocabulary to this size (the "
        "data's most frequent other tokens join it, trained weights kept)",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="a fresh drafter's draft decoder layers (num_hidden_layers, for families that stack them); with a trained "
        "--drafter whose family can deepen, deepen it to this many (the added layers start as identities, trained "
        "weights kept)",
    )
    p.add_argument("--layer-ids", type=int, nargs="+", default=None)
    p.add_argument(
        "--context-vocabulary",
        action="store_true",
        help="also draft the sequence's own tokens outside the draft vocabulary (context_vocabulary; for a trained "
        "--drafter: the map is added and fitted to its LM head, every trained weight kept)",
    )
    p.add_argument(
        "--config",
        action="append",
        metavar="KEY=VALUE",
        help="a config field of a fresh drafter (e.g. num_draft_tokens=3; VALUE read as JSON)",
    )
    p.add_argument("--save-steps", type=int, default=200)
    p.add_argument("--eval-steps", type=int, default=100)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="auto", choices=["auto", "none", "tensorboard", "wandb"])
    p.add_argument("--lora", action="store_true", help="adapt --drafter with a LoRA adapter instead of full training")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.set_defaults(func=_train)
