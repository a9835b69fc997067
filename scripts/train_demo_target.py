#!/usr/bin/env python
"""Trains hf_specdec's demo target: a small Llama-style Python code model, from scratch, on this machine.

Reproducible and seeded. The corpus is the Python standard library of the interpreter running the script (present on
every machine); its file list hash and the Python version are recorded. Steps:

1. collect ``*.py`` files of the stdlib (sorted), hold out ~2% of the files (by a hash of their relative path);
2. train a byte-level BPE tokenizer (``tokenizers``) on the training files;
3. train a Llama model with next-token loss on random 256-token windows (bf16 autocast on CPU), checkpointing every
   ``--save-every`` steps so a killed run continues with ``--resume``;
4. export the model (bf16 safetensors), tokenizer and a ``training_info.json`` (held-out loss) to ``--export``.

Usage:
    python scripts/train_demo_target.py --minutes 60 --export src/hf_specdec/assets/demo-target

The small assistant model used as a peer by ``hf-specdec bench`` (transformers' assisted generation) is trained by
the same script with the target's tokenizer:

    python scripts/train_demo_target.py --tokenizer src/hf_specdec/assets/demo-target --hidden 128 \
        --intermediate 384 --layers 2 --heads 2 --kv-heads 1 --steps 1500 --warmup 50 --lr 3e-3 \
        --work-dir runs/demo-assistant --export src/hf_specdec/assets/demo-assistant
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import time

import torch

from hf_specdec.demo import is_held_out, stdlib_files  # the held-out split is shared with the demo prompts

SPECIAL = "<|endoftext|>"


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, pad_token=SPECIAL)
    fast.model_max_length = 2048
    return fast


def encode_corpus(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(SPECIAL)
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def model_config(vocab_size: int, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + seq + 1].long() for s in starts.tolist()])
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, seq: int, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (data.numel() - 1) // seq)
    losses = []
    for i in range(0, n, 8):
        idx = range(i, min(n, i + 8))
        x = torch.stack([data[j * seq : j * seq + seq + 1].long() for j in idx])
        logits = model(input_ids=x[:, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="runs/demo-target")
    p.add_argument("--export", default="src/hf_specdec/assets/demo-target")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument(
        "--tokenizer",
        default=None,
        help="reuse this tokenizer instead of training one (e.g. a small assistant model sharing the demo "
        "target's vocabulary: --tokenizer src/hf_specdec/assets/demo-target)",
    )
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=1200, help="planned optimizer steps (cosine schedule length)")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of this invocation")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (only faster on CPUs with native bf16)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--export-only", action="store_true", help="export the latest checkpoint and exit")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.work_dir, exist_ok=True)
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    files, root = stdlib_files()
    rel = [os.path.relpath(f, root) for f in files]
    train_files = [f for f, r in zip(files, rel) if not is_held_out(r)]
    eval_files = [f for f, r in zip(files, rel) if is_held_out(r)]
    corpus_hash = hashlib.sha1("\n".join(rel).encode()).hexdigest()[:16]

    tok_dir = os.path.join(args.work_dir, "tokenizer")
    data_path = os.path.join(args.work_dir, "data.pt")
    if os.path.exists(data_path):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
        data = torch.load(data_path)
    else:
        t0 = time.time()
        train_texts = [read(f) for f in train_files]
        if args.tokenizer:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
        else:
            tokenizer = build_tokenizer(train_texts, args.vocab)
        tokenizer.save_pretrained(tok_dir)
        data = {
            "train": encode_corpus(tokenizer, train_texts),
            "eval": encode_corpus(tokenizer, [read(f) for f in eval_files]),
        }
        torch.save(data, data_path)
        print(
            f"tokenizer + corpus: {data['train'].numel():,} train / {data['eval'].numel():,} held-out tokens "
            f"from {len(train_files)} / {len(eval_files)} files in {time.time() - t0:.0f}s",
            flush=True,
        )

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(model_config(len(tokenizer), args))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    ckpt = os.path.join(args.work_dir, "checkpoint.pt")
    step, history = 0, []
    gen = torch.Generator().manual_seed(args.seed)
    if (args.resume or args.export_only) and os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["rng"])
        step, history = state["step"], state["history"]
        print(f"resumed at step {step}", flush=True)

    def save():
        tmp = ckpt + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                    "rng": torch.get_rng_state(), "step": step, "history": history}, tmp)  # fmt: skip
        os.replace(tmp, ckpt)

    print(f"model: {n_params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}", flush=True)
    model.train()
    t_start = time.time()
    tokens = 0
    while not args.export_only and step < args.steps and (time.time() - t_start) < args.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batches(data["train"], args.batch, args.seq, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 20 == 0:
            rate = tokens / (time.time() - t_start)
            history.append({"step": step, "loss": round(loss.item(), 4), "lr": lr_at(step)})
            print(f"step {step} loss {loss.item():.3f} lr {lr_at(step):.2e} {rate:.0f} tok/s", flush=True)
        if step % args.save_every == 0:
            save()
    save()
    ev = held_out_loss(model, data["eval"], args.seq)
    print(f"held-out loss {ev:.3f} (perplexity {math.exp(ev):.1f}) at step {step}", flush=True)

    os.makedirs(args.export, exist_ok=True)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 0
    model.generation_config.bos_token_id = 0
    model.to(torch.bfloat16).save_pretrained(args.export)
    tokenizer.save_pretrained(args.export)
    info = {
        "parameters": n_params,
        "steps": step,
        "planned_steps": args.steps,
        "tokens_seen": step * args.batch * args.seq,
        "train_tokens": int(data["train"].numel()),
        "held_out_tokens": int(data["eval"].numel()),
        "held_out_loss": round(ev, 4),
        "held_out_perplexity": round(math.exp(ev), 2),
        "corpus": f"Python {platform.python_version()} standard library, {len(train_files)} train / "
        f"{len(eval_files)} held-out files (sha1 of file list {corpus_hash})",
        "args": vars(args),
        "history": history[-50:],
    }
    with open(os.path.join(args.export, "training_info.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    print(f"exported to {args.export}", flush=True)


if __name__ == "__main__":
    main()
