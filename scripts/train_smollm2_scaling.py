#!/usr/bin/env python
"""EAGLE-3 for SmolLM2-135M-Instruct on the committed self-distillation data, at several data sizes: the scaling curve.

1. data: ``data/smollm2-distill`` (``scripts/build_smollm2_distill.py``; committed, so nothing is regenerated). A
   fixed held-out set (records whose prompt hashes to 0 mod ``--eval-every``, about 1.5 %) is kept apart, the same for
   every size; the training records are taken in shard order. ``--shards N`` reads the first N shards (default 15,
   those the committed curve and the shipped drafters were trained on): a grown data set leaves them as they were;
2. features: the target runs once over the held-out set and once over the largest training prefix, and the hidden
   states the drafter reads are stored (``dump_features``, resumable shard by shard; not committed: rebuilt by this
   command; ``--dump-only`` stops here, the family script reads the same dumps). The target runs in bf16 by default
   (``--target-dtype``): the dtype the data's answers were generated in, 2.4x faster than fp32 on this CPU; the
   soft labels then come from the same bf16 target, and the drafter is measured against the fp32 target too;
3. training: one drafter per size in ``--sizes`` (answer tokens of training data), each for ``--epochs`` epochs on its
   prefix of the dump, scored on the same held-out features (acc_0..4, simulated tau); resumable (a killed size
   resumes from its last checkpoint, finished sizes are skipped);
4. results: ``model_cards/results/smollm2-eagle3-scaling.{json,png}``.

``--drafter FAMILY`` (with ``--config KEY=VALUE`` overrides) trains another family on the same dumps and split, in
``OUT/FAMILY-size-N``: ``--drafter hydra --config num_heads=5 --results model_cards/results/smollm2-hydra-scaling``
wrote the Hydra curve.

Usage (the committed curve)::

    python scripts/train_smollm2_scaling.py --sizes 150000 500000 1500000

The drafter of the largest size is the shipped one: ``cp runs/smollm2-scaling/size-1500000/{config.json,
model.safetensors,training_record.json} src/hf_specdec/assets/smollm2-drafter/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys

import torch

SHIPPED_SHARDS = 15  # the shards of data/smollm2-distill the shipped drafters and the committed curve were trained on


def add_shards_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shards",
        type=int,
        default=SHIPPED_SHARDS,
        help=f"use the data set's first N shards (default {SHIPPED_SHARDS}: those the shipped drafters and the "
        "committed results were trained on; the data set may hold more)",
    )


def read_records(data: str, shards: int) -> list[dict]:
    """The records of the first ``shards`` shards of a self-distillation data set, in shard order."""
    from hf_specdec.training.distill import read_distill_dataset

    return read_distill_dataset(data, shards=range(shards))


def split_records(records: list[dict], eval_every: int) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)``: a record is held out when its user prompt hashes to 0 mod ``eval_every``."""
    from hf_specdec.training.distill import normalize_prompt

    def held_out(r):
        prompt = " ".join(m["content"] for m in r["messages"] if m["role"] == "user")
        return int(hashlib.sha256(normalize_prompt(prompt).encode()).hexdigest()[:8], 16) % eval_every == 0

    train = [r for r in records if not held_out(r)]
    return train, [r for r in records if held_out(r)]


def training_and_held_out(data: str, shards: int, eval_every: int, from_shard: int = 0):
    """``(train, held_out)`` of the first ``shards`` shards; the training records only of shards ``from_shard`` on
    (a drafter trained on the first shards continues on those added since), the held-out ones of every shard."""
    train, held_out = split_records(read_records(data, shards), eval_every)
    if from_shard:
        train, _ = split_records(read_distill_range(data, from_shard, shards), eval_every)
    return train, held_out


def read_distill_range(data: str, first: int, end: int) -> list[dict]:
    from hf_specdec.training.distill import read_distill_dataset

    if not 0 <= first < end:
        raise SystemExit(f"--from-shard {first} must lie in [0, --shards {end}).")
    return read_distill_dataset(data, shards=range(first, end))


def prefix_for_tokens(records: list[dict], tokens: int) -> int:
    """How many leading records hold ``tokens`` answer tokens."""
    total = 0
    for n, r in enumerate(records, start=1):
        total += r["answer_tokens"]
        if total >= tokens:
            return n
    return len(records)


def write_split(data: str, shards: int, eval_every: int, out_dir: str) -> None:
    """The training and held-out records as two JSONL files (the records of the two feature dumps, in their order)."""

    os.makedirs(out_dir, exist_ok=True)
    for name, records in zip(("train", "held-out"), split_records(read_records(data, shards), eval_every)):
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"{out_dir}/{name}.jsonl: {len(records)} records")


