#!/usr/bin/env python
"""What a verification pass costs on this CPU: SmolLM2's forward over w new tokens, against a one-token step.

Speculative decoding pays when a pass over K + 1 tokens costs little more than a plain one-token step. This script
times the target alone (no drafter, no loop): a cached forward over ``w`` new tokens after a ``--context``-token
prompt, for each dtype and thread count, interleaved and repeated, and reports each width's median time relative to
the one-token step of the same dtype, threads and repeat.

Usage::

    python scripts/smollm2_pass_cost.py

Writes ``model_cards/results/smollm2-pass-cost.{json,md}``.

``--layouts stock weight-first`` also times every ``nn.Linear`` computed as ``W @ x^T`` (a single row padded to two)
instead of ``F.linear``'s ``x @ W^T``: the same product through another of the BLAS library's kernels. On this AMD
CPU MKL's fp32 kernels for one to a few rows are slow, and which layout is faster depends on the rows; the table
shows what a pass would cost with each (a diagnostic)::

    python scripts/smollm2_pass_cost.py --dtypes float32 --layouts stock weight-first \
        --results model_cards/results/smollm2-pass-cost-layouts

``--layouts packed`` times the target with its weights packed for oneDNN once
(:func:`hf_specdec.cpu_kernels.pack_linear_weights`, what ``hf-specdec demo`` and ``bench`` do for an fp32 target
on a CPU; ``smollm2-pass-cost-packed`` is the same command from before, when the weights were packed for MKL)::

    python scripts/smollm2_pass_cost.py --dtypes float32 --layouts stock packed \
        --results model_cards/results/smollm2-pass-cost-onednn

``--batch-sizes 1 4 --attention copied grouped`` times batches too, with transformers' SDPA as it is and with the
grouped-query kernel the speculative loop runs on a CPU target (:func:`hf_specdec.cpu_kernels.grouped_query_sdpa`;
a pass over several tokens, and every call of a padded batch, has a mask, and a masked call otherwise copies the
keys and values to every query head)::

    python scripts/smollm2_pass_cost.py --dtypes float32 --layouts packed --batch-sizes 1 4 \
        --attention copied grouped --context 1000 --results model_cards/results/smollm2-pass-cost-batch
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shlex
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402


@torch.no_grad()
def time_widths(target, widths, context: int, calls: int, batch: int = 1) -> dict[int, float]:
    """Median seconds of a cached forward over each width, for ``batch`` rows (the cache is cut back after every
    call)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    target(torch.randint(100, 20000, (batch, context)), cache=cache, use_cache=True)
    out = {}
    for w in widths:
        x = torch.randint(100, 20000, (batch, w))
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            target(x, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-w)
        out[w] = statistics.median(times)
    return out


