"""Benchmark reports: Markdown / console tables, a summary plot and the files written by a benchmark run.

A report is a plain dict ``{"hardware": {...}, "config": {...}, "records": [...], "load": {...}}``. Each record
describes one (method, mode, batch size, category) cell; category ``"all"`` aggregates every prompt. Record fields:
``method``, ``kind`` (``"plain"`` / ``"drafter"`` / ``"prompt_lookup"``), ``mode`` (``"greedy"`` / ``"sampling"``),
``temperature``, ``batch_size``, ``category``, ``num_prompts``, ``new_tokens``, ``wall_s``, ``tokens_per_s``,
``speedup`` (pooled totals), ``speedup_by_repeat``, ``speedup_median``, ``speedup_min``, ``speedup_max``,
``speedup_ci95``, ``verdict``, ``mean_accepted_length`` (τ), ``acceptance_by_position``, ``alpha`` (α),
``draft_cost_ratio`` (c), ``speedup_bound``, ``identical`` and, for greedy records, ``mismatches``,
``near_tie_mismatches``, ``real_mismatches`` and ``identical_up_to_near_ties`` (see :mod:`hf_specdec.bench.runner`).
Any numeric field may be ``None`` (not measured / not applicable). ``load`` records the machine's load averages
during the run (optional: older reports have none).

Every table and the plot show the median of the per-repeat speedups where a record has one (else the pooled
``speedup``, as for the baseline and older reports); the main table adds its 95 % interval and the verdict, and a line
under each category table counts its category rows' verdicts and names each row slower than plain. The
Identical column reads ``yes``, or ``no (N near-ties, M real)`` when outputs differ from plain greedy decoding.
"""

from __future__ import annotations

import json
import math
import os
import warnings

__all__ = [
    "approximate_table",
    "category_table",
    "category_verdicts",
    "format_console_table",
    "markdown_table",
    "save_plots",
    "write_report",
]

DASH = "—"
_COLUMNS = (
    "Method",
    "Mode",
    "Batch",
    "tokens/s",
    "Speedup",
    "Verdict",
    "τ",
    "α",
    "c",
    "Bound",
    "Plain/lookup",
    "Cache",
    "Identical",
)
# A speedup's verdict by its 95 % interval (the runner's ``_verdict``): above 1, around 1, below 1.
FASTER, WITHIN_NOISE, SLOWER = "faster", "within noise", "slower than plain"
_VERDICTS = (FASTER, WITHIN_NOISE, SLOWER)
_NUMERIC = {"Batch", "tokens/s", "Speedup", "τ", "α", "c", "Bound", "Plain/lookup", "Cache"}


