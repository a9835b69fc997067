#!/usr/bin/env python
"""Fine-tunes the shipped SmolLM2 EAGLE-3 drafter on long contexts: the lever the Spec-Bench gap points at.

On the chat data's own held-out prompts the shipped drafter reaches tau 2.15, on Spec-Bench 1.53, lowest in the
long-context categories (summarization 1.28, translation 1.34, rag 1.46): it was trained on prompts of a few hundred
tokens, while Spec-Bench's documents run to several thousand characters and its answers copy from them.

1. data: ``data/smollm2-distill-long`` (``scripts/build_smollm2_distill.py --source long-context``) plus a replay
   of ``--replay-tokens`` answer tokens of ``data/smollm2-distill``, so the chat skill is kept; each set's held-out
   records are the same hash rule as the scaling curve (``--eval-every``; the chat held-out set is the curve's);
2. features: the bf16 target's features over the mix and over both held-out sets (``dump_features``, resumable);
3. training: from ``--drafter`` (default: the shipped drafter) for ``--epochs``, resumable from its checkpoints;
4. results: both held-out sets scored before and after (acc_0..4, simulated tau, the share of their loss tokens in
   the draft vocabulary) in ``--results`` (default ``model_cards/results/smollm2-eagle3-long.json``).

``--draft-vocab-size N`` widens the drafter's draft vocabulary before the fine-tune (the three-epoch drafter's 4,096
tokens cover 90.5 % of the held-out chat answers' tokens and 87.5 % of the long-context ones; a token outside it is
always rejected): the training data's most frequent other tokens join it, starting from the target's LM-head rows.

Usage::

    python scripts/train_smollm2_long.py

Then ship it: ``cp runs/smollm2-long/drafter/{config.json,model.safetensors,training_record.json}
src/hf_specdec/assets/smollm2-drafter/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_smollm2_scaling import add_shards_argument, dump, prefix_for_tokens, read_records, split_records  # noqa: E402

SCORED_STEPS = 5  # every drafter is scored with five draft steps unrolled (acc_0..4), whatever it was trained with


def score(drafter, target, features_dir, args) -> dict:
    """Held-out loss, acc_0..4 and simulated tau of ``drafter`` on one feature dump, with ``SCORED_STEPS`` draft steps
    unrolled (a family with ``ttt_steps``, EAGLE-3 or MTP, for the scoring only; Hydra unrolls one per head)."""
    if not hasattr(drafter.config, "ttt_steps"):
        return score_unrolled(drafter, target, features_dir, args)
    unrolled, drafter.config.ttt_steps = drafter.config.ttt_steps, SCORED_STEPS
    try:
        return score_unrolled(drafter, target, features_dir, args)
    finally:
        drafter.config.ttt_steps = unrolled


def score_unrolled(drafter, target, features_dir, args) -> dict:
    """``score`` with the draft steps ``drafter``'s config unrolls."""
    from hf_specdec.training.offline import OfflineFeatureDataset, collate_offline
    from hf_specdec.training.trainer import DrafterTrainer, DrafterTrainingArguments

    held_out = OfflineFeatureDataset(features_dir)
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    targs = DrafterTrainingArguments(
        output_dir=os.path.join(args.out, "scoring"), per_device_eval_batch_size=args.batch_size, report_to="none",
        bf16=args.mixed_precision == "bf16",
    )  # fmt: skip
    trainer = DrafterTrainer(drafter, target, targs, held_out, held_out, collate_fn=lambda b: collate_offline(b, pad))
    metrics = trainer.draft_metrics()
    out = {"loss": round(metrics.loss, 5)}
    out.update({f"acc_{d}": round(a, 4) for d, a in enumerate(metrics.accuracy)})
    out["simulated_tau"] = round(metrics.rate("simulated_tau"), 4)
    out["vocab_coverage"] = round(vocab_coverage(drafter, held_out), 4)
    return out


def fine_tune(target, tokenizer, args, out, train_dir, eval_dir, eval_steps, overrides=None):
    """``args.drafter`` trained on the features in ``train_dir`` (scored on ``eval_dir`` every ``eval_steps``), a
    fresh cosine schedule from ``args.lr``; resumes from a checkpoint in ``out``. Returns ``(drafter, record)``."""
    from hf_specdec.training.recipes import train_drafter
    from hf_specdec.training.trainer import DrafterTrainingArguments

    targs = DrafterTrainingArguments(
        output_dir=out, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        warmup_steps=0.03, save_steps=args.save_steps, eval_steps=eval_steps, logging_steps=20,
        seed=args.seed, report_to="none", bf16=args.mixed_precision == "bf16",
    )  # fmt: skip
    resume = os.path.isdir(out) and any(name.startswith("checkpoint-") for name in os.listdir(out))
    return train_drafter(
        target, tokenizer, None, targs, drafter=args.drafter, features_dir=train_dir, eval_features_dir=eval_dir,
        resume=resume, drafter_overrides=overrides,
    )  # fmt: skip


