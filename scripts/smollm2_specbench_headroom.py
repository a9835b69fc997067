#!/usr/bin/env python
"""How far would data that looks like Spec-Bench move the SmolLM2 drafter? A diagnostic, not a drafter to ship.

The shipped drafter drafts the target's next token 68 % of the time on held-out chat answers and 23–52 % on
Spec-Bench's categories, and more chat data did not move Spec-Bench. Before building task data at scale this measures
the ceiling that data could reach: Spec-Bench's own prompts split in two halves per category (even positions to fit,
odd positions to score), the target's greedy answers to both, the drafter fine-tuned on the fit half, and per
category the held-out half's acc_0..4 and simulated τ before and after (and the chat held-out set's, for what the
fine-tune forgets). A category that moves with a hundred answers of its own kind is one that task data can fix; one
that does not is limited by the drafter or by the target's answers.

The fine-tuned drafter has seen half of Spec-Bench: it stays in ``--work`` and is never benchmarked or shipped.

1. answers: the bf16 target's greedy answers (``--max-new-tokens``) to ``--per-category`` prompts of each category
   (resumable, in ``--work``);
2. features: the fit half, and per category the scoring half (``dump_features``, resumable);
3. training: from ``--drafter`` for ``--epochs`` at ``--lr``, a fresh cosine schedule;
4. results: ``--results`` ``.json`` and ``.md``.

Usage::

    python scripts/smollm2_specbench_headroom.py
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402
from smollm2_confidence_gap import spec_bench_answers  # noqa: E402
from train_smollm2_long import fine_tune, score  # noqa: E402
from train_smollm2_scaling import dump  # noqa: E402

METRICS = ("acc_0", "acc_2", "acc_4", "simulated_tau")


def halves(answers: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The fit half (even positions within each category) and the scoring half per category (odd positions)."""
    fit, scored = [], {}
    for category in dict.fromkeys(r["category"] for r in answers):
        rows = [r for r in answers if r["category"] == category]
        fit += rows[0::2]
        scored[category] = rows[1::2]
    return fit, scored


def markdown(result: dict) -> str:
    lines = [
        "# SmolLM2 drafter: the headroom of Spec-Bench-like data (a diagnostic)",
        "",
        f"Command: `{result['command']}`. Drafter: `{result['drafter']}`, fine-tuned for {result['settings']['epochs']} "
        f"epochs at lr {result['settings']['lr']} on the target's greedy answers to half of Spec-Bench's prompts "
        f"({result['fit_records']} records, {result['fit_answer_tokens']} answer tokens; even positions of each "
        "category) and scored, teacher-forced, on the other half. The fine-tuned drafter has seen Spec-Bench and is "
        "neither shipped nor benchmarked; it measures what data of Spec-Bench's kind could give.",
        "",
        "| held-out set | records | " + " | ".join(f"{m} before → after" for m in METRICS) + " |",
        "|:---|---:|" + "---:|" * len(METRICS),
    ]
    for name, row in result["scores"].items():
        cells = [f"{row['before'][m]:.3f} → {row['after'][m]:.3f}" for m in METRICS]
        lines.append(f"| {name} | {row['records']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--per-category", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--chat-eval-features", default="runs/smollm2-grown30/features-eval",
                   help="the chat held-out set's features (train_smollm2_grown.py); skipped when missing")  # fmt: skip
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    p.add_argument("--work", default="runs/specbench-headroom")
    p.add_argument("--results", default="model_cards/results/smollm2-specbench-headroom")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out = args.work  # where train_smollm2_long.score writes its scratch trainer output

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.training.offline import OfflineFeatureDataset

    target, tokenizer = load_smollm2(dtype="bfloat16")
    target.eval()
    fit, scored = halves(spec_bench_answers(target, tokenizer, args.per_category, args.max_new_tokens, args.work))
    start = AutoModelForDrafting.from_pretrained(args.drafter)
    fit_dir = os.path.join(args.work, "features-fit")
    dump(target, tokenizer, fit, start.config, fit_dir, args.max_length)
    eval_dirs = {}
    for category, records in scored.items():
        eval_dirs[category] = os.path.join(args.work, f"features-{category}")
        dump(target, tokenizer, records, start.config, eval_dirs[category], args.max_length)
    counts = {category: len(records) for category, records in scored.items()}
    if os.path.isdir(args.chat_eval_features):
        eval_dirs["chat (data's held-out)"] = args.chat_eval_features
        counts["chat (data's held-out)"] = len(OfflineFeatureDataset(args.chat_eval_features))
    before = {name: score(start, target, path, args) for name, path in eval_dirs.items()}
    drafter, record = fine_tune(target, tokenizer, args, os.path.join(args.work, "drafter"), fit_dir, None, 10**9)
    after = {name: score(drafter, target, path, args) for name, path in eval_dirs.items()}
    result = {
        "target": "SmolLM2-135M-Instruct",
        "drafter": args.drafter,
        "command": "python scripts/smollm2_specbench_headroom.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "settings": {k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "max_length", "max_new_tokens")},
        "fit_records": len(fit),
        "fit_answer_tokens": sum(r["answer_tokens"] for r in fit),
        "steps": record.get("steps"),
        "wall_time_s": record.get("wall_time_s"),
        "scores": {name: {"records": counts[name], "before": before[name], "after": after[name]} for name in eval_dirs},
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
