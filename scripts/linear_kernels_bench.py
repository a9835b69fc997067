#!/usr/bin/env python
"""What packing the target's linear weights for oneDNN gives speculative decoding, measured in one interleaved run.

``hf-specdec demo`` and ``bench`` pack an fp32 CPU target's linear weights by default
(:func:`hf_specdec.pack_linear_weights`): passes over a few tokens get much cheaper, and so may one-token steps (on a
2-core AMD VM at two threads; at one thread they cost what they did). Two demo runs, one packed and one not, differ
by more than that from the machine's noise alone, so this script measures both in the same run: the target as it is
(plain ``generate`` and the packaged drafter, adaptive length) and a second copy of it with packed weights (its own
plain row, which greedy outputs are checked against, and the drafter again), every row timed prompt by prompt
against the stock plain ``generate``. The packed plain row shows what packing does to plain decoding itself; the
packed drafter row over it is the drafter's own speedup, what ``demo`` and ``bench`` report.

``--rows measured all`` adds a copy packed for every call over 1-64 rows (as before the packing measured where it
pays) beside the default one, which packs only the row counts where this machine measured the packed kernel faster.

(The files from before the oneDNN packing, ``{smollm2,demo-code}-linear-kernels``, packed the weights for MKL and
computed one-token steps with the stock kernel.)

Usage::

    python scripts/linear_kernels_bench.py                      # SmolLM2, 2 Spec-Bench prompts per category
    python scripts/linear_kernels_bench.py --target demo-code   # the code demo target, its 8 prompts

Writes ``model_cards/results/{smollm2,demo-code}-linear-kernels.{json,md,png}`` (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import demo_bench_args, demo_bench_prompts, write_bench_report  # noqa: E402


def methods(copies: dict, drafter_path: str):
    """Plain and the drafter on the stock target, then for each packed copy (``{name: model}``) a plain row and the
    drafter on it."""
    from hf_specdec import AutoModelForDrafting
    from hf_specdec.bench.runner import drafter_method, plain_method

    def drafter():
        return AutoModelForDrafting.from_pretrained(drafter_path).eval()

    rows = [plain_method(), drafter_method(drafter(), name="drafter, stock target")]
    for name, target_copy in copies.items():
        packed_plain = plain_method(name=f"plain, {name} target", target=target_copy)
        packed = drafter_method(drafter(), name=f"drafter, {name} target")
        packed.target, packed.reference = target_copy, packed_plain.name
        rows += [packed_plain, packed]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_bench_args(p, "linear-kernels")
    p.add_argument(
        "--rows",
        nargs="+",
        default=["measured"],
        choices=["measured", "all"],
        help="the packed copies' row plans (pack_linear_weights(rows=...)), one copy each: measured (the default, "
        "the calls over the row counts this machine measured the packed kernel faster at) / all (every call)",
    )
    args = p.parse_args(argv)

    from hf_specdec import pack_linear_weights
    from hf_specdec.bench.runner import run_benchmark
    from hf_specdec.demo import demo_drafter_path, get_demo_target

    torch.set_num_threads(args.threads)
    spec = get_demo_target(args.target)
    target, tokenizer = spec.load(dtype="float32")
    copies, plans = {}, {}
    for rows in args.rows:
        name = "packed" if rows == "measured" else f"packed ({rows} rows)"
        copies[name] = spec.load(dtype="float32")[0]
        plans[name] = pack_linear_weights(copies[name], rows=rows).row_plans()
    prompts = demo_bench_prompts(spec, args.max_prompts)
    report = run_benchmark(
        target,
        tokenizer,
        methods(copies, demo_drafter_path(spec)),
        prompts,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        linear_kernels="stock",
        config={
            "target": spec.title,
            "packed_copies": {
                name: f"a copy of the target, pack_linear_weights rows per shape {plan}" for name, plan in plans.items()
            },  # fmt: skip
            "command": "python scripts/linear_kernels_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        },
    )
    write_bench_report(report, args.out, args.stem or f"{args.target}-linear-kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
