#!/usr/bin/env python
"""Trains an EAGLE-3 drafter for the demo target with hf_specdec's own pipeline, and measures it.

1. prompts: code prefixes ending at a ``def``/``class`` line, cut from the stdlib files the target was trained on
   (train prompts) and from its held-out files (evaluation prompts);
2. self-distillation: the target continues every train prompt greedily (``hf_specdec.training.regenerate``);
3. ``train_drafter`` (online target features, training-time test) on the regenerated data;
4. mean accepted length τ with K draft tokens at temperature 0 on held-out prompts, before and after training,
   via ``target.generate(assistant_model=drafter)`` (outputs checked identical to plain generate).

Usage:
    python scripts/train_demo_drafter.py --target src/hf_specdec/assets/demo-target --out runs/demo-drafter
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def code_prompts(files: list[str], per_file: int, seed: int, max_chars: int = 600) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        anchors = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class ")) and i >= 4]
        for i in rng.sample(anchors, min(per_file, len(anchors))):
            text = "\n".join(lines[max(0, i - 12) : i + 1]) + "\n"
            prompts.append(text[-max_chars:])
    return prompts


def measure_tau(target, tokenizer, drafter, prompts, k, max_new_tokens, batch_size=1):
    """τ, identity with plain generate and wall-clock times, prompt by prompt (batch size 1)."""
    taus, identical, t_plain, t_spec, n_tokens = [], True, 0.0, 0.0, 0
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
        t0 = time.perf_counter()
        ref = target.generate(ids, **kw)
        t_plain += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=k, return_dict_in_generate=True, **kw)
        t_spec += time.perf_counter() - t0
        identical &= torch.equal(out.sequences, ref)
        taus.extend(x for row in out.accepted_lengths for x in row)
        n_tokens += ref.shape[1] - ids.shape[1]
    return {
        "tau": round(sum(taus) / max(1, len(taus)), 3),
        "identical": bool(identical),
        "tokens_per_s_plain": round(n_tokens / t_plain, 1),
        "tokens_per_s_speculative": round(n_tokens / t_spec, 1),
        "speedup": round(t_plain / t_spec, 3),
        "prompts": len(prompts),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="src/hf_specdec/assets/demo-target")
    p.add_argument("--out", default="runs/demo-drafter")
    p.add_argument("--train-prompts-per-file", type=int, default=1)
    p.add_argument("--max-train-files", type=int, default=600)
    p.add_argument("--regen-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="resume the drafter training from its last checkpoint")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)

    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from train_demo_target import is_held_out, stdlib_files

    import hf_specdec  # noqa: F401
    from hf_specdec import AutoModelForDrafting, Eagle3Config
    from hf_specdec.training.recipes import load_target, train_drafter
    from hf_specdec.training.regenerate import regenerate
    from hf_specdec.training.trainer import DrafterTrainingArguments

    target, tokenizer = load_target(args.target, dtype="float32")
    files, root = stdlib_files()
    train_files = [f for f in files if not is_held_out(os.path.relpath(f, root))]
    eval_files = [f for f in files if is_held_out(os.path.relpath(f, root))]
    rng = random.Random(args.seed)
    train_files = rng.sample(train_files, min(args.max_train_files, len(train_files)))
    train_prompts = code_prompts(train_files, args.train_prompts_per_file, args.seed)
    eval_prompts = code_prompts(eval_files, 1, args.seed + 1)[: args.eval_prompts]
    print(f"{len(train_prompts)} train prompts, {len(eval_prompts)} held-out prompts", flush=True)

    regen_path = os.path.join(args.out, "regenerated.jsonl")
    t0 = time.time()
    regenerate(
        target,
        tokenizer,
        [{"prompt": text} for text in train_prompts],
        regen_path,
        max_new_tokens=args.regen_tokens,
        batch_size=16,
        resume=True,
    )
    print(f"self-distillation done in {time.time() - t0:.0f}s", flush=True)

    torch.manual_seed(args.seed)
    config = Eagle3Config.for_target(
        target.config, num_draft_tokens=args.k, draft_vocab_size=args.draft_vocab_size or None
    )
    untrained = AutoModelForDrafting.from_config(config).eval()
    before = measure_tau(target, tokenizer, untrained, eval_prompts[:8], args.k, args.eval_new_tokens)
    print("before training:", before, flush=True)

    targs = DrafterTrainingArguments(
        output_dir=os.path.join(args.out, "drafter"),
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_ratio=0.03,
        save_steps=100,
        eval_steps=100,
        logging_steps=20,
        seed=args.seed,
        report_to="none",
    )
    drafter, record = train_drafter(
        target,
        tokenizer,
        regen_path,
        targs,
        drafter="eagle3",
        drafter_overrides={"num_draft_tokens": args.k, "draft_vocab_size": args.draft_vocab_size},
        max_length=256,
        eval_fraction=0.05,
        resume=args.resume,
    )
    drafter = AutoModelForDrafting.from_pretrained(targs.output_dir).eval()
    after = measure_tau(target, tokenizer, drafter, eval_prompts, args.k, args.eval_new_tokens)
    print("after training:", after, flush=True)
    summary = {
        "before": before,
        "after": after,
        "training": {
            k: record.get(k) for k in ("steps", "tokens_per_second", "wall_time_s", "peak_rss_mb", "final_eval")
        },
        "k": args.k,
        "temperature": 0.0,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
