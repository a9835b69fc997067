#!/usr/bin/env python
"""Which linear kernel is faster on this CPU, per layer shape and row count: the stock ``F.linear`` against the packed
fp32 kernel the target's layers use (:func:`hf_specdec.pack_linear_weights`) and the bf16 / int8 weights a drafter's
layers use (:func:`hf_specdec.pack_draft_weights`), on the shapes of SmolLM2-135M-Instruct and its packaged drafter.

This is what ``rows="measured"`` (the default of both) measures, once per shape, when it packs a model; here with more
repeats, for every shape and kernel, as a table. Usage::

    python scripts/kernel_rows_bench.py --threads 2 --stem kernel-rows-intel-t2

Writes ``model_cards/results/STEM.{json,md}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # (out, in): where it occurs
    (576, 576): "target q/o projections",
    (192, 576): "target k/v projections",
    (1536, 576): "target gate/up projections",
    (576, 1536): "target down projection",
    (49152, 576): "target LM head",
    (576, 1728): "drafter fc (three target states)",
    (4096, 576): "drafter LM head (draft vocabulary)",
}


def time_call(call, repeats: int) -> float:
    """The median of ``repeats`` timed calls after two untimed ones, in microseconds."""
    call(), call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


@torch.no_grad()
def measure(shape: tuple[int, int], rows: int, repeats: int) -> dict:
    from hf_specdec.cpu_kernels import _Int8Weight, _PackedWeight, bf16_linears_supported

    weight = torch.randn(*shape) / shape[1] ** 0.5
    x = torch.randn(rows, shape[1])
    kernels = {"stock": lambda: F.linear(x, weight)}
    kernels["packed fp32"] = (lambda copy: lambda: copy.compute(x, None))(_PackedWeight(weight, sys.maxsize))
    if bf16_linears_supported():
        bf16 = _PackedWeight(weight, sys.maxsize, torch.bfloat16)
        kernels["bf16"] = lambda: bf16.compute(x, None)
        if rows <= 2 and hasattr(torch, "_weight_int8pack_mm"):
            int8 = _Int8Weight(weight, sys.maxsize)
            kernels["int8"] = lambda: int8.compute(x, None)
    return {name: round(time_call(call, repeats), 1) for name, call in kernels.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 6, 16, 64, 1024])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="model_cards/results")
    p.add_argument("--stem", default="kernel-rows")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_specdec.bench.runner import hardware_info

    table = []
    for shape, role in SHAPES.items():
        for rows in args.rows:
            times = measure(shape, rows, args.repeats)
            table.append({"shape": f"{shape[0]}x{shape[1]}", "role": role, "rows": rows, "microseconds": times})
            print(table[-1], flush=True)
    cpu = {name: bool(getattr(torch.cpu, f"_is_{name}_supported")()) for name in ("avx512", "avx512_bf16", "amx_tile")}
    report = {
        "hardware": hardware_info("cpu"),
        "cpu_features": cpu,
        "threads": args.threads,
        "repeats": args.repeats,
        "command": "python scripts/kernel_rows_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "table": table,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.stem}.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(args.out, f"{args.stem}.md"), "w") as f:
        f.write(markdown(report))
    return 0


def markdown(report: dict) -> str:
    names = list(dict.fromkeys(name for row in report["table"] for name in row["microseconds"]))
    lines = [
        "# Linear kernels by shape and row count",
        "",
        f"**Hardware:** {report['hardware'].get('device_name', '?')}; CPU features {report['cpu_features']}; "
        f"{report['threads']} torch threads; median of {report['repeats']} calls. Command: `{report['command']}`",
        "",
        "Microseconds per call, and each kernel's time over the stock `F.linear`'s (below 1: faster).",
        "",
        "| shape | layer | rows | " + " | ".join(names) + " |",
        "|---|---|---:|" + "---:|" * len(names),
    ]
    for row in report["table"]:
        t = row["microseconds"]
        cells = [f"{t[n]:.0f} ({t[n] / t['stock']:.2f})" if n in t else "—" for n in names]
        lines.append(f"| {row['shape']} | {row['role']} | {row['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
