#!/usr/bin/env python
"""Which prompt-lookup rule pays on Spec-Bench: the drafter's chain, the n-gram copy, or a switch between them.

``scripts/smollm2_confidence_gap.py`` shows the shipped drafter failing where the target copies from its prompt
(summaries quoting the article, passages, the German it echoes). This script replays the target's own greedy
answers (the gap script's feature dumps, teacher-forced) pass by pass, the way the loop walks them, and counts the
tokens each rule commits per target pass (tau) and the tokens each pass verifies (width):

* ``drafter``: the drafter's chain of ``--k`` tokens;
* ``lookup``: the n-gram copy alone (:func:`hf_specdec.generation.ngram.lookup_continuations`, up to
  ``--copy-tokens``), a plain step where there is no match;
* ``merge agree=A``: the drafter's chain, switched to the copy when the drafter's first ``A`` tokens equal the
  copy's (the loop's rule, ``AGREE`` = 2; ``A = 0``: the copy wherever there is one).

Usage::

    python scripts/smollm2_copy_rules.py

Writes ``model_cards/results/smollm2-copy-rules.{json,md}``.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402

RULES = ("drafter", "lookup", "merge agree=2", "merge agree=1", "merge agree=0")


@torch.no_grad()
def chains(drafter, example, k: int) -> torch.Tensor:
    """``(seq, k)``: at anchor ``a``, the drafter's chain for tokens ``a + 2 ..`` (teacher-forced: exact for the
    chain's accepted prefix)."""
    ids = example["input_ids"][None]
    layers = [h[None].float() for h in example["target_hidden_states"].unbind(0)]
    steps = drafter.ttt_forward(ids, layers, steps=k)
    return torch.stack([drafter.draft_token_ids[logits[0].argmax(-1)] for logits, _ in steps], dim=1)


def _chain_after(drafted: torch.Tensor, c: int) -> torch.Tensor:
    """The chain drafted after committing ``ids[:c]`` (anchor ``c - 2`` drafts token ``c`` first)."""
    return drafted[c - 2]


def leading_matches(proposal: torch.Tensor, truth: torch.Tensor) -> int:
    n = min(len(proposal), len(truth))
    miss = (proposal[:n] != truth[:n]).nonzero()
    return int(miss[0]) if miss.numel() else n


def pass_proposal(rule: str, chain: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    """The tokens one pass verifies under ``rule`` (``chain``: the drafter's, ``copy``: the n-gram continuation,
    possibly empty)."""
    if rule == "drafter":
        return chain
    if rule == "lookup":
        return copy
    agree = int(rule.rsplit("=", 1)[1])
    if len(copy) > agree and torch.equal(chain[:agree], copy[:agree]):
        return copy
    return chain


def walk(rule: str, ids: torch.Tensor, start: int, chain_at, copy_tokens: int) -> tuple[int, int, int]:
    """``(tokens, passes, verified)`` over one answer: each pass commits its proposal's accepted prefix plus the
    target's own token."""
    from hf_specdec.generation.ngram import NGRAM_SIZES, lookup_continuations

    n = len(ids)
    c, passes, verified = start, 0, 0
    while c < n:
        copy = torch.empty(0, dtype=ids.dtype)
        if rule != "drafter":
            cont, count = lookup_continuations(
                ids[None, :c], torch.zeros(1, dtype=torch.long), torch.tensor([c]), copy_tokens, NGRAM_SIZES
            )
            copy = cont[0, : int(count[0])]
        proposal = pass_proposal(rule, chain_at(c), copy)[: n - c]
        c += leading_matches(proposal, ids[c:]) + 1
        passes += 1
        verified += len(proposal)
    return n - start, passes, verified


def simulate(drafter, features_dir: str, k: int, copy_tokens: int) -> dict:
    from hf_specdec.training.offline import OfflineFeatureDataset

    totals = {rule: [0, 0, 0] for rule in RULES}
    for ex in OfflineFeatureDataset(features_dir):
        ids = ex["input_ids"]
        start = int(ex["loss_mask"].bool().nonzero()[0])
        drafted = chains(drafter, ex, k)
        chain_at = functools.partial(_chain_after, drafted)
        for rule in RULES:
            for i, v in enumerate(walk(rule, ids, start, chain_at, copy_tokens)):
                totals[rule][i] += v
    return {
        rule: {"tau": round(t / p, 3), "width": round(v / p, 2), "tokens": t, "passes": p}
        for rule, (t, p, v) in totals.items()
    }


def markdown(result: dict) -> str:
    lines = [
        "# Prompt-lookup rules on SmolLM2's own answers (simulated passes, teacher-forced)",
        "",
        f"Command: `{result['command']}`. Drafter: `{result['drafter']}`, chains of K = {result['k']}; copies of up "
        f"to {result['copy_tokens']} tokens. Cells: τ (tokens per target pass) / mean tokens verified per pass.",
        "",
        "| set | " + " | ".join(RULES) + " |",
        "|:---|" + "---:|" * len(RULES),
    ]
    for name, rules in result["sets"].items():
        cells = [f"{rules[r]['tau']:.2f} / {rules[r]['width']:.1f}" for r in RULES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--work", default="runs/smollm2-confidence-gap", help="the gap script's feature dumps")
    p.add_argument("--sets", nargs="+", default=["chat", "mt_bench", "translation", "summarization", "qa",
                                                 "math_reasoning", "rag"])  # fmt: skip
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--copy-tokens", type=int, default=10)
    p.add_argument("--results", default="model_cards/results/smollm2-copy-rules")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2

    target, _ = load_smollm2(dtype="bfloat16")
    drafter = AutoModelForDrafting.from_pretrained(args.drafter).float().eval()
    drafter.bind_target(target)
    sets = {name: simulate(drafter, os.path.join(args.work, f"features-{name}"), args.k, args.copy_tokens)
            for name in args.sets}  # fmt: skip
    result = {
        "target": "SmolLM2-135M-Instruct (bf16 features over its bf16 greedy answers)",
        "drafter": args.drafter,
        "k": args.k,
        "copy_tokens": args.copy_tokens,
        "command": "python scripts/smollm2_copy_rules.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "sets": sets,
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
