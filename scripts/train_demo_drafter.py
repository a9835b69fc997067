#!/usr/bin/env python
"""Trains an EAGLE-3 drafter for the demo target with hf_specdec's own pipeline, and measures it.

1. prompts: code prefixes ending at a ``def``/``class`` line, cut from the stdlib files the target was trained on;
2. self-distillation: the target continues every train prompt greedily (``hf_specdec.training.regenerate``);
3. ``train_drafter`` (online target features, training-time test) on the regenerated data;
4. ``hf_specdec.bench``: plain generate vs the untrained and the trained drafter on the held-out demo prompts
   (temperature 0, batch size 1; outputs checked identical to plain generate).

Steps 1-3 are :func:`hf_specdec.demo.train_demo_drafter` (what ``hf-specdec demo --train`` runs).

Usage:
    python scripts/train_demo_drafter.py --out runs/demo-drafter
    cp runs/demo-drafter/drafter/{config.json,model.safetensors,training_record.json} src/hf_specdec/assets/demo-drafter/
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo-drafter")
    p.add_argument("--max-train-files", type=int, default=600)
    p.add_argument("--prompts-per-file", type=int, default=1)
    p.add_argument("--regen-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--eval-new-tokens", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="resume the drafter training from its last checkpoint")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec import AutoModelForDrafting, Eagle3Config
    from hf_specdec.bench.prompts import load_prompts
    from hf_specdec.bench.runner import drafter_method, plain_method, run_benchmark
    from hf_specdec.demo import load_demo_target, train_demo_drafter

    target, tokenizer = load_demo_target()
    folder = train_demo_drafter(
        target,
        tokenizer,
        args.out,
        max_steps=args.max_steps,
        num_draft_tokens=args.k,
        draft_vocab_size=args.draft_vocab_size,
        regen_tokens=args.regen_tokens,
        max_train_files=args.max_train_files,
        prompts_per_file=args.prompts_per_file,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        seed=args.seed,
        resume=args.resume,
    )
    torch.manual_seed(args.seed)
    untrained = AutoModelForDrafting.from_config(
        Eagle3Config.for_target(target.config, num_draft_tokens=args.k, draft_vocab_size=args.draft_vocab_size)
    ).eval()
    trained = AutoModelForDrafting.from_pretrained(folder).eval()
    methods = [plain_method(), drafter_method(untrained, name="untrained"), drafter_method(trained, name="trained")]
    prompts = load_prompts("demo")[: args.eval_prompts]
    report = run_benchmark(target, tokenizer, methods, prompts, max_new_tokens=args.eval_new_tokens, warmup=1)
    with open(os.path.join(folder, "training_record.json")) as fh:
        record = json.load(fh)
    by_name = {r["method"]: r for r in report["records"] if r["category"] == "all"}
    keys = ("mean_accepted_length", "tokens_per_s", "speedup", "identical", "alpha", "draft_cost_ratio")
    summary = {
        "before": {k: by_name["untrained"][k] for k in keys},
        "after": {k: by_name["trained"][k] for k in keys},
        "plain_tokens_per_s": by_name["plain"]["tokens_per_s"],
        "training": {
            k: record.get(k) for k in ("steps", "tokens_per_second", "wall_time_s", "peak_rss_mb", "final_eval")
        },
        "k": args.k,
        "temperature": 0.0,
        "eval_prompts": len(prompts),
        "eval_new_tokens": args.eval_new_tokens,
        "hardware": report["hardware"],
    }
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
