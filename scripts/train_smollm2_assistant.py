#!/usr/bin/env python
"""Trains the small assistant that ``hf-specdec bench`` runs as a peer on SmolLM2-135M-Instruct (transformers'
assisted generation needs an assistant with the target's tokenizer).

The assistant is a stock ``LlamaForCausalLM`` with SmolLM2's shape but ``--layers`` decoder layers (initialised from
the target's first layers, or from ``--init-layers``), sharing the target's embedding and tied LM head, which stay
frozen: only the layers and the final norm are trained and shipped (``hf_specdec.assistant``). Every stage resumes:

1. prompts: the first ``--max-records`` of ``hf_specdec.chat_prompts.chat_training_prompts`` (the drafter's prompt
   set, disjoint from the benchmarks);
2. self-distillation: SmolLM2 answers them greedily through its chat template (``hf_specdec.training.regenerate``);
3. training: next-token cross-entropy on the answer tokens (the target's own greedy choices), AdamW with cosine decay,
   a checkpoint every ``--save-steps`` (rerun the command to continue a killed run); 5% of the answers are held out
   and the record gives the assistant's top-1 agreement with the target on them;
4. export to ``--export`` (default ``src/hf_specdec/assets/smollm2-assistant``).

Usage (about 25 minutes on 2 CPU cores)::

    python scripts/train_smollm2_assistant.py --out runs/smollm2-assistant
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch
import torch.nn.functional as F


def batches(dataset, indices, batch_size, pad_id):
    for start in range(0, len(indices), batch_size):
        items = [dataset[i] for i in indices[start : start + batch_size]]
        n = max(len(it["input_ids"]) for it in items)
        ids = torch.full((len(items), n), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        loss = torch.zeros((len(items), n), dtype=torch.bool)
        for row, it in enumerate(items):
            m = len(it["input_ids"])
            ids[row, :m] = torch.as_tensor(it["input_ids"])
            mask[row, :m] = 1
            loss[row, :m] = torch.as_tensor(it["loss_mask"]).bool()
        yield ids, mask, loss


def loss_and_hits(model, ids, mask, loss_mask):
    """Cross-entropy of the next token at the answer positions; the LM head runs on those positions only."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    pos = loss_mask[:, 1:]
    h = hidden[:, :-1][pos]
    labels = ids[:, 1:][pos]
    logits = model.lm_head(h).float()
    return F.cross_entropy(logits, labels), int((logits.argmax(-1) == labels).sum()), int(labels.numel())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/smollm2-assistant")
    p.add_argument("--export", default=None, help="default: src/hf_specdec/assets/smollm2-assistant")
    p.add_argument("--num-prompts", type=int, default=1200, help="size of the prompt set (the drafter's)")
    p.add_argument("--max-records", type=int, default=480)
    p.add_argument("--regen-tokens", type=int, default=192)
    p.add_argument("--regen-batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--init-layers", default=None, help="comma-separated target layers to copy (default: the first)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec.assistant import assistant_from_target, save_shared_embedding_assistant
    from hf_specdec.chat_prompts import benchmark_texts, chat_training_prompts, check_disjoint
    from hf_specdec.gguf_target import SMOLLM2_HUB_ID, load_smollm2
    from hf_specdec.training.data import load_records
    from hf_specdec.training.recipes import build_datasets
    from hf_specdec.training.regenerate import regenerate

    export = args.export or os.path.join(
        os.path.dirname(__file__), "..", "src", "hf_specdec", "assets", "smollm2-assistant"
    )
    os.makedirs(args.out, exist_ok=True)
    target, tokenizer = load_smollm2()
    target.requires_grad_(False)

    # 1-2. prompts and self-distilled answers
    prompts = chat_training_prompts(args.num_prompts, seed=args.seed)
    bad = check_disjoint([r["prompt"] for r in prompts], benchmark_texts())
    if bad:
        raise SystemExit(f"{len(bad)} training prompts overlap a benchmark prompt, e.g. {prompts[bad[0]]['prompt']!r}")
    prompts = prompts[: args.max_records]
    regen = os.path.join(args.out, "regenerated.jsonl")
    regenerate(target, tokenizer, prompts, regen, max_new_tokens=args.regen_tokens, batch_size=args.regen_batch_size)
    records = [r for r in load_records(regen) if r["source_index"] < len(prompts)]
    train, held_out, info = build_datasets(records, tokenizer, args.max_length, eval_fraction=0.05, seed=args.seed)
    print(f"[1-2] {len(records)} answers; {len(train)} train / {len(held_out)} held-out examples", flush=True)

    # 3. training
    init_layers = [int(x) for x in args.init_layers.split(",")] if args.init_layers else None
    model = assistant_from_target(target, args.layers, init_layers)
    params = [p_ for n, p_ in model.named_parameters() if p_.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    ckpt = os.path.join(args.out, "checkpoint.pt")
    step, history = 0, []
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, history = state["step"], state["history"]
        print(f"[3] resuming at step {step}", flush=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    # long examples first within shuffled chunks keeps padding low; the order depends on the epoch only
    rng = random.Random(args.seed)
    order: list[int] = []
    for _ in range(math.ceil(args.steps * args.batch_size / len(train)) + 1):
        epoch = list(range(len(train)))
        rng.shuffle(epoch)
        order += epoch

    def evaluate():
        model.eval()
        hits = total = 0
        with torch.no_grad():
            for ids, mask, lm in batches(held_out, list(range(len(held_out))), args.batch_size, pad):
                _, h, n = loss_and_hits(model, ids, mask, lm)
                hits, total = hits + h, total + n
        model.train()
        return hits / max(total, 1)

    if step == 0:
        history.append({"step": 0, "held_out_top1": round(evaluate(), 4)})
        print(f"[3] step 0: held-out top-1 agreement {history[-1]['held_out_top1']}", flush=True)
    model.train()
    t0, tokens = time.time(), 0
    while step < args.steps:
        idx = order[step * args.batch_size : (step + 1) * args.batch_size]
        ids, mask, lm = next(batches(train, idx, args.batch_size, pad))
        loss, _, n = loss_and_hits(model, ids, mask, lm)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step, tokens = step + 1, tokens + n
        if step % 10 == 0:
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} ({tokens / (time.time() - t0):.0f} tok/s)", flush=True
            )
        if step % args.save_steps == 0 or step == args.steps:
            history.append({"step": step, "train_loss": round(loss.item(), 4), "held_out_top1": round(evaluate(), 4)})
            print(f"[3] step {step}: held-out top-1 agreement {history[-1]['held_out_top1']}", flush=True)
            trainable = {
                k: v
                for k, v in model.state_dict().items()
                if not k.endswith("embed_tokens.weight") and k != "lm_head.weight"
            }
            torch.save(
                {
                    "model": trainable,
                    "opt": opt.state_dict(),
                    "sched": sched.state_dict(),
                    "step": step,
                    "history": history,
                },
                ckpt + ".tmp",
            )
            os.replace(ckpt + ".tmp", ckpt)

    # 4. export
    model.config._name_or_path = "smollm2-assistant"
    save_shared_embedding_assistant(
        model,
        export,
        {
            "embeddings_from": SMOLLM2_HUB_ID,
            "trained_by": "scripts/train_smollm2_assistant.py",
            "layers": args.layers,
            "init_layers": init_layers or list(range(args.layers)),
            "data": {
                "answers": len(records),
                "prompt_source": "hf_specdec.chat_prompts.chat_training_prompts",
                "regen_tokens": args.regen_tokens,
                **{k: info[k] for k in ("examples", "tokens", "loss_tokens")},
            },
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "history": history,
        },
    )
    print(f"[4] exported to {export}; held-out top-1 agreement {history[-1]['held_out_top1']}")


if __name__ == "__main__":
    main()
