#!/usr/bin/env python
"""What cheaper drafter linear layers give speculative decoding, measured in one interleaved run.

``hf-specdec demo`` and ``bench`` compute an fp32 drafter's CPU linear layers with cheaper weights by default
(:func:`hf_specdec.pack_draft_weights`: ``--draft-kernels bf16|int8|stock``). The target's output is unchanged; what
changes is a draft step's cost, and perhaps which drafts are accepted. This script measures both on the same packed
target in one run: plain ``generate``, then one copy of the packaged drafter per kind of weights (``stock``: as it
is), each with the adaptive length and with a fixed chain, every row timed prompt by prompt against plain
``generate``.

Usage::

    python scripts/draft_kernels_bench.py --threads 2             # SmolLM2, 2 Spec-Bench prompts per category
    python scripts/draft_kernels_bench.py --weights bf16 int8     # only these two kinds
    python scripts/draft_kernels_bench.py --target demo-code      # the code demo target, its 8 prompts

Writes ``model_cards/results/{smollm2,demo-code}-draft-kernels.{json,md,png}`` (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

from hf_specdec.cpu_kernels import DRAFT_KERNELS

sys.path.insert(0, os.path.dirname(__file__))
from results_files import demo_bench_args, demo_bench_prompts, write_bench_report  # noqa: E402


def methods(drafter_path: str, num_draft_tokens: int | None, kinds: list[str]):
    """One copy of the drafter per kind of weights, adaptive, then with a fixed chain; and the packed layers."""
    from hf_specdec import AutoModelForDrafting, PackedLinears, pack_draft_weights
    from hf_specdec.bench.runner import drafter_method

    drafters, packed = {}, PackedLinears([])
    for kind in kinds:
        drafters[kind] = AutoModelForDrafting.from_pretrained(drafter_path).eval()
        if kind != "stock":
            packed.modules += pack_draft_weights(drafters[kind], weights=kind).modules
    rows = []
    for length in ("adaptive", "fixed"):
        for kind, drafter in drafters.items():
            label = f"drafter {'fp32' if kind == 'stock' else kind}, {length}"
            rows.append(drafter_method(drafter, name=label, draft_length=length, num_draft_tokens=num_draft_tokens))
    return rows, packed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_bench_args(p, "draft-kernels")
    p.add_argument("--k", type=int, default=None, help="draft tokens of the fixed chain (default: the drafter's)")
    p.add_argument(
        "--weights",
        nargs="+",
        choices=DRAFT_KERNELS,
        default=["stock", *(k for k in DRAFT_KERNELS if k != "stock")],
        help="the drafter copies compared (default: stock, then each kind of cheaper weights)",
    )
    args = p.parse_args(argv)

    from hf_specdec.bench.runner import run_benchmark
    from hf_specdec.demo import demo_drafter_path, get_demo_target

    torch.set_num_threads(args.threads)
    spec = get_demo_target(args.target)
    target, tokenizer = spec.load(dtype="float32")
    rows, packed = methods(demo_drafter_path(spec), args.k, args.weights)
    prompts = demo_bench_prompts(spec, args.max_prompts)
    report = run_benchmark(
        target,
        tokenizer,
        rows,
        prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        draft_kernels="stock",  # each row's drafter is packed above as it should be
        config={
            "target": spec.title,
            "drafter_weights": f"one copy of the drafter per kind, {', '.join(args.weights)}: pack_draft_weights "
            f"({len(packed)} layers in all)",
            "command": "python scripts/draft_kernels_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        },
    )
    write_bench_report(report, args.out, args.stem or f"{args.target}-draft-kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
