#!/usr/bin/env python
"""Scores SmolLM2 drafters on Spec-Bench teacher-forced: less noisy than a timed benchmark on a few prompts.

``hf-specdec bench`` at a fixed K measures τ on the prompts it times, a few per category on this CPU. Teacher-forced
scoring sees many more: the bf16 target's greedy answers to ``--per-category`` Spec-Bench prompts of each category,
then per category and drafter the held-out metrics of training (acc_0..4: the share of answer positions where draft
step k drafts the target's token, the steps before it right; simulated τ of a K = 5 chain). No drafter is trained on
these answers; they only score.

1. answers: the target's greedy answers (``--max-new-tokens``), resumable in ``--work``;
2. features: per category, the target's features over them (``dump_features``, resumable);
3. results: ``--results`` ``.json`` and ``.md``, one row per drafter and category.

Usage::

    python scripts/smollm2_specbench_score.py --drafters src/hf_specdec/assets/smollm2-drafter runs/candidate
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
from train_smollm2_long import score  # noqa: E402
from train_smollm2_scaling import dump  # noqa: E402

METRICS = ("acc_0", "acc_2", "acc_4", "simulated_tau")


def features_by_category(target, tokenizer, answers: list[dict], config, work: str, max_length: int) -> dict:
    """``{category: features folder}`` of the target's features over each category's answers."""
    dirs = {}
    for category in dict.fromkeys(r["category"] for r in answers):
        dirs[category] = os.path.join(work, f"features-{category}")
        rows = [r for r in answers if r["category"] == category]
        dump(target, tokenizer, rows, config, dirs[category], max_length)
    return dirs


def drafter_names(paths: list[str]) -> dict[str, str]:
    """``{name: path}``: each drafter named by its folder, or by its last two path parts where folders share a name
    (``runs/a/drafter``, ``runs/b/drafter``)."""
    folders = [os.path.normpath(path).split(os.sep) for path in paths]
    names = [parts[-1] for parts in folders]
    return {
        "/".join(parts[-2:]) if names.count(name) > 1 else name: path
        for name, parts, path in zip(names, folders, paths)
    }


def markdown(result: dict) -> str:
    categories = list(next(iter(result["scores"].values())))
    lines = [
        "# SmolLM2 drafters on Spec-Bench, teacher-forced",
        "",
        f"Command: `{result['command']}`. The bf16 target's greedy answers ({result['settings']['max_new_tokens']} "
        f"new tokens at most) to {result['settings']['per_category']} Spec-Bench prompts per category, scored "
        "teacher-forced (acc_k: draft step k drafts the target's token; simulated τ of a K = 5 chain). Cells: "
        "simulated τ (acc_0); mean: the unweighted mean over the categories.",
        "",
        "| drafter | " + " | ".join(categories) + " | mean |",
        "|:---|" + "---:|" * (len(categories) + 1),
    ]
    for drafter, rows in result["scores"].items():
        cells = [(rows[c]["simulated_tau"], rows[c]["acc_0"]) for c in categories]
        cells.append(tuple(sum(column) / len(categories) for column in zip(*cells)))
        lines.append(f"| {drafter} | " + " | ".join(f"{tau:.2f} ({acc:.3f})" for tau, acc in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", default=["src/hf_specdec/assets/smollm2-drafter"])
    p.add_argument("--per-category", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    p.add_argument("--work", default="runs/specbench-score")
    p.add_argument("--results", default="model_cards/results/smollm2-specbench-score")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out = args.work  # where train_smollm2_long.score writes its scratch trainer output

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2

    target, tokenizer = load_smollm2(dtype="bfloat16")
    target.eval()
    answers = spec_bench_answers(target, tokenizer, args.per_category, args.max_new_tokens, args.work)
    drafters = drafter_names(args.drafters)
    first = AutoModelForDrafting.from_pretrained(args.drafters[0])
    dirs = features_by_category(target, tokenizer, answers, first.config, args.work, args.max_length)
    scores = {}
    for name, path in drafters.items():
        drafter = AutoModelForDrafting.from_pretrained(path)
        scores[name] = {category: score(drafter, target, folder, args) for category, folder in dirs.items()}
    result = {
        "target": "SmolLM2-135M-Instruct",
        "drafters": drafters,
        "command": "python scripts/smollm2_specbench_score.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "settings": {k: getattr(args, k) for k in ("per_category", "max_new_tokens", "max_length")},
        "records": {category: sum(r["category"] == category for r in answers) for category in dirs},
        "scores": scores,
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
