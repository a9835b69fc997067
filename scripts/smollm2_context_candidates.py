#!/usr/bin/env python
"""How a context-vocabulary drafter's first draft step treats its candidates on Spec-Bench answers (a diagnostic).

For each drafter and category, over the first ``--records`` answers of ``smollm2_specbench_score.py``'s feature
dumps, teacher forced, at every scored anchor: whether the target's greedy token lies outside the draft vocabulary,
whether it is a candidate (a token seen earlier in the sequence), whether the copied token is the best-scoring
candidate, and how often a candidate beats the best vocabulary token (the drafter then drafts it) and is right.
A drafter without a context vocabulary is given one first, its map fitted to its LM head (``--fit``, the start of
``hf-specdec train --context-vocabulary``).

Usage::

    python scripts/smollm2_context_candidates.py --drafters runs/levers-features/context-vocab \
        src/hf_specdec/assets/smollm2-drafter
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402

COUNTS = (
    "anchors",
    "outside_vocab",
    "candidate_labels",
    "copy_is_top_candidate",
    "candidate_drafted",
    "candidate_right",
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafters", nargs="+", required=True)
    p.add_argument("--features", default="runs/specbench-score", help="folder of features-<category>")
    p.add_argument("--categories", nargs="+", default=["rag", "summarization", "translation", "mt_bench"])
    p.add_argument("--records", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", default="model_cards/results/smollm2-context-candidates")
    return p.parse_args(argv)


@torch.no_grad()
def record_counts(drafter, item, head) -> dict:
    """The :data:`COUNTS` of one dumped answer at the drafter's first draft step."""
    from hf_specdec.context_vocab import training_candidates, visible

    ids = item["input_ids"].long()[None]
    feats = [x[None].float() for x in item["target_hidden_states"]]
    ((logits, hidden),) = drafter.ttt_forward(ids, feats, None, steps=1)
    cand, first = training_candidates(ids, torch.ones_like(ids).bool(), ~drafter.t2d[ids])
    ctx = drafter.context_vocab.logits(drafter.output_features(hidden), drafter.context_vocab.rows(head, cand))
    ctx = ctx.masked_fill(~visible(first, ids.shape[1], 1), float("-inf"))[0]
    anchors = torch.nonzero(item["loss_mask"].bool()[2:]).flatten()
    label = (item["target_last_hidden"][anchors + 1].float() @ head.T).argmax(-1)
    best_vocab = logits[0, anchors].max(-1).values
    best_ctx, top = ctx[anchors].max(-1)
    is_label = (cand[0][None, :] == label[:, None]) & torch.isfinite(ctx[anchors])
    drafted = best_ctx > best_vocab
    right = drafted & (cand[0][top] == label)
    return {
        "anchors": len(anchors),
        "outside_vocab": int((~drafter.t2d[label]).sum()),
        "candidate_labels": int(is_label.any(-1).sum()),
        "copy_is_top_candidate": int((is_label.any(-1) & is_label.gather(1, top[:, None])[:, 0]).sum()),
        "candidate_drafted": int(drafted.sum()),
        "candidate_right": int(right.sum()),
    }


def drafter_rows(path, target, args) -> list[dict]:
    from hf_specdec import AutoModelForDrafting
    from hf_specdec.training.offline import OfflineFeatureDataset

    drafter = AutoModelForDrafting.from_pretrained(path).eval()
    fitted = not drafter.config.context_vocabulary
    drafter = drafter.with_context_vocabulary(target).eval().bind_target(target)
    head = target.get_output_embeddings().weight.detach().float()
    rows = []
    for category in args.categories:
        dataset = OfflineFeatureDataset(os.path.join(args.features, f"features-{category}"))
        totals = dict.fromkeys(COUNTS, 0)
        for i in range(min(args.records, len(dataset))):
            for key, value in record_counts(drafter, dataset[i], head).items():
                totals[key] += value
        rows.append({"drafter": os.path.basename(path.rstrip("/")), "map": "fitted" if fitted else "trained",
                     "category": category, **totals})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [
        "# Context-vocabulary candidates at the first draft step, on Spec-Bench answers",
        "",
        f"Command: `{result['command']}`. Teacher forced over the first {result['records']} answers per category "
        "(the bf16 target's greedy answers of `smollm2_specbench_score.py`). outside: the target's token is outside "
        "the draft vocabulary; candidate: it was seen earlier; top: it is the best-scoring candidate; drafted: a "
        "candidate beats the best vocabulary token; right: that candidate is the target's token. A drafter without a "
        "context vocabulary gets its map fitted to its LM head (map: fitted).",
        "",
        "| drafter | map | category | anchors | outside | candidate | top | drafted | right |",
        "|:---|:---|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['drafter']} | {r['map']} | {r['category']} | " + " | ".join(str(r[k]) for k in COUNTS) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_specdec.demo import DEMO_TARGETS

    target, _ = DEMO_TARGETS["smollm2"].load(dtype="float32", device_map=None)
    rows = [row for path in args.drafters for row in drafter_rows(path, target, args)]
    command = "python scripts/smollm2_context_candidates.py " + shlex.join(argv)
    result = {"command": command.strip(), "records": args.records, "rows": rows}
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