def markdown_table(report: dict, category: str | None = "all") -> str:
    """Formats the records of one category as a GitHub Markdown table.

    Args:
        report: The benchmark report.
        category: Category to show (``"all"``: the aggregate over every prompt); ``None`` shows every record with an
            extra Category column.

    Returns:
        The table (header, separator and one row per record), without a trailing newline.

    Raises:
        ValueError: On a malformed report or a category with no records.
    """
    records = _select(report, category)
    columns = list(_COLUMNS)
    if category is None:
        columns.insert(1, "Category")
    rows = [_row_cells(r, with_category=category is None) for r in records]
    header = "| " + " | ".join(columns) + " |"
    separator = "|" + "|".join("---:" if c in _NUMERIC else ":---" for c in columns) + "|"
    lines = [header, separator] + ["| " + " | ".join(_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def format_console_table(report: dict) -> str:
    """Formats the ``"all"`` records as a fixed-width plain-text table for terminal output.

    Args:
        report: The benchmark report.

    Returns:
        The table (header, rule and one line per record), without a trailing newline.

    Raises:
        ValueError: On a malformed report.
    """
    records = [r for r in _measured(report) if r.get("category", "all") == "all"]
    rows = [list(_COLUMNS)] + [_row_cells(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]

    def fmt(row):
        cells = [cell.rjust(w) if name in _NUMERIC else cell.ljust(w) for cell, w, name in zip(row, widths, _COLUMNS)]
        return "  ".join(cells).rstrip()

    lines = [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(row) for row in rows[1:]]
    return "\n".join(lines)


def category_table(report: dict, mode: str = "greedy", batch_size: int = 1) -> str:
    """Formats a Spec-Bench style table: one row per method, one column per category, then ``Overall``.

    Cells read ``speedup× (τ)``; only records with the given mode and batch size are used.

    Args:
        report: The benchmark report.
        mode: ``"greedy"`` or ``"sampling"``.
        batch_size: Batch size of the records to show.

    Returns:
        The Markdown table, without a trailing newline.

    Raises:
        ValueError: On a malformed report or when no record has that mode and batch size.
    """
    all_records = _records(report)
    records = [r for r in all_records if r.get("mode") == mode and r.get("batch_size") == batch_size]
    if not records:
        available = sorted({(str(r.get("mode")), str(r.get("batch_size"))) for r in all_records})
        raise ValueError(
            f"no records with mode={mode!r} and batch_size={batch_size!r}; available (mode, batch_size): {available}."
        )
    categories = list(dict.fromkeys(r.get("category", "all") for r in records if r.get("category", "all") != "all"))
    temperatures = {r.get("temperature") for r in records}
    rows: dict[tuple, dict[str, dict]] = {}
    for r in records:
        key = (str(r.get("method", DASH)), r.get("temperature"))
        rows.setdefault(key, {})[r.get("category", "all")] = r

    columns = ["Method"] + categories + ["Overall"]
    lines = [
        "| " + " | ".join(_escape(c) for c in columns) + " |",
        "|:---|" + "|".join("---:" for _ in columns[1:]) + "|",
    ]
    for (method, temperature), cells in rows.items():
        label = method
        if len(temperatures) > 1 and temperature is not None:
            label += f" (T={temperature:g})"
        values = [_category_cell(cells.get(c)) for c in categories] + [_category_cell(cells.get("all"))]
        lines.append("| " + " | ".join(_escape(v) for v in [label] + values) + " |")
    return "\n".join(lines)


def category_verdicts(report: dict, mode: str = "greedy", batch_size: int = 1) -> str | None:
    """One line for under a category table: how many of its category rows (not the Overall column) are faster or
    within noise by their own 95 % interval, and each that is slower than plain, named with its interval; ``None``
    when none of them has a verdict (under 3 repeats, or an older report)."""
    rows = [
        r
        for r in _records(report)
        if r.get("mode") == mode and r.get("batch_size") == batch_size and r.get("kind") != "plain"
        and r.get("category", "all") != "all" and r.get("verdict") in _VERDICTS
    ]  # fmt: skip
    if not rows:
        return None
    slower = [f"{r.get('method')} in {r.get('category')} {_speedup_cell(r)}" for r in rows
              if r["verdict"] == SLOWER]  # fmt: skip
    counts = ", ".join(f"{sum(r['verdict'] == v for r in rows)} {v}" for v in _VERDICTS[:2])
    return f"Category rows by their own interval: {counts}; slower than plain: {'; '.join(slower) or 'none'}."


def save_plots(report: dict, path: str) -> str | None:
    """Draws the acceptance-by-position and speedup panels into one PNG.

    Left: acceptance rate per draft position, one line per drafter record of category ``"all"``. Right: speedup
    (the median over repeats where known) of every ``"all"`` record grouped by method, the speedup bound drawn as a
    hollow bar where known, and a dashed line at 1.0 (plain decoding).

    Args:
        report: The benchmark report.
        path: Where to write the PNG (parent folders are created).

    Returns:
        ``path``, or ``None`` (with a warning) when matplotlib is not installed.

    Raises:
        ValueError: On a malformed report.
    """
    records = [r for r in _records(report) if r.get("category", "all") == "all"]
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn(
            "matplotlib is not installed, so no benchmark plot was written; "
            "pip install matplotlib (or pip install hf_specdec[bench]) to get it.",
            stacklevel=2,
        )
        return None
    # Figure + its Agg canvas (no pyplot): headless-safe, and a notebook's interactive backend is left untouched.

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_acc, ax_speed = fig.subplots(1, 2)

    drafters = [r for r in records if _positions(r)]
    for r in drafters:
        rates = _positions(r)
        ax_acc.plot(range(1, len(rates) + 1), rates, marker="o", label=_config_label(r, with_method=True))
    if drafters:
        ax_acc.legend(fontsize="small")
        ax_acc.set_xticks(range(1, max(len(_positions(r)) for r in drafters) + 1))
    else:
        ax_acc.text(0.5, 0.5, "no per-position acceptance data", ha="center", va="center", transform=ax_acc.transAxes)
    ax_acc.set_ylim(0.0, 1.0)
    ax_acc.set_xlabel("draft position")
    ax_acc.set_ylabel("acceptance rate")
    ax_acc.set_title("Acceptance rate by draft position")
    ax_acc.grid(alpha=0.3)

    methods = list(dict.fromkeys(str(r.get("method", DASH)) for r in records))
    configs = list(dict.fromkeys(_config_label(r) for r in records))
    width = 0.8 / max(1, len(configs))
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    bound_drawn = False
    for j, config in enumerate(configs):
        xs, speeds, bounds = [], [], []
        for r in records:
            if _config_label(r) != config:
                continue
            x = methods.index(str(r.get("method", DASH))) - 0.4 + width * (j + 0.5)
            speed = _speedup(r)
            if speed is not None:
                xs.append(x)
                speeds.append(speed)
            bound = _bound(r)
            if bound is not None and math.isfinite(bound):
                bounds.append((x, bound))
        color = colors[j % len(colors)]
        ax_speed.bar(xs, speeds, width=width * 0.9, color=color, label=config)
        for x, bound in bounds:
            ax_speed.bar(
                [x],
                [bound],
                width=width * 0.9,
                fill=False,
                edgecolor=color,
                linestyle=":",
                label=None if bound_drawn else "bound",
            )
            bound_drawn = True
    ax_speed.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_speed.set_xticks(range(len(methods)))
    ax_speed.set_xticklabels(methods, rotation=15, ha="right", fontsize="small")
    ax_speed.set_ylabel("speedup over plain decoding (×)")
    ax_speed.set_title("Speedup (hollow: bound min(1/c, 1/(1−α)))")
    if configs:
        ax_speed.legend(fontsize="small")
    ax_speed.grid(axis="y", alpha=0.3)

    hardware = report.get("hardware") or {}
    fig.suptitle(f"hf_specdec benchmark on {_hardware_name(hardware)}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    return path


def write_report(report: dict, out_dir: str, stem: str = "bench") -> dict[str, str]:
    """Writes ``{stem}.json``, ``{stem}.md`` and ``{stem}.png`` into ``out_dir`` (created if needed).

    Args:
        report: The benchmark report.
        out_dir: Output folder.
        stem: File name stem (no folder separators).

    Returns:
        ``{"json": path, "markdown": path, "png": path or None}`` (``None`` when matplotlib is missing).

    Raises:
        ValueError: On a malformed report or stem.
    """
    records = _records(report)
    if not stem or os.sep in stem or (os.altsep and os.altsep in stem):
        raise ValueError(f"stem must be a plain file name without folders, got {stem!r}; pass folders in out_dir.")
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{stem}.json")
    md_path = os.path.join(out_dir, f"{stem}.md")
    png_path = os.path.join(out_dir, f"{stem}.png")

    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(_markdown_document(report, records, png_name=f"{stem}.png"))
    png = save_plots(report, png_path)
    return {"json": json_path, "markdown": md_path, "png": png}


def _markdown_document(report: dict, records: list[dict], png_name: str) -> str:
    config = report.get("config") or {}
    hardware = report.get("hardware") or {}
    target = config.get("target") or config.get("model") or "unknown target"
    parts = [f"# Speculative decoding benchmark: {target}", ""]
    hw = [f"**Hardware:** {_hardware_name(hardware)}"]
    for key in ("device", "torch", "threads"):
        if hardware.get(key) is not None:
            hw.append(f"{key} {hardware[key]}")
    parts += [", ".join(hw), ""]
    if config:
        parts += ["**Config:** " + ", ".join(f"`{k}={v}`" for k, v in config.items()), ""]
    load = _load_line(report.get("load"))
    if load:
        parts += [load, ""]
    parts += [
        "Speedup: the median over repeats of each repeat's tokens/s over plain's in the same repeat and prompts, "
        "[its 95 % interval: t-interval of the log-ratios]; Verdict: faster when the interval lies above 1, slower "
        "than plain when it lies below 1, else within noise (under 3 repeats: too few repeats). "
        "τ: mean tokens per target forward (plain decoding = 1), α: acceptance rate, c: draft/target cost ratio, "
        "Bound: min(1/c, 1/(1−α)).",
        "",
    ]
    if any(r.get("mismatches") for r in records):
        dtype = config.get("near_tie_dtype") or config.get("target_dtype") or "the target's dtype"
        parts += [
            "Identical: greedy outputs token-identical to plain `generate`; otherwise each differing output is "
            "classified at its first divergent token: a near-tie (plain's two candidate logits within "
            f"{config.get('near_tie_k', 4):g}·eps·max(|top logit|, 1) in {dtype}) or a real difference. In bf16/fp16 "
            "near-ties are rounding (a multi-token pass rounds differently from a one-token step); in fp32 every "
            "mismatch breaks the identity promise.",
            "",
        ]
    references = sorted({r["reference"] for r in records if r.get("reference")})
    if references:
        parts += [
            "Rows of a drafter trained with a target adapter run on the adapted target: their Identical "
            f"column compares them with that target's own plain decoding ({', '.join(references)}), their speedups "
            "are against plain `generate` of the unadapted target.",
            "",
        ]
    has_all = any(r.get("category", "all") == "all" for r in records)
    parts += ["## All prompts" if has_all else "## Results", "", markdown_table(report, "all" if has_all else None), ""]

    categories = {r.get("category", "all") for r in records} - {"all"}
    if len(categories) > 1:
        # Only the mode / batch size settings that were measured per category get a category table.
        combos = list(
            dict.fromkeys((r.get("mode"), r.get("batch_size")) for r in records if r.get("category", "all") != "all")
        )
        for mode, batch_size in combos:
            parts += [f"## By category ({mode}, batch size {batch_size})", ""]
            parts += [category_table(report, mode=mode, batch_size=batch_size), ""]
            verdicts = category_verdicts(report, mode=mode, batch_size=batch_size)
            parts += [verdicts, ""] if verdicts else []
    approx = approximate_table(report)
    if approx:
        parts += ["## Approximate verification: quality", "", approx, ""]
    tasks = task_table(report)
    if tasks:
        parts += [
            "## Task accuracy",
            "",
            f"Scored by `{config.get('prompts', 'the task')}`: pass@1 for code (the task's tests, run sandboxed), exact "
            "match for arithmetic, for JSON whether the output parses and follows its schema. Outputs run to their "
            "natural EOS; those cut by the length cap are counted apart.",
            "",
            tasks,
            "",
        ]
    skipped = [r for r in records if r.get("skipped") and r.get("category", "all") == "all"]
    if skipped:
        parts += ["Not run: " + "; ".join(f"{r['method']} ({_mode_label(r)}, batch {r.get('batch_size')}): "
                                          f"{r['skipped']}" for r in skipped), ""]  # fmt: skip
    parts += [f"![benchmark plot]({png_name})", ""]
    return "\n".join(parts)


def task_table(report: dict) -> str:
    """Task accuracy of every method (``"all"`` records of runs with a task scorer); empty string without one.

    Columns: accuracy (correct / scored), tokens/s, speedup, τ, the share of outputs that differ from plain decoding
    and the outputs cut by the length cap."""
    records = [r for r in _measured(report) if r.get("category", "all") == "all" and r.get("task_scored")]
    if not records:
        return ""
    lines = [
        "| Method | Mode | Batch | Accuracy | tokens/s | Speedup | τ | Diverged | Cut by the cap |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        n = int(r["task_scored"])
        acc = r.get("task_accuracy")
        correct = None if acc is None else round(acc * n)
        diverged = r.get("divergence_rate")
        cells = [
            str(r.get("method")),
            _mode_label(r),
            str(r.get("batch_size")),
            DASH if acc is None else f"{100 * acc:.1f}% ({correct}/{n})",
            _fmt(r.get("tokens_per_s"), "{:.1f}"),
            _fmt(_speedup(r), "{:.2f}×"),
            _fmt(r.get("mean_accepted_length"), "{:.2f}"),
            DASH if diverged is None else f"{100 * diverged:.0f}%",
            DASH if r.get("length_cap_hits") is None else f"{r['length_cap_hits']}/{n}",
        ]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def approximate_table(report: dict) -> str:
    """Quality of approximate verifiers (ASD) next to plain decoding, greedy ``"all"`` records only.

    Columns: speedup, τ, the share of prompts whose output differs from plain ``generate`` (Diverged) and the target's
    mean log-likelihood per generated token of the method's outputs against plain decoding's. Empty string when the
    report has no approximate method.
    """
    records = [r for r in _measured(report) if r.get("category", "all") == "all" and r.get("mode") == "greedy"]
    plain = {r.get("batch_size"): r for r in records if r.get("kind") == "plain"}
    approx = [r for r in records if r.get("approximate")]
    if not approx:
        return ""
    lines = [
        "| Method | Batch | Speedup | τ | Diverged | log p / token | plain log p / token | Δ log p |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in approx:
        base = plain.get(r.get("batch_size"), {})
        lp, base_lp = r.get("target_logprob"), base.get("target_logprob")
        delta = lp - base_lp if lp is not None and base_lp is not None else None
        diverged = r.get("divergence_rate")
        cells = [
            str(r.get("method")),
            str(r.get("batch_size")),
            _fmt(_speedup(r), "{:.2f}×"),
            _fmt(r.get("mean_accepted_length"), "{:.2f}"),
            DASH if diverged is None else f"{100 * diverged:.0f}%",
            _fmt(lp, "{:.3f}"),
            _fmt(base_lp, "{:.3f}"),
            _fmt(delta, "{:+.3f}"),
        ]
        lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def _records(report) -> list[dict]:
    if not isinstance(report, dict):
        raise ValueError(f"a report must be a dict with a 'records' list, got {type(report).__name__}.")
    records = report.get("records")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("report['records'] must be a list of dicts (one per method, mode, batch size and category).")
    return records


def _measured(report) -> list[dict]:
    """Records that were run (methods skipped for a setting carry a ``skipped`` reason instead of figures)."""
    return [r for r in _records(report) if not r.get("skipped")]


def _select(report, category: str | None) -> list[dict]:
    records = _measured(report)
    if category is None:
        return records
    selected = [r for r in records if r.get("category", "all") == category]
    if records and not selected:
        available = list(dict.fromkeys(r.get("category", "all") for r in records))
        raise ValueError(f"no records with category {category!r}; available: {available} (or None for all).")
    return selected


def _row_cells(r: dict, with_category: bool = False) -> list[str]:
    cells = [
        str(r.get("method", DASH)),
        _mode_label(r),
        DASH if r.get("batch_size") is None else str(r.get("batch_size")),
        _fmt(r.get("tokens_per_s"), "{:.1f}"),
        _speedup_cell(r),
        str(r.get("verdict") or DASH),
        _fmt(r.get("mean_accepted_length"), "{:.2f}"),
        _fmt(r.get("alpha"), "{:.2f}"),
        _fmt(r.get("draft_cost_ratio"), "{:.2f}"),
        _fmt(_bound(r), "{:.2f}×"),
        _shares(r),
        # The cache's length over the sequence's at the end of the run (batched caches keep rejected slots).
        _fmt(r.get("cache_length_ratio"), "{:.2f}"),
        _identical(r),
    ]
    if with_category:
        cells.insert(1, str(r.get("category", "all")))
    return cells


def _shares(r: dict) -> str:
    """Share of passes run as plain steps / as prompt-lookup copies alone (the adaptive draft length)."""
    plain, lookup = r.get("plain_step_share"), r.get("lookup_pass_share")
    if plain is None and lookup is None:
        return DASH
    return f"{100 * (plain or 0):.0f}%/{100 * (lookup or 0):.0f}%"


def _speedup(r: dict) -> float | None:
    """The speedup a table shows: the median of the per-repeat speedups, else the pooled one."""
    median = _number(r.get("speedup_median"))
    return median if median is not None else _number(r.get("speedup"))


def _speedup_cell(r: dict) -> str:
    """``1.62× [1.50–1.75]``: the speedup and, where the record has one, its 95 % interval."""
    cell = _fmt(_speedup(r), "{:.2f}×")
    interval = r.get("speedup_ci95")
    if _number(r.get("speedup_median")) is None or not isinstance(interval, (list, tuple)) or len(interval) != 2:
        return cell
    return f"{cell} [{_fmt(interval[0], '{:.2f}')}–{_fmt(interval[1], '{:.2f}')}]"


def _load_line(load) -> str | None:
    """One line on the machine's load during the run (``None`` for a report without a ``load`` entry)."""
    if not isinstance(load, dict):
        return None
    start, end = load.get("loadavg_start"), load.get("loadavg_end")
    repeats = [p["loadavg"][0] for p in load.get("per_repeat") or [] if p.get("loadavg")]
    cpus = load.get("process_cpus") or load.get("cpu_count")
    where = f"{cpus} CPUs for this process, {load.get('torch_threads', DASH)} torch threads"
    parts = [f"{start[0]:.2f} at the start"] if start else []
    if repeats:
        parts.append(f"{min(repeats):.2f}–{max(repeats):.2f} after each of {len(repeats)} repeats")
    if end:
        parts.append(f"{end[0]:.2f} at the end")
    if not parts:
        return f"**Machine load:** no load average on this platform; {where}."
    line = f"**Machine load:** 1-minute load average {', '.join(parts)}; {where}."
    if cpus and max([v[0] for v in (start, end) if v] + repeats) > cpus:
        line += " The load exceeded the CPU count: other work competed with the benchmark, so read the intervals."
    return line


def _category_cell(r: dict | None) -> str:
    if r is None:
        return DASH
    speed = _fmt(_speedup(r), "{:.2f}×")
    tau = _number(r.get("mean_accepted_length"))
    return speed if tau is None else f"{speed} ({tau:.2f})"


def _mode_label(r: dict) -> str:
    mode = r.get("mode")
    if mode is None:
        return DASH
    temperature = _number(r.get("temperature"))
    if mode == "greedy" or temperature is None:
        return str(mode)
    return f"{mode} T={temperature:g}"


def _config_label(r: dict, with_method: bool = False) -> str:
    label = f"{_mode_label(r)} bsz={r.get('batch_size', DASH)}"
    return f"{r.get('method', DASH)} {label}" if with_method else label


def _bound(r: dict) -> float | None:
    """The record's ``speedup_bound``, else min(1/c, 1/(1−α)) from whichever of α and c is known."""
    bound = _number(r.get("speedup_bound"))
    if bound is not None:
        return bound
    alpha, cost = _number(r.get("alpha")), _number(r.get("draft_cost_ratio"))
    if alpha is None or cost is None:
        return None
    candidates = [1.0 / (1.0 - alpha) if alpha < 1.0 else math.inf, 1.0 / cost if cost > 0.0 else math.inf]
    return min(candidates)


def _positions(r: dict) -> list[float]:
    if r.get("kind") != "drafter":
        return []
    rates = r.get("acceptance_by_position")
    if not isinstance(rates, (list, tuple)):
        return []
    return [float(x) if x is not None else float("nan") for x in rates]


def _number(value) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _fmt(value, pattern: str) -> str:
    number = _number(value)
    if number is None:
        return DASH
    if math.isinf(number):
        return "∞" + ("×" if pattern.endswith("×") else "")
    return pattern.format(number)


def _identical(r: dict) -> str:
    """``yes`` / ``no`` / ``—``; a ``no`` with classified mismatches reads ``no (3 near-ties, 0 real)``."""
    value = r.get("identical")
    if value is None:
        return DASH
    if value:
        return "yes"
    near, real = r.get("near_tie_mismatches"), r.get("real_mismatches")
    if isinstance(near, int) and isinstance(real, int) and near + real > 0:
        return f"no ({near} near-tie{'' if near == 1 else 's'}, {real} real)"
    return "no"


def _hardware_name(hardware: dict) -> str:
    return str(hardware.get("device_name") or hardware.get("device") or "unknown hardware")


def _escape(cell: str) -> str:
    return str(cell).replace("|", "\\|")
