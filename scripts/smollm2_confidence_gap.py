#!/usr/bin/env python
"""Why Spec-Bench tau stays low: the target's own confidence against the drafter's generalisation.

The shipped SmolLM2 drafter commits tau 2.15 on the distillation data's held-out prompts and 1.53 on Spec-Bench.
Either Spec-Bench's answers are less predictable for the target itself (a 135M model is unsure on news articles,
WMT sentences and open questions, and no drafter predicts a near-random argmax), or the drafter has not learned
what it would need there. This script separates the two:

1. answers: the target's greedy answers (bf16, ``--max-new-tokens``) to ``--per-category`` Spec-Bench prompts per
   category, and the held-out records of the distillation data (their answers are already the target's);
2. per answer position, teacher-forced: the target's top-1 probability and the drafter's first-step prediction
   (accepted when it equals the target's argmax: acc_0);
3. acc_0 in buckets of the target's top-1 probability, and each set's acc_0 *predicted* from its own bucket mix with
   the held-out set's per-bucket acc_0: the part of the gap the target's confidence explains.

Usage::

    python scripts/smollm2_confidence_gap.py

Writes ``model_cards/results/smollm2-confidence-gap.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402
from train_smollm2_scaling import add_shards_argument, dump, read_records, split_records  # noqa: E402

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)


def spec_bench_answers(target, tokenizer, per_category: int, max_new_tokens: int, work: str) -> list[dict]:
    """The target's greedy answers to the first ``per_category`` Spec-Bench prompts of each category."""
    from hf_specdec.bench.prompts import load_prompts
    from hf_specdec.training.regenerate import regenerate

    items = load_prompts("spec-bench", max_per_category=per_category)
    records = [{"messages": list(it.messages), "category": it.category} for it in items]
    path = os.path.join(work, "spec-bench-answers.jsonl")
    regenerate(target, tokenizer, records, path, max_new_tokens=max_new_tokens, batch_size=8, log=None)
    with open(path, encoding="utf-8") as fh:
        return sorted((json.loads(line) for line in fh), key=lambda r: r["source_index"])


def bf16_target_and_drafter(drafter_path: str):
    """SmolLM2 in bf16 (the dtype the data and its features were made in), its tokenizer, and the fp32 drafter
    bound to it, both in eval mode."""
    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2

    target, tokenizer = load_smollm2(dtype="bfloat16")
    target.eval()
    drafter = AutoModelForDrafting.from_pretrained(drafter_path).float().eval()
    drafter.bind_target(target)
    return target, tokenizer, drafter


@torch.no_grad()
def positions(drafter, target, features_dir) -> tuple[torch.Tensor, ...]:
    """Per scored answer position: the target's top-1 probability, whether the drafter's first step drafts the
    target's argmax, whether that argmax is in the draft vocabulary at all, and whether it continues a bigram of the
    prompt (a copy: ``(probs, hits, in_vocab, copies)``)."""
    from hf_specdec.features import target_logits_from_last_hidden
    from hf_specdec.training.offline import OfflineFeatureDataset

    head = target.get_output_embeddings()
    probs, hits, in_vocab, copies = [], [], [], []
    for ex in OfflineFeatureDataset(features_dir):
        ids = ex["input_ids"][None]
        layers = [h[None].float() for h in ex["target_hidden_states"].unbind(0)]
        logits, _ = drafter.ttt_forward(ids, layers, steps=1)[0]
        draft = drafter.draft_token_ids[logits[0].argmax(-1)]  # anchor t drafts token t + 2
        target_probs = target_logits_from_last_hidden(head, ex["target_last_hidden"].float()).softmax(-1)
        top_p, top = target_probs.max(-1)  # position s predicts token s + 1
        n = ids.shape[1]
        scored = ex["loss_mask"][2:].bool()  # token t + 2 is an answer token
        probs.append(top_p[1 : n - 1][scored])
        hits.append((draft[: n - 2] == top[1 : n - 1])[scored])
        in_vocab.append(drafter.t2d[top[1 : n - 1]][scored].bool())
        copies.append(prompt_bigrams(ids[0], ex["loss_mask"], top)[scored])
    return torch.cat(probs), torch.cat(hits), torch.cat(in_vocab), torch.cat(copies)


