"""Freezing ASD's settings on a dev split under a quality constraint (``hf-specdec asd-tune``).

The ASD paper recommends choosing the budget ``B``, gate ``g`` and block cap ``M`` once per target, drafter and
workload on held-out data, then freezing them. :func:`tune_asd` runs strict verification and every candidate on the
dev prompts in one interleaved benchmark and picks the candidate with the highest mean accepted length τ whose
quality stays within the constraint: the target's mean log-likelihood per generated token may drop by at most
``max_logprob_drop`` nats against strict (= plain greedy) decoding, optionally the share of prompts whose output
changes may not exceed ``max_divergence``, and, with a task scorer (:mod:`hf_specdec.bench.tasks`), task accuracy may
drop by at most ``max_accuracy_drop`` against strict. τ is the selection criterion because it is deterministic; the measured
speedups are reported next to it.
"""

from __future__ import annotations

import hashlib
import itertools

from .prompts import PromptItem
from .runner import drafter_method, plain_method, run_benchmark

__all__ = ["split_prompts", "tune_asd"]


def split_prompts(prompts: list[PromptItem], dev_fraction: float = 0.5) -> tuple[list[PromptItem], list[PromptItem]]:
    """Deterministic dev / test split by a hash of each prompt's category and id."""
    if not 0.0 < dev_fraction < 1.0:
        raise ValueError(f"dev_fraction must be in (0, 1), got {dev_fraction}.")
    dev, test = [], []
    for item in prompts:
        h = int(hashlib.sha1(f"{item.category}/{item.id}".encode()).hexdigest(), 16) % 10_000
        (dev if h < dev_fraction * 10_000 else test).append(item)
    if not dev or not test:
        raise ValueError(f"The split of {len(prompts)} prompts left an empty side; use more prompts.")
    return dev, test


def tune_asd(
    target,
    tokenizer,
    drafter,
    dev_prompts: list[PromptItem],
    budgets=(2.0, 4.0, 8.0),
    gates=(0.25, 0.5),
    block_caps=(1, 2),
    max_logprob_drop: float = 0.05,
    max_divergence: float | None = None,
    max_new_tokens: int = 96,
    num_draft_tokens: int | None = None,
    progress: bool = True,
    scorer=None,
    max_accuracy_drop: float | None = None,
) -> dict:
    """Grid search over ``(B, g, M)``; returns the chosen settings, every candidate's figures and the report.

    Returns:
        ``{"recommended": {"asd_budget", "asd_gate", "asd_block_cap"} or None, "candidates": [...],
        "strict": {...}, "constraint": {...}, "report": <benchmark report>}``. ``recommended`` is ``None`` when no
        candidate meets the constraint (then keep strict verification).
    """
    if max_logprob_drop < 0:
        raise ValueError(f"max_logprob_drop must be >= 0, got {max_logprob_drop}.")
    if max_accuracy_drop is not None and (scorer is None or max_accuracy_drop < 0):
        raise ValueError("max_accuracy_drop needs a task scorer (--task) and must be >= 0.")
    grid = list(itertools.product(budgets, gates, block_caps))
    if not grid:
        raise ValueError("The ASD grid is empty: give at least one budget, gate and block cap.")
    # Fixed draft length, no lookup merge: every candidate verifies the same kind of proposals as strict, whatever
    # the wall clock says (the adaptive length would make the comparison depend on timing noise).
    fixed = {"draft_length": "fixed", "lookup_tokens": 0}
    strict = drafter_method(drafter, name="strict", num_draft_tokens=num_draft_tokens, **fixed)
    candidates = {}
    for b, g, m in grid:
        options = {"budget": float(b), "gate": float(g), "block_cap": int(m)}
        name = f"asd B={b} g={g} M={m}"
        candidates[name] = options
    methods = [plain_method(), strict] + [
        drafter_method(
            drafter, name=name, num_draft_tokens=num_draft_tokens, verifier="asd", verifier_options=opts, **fixed
        )
        for name, opts in candidates.items()
    ]
    report = run_benchmark(
        target,
        tokenizer,
        methods,
        dev_prompts,
        max_new_tokens=max_new_tokens,
        warmup=1,
        progress=progress,
        scorer=scorer,
    )
    by_name = {r["method"]: r for r in report["records"] if r["category"] == "all"}
    limits = {"max_logprob_drop": max_logprob_drop, "max_divergence": max_divergence,
              "max_accuracy_drop": max_accuracy_drop if scorer is not None else None}  # fmt: skip
    rows = [_candidate_row(name, options, by_name, scorer is not None, limits) for name, options in candidates.items()]
    feasible = [r for r in rows if r["meets_constraint"]]
    best = max(feasible, key=lambda r: (r["mean_accepted_length"], -r["logprob_drop"])) if feasible else None
    recommended = None
    if best is not None:
        recommended = {k: best[k] for k in ("asd_budget", "asd_gate", "asd_block_cap")}
    return {
        "recommended": recommended,
        "chosen": best["name"] if best else None,
        "constraint": {
            "max_logprob_drop": max_logprob_drop,
            "max_divergence": max_divergence,
            "max_accuracy_drop": max_accuracy_drop,
        },
        "strict": {
            k: by_name["strict"].get(k)
            for k in ("mean_accepted_length", "speedup", "identical", "task_accuracy", "length_cap_hits")
        },
        "candidates": rows,
        "num_dev_prompts": len(dev_prompts),
        "report": report,
    }


def _candidate_row(name: str, options: dict, by_name: dict, scored: bool, limits: dict) -> dict:
    """One ASD setting's figures against plain (log-likelihood drop) and strict (speed, task accuracy), and whether
    it meets every given limit."""
    rec, base, strict = by_name[name], by_name["plain"], by_name["strict"]
    drop = None
    if rec["target_logprob"] is not None and base["target_logprob"] is not None:
        drop = base["target_logprob"] - rec["target_logprob"]
    ok = drop is not None and drop <= limits["max_logprob_drop"]
    if limits["max_divergence"] is not None:
        ok = ok and rec["divergence_rate"] is not None and rec["divergence_rate"] <= limits["max_divergence"]
    accuracy_drop = strict["task_accuracy"] - rec["task_accuracy"] if scored else None
    if accuracy_drop is not None and limits["max_accuracy_drop"] is not None:
        ok = ok and accuracy_drop <= limits["max_accuracy_drop"] + 1e-12
    over_strict = None
    if rec["tokens_per_s"] and strict["tokens_per_s"]:
        over_strict = round(rec["tokens_per_s"] / strict["tokens_per_s"], 4)
    return {
        "name": name,
        **{f"asd_{k}": v for k, v in options.items()},
        "mean_accepted_length": rec["mean_accepted_length"],
        "speedup": rec["speedup"],
        "speedup_over_strict": over_strict,
        "divergence_rate": rec["divergence_rate"],
        "logprob_drop": None if drop is None else round(drop, 5),
        "task_accuracy": rec.get("task_accuracy"),
        "accuracy_drop": None if accuracy_drop is None else round(accuracy_drop, 5),
        "length_cap_hits": rec.get("length_cap_hits"),
        "meets_constraint": ok,
    }
