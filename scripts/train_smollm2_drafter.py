#!/usr/bin/env python
"""Trains an EAGLE-3 drafter for SmolLM2-135M-Instruct with hf_specdec's own pipeline, end to end from prompts.

This built the drafter shipped before issue 24 (480-640 answers). The shipped drafter is now trained on the
committed ``data/smollm2-distill`` by ``bash scripts/train_smollm2_eagle3.sh``.

Every stage is resumable: rerun the same command after an interruption and it continues where it stopped.

1. prompts: ``hf_specdec.chat_prompts.chat_training_prompts`` (templates x topics, generated word problems, passages
   from the installed Python distributions' READMEs and standard-library docstrings), checked disjoint from the
   benchmark prompts (Spec-Bench, HumanEval, the demo prompts: no shared 12-word span);
2. self-distillation: SmolLM2 answers every prompt through its chat template, greedily
   (``hf_specdec.training.regenerate``, appended record by record);
3. offline features: the target runs once over the answered conversations and the hidden states the drafter reads
   are stored (``hf_specdec.training.offline.dump_features``, shard by shard);
4. training: ``train_drafter`` on the stored features (training-time test, checkpoints every ``--save-steps``);
5. the model card: ``model_cards/smollm2-eagle3.md`` is rendered from the training record and, when given, a bench
   report (``--bench``).

Usage (the earlier drafter; about an hour on 2 CPU cores)::

    python scripts/train_smollm2_drafter.py --out runs/smollm2-drafter --max-records 480
    cp runs/smollm2-drafter/drafter/{config.json,model.safetensors,training_record.json} \
        src/hf_specdec/assets/smollm2-drafter/

``--max-records`` uses the first N answered prompts (in the shuffled order of step 1), so a long regeneration can be
cut and a later run with a larger N continues it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2-drafter")
    p.add_argument("--num-prompts", type=int, default=1200, help="size of the prompt set (step 1)")
    p.add_argument("--max-records", type=int, default=None, help="answer and train on the first N prompts only")
    p.add_argument("--regen-tokens", type=int, default=192, help="longest answer (step 2)")
    p.add_argument("--regen-batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512, help="longest training example in tokens")
    p.add_argument("--k", type=int, default=5, help="draft length the drafter is trained for (TTT steps)")
    p.add_argument("--draft-vocab-size", type=int, default=4096)
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--stop-after-steps", type=int, default=-1, help="stop early with a checkpoint (resume later)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec.chat_prompts import benchmark_texts, chat_training_prompts, check_disjoint
    from hf_specdec.gguf_target import load_smollm2
    from hf_specdec.registry import default_drafter_spec
    from hf_specdec.training.data import load_records
    from hf_specdec.training.offline import dump_features
    from hf_specdec.training.recipes import build_datasets, train_drafter
    from hf_specdec.training.regenerate import regenerate
    from hf_specdec.training.trainer import DrafterTrainingArguments

    os.makedirs(args.out, exist_ok=True)
    target, tokenizer = load_smollm2()

    # 1. prompts
    prompts = chat_training_prompts(args.num_prompts, seed=args.seed)
    bad = check_disjoint([r["prompt"] for r in prompts], benchmark_texts())
    if bad:
        raise SystemExit(f"{len(bad)} training prompts overlap a benchmark prompt, e.g. {prompts[bad[0]]['prompt']!r}")
    if args.max_records:
        prompts = prompts[: args.max_records]
    with open(os.path.join(args.out, "prompts.jsonl"), "w", encoding="utf-8") as fh:
        for r in prompts:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"[1/4] {len(prompts)} prompts, disjoint from the benchmarks", flush=True)

    # 2. self-distillation
    regen = os.path.join(args.out, "regenerated.jsonl")
    t0 = time.time()
    regenerate(target, tokenizer, prompts, regen, max_new_tokens=args.regen_tokens, batch_size=args.regen_batch_size)
    records = [r for r in load_records(regen) if r["source_index"] < len(prompts)]
    print(f"[2/4] {len(records)} answers ({time.time() - t0:.0f}s this run)", flush=True)

    # 3. offline features for the layers the drafter reads
    spec = default_drafter_spec()  # EAGLE-3
    config = spec.config_class.for_target(
        target.config, num_draft_tokens=args.k, draft_vocab_size=args.draft_vocab_size
    )
    dataset, _, info = build_datasets(records, tokenizer, args.max_length, eval_fraction=0.0)
    features = os.path.join(args.out, "features")
    t0 = time.time()
    dump_features(
        target,
        [dataset[i] for i in range(len(dataset))],
        config.target_layer_ids,
        features,
        dtype=torch.bfloat16,
        batch_size=8,
        tokenizer=tokenizer,
    )
    print(f"[3/4] features of {info['examples']} examples, {info['tokens']} tokens ({time.time() - t0:.0f}s)")

    # 4. training on the stored features
    targs = DrafterTrainingArguments(
        output_dir=os.path.join(args.out, "drafter"),
        max_steps=args.max_steps,
        stop_after_steps=args.stop_after_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=0.03,
        save_steps=args.save_steps,
        eval_steps=args.save_steps,
        logging_steps=20,
        seed=args.seed,
        report_to="none",
    )
    resume = os.path.isdir(targs.output_dir) and any(n.startswith("checkpoint-") for n in os.listdir(targs.output_dir))
    _, record = train_drafter(
        target,
        tokenizer,
        None,
        targs,
        drafter=spec.name,
        drafter_overrides={"num_draft_tokens": args.k, "draft_vocab_size": args.draft_vocab_size},
        features_dir=features,
        eval_fraction=0.05,
        resume=resume,
    )
    if record.get("stopped_early"):
        print(f"[4/4] stopped after step {record['steps']}; rerun the same command to continue")
        return
    record["data"] = {
        "prompts": len(prompts),
        "answers": len(records),
        "prompt_source": "hf_specdec.chat_prompts.chat_training_prompts",
        "seed": args.seed,
        "regen_tokens": args.regen_tokens,
        **{k: info[k] for k in ("examples", "tokens", "loss_tokens", "max_length")},
    }
    with open(os.path.join(targs.output_dir, "training_record.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
    ev = record.get("final_eval") or {}
    print(f"[4/4] {record['steps']} steps; held-out simulated tau {ev.get('simulated_tau')}")


if __name__ == "__main__":
    main()
