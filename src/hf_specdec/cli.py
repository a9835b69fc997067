"""``hf-specdec`` command line. Thin: parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _families(args) -> int:
    from . import DRAFTERS

    width = max(len(name) for name in DRAFTERS)
    for name, spec in sorted(DRAFTERS.items()):
        print(f"{name:<{width}}  {spec.model_type:<20}  {spec.model_class.__name__:<22}  {spec.description}")
    return 0


def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    ok = run_selfcheck(
        architectures=args.arch, batch_sizes=args.batch, num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens
    )
    return 0 if ok else 1


def _load_target(args):
    from .training.recipes import load_target

    return load_target(args.target, dtype=args.dtype, device_map=args.device_map)


def _regenerate(args) -> int:
    from .training.data import load_records
    from .training.regenerate import regenerate

    target, tokenizer = _load_target(args)
    written = regenerate(
        target,
        tokenizer,
        load_records(args.data),
        args.output,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size,
        resume=not args.no_resume,
        seed=args.seed,
    )
    print(f"wrote {written} regenerated records to {args.output}")
    return 0


def _drafter_overrides(args) -> dict:
    out = {}
    if getattr(args, "num_draft_tokens", None):
        out["num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "draft_vocab_size", None):
        out["draft_vocab_size"] = args.draft_vocab_size
    if getattr(args, "layer_ids", None):
        out["target_layer_ids"] = args.layer_ids
    return out


def _dump_features(args) -> int:
    from .training.offline import dump_features
    from .training.recipes import build_datasets, make_drafter

    target, tokenizer = _load_target(args)
    drafter = make_drafter(target, args.drafter, **_drafter_overrides(args))
    dataset, _, info = build_datasets(args.data, tokenizer, args.max_length, eval_fraction=0.0)
    examples = [dataset[i] for i in range(len(dataset))]
    index = dump_features(
        target,
        examples,
        drafter.config.target_layer_ids,
        args.output_dir,
        dtype=args.feature_dtype,
        batch_size=args.batch_size,
        resume=not args.no_resume,
    )
    print(f"dumped features of {index.get('num_examples', len(examples))} examples to {args.output_dir}")
    return 0


def _train(args) -> int:
    from .training.recipes import train_drafter
    from .training.trainer import DrafterTrainingArguments

    target, tokenizer = _load_target(args)
    targs = DrafterTrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        lr_scheduler_type=args.scheduler,
        max_grad_norm=args.max_grad_norm,
        mixed_precision=args.mixed_precision,
        ttt_steps=args.ttt_steps,
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
        drafter_overrides=_drafter_overrides(args),
        features_dir=args.features,
        max_length=args.max_length,
        eval_fraction=args.eval_fraction,
        resume=args.resume,
        lora={"r": args.lora_r, "lora_alpha": args.lora_alpha} if args.lora else None,
    )
    if record:
        ev = record.get("final_eval") or {}
        print(
            f"saved {type(drafter).__name__} to {args.output_dir}: {record['steps']} steps, "
            f"{record.get('tokens_per_second')} tokens/s, held-out simulated tau {ev.get('simulated_tau')}"
        )
    return 0


def _add_target_args(p) -> None:
    p.add_argument("--target", required=True, help="target model: local folder or Hub id")
    p.add_argument("--dtype", default="auto", help="target dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device-map", default=None, help='accelerate placement of the target, e.g. "auto"')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("families", help="list the registered drafter families")
    p.set_defaults(func=_families)

    p = sub.add_parser(
        "selfcheck",
        help="build tiny targets of several architectures and check that speculative decoding reproduces plain "
        "generate token for token (greedy), with an EAGLE-3 drafter and a replay drafter",
    )
    p.add_argument("--arch", nargs="+", default=["llama", "qwen2", "qwen3", "mistral", "gemma"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 3])
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=_selfcheck)

    p = sub.add_parser("regenerate", help="self-distillation: let the target answer the prompts of a JSONL file")
    _add_target_args(p)
    p.add_argument("--data", required=True, help="JSONL of chat (messages) or prompt records")
    p.add_argument("--output", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-resume", action="store_true", help="start over instead of continuing an existing output")
    p.set_defaults(func=_regenerate)

    p = sub.add_parser("dump-features", help="write the target features a drafter trains on to disk (offline)")
    _add_target_args(p)
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--drafter", default="eagle3", help="family name (its default layers) or a drafter path")
    p.add_argument("--layer-ids", type=int, nargs="+", default=None, help="override the target layers to store")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--feature-dtype", default="bfloat16", help="storage dtype: bfloat16, float16 or float32")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-resume", action="store_true")
    p.set_defaults(func=_dump_features)

    p = sub.add_parser("train", help="train a drafter for a target (online or offline target features)")
    _add_target_args(p)
    p.add_argument("--drafter", default="eagle3", help="family name (fresh drafter) or a trained drafter path")
    p.add_argument("--data", default=None, help="JSONL training data (chat, prompt/response, text or token ids)")
    p.add_argument("--features", default=None, help="offline features directory from dump-features")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--scheduler", default="cosine")
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--ttt-steps", type=int, default=None, help="unrolled draft steps in the loss")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--save-steps", type=int, default=200)
    p.add_argument("--eval-steps", type=int, default=100)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="auto", choices=["auto", "none", "tensorboard", "wandb"])
    p.add_argument("--lora", action="store_true", help="adapt --drafter with a LoRA adapter instead of full training")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
