"""Writes the first N held-out prompts of the committed SmolLM2 self-distillation data (data/smollm2-distill) as a
prompt file for `hf-specdec bench`: the user turns of the records `scripts/train_smollm2_scaling.py` holds out (their
prompt hashes to 0 mod 64), each with its source as the category.

Benchmarking the shipped drafter on them next to Spec-Bench separates what the drafter learned from how far Spec-Bench
lies from its training prompts:

    python scripts/smollm2_heldout_prompts.py /tmp/heldout_prompts.jsonl
    hf-specdec bench --target smollm2 --prompts /tmp/heldout_prompts.jsonl --max-new-tokens 96 --draft-length fixed \
        --lookup-tokens 0 --no-peers --repeats 1 --threads 1 --out runs/heldout-check --stem tau
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_smollm2_scaling import add_shards_argument, read_records, split_records  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="the prompt file to write (JSONL)")
    p.add_argument("--data", default="data/smollm2-distill")
    add_shards_argument(p)
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=64, help="as in train_smollm2_scaling.py")
    args = p.parse_args()
    _, held_out = split_records(read_records(args.data, args.shards), args.eval_every)
    with open(args.out, "w", encoding="utf-8") as fh:
        for i, record in enumerate(held_out[: args.num_prompts]):
            user_turns = [m for m in record["messages"] if m["role"] != "assistant"]
            fh.write(json.dumps({"id": i, "category": record.get("source", "held-out"), "messages": user_turns}) + "\n")
    print(f"wrote {min(args.num_prompts, len(held_out))} of {len(held_out)} held-out prompts to {args.out}")


if __name__ == "__main__":
    main()