def prompt_bigrams(ids: torch.Tensor, loss_mask: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """For anchors ``0..n-3``: whether the target's next token after ``ids[a + 1]`` (``top[a + 1]``) continues a
    bigram that occurs in the prompt (the tokens before the answer)."""
    start = int(loss_mask.bool().nonzero()[0])
    prompt = ids[:start].tolist()
    bigrams = set(zip(prompt, prompt[1:]))
    n = len(ids)
    return torch.tensor([(int(ids[a + 1]), int(top[a + 1])) in bigrams for a in range(n - 2)], dtype=torch.bool)


def bucket_table(probs: torch.Tensor, hits: torch.Tensor) -> list[dict]:
    rows = []
    for lo, hi in zip(BUCKETS, BUCKETS[1:]):
        sel = (probs >= lo) & (probs < hi)
        n = int(sel.sum())
        acc = float(hits[sel].float().mean()) if n else None
        rows.append({"p_top1": [lo, min(hi, 1.0)], "share": n / len(probs), "acc_0": acc})
    return rows


def summarise(name: str, probs, hits, in_vocab, copies, reference: list[dict] | None) -> dict:
    table = bucket_table(probs, hits)
    confident_copy = copies & (probs >= 0.9)
    out = {
        "set": name,
        "positions": len(probs),
        "target_top1_mean": round(float(probs.mean()), 4),
        "target_top1_ge_0.9": round(float((probs >= 0.9).float().mean()), 4),
        "acc_0": round(float(hits.float().mean()), 4),
        "in_draft_vocab": round(float(in_vocab.float().mean()), 4),
        "acc_0_in_vocab": round(float(hits[in_vocab].float().mean()), 4),
        "top1_ge_0.9_in_vocab": round(float(in_vocab[probs >= 0.9].float().mean()), 4),
        "confident_copies": round(float(confident_copy.float().mean()), 4),
        "acc_0_confident_copies": round(float(hits[confident_copy].float().mean()), 4),
        "confident_copies_in_vocab": round(float(in_vocab[confident_copy].float().mean()), 4),
        "buckets": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()} for row in table],
    }
    if reference is not None:
        predicted = sum(row["share"] * (ref["acc_0"] or 0.0) for row, ref in zip(table, reference))
        out["acc_0_from_confidence"] = round(predicted, 4)
    return out


def markdown(result: dict) -> str:
    lines = [
        "# Spec-Bench against the held-out chat prompts: the target's confidence and the drafter's acc_0",
        "",
        f"Command: `{result['command']}`. Drafter: `{result['drafter']}`. acc_0: the drafter's first draft token "
        "equals the target's greedy token (teacher-forced over the target's own greedy answers). "
        "acc_0 from confidence: the set's acc_0 if the drafter were as good in each confidence bucket as on the "
        "held-out chat prompts.",
        "",
        "| set | positions | target top-1 mean | top-1 ≥ 0.9 | in draft vocab (all / top-1 ≥ 0.9) | acc_0 | "
        "acc_0 in vocab | acc_0 from confidence |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["sets"]:
        lines.append(
            f"| {s['set']} | {s['positions']} | {s['target_top1_mean']:.3f} | {s['target_top1_ge_0.9']:.1%} | "
            f"{s['in_draft_vocab']:.1%} / {s['top1_ge_0.9_in_vocab']:.1%} | {s['acc_0']:.3f} | "
            f"{s['acc_0_in_vocab']:.3f} | {s.get('acc_0_from_confidence', s['acc_0']):.3f} |"
        )
    lines += [
        "",
        "Confident copies: positions where the target is at least 90 % sure of a token that continues a bigram of "
        "the prompt.",
        "",
        "| set | confident copies | acc_0 there | in draft vocab there |",
        "|:---|---:|---:|---:|",
    ]
    for s in result["sets"]:
        lines.append(
            f"| {s['set']} | {s['confident_copies']:.1%} | {s['acc_0_confident_copies']:.3f} | "
            f"{s['confident_copies_in_vocab']:.1%} |"
        )
    lines += ["", "acc_0 by the target's top-1 probability:", ""]
    edges = [f"{b['p_top1'][0]:.1f}–{b['p_top1'][1]:.1f}" for b in result["sets"][0]["buckets"]]
    lines += ["| set | " + " | ".join(edges) + " |", "|:---|" + "---:|" * len(edges)]
    for s in result["sets"]:
        cells = ["—" if b["acc_0"] is None else f"{b['acc_0']:.2f} ({b['share']:.0%})" for b in s["buckets"]]
        lines.append(f"| {s['set']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--chat-data", default="data/smollm2-distill")
    add_shards_argument(p)
    p.add_argument("--eval-every", type=int, default=64, help="the held-out rule of the scaling curve")
    p.add_argument("--per-category", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--work", default="runs/smollm2-confidence-gap")
    p.add_argument("--results", default="model_cards/results/smollm2-confidence-gap")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    os.makedirs(args.work, exist_ok=True)
    target, tokenizer, drafter = bf16_target_and_drafter(args.drafter)
    _, held_out = split_records(read_records(args.chat_data, args.shards), args.eval_every)
    spec = spec_bench_answers(target, tokenizer, args.per_category, args.max_new_tokens, args.work)
    sets = {"held-out chat": held_out}
    for category in dict.fromkeys(r["category"] for r in spec):
        sets[f"Spec-Bench {category}"] = [r for r in spec if r["category"] == category]
    measured = {}
    for name, records in sets.items():
        features = os.path.join(args.work, "features-" + name.split()[-1])
        dump(target, tokenizer, records, drafter.config, features, args.max_length)
        measured[name] = positions(drafter, target, features)
    spec_names = [n for n in measured if n.startswith("Spec-Bench")]
    measured["Spec-Bench (all)"] = tuple(torch.cat([measured[n][i] for n in spec_names]) for i in range(4))
    sets["Spec-Bench (all)"] = spec
    reference = bucket_table(*measured["held-out chat"][:2])
    results = [summarise(n, *measured[n], None if n == "held-out chat" else reference) for n in measured]
    result = {
        "target": "SmolLM2-135M-Instruct (bf16 features, bf16 greedy answers)",
        "drafter": args.drafter,
        "command": "python scripts/smollm2_confidence_gap.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "records": {n: len(sets[n]) for n in measured},
        "sets": results,
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
