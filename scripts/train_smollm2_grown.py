#!/usr/bin/env python
"""Continues a trained SmolLM2 EAGLE-3 drafter on the shards ``data/smollm2-distill`` gained since it was trained.

The shipped drafter saw the data set's first 15 shards three times (``scripts/train_smollm2_eagle3.sh``); the data
set keeps growing (``scripts/build_smollm2_distill.py --num-shards N``). This trains it on the new shards' records
only, as fresh data, without dumping and re-reading the old ones:

1. data: the training records of shards ``--from-shard`` .. ``--shards``-1; the held-out records (the scaling
   curve's hash rule) of every shard up to ``--shards``, so the new shards' held-out prompts are never trained on;
2. features: the bf16 target's features over both (``dump_features``, resumable; the same dumps as
   ``train_smollm2_scaling.py --shards S --from-shard F --dump-only --out OUT``);
3. training: from ``--drafter`` (default: the shipped drafter) for ``--epochs``, a fresh cosine schedule from
   ``--lr``, resumable from its checkpoints; with ``--draft-layers N`` the drafter is first deepened to ``N`` draft
   layers (``Eagle3ForDrafting.with_draft_layers``: the added layers start as identities, so training starts from
   the trained drafter's acceptance) and written to ``OUT/drafter-Nlayers``;
4. results: the drafter scored on the held-out set before and after (loss, acc_0..4, simulated tau) in
   ``--results`` (default ``model_cards/results/smollm2-eagle3-grown.json``).

Usage::

    python scripts/train_smollm2_grown.py --shards 21 --from-shard 15

Then ship it: ``cp runs/smollm2-grown/drafter/{config.json,model.safetensors,training_record.json}
src/hf_specdec/assets/smollm2-drafter/``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_smollm2_long import fine_tune, score, write_fine_tune_results  # noqa: E402
from train_smollm2_scaling import SHIPPED_SHARDS, dump, training_and_held_out  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/smollm2-distill")
    p.add_argument("--shards", type=int, required=True, help="read the data set's first N shards")
    p.add_argument(
        "--from-shard",
        type=int,
        default=SHIPPED_SHARDS,
        help=f"train on the records of this shard on (default {SHIPPED_SHARDS}: those the shipped drafter has not seen)",
    )
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--draft-layers", type=int, help="deepen the drafter to this many draft layers first")
    p.add_argument("--out", default="runs/smollm2-grown")
    p.add_argument("--results", default="model_cards/results/smollm2-eagle3-grown")
    p.add_argument("--eval-every", type=int, default=64, help="the held-out rule of train_smollm2_scaling.py")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--save-steps", type=int, default=200)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def dump_new_shards(target, tokenizer, config, args) -> tuple[dict, list, list]:
    """The bf16 target's features over the training records of shards ``args.from_shard`` .. ``args.shards``-1 and
    the held-out records of every shard up to ``args.shards`` (resumable; what is dumped already is kept). Returns
    ``({"train": dir, "eval": dir}, training records, held-out records)``."""
    train_records, eval_records = training_and_held_out(args.data, args.shards, args.eval_every, args.from_shard)
    dirs = {name: os.path.join(args.out, f"features-{name}") for name in ("train", "eval")}
    dump(target, tokenizer, eval_records, config, dirs["eval"], args.max_length)
    dump(target, tokenizer, train_records, config, dirs["train"], args.max_length)
    return dirs, train_records, eval_records


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2

    target, tokenizer = load_smollm2(dtype="bfloat16")
    target.eval()
    start = AutoModelForDrafting.from_pretrained(args.drafter)
    dirs, train_records, eval_records = dump_new_shards(target, tokenizer, start.config, args)
    before = score(start, target, dirs["eval"], args)  # a deepened drafter starts here too (its new layers: identities)
    print(f"before: {before}")

    drafter_dir = os.path.join(args.out, "drafter" + (f"-{args.draft_layers}layers" if args.draft_layers else ""))
    deepen = {"num_hidden_layers": args.draft_layers} if args.draft_layers else None
    drafter, record = fine_tune(
        target, tokenizer, args, drafter_dir, dirs["train"], dirs["eval"], args.save_steps * 2, overrides=deepen
    )
    after = score(drafter, target, dirs["eval"], args)
    print(f"after: {after}")
    fields = {
        "drafter": "EAGLE-3, continued from " + args.drafter,
        "draft_layers": drafter.config.num_hidden_layers,
        "data": args.data,
        "shards": {"read": args.shards, "trained_from": args.from_shard},
        "training_records": len(train_records),
        "training_answer_tokens": sum(r["answer_tokens"] for r in train_records),
        "held_out_records": len(eval_records),
    }
    write_fine_tune_results(args, argv, "train_smollm2_grown.py", fields, record, before, after)


if __name__ == "__main__":
    main()
