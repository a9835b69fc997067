#!/usr/bin/env python
"""What computing the drafter's linear layers in bf16 gives speculative decoding, measured in one interleaved run.

``hf-specdec demo`` and ``bench`` compute an fp32 drafter's CPU linear layers in bf16 with weights packed for oneDNN
by default (:func:`hf_specdec.pack_draft_weights`; ``--draft-kernels stock`` turns it off). The target's output is
unchanged; what changes is a draft step's cost, and perhaps which drafts are accepted. This script measures both on
the same packed target in one run: plain ``generate``, then the packaged drafter as it is and a second copy of it
with bf16 weights, each with the adaptive length and with a fixed chain, every row timed prompt by prompt against
plain ``generate``.

Usage::

    python scripts/draft_kernels_bench.py --threads 2             # SmolLM2, 2 Spec-Bench prompts per category
    python scripts/draft_kernels_bench.py --target demo-code      # the code demo target, its 8 prompts

Writes ``model_cards/results/{smollm2,demo-code}-draft-kernels.{json,md,png}`` (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import demo_bench_args, demo_bench_prompts, write_bench_report  # noqa: E402


def methods(drafter_path: str, num_draft_tokens: int | None):
    """The drafter in fp32 and a bf16-packed copy of it, adaptive, then with a fixed chain; and the packed copies."""
    from hf_specdec import AutoModelForDrafting, pack_draft_weights
    from hf_specdec.bench.runner import drafter_method

    fp32, bf16 = (AutoModelForDrafting.from_pretrained(drafter_path).eval() for _ in range(2))
    packed = pack_draft_weights(bf16)
    rows = []
    for length in ("adaptive", "fixed"):
        for name, drafter in (("fp32", fp32), ("bf16", bf16)):
            label = f"drafter {name}, {length}"
            rows.append(drafter_method(drafter, name=label, draft_length=length, num_draft_tokens=num_draft_tokens))
    return rows, packed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_bench_args(p, "draft-kernels")
    p.add_argument("--k", type=int, default=None, help="draft tokens of the fixed chain (default: the drafter's)")
    args = p.parse_args(argv)

    from hf_specdec.bench.runner import run_benchmark
    from hf_specdec.demo import demo_drafter_path, get_demo_target

    torch.set_num_threads(args.threads)
    spec = get_demo_target(args.target)
    target, tokenizer = spec.load(dtype="float32")
    rows, packed = methods(demo_drafter_path(spec), args.k)
    prompts = demo_bench_prompts(spec, args.max_prompts)
    report = run_benchmark(
        target,
        tokenizer,
        rows,
        prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        draft_kernels="stock",  # the bf16 rows' drafter is packed above; the fp32 rows' stays as it is
        config={
            "target": spec.title,
            "bf16_drafter": f"a second copy of the drafter with pack_draft_weights ({len(packed)} layers)",
            "command": "python scripts/draft_kernels_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        },
    )
    write_bench_report(report, args.out, args.stem or f"{args.target}-draft-kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