def dump(target, tokenizer, records, config, out_dir, max_length):
    from hf_specdec.training.offline import dump_features
    from hf_specdec.training.recipes import build_datasets

    dataset, _, info = build_datasets(records, tokenizer, max_length, eval_fraction=0.0)
    examples = [dataset[i] for i in range(len(dataset))]
    dump_features(target, examples, config.target_layer_ids, out_dir, dtype=torch.bfloat16, batch_size=8,
                  tokenizer=tokenizer)  # fmt: skip
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/smollm2-distill")
    add_shards_argument(p)
    p.add_argument(
        "--from-shard",
        type=int,
        default=0,
        help="train only on the records of shards FROM_SHARD.. --shards-1 (the held-out set still spans every shard "
        "read): the dump a trained drafter continues on (hf-specdec train --drafter) when the data set has grown",
    )
    p.add_argument("--out", default="runs/smollm2-scaling")
    p.add_argument("--results", default="model_cards/results/smollm2-eagle3-scaling")
    p.add_argument("--sizes", type=int, nargs="+", default=[150_000, 500_000, 1_500_000])
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-steps", type=int, default=200)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"], help="bf16 autocast (CPUs with bf16)")
    p.add_argument(
        "--target-dtype",
        default="bfloat16",
        help="the target's dtype for the feature dumps and the soft labels (the data was generated in bf16)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dump-only", action="store_true", help="write the two feature dumps and stop (the families use them)"
    )
    p.add_argument(
        "--write-split",
        metavar="DIR",
        help="write the training records and the held-out records as DIR/{train,held-out}.jsonl and stop (online "
        "training on the same split: the family script's Medusa-2)",
    )
    p.add_argument(
        "--drafter",
        help="train this drafter family (default: the shipped one, EAGLE-3) on the same dumps; its runs go to "
        "OUT/<family>-size-N and its results to --results",
    )
    p.add_argument("--config", nargs="+", metavar="KEY=VALUE", help="drafter config overrides (as hf-specdec train's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.write_split:
        return write_split(args.data, args.shards, args.eval_every, args.write_split)

    from hf_specdec.commands.common import drafter_overrides
    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.registry import default_drafter_spec
    from hf_specdec.training.recipes import train_drafter
    from hf_specdec.training.trainer import DrafterTrainingArguments

    target, tokenizer = load_smollm2(dtype=args.target_dtype)
    target.eval()
    train_records, eval_records = training_and_held_out(args.data, args.shards, args.eval_every, args.from_shard)
    sizes = sorted(args.sizes)
    largest = prefix_for_tokens(train_records, sizes[-1])
    spec = default_drafter_spec()  # EAGLE-3: the dumps hold its layers (and the final state every family reads)
    config = spec.config_class.for_target(target.config, num_draft_tokens=args.k)
    eval_info = dump(target, tokenizer, eval_records, config, os.path.join(args.out, "features-eval"), args.max_length)
    dump(target, tokenizer, train_records[:largest], config, os.path.join(args.out, "features-train"), args.max_length)
    print(f"held out: {len(eval_records)} records ({eval_info['tokens']} tokens); training pool: {largest} records")
    if args.dump_only:
        return

    family = args.drafter or spec.name
    config_overrides = drafter_overrides(args)  # --draft-vocab-size, --config
    overrides = {"num_draft_tokens": args.k, **config_overrides}
    rows = []
    for size in reversed(sizes):  # the largest (the shipped drafter) first
        n = prefix_for_tokens(train_records, size)
        out = os.path.join(args.out, f"size-{size}" if family == spec.name else f"{family}-size-{size}")
        targs = DrafterTrainingArguments(
            output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, warmup_steps=0.03, save_steps=args.save_steps, eval_steps=args.save_steps, logging_steps=20,
            seed=args.seed, report_to="none", bf16=args.mixed_precision == "bf16",
        )  # fmt: skip
        record_path = os.path.join(out, "training_record.json")
        if os.path.isfile(record_path):
            with open(record_path, encoding="utf-8") as fh:
                record = json.load(fh)
        else:
            resume = os.path.isdir(out) and any(name.startswith("checkpoint-") for name in os.listdir(out))
            _, record = train_drafter(
                target, tokenizer, None, targs, drafter=family, drafter_overrides=overrides,
                features_dir=os.path.join(args.out, "features-train"),
                eval_features_dir=os.path.join(args.out, "features-eval"), max_train_examples=n, resume=resume,
            )  # fmt: skip
        answer_tokens = sum(r["answer_tokens"] for r in train_records[:n])
        rows.append({"size": size, "records": n, "answer_tokens": answer_tokens, "steps": record["steps"],
                     "final_train": record.get("final_train"), "final_eval": record.get("final_eval"),
                     "wall_time_s": record.get("wall_time_s")})  # fmt: skip
        ev = record.get("final_eval") or {}
        print(f"{size}: {n} records, {answer_tokens} answer tokens, held-out acc_0 {ev.get('acc_0')}, "
              f"simulated tau {ev.get('simulated_tau')}")  # fmt: skip
    write_results(args, rows[::-1], len(eval_records), family, config_overrides)


def write_results(args, rows, n_eval, family, config_overrides):
    from hf_specdec.registry import get_drafter_spec

    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    result = {
        "target": "SmolLM2-135M-Instruct",
        "drafter": get_drafter_spec(family).label,
        "config_overrides": config_overrides,
        "data": args.data,
        "held_out_records": n_eval,
        "settings": {
            k: getattr(args, k)
            for k in (
                "epochs",
                "k",
                "draft_vocab_size",
                "batch_size",
                "lr",
                "max_length",
                "mixed_precision",
                "target_dtype",
            )
        },
        "command": "python scripts/train_smollm2_scaling.py " + shlex.join(sys.argv[1:]),
        "rows": rows,
    }
    with open(args.results + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [r["answer_tokens"] / 1e6 for r in rows]
    for d in range(args.k):
        a.plot(x, [(r["final_eval"] or {}).get(f"acc_{d}") for r in rows], marker="o", label=f"acc_{d}")
    b.plot(x, [(r["final_eval"] or {}).get("simulated_tau") for r in rows], marker="o", color="k")
    a.set_xlabel("training answer tokens (M)")
    b.set_xlabel("training answer tokens (M)")
    a.set_ylabel("held-out acceptance")
    b.set_ylabel(f"held-out simulated τ (K = {args.k})")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.results + ".png", dpi=120)


if __name__ == "__main__":
    main()