def _weight_first(self, x):
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1:
        rows = rows.repeat(2, 1)  # MKL's two-row kernel beats its one-row one here
    y = torch.mm(self.weight, rows.t()).t()[:n]
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def linear_layout(model, layout: str):
    """Every plain ``nn.Linear`` of ``model`` computes in ``layout``: ``"stock"`` (``F.linear``), ``"weight-first"``
    (``W @ x^T``) or ``"packed"`` (:func:`hf_specdec.cpu_kernels.pack_linear_weights`)."""
    if layout == "packed":
        from hf_specdec.cpu_kernels import pack_linear_weights

        with pack_linear_weights(model):
            yield
        return
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear] if layout == "weight-first" else []
    for m in linears:
        m.forward = types.MethodType(_weight_first, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


@contextlib.contextmanager
def attention_kind(model, attention: str):
    """``"copied"``: transformers' SDPA as it is (a masked call copies the keys and values to every query head);
    ``"grouped"``: the grouped-query kernel for every call (:func:`hf_specdec.cpu_kernels.grouped_query_sdpa`, what
    the speculative loop runs on a CPU target). A pass over several tokens has a mask, a one-token step has none."""
    from hf_specdec.cpu_kernels import GQA_SWITCH, grouped_query_sdpa

    if attention == "grouped":
        with grouped_query_sdpa(model):
            yield
        return
    saved = os.environ.pop(GQA_SWITCH, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[GQA_SWITCH] = saved


@torch.no_grad()
def layout_logit_difference(target, context: int, width: int, layout: str) -> float:
    """The largest difference between the stock layout's logits and ``layout``'s over a cached pass of ``width``
    tokens after ``context`` (relative to the logits' largest magnitude)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    target(torch.randint(100, 20000, (1, context)), cache=cache, use_cache=True)
    x = torch.randint(100, 20000, (1, width))
    stock = target(x, cache=cache, use_cache=True).logits
    cache.crop(-width)
    with linear_layout(target, layout):
        other = target(x, cache=cache, use_cache=True).logits
    return float((stock - other).abs().max() / stock.abs().max())


def markdown(result: dict) -> str:
    widths = result["widths"]
    lines = [
        "# SmolLM2-135M-Instruct: a forward over w new tokens, relative to a one-token step",
        "",
        f"Command: `{result['command']}`. {result['context']}-token cached context, median of {result['calls']} calls "
        f"per width, {result['repeats']} interleaved repeats; cells: the median over repeats of w's time over the "
        "one-token step's in the same repeat [min–max]; the last column is the one-token step itself.",
        "",
        "A batch's pass over w tokens runs w tokens in each of its rows (rows of equal length, no padding); its "
        "step is a one-token step of the same rows. Attention: `copied`, transformers' SDPA as it is (a masked "
        "call copies the keys and values to every query head); `grouped`, the grouped-query kernel for every call "
        "(what the speculative loop runs).",
        "",
        "| dtype | threads | batch | layout | attention | "
        + " | ".join(f"w = {w}" for w in widths[1:])
        + " | one-token step |",
        "|:---|---:|---:|:---|:---|" + "---:|" * len(widths),
    ]
    for row in result["rows"]:
        cells = [f"{r['median']:.2f}× [{r['min']:.2f}–{r['max']:.2f}]" for r in row["relative"]]
        lines.append(
            f"| {row['dtype']} | {row['threads']} | {row.get('batch', 1)} | {row.get('layout', 'stock')} | "
            f"{row.get('attention', 'copied')} | " + " | ".join(cells) + f" | {row['step_ms']:.0f} ms |"
        )
    differences = result.get("layout_logit_difference") or {}
    if not isinstance(differences, dict):  # results written before the packed layout: weight-first only
        differences = {"weight-first": differences}
    for layout, difference in differences.items():
        lines += ["", f"Largest logit difference from the stock layout, {layout} (fp32, relative): {difference:.1e}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 11])
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--layouts", nargs="+", default=["stock"], choices=["stock", "weight-first", "packed"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--attention", nargs="+", default=["copied"], choices=["copied", "grouped"])
    p.add_argument("--calls", type=int, default=9)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--results", default="model_cards/results/smollm2-pass-cost")
    args = p.parse_args(argv)
    if args.widths[0] != 1:
        p.error("--widths must start with 1 (the one-token step the others are relative to)")

    from hf_specdec.gguf_target import load_smollm2

    targets = {dtype: load_smollm2(dtype=dtype)[0].eval() for dtype in args.dtypes}
    settings = itertools.product(args.dtypes, args.threads, args.batch_sizes, args.layouts, args.attention)
    samples = {setting: [] for setting in settings}
    for _ in range(args.repeats):
        for (dtype, threads, batch, layout, attention), runs in samples.items():
            torch.set_num_threads(threads)
            with linear_layout(targets[dtype], layout), attention_kind(targets[dtype], attention):
                runs.append(time_widths(targets[dtype], args.widths, args.context, args.calls, batch))
    rows = []
    for (dtype, threads, batch, layout, attention), runs in samples.items():
        ratios = {w: [r[w] / r[1] for r in runs] for w in args.widths[1:]}
        rows.append({
            "dtype": dtype, "threads": threads, "batch": batch, "layout": layout, "attention": attention,
            "step_ms": 1000 * statistics.median(r[1] for r in runs),
            "relative": [{"width": w, "median": statistics.median(v), "min": min(v), "max": max(v)}
                         for w, v in ratios.items()],
        })  # fmt: skip
    result = {
        "target": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "command": "python scripts/smollm2_pass_cost.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "context": args.context,
        "calls": args.calls,
        "repeats": args.repeats,
        "widths": args.widths,
        "rows": rows,
    }
    others = [layout for layout in args.layouts if layout != "stock"]
    if others and "float32" in targets:
        result["layout_logit_difference"] = {
            layout: layout_logit_difference(targets["float32"], args.context, args.widths[-1], layout)
            for layout in others
        }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
