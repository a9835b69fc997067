#!/usr/bin/env python
"""Does the SmolLM2 drafter read the document it could copy from? Its acc_0 with its attention cut to the last W keys.

On Spec-Bench's long prompts (news articles to summarise, retrieved passages) the target copies from the prompt, and
the drafter is trained on records of at most 512 tokens. If it drafted those copies by attending back into the
document, cutting its attention to a window of the last W positions would cost accuracy; if it does not read that far,
nothing changes. Per category:

1. answers: the target's greedy answers (bf16, 128 new tokens) to ``--per-category`` Spec-Bench prompts (the answers and
   feature dumps of ``scripts/smollm2_confidence_gap.py``, in ``--work``, reused when there);
2. the drafter's first draft token at every answer position, teacher-forced (acc_0: it equals the target's argmax),
   with its step-0 attention over the whole sequence and over the last W keys only, for each W of ``--windows``.

Usage::

    python scripts/smollm2_attention_window.py --drafter src/hf_specdec/assets/smollm2-drafter

Writes ``model_cards/results/smollm2-attention-window.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402
from smollm2_confidence_gap import bf16_target_and_drafter, spec_bench_answers  # noqa: E402
from train_smollm2_scaling import dump  # noqa: E402


@contextlib.contextmanager
def attention_window(window: int | None):
    """Within the block, the drafter's training-time-test attention lets a query see only the keys less than
    ``window`` positions back (``None``: no limit). It narrows the causal mask ``DraftAttention.ttt`` builds with
    ``Tensor.tril``, so the rest of the step is the library's own code."""
    if window is None:
        yield
        return
    original = torch.Tensor.tril

    def banded(matrix, *args, **kwargs):
        out = original(matrix, *args, **kwargs)
        if out.dtype != torch.bool or out.dim() != 2 or out.shape[0] != out.shape[1]:
            return out
        idx = torch.arange(out.shape[0], device=out.device)
        return out & ((idx[:, None] - idx[None, :]) < window)

    torch.Tensor.tril = banded
    try:
        yield
    finally:
        torch.Tensor.tril = original


@torch.no_grad()
def first_step_accuracy(drafter, head, examples) -> float:
    """acc_0 over the answer positions of ``examples`` (offline feature items)."""
    from hf_specdec.features import target_logits_from_last_hidden

    hits = total = 0
    for ex in examples:
        ids = ex["input_ids"][None]
        layers = [h[None].float() for h in ex["target_hidden_states"].unbind(0)]
        logits, _ = drafter.ttt_forward(ids, layers, steps=1)[0]
        draft = drafter.draft_token_ids[logits[0].argmax(-1)]  # anchor t drafts token t + 2
        top = target_logits_from_last_hidden(head, ex["target_last_hidden"].float()).argmax(-1)
        n = ids.shape[1]
        scored = ex["loss_mask"][2:].bool()
        hits += int((draft[: n - 2] == top[1 : n - 1])[scored].sum())
        total += int(scored.sum())
    return hits / max(total, 1)


def markdown(result: dict) -> str:
    windows = result["windows"]
    head = "| category | mean tokens (prompt + answer) | " + " | ".join(f"W = {w or 'all'}" for w in windows) + " |"
    lines = [
        "# SmolLM2 drafter: acc_0 with its attention cut to the last W keys",
        "",
        f"Command: `{result['command']}`. Drafter: `{result['drafter']}`. Teacher-forced over the target's greedy "
        "answers to Spec-Bench prompts; acc_0 = the drafter's first draft token equals the target's argmax.",
        "",
        head,
        "|:---|---:|" + "---:|" * len(windows),
    ]
    for row in result["rows"]:
        accs = " | ".join(f"{a:.3f}" for a in row["acc_0"])
        lines.append(f"| {row['category']} ({row['records']}) | {row['mean_tokens']} | {accs} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--per-category", type=int, default=12)
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 512, 256, 128])
    p.add_argument("--work", default="runs/smollm2-attention-window")
    p.add_argument("--results", default="model_cards/results/smollm2-attention-window")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec.training.offline import OfflineFeatureDataset

    os.makedirs(args.work, exist_ok=True)
    target, tokenizer, drafter = bf16_target_and_drafter(args.drafter)
    answers = spec_bench_answers(target, tokenizer, args.per_category, 128, args.work)
    windows = [None, *args.windows]
    rows = []
    for category in dict.fromkeys(r["category"] for r in answers):
        features = os.path.join(args.work, "features-" + category)
        dump(target, tokenizer, [r for r in answers if r["category"] == category], drafter.config, features, 2048)
        examples = list(OfflineFeatureDataset(features))
        accs = []
        for w in windows:
            with attention_window(w):
                accs.append(round(first_step_accuracy(drafter, target.get_output_embeddings(), examples), 4))
        mean_tokens = sum(len(e["input_ids"]) for e in examples) // len(examples)
        rows.append({"category": category, "records": len(examples), "mean_tokens": mean_tokens, "acc_0": accs})
        print(rows[-1], flush=True)
    result = {
        "target": "SmolLM2-135M-Instruct (bf16 features, bf16 greedy answers)",
        "drafter": args.drafter,
        "command": "python scripts/smollm2_attention_window.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "windows": windows,
        "rows": rows,
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
