"""Writing a script's results file pair: ``STEM.json`` (the figures) and ``STEM.md`` (their table), shared by the
SmolLM2 analysis scripts."""

from __future__ import annotations

import json
import os


def write_results(stem: str, result: dict, markdown: str) -> None:
    """Writes ``stem + ".json"`` and ``stem + ".md"`` and prints the Markdown."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown)
    print(markdown)


def write_bench_report(report: dict, out_dir: str, stem: str) -> None:
    """Writes a benchmark report's ``STEM.{json,md,png}`` under ``out_dir`` and prints its tables (per category too,
    when the prompts have several)."""
    from hf_specdec.bench.report import category_table, format_console_table, write_report

    paths = write_report(report, out_dir, stem=stem)
    print(format_console_table(report))
    if len(report["config"]["categories"]) > 1:
        print("\n" + category_table(report, mode="greedy", batch_size=1))
    print("\n".join(f"wrote {p}" for p in paths.values() if p))


def demo_bench_args(p, stem: str) -> None:
    """The options of a script that times rows on a demo target (``--target`` ... ``--stem``), defaults alike."""
    p.add_argument("--target", default="smollm2", choices=["smollm2", "demo-code"])
    p.add_argument("--max-prompts", type=int, default=2, help="prompts per category (smollm2: Spec-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="model_cards/results")
    p.add_argument("--stem", default=None, help=f"default: TARGET-{stem}")


def demo_bench_prompts(spec, max_prompts: int):
    """A demo target's prompts: Spec-Bench for SmolLM2, its own set for the code model."""
    from hf_specdec.bench.prompts import load_prompts

    return load_prompts("spec-bench" if spec.name == "smollm2" else spec.prompts, max_per_category=max_prompts)
