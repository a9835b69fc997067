#!/usr/bin/env python
"""How much of SmolLM2's answers a drafter's draft vocabulary can draft at all, and how a widened vocabulary starts.

1. coverage: the share of answer tokens (the loss tokens: answer and end-of-turn) inside the draft vocabulary of
   ``--drafter``, by data set and category, on the held-out records of ``data/smollm2-distill`` and
   ``data/smollm2-distill-long`` (the hash rule of ``scripts/train_smollm2_long.py``); and the coverage a vocabulary
   widened to each of ``--sizes`` would have (the drafter's tokens plus the training records' most frequent others);
2. the start of a widened drafter: held-out loss, acc_0..4 and simulated tau on the chat held-out features of
   ``runs/smollm2-long/features-eval-chat`` (``scripts/train_smollm2_long.py`` writes them) for the drafter, the
   drafter widened to ``--init-size`` (the new rows mapped from the target's rows: the library's rule), and the same
   with the target's raw LM-head rows for the new tokens (the rule it replaces).

Writes ``model_cards/results/smollm2-vocab-coverage.json``.

Usage::

    python scripts/smollm2_vocab_coverage.py
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_smollm2_long import score  # noqa: E402
from train_smollm2_scaling import SHIPPED_SHARDS, read_records, split_records  # noqa: E402


def loss_tokens(records, tokenizer) -> list[tuple[str, list[int]]]:
    """``(category, loss token ids)`` of each record, tokenised as training tokenises it."""
    from hf_specdec.training.data import tokenize_record

    out = []
    for r in records:
        example = tokenize_record(r, tokenizer)
        ids = [t for t, m in zip(example["input_ids"], example["loss_mask"]) if m]
        out.append((r.get("category") or r.get("source") or "?", ids))
    return out


def coverage(rows, vocab: set) -> dict:
    by = collections.defaultdict(lambda: [0, 0])
    for category, ids in rows:
        by[category][0] += sum(t in vocab for t in ids)
        by[category][1] += len(ids)
    inside, total = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
    return {"all": round(inside / total, 4), **{k: round(v[0] / v[1], 4) for k, v in sorted(by.items())}}


def widened_vocabulary(old: list[int], tally: torch.Tensor, size: int) -> set:
    """The tokens of a vocabulary widened to ``size`` (the library's rule: the most frequent others, ties by id)."""
    counts = tally.to(torch.float64).clone()
    counts[old] = float("-inf")
    return set(old) | set(torch.argsort(-counts, stable=True)[: size - len(old)].tolist())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 16384])
    p.add_argument("--init-size", type=int, default=8192)
    p.add_argument("--features", default="runs/smollm2-long/features-eval-chat")
    p.add_argument("--out", default="model_cards/results/smollm2-vocab-coverage.json")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.training.distill import read_distill_dataset

    target, tokenizer = load_smollm2(dtype="bfloat16")
    drafter = AutoModelForDrafting.from_pretrained(args.drafter)
    old = drafter.draft_token_ids.tolist()
    held_out, tally = {}, torch.zeros(target.config.vocab_size, dtype=torch.long)
    for name, every in (("chat", 64), ("long", 16)):
        folder = "data/smollm2-distill" + ("-long" if name == "long" else "")
        shards = SHIPPED_SHARDS if name == "chat" else None
        records = read_records(folder, shards) if shards else read_distill_dataset(folder)
        train, evaluation = split_records(records, every)
        held_out[name] = loss_tokens(evaluation, tokenizer)
        for _, ids in loss_tokens(train, tokenizer):
            tally += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=tally.numel())
    result = {
        "target": "SmolLM2-135M-Instruct",
        "drafter": args.drafter,
        "draft_vocab_size": len(old),
        "command": "python scripts/smollm2_vocab_coverage.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "held_out_records": {k: len(v) for k, v in held_out.items()},
        "coverage": {k: coverage(v, set(old)) for k, v in held_out.items()},
        "widened_coverage": {
            str(size): {k: coverage(v, widened_vocabulary(old, tally, size))["all"] for k, v in held_out.items()}
            for size in args.sizes
        },
    }
    result["widened_start_chat"] = start_of_widened(drafter, target, tally, args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


def start_of_widened(drafter, target, tally: torch.Tensor, args) -> dict:
    """Held-out chat metrics of the drafter, widened with mapped rows, and widened with the target's raw rows."""
    ns = argparse.Namespace(out="runs/vocab-coverage", batch_size=4, mixed_precision="bf16")
    wider = drafter.widened_draft_vocabulary(args.init_size, tally, target)
    raw = drafter.widened_draft_vocabulary(args.init_size, tally, target)
    added = ~torch.isin(raw.draft_token_ids, drafter.draft_token_ids)
    with torch.no_grad():
        raw.lm_head.weight[added] = target.get_output_embeddings().weight[raw.draft_token_ids[added]].to(raw.dtype)
    return {
        "drafter": score(drafter, target, args.features, ns),
        f"widened_{args.init_size}_mapped_rows": score(wider, target, args.features, ns),
        f"widened_{args.init_size}_raw_target_rows": score(raw, target, args.features, ns),
    }


if __name__ == "__main__":
    main()