def write_fine_tune_results(args, argv, script: str, fields: dict, record: dict, before: dict, after: dict) -> None:
    """``args.results``.json: ``fields``, the training settings and command, and the held-out scores before and
    after."""
    result = {
        "target": "SmolLM2-135M-Instruct",
        **fields,
        "settings": {k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "max_length", "mixed_precision")},
        "command": f"python scripts/{script} " + shlex.join(sys.argv[1:] if argv is None else argv),
        "steps": record.get("steps"),
        "wall_time_s": record.get("wall_time_s"),
        "held_out_before": before,
        "held_out_after": after,
    }
    os.makedirs(os.path.dirname(args.results) or ".", exist_ok=True)
    with open(args.results + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


def vocab_coverage(drafter, dataset) -> float:
    """The share of the loss tokens of ``dataset`` that are in ``drafter``'s draft vocabulary (a token outside it
    can never be drafted)."""
    from hf_specdec.training.data import loss_token_counts

    counts = loss_token_counts(dataset, drafter.config.target_vocab_size)
    return float(counts[drafter.draft_token_ids.cpu()].sum() / counts.sum())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long-data", default="data/smollm2-distill-long")
    p.add_argument("--chat-data", default="data/smollm2-distill")
    add_shards_argument(p)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--out", default="runs/smollm2-long")
    p.add_argument("--results", default="model_cards/results/smollm2-eagle3-long")
    p.add_argument("--replay-tokens", type=int, default=400_000)
    p.add_argument("--eval-every", type=int, default=64, help="the chat held-out rule (the scaling curve's)")
    p.add_argument("--long-eval-every", type=int, default=16)
    p.add_argument("--max-length", type=int, default=1536)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="widen the drafter's draft vocabulary to this size first (the training data's most frequent other "
        "tokens join it; trained weights kept); the drafter then goes to OUT/drafter-vocabN",
    )
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-records", type=int, default=None, help="cap every set at N records (a quick check)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.training.distill import read_distill_dataset

    target, tokenizer = load_smollm2(dtype="bfloat16")
    target.eval()
    chat_train, chat_eval = split_records(read_records(args.chat_data, args.shards), args.eval_every)
    long_train, long_eval = split_records(read_distill_dataset(args.long_data), args.long_eval_every)
    replay = chat_train[: prefix_for_tokens(chat_train, args.replay_tokens)]
    cap = slice(args.max_records)
    long_train, replay, chat_eval, long_eval = long_train[cap], replay[cap], chat_eval[cap], long_eval[cap]
    start = AutoModelForDrafting.from_pretrained(args.drafter)
    dirs = {name: os.path.join(args.out, f"features-{name}") for name in ("train", "eval-chat", "eval-long")}
    dump(target, tokenizer, long_train + replay, start.config, dirs["train"], args.max_length)
    dump(target, tokenizer, chat_eval, start.config, dirs["eval-chat"], args.max_length)
    dump(target, tokenizer, long_eval, start.config, dirs["eval-long"], args.max_length)
    before = {name: score(start, target, dirs[f"eval-{name}"], args) for name in ("chat", "long")}
    print(f"before: {before}")

    out = os.path.join(
        args.out, "drafter" if args.draft_vocab_size is None else f"drafter-vocab{args.draft_vocab_size}"
    )
    overrides = None if args.draft_vocab_size is None else {"draft_vocab_size": args.draft_vocab_size}
    drafter, record = fine_tune(
        target, tokenizer, args, out, dirs["train"], dirs["eval-long"], args.save_steps * 4, overrides
    )
    after = {name: score(drafter, target, dirs[f"eval-{name}"], args) for name in ("chat", "long")}
    print(f"after: {after}")
    fields = {
        "drafter": "EAGLE-3, fine-tuned from " + args.drafter,
        "data": {"long": args.long_data, "chat_replay": args.chat_data},
        "training_records": {"long": len(long_train), "chat_replay": len(replay)},
        "training_answer_tokens": {
            "long": sum(r["answer_tokens"] for r in long_train),
            "chat_replay": sum(r["answer_tokens"] for r in replay),
        },
        "held_out_records": {"chat": len(chat_eval), "long": len(long_eval)},
        "draft_vocab_size": {"before": start.config.draft_vocab_size, "after": drafter.config.draft_vocab_size},
    }
    write_fine_tune_results(args, argv, "train_smollm2_long.py", fields, record, before, after)


if __name__ == "__main__":
    main()
