#!/usr/bin/env python
"""The n-gram copies' threshold (``copy_threshold``) for a SmolLM2 drafter, teacher-forced: simulated τ of K = 5
chains, passed over each answer as the live loop passes over it (:func:`walk`), where each draft position whose
drafter's top probability is at or below the threshold drafts the loop's n-gram copy
(:func:`hf_specdec.generation.ngram.continuation_tokens`) instead of the drafter's token.

The answers are those of ``smollm2_specbench_score.py`` (the bf16 target's greedy answers to the first
``--per-category`` Spec-Bench prompts per category, features dumped when missing, in ``--work``), less the first
``--skip`` prompts of each category, which ``bench_smollm2.sh`` times (they are the test set here, the rest the
set the threshold is chosen on). ``--heldout``: a features folder of held-out chat records scored as one more row
(e.g. ``runs/depth-ab/features-eval``, which ``smollm2_levers.py`` dumps), when it exists.

Usage::

    python scripts/smollm2_copy_threshold.py
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402
from smollm2_confidence_gap import spec_bench_answers  # noqa: E402
from smollm2_specbench_score import features_by_category  # noqa: E402

K = 5


def records(folder: str, skip: int):
    """``(input_ids, loss_mask, layers)`` of each record in a features folder, in record order, from ``skip`` on."""
    for path in sorted(glob.glob(os.path.join(folder, "features-*.safetensors"))):
        data = load_file(path)
        for key in sorted({name.split(".")[0] for name in data}, key=int):
            if int(key) >= skip:
                yield data[f"{key}.input_ids"].long(), data[f"{key}.loss_mask"].bool(), data[f"{key}.layers"].float()


@torch.no_grad()
def chain_steps(drafter, ids, layers):
    """Per draft step ``j`` at every anchor ``t`` (teacher-forced): the drafter's token (a target id) for position
    ``t + 2 + j`` and its top probability."""
    outs = drafter.ttt_forward(ids[None], [layer[None] for layer in layers], None, K)
    steps = []
    for logits, _ in outs:
        probs = torch.softmax(logits[0].float(), dim=-1)
        top, index = probs.max(dim=-1)
        tokens = index + drafter.d2t[index] if drafter.has_vocabulary_maps else index
        steps.append((tokens, top))
    return steps


def copies(ids, ngram_sizes):
    """Per draft step: the loop's copy for every anchor (committed text ``ids[:t + 2]``, the drafted tokens before
    the position right, as teacher forcing assumes) and whether there is one."""
    from hf_specdec.generation.ngram import continuation_tokens

    t = ids.numel()
    seq = torch.cat([ids, ids.new_zeros(K + 2)])[None].expand(t, t + K + 2)  # room after the last anchors' drafts
    lengths = torch.arange(t) + 2
    return [continuation_tokens(seq, torch.zeros(t, dtype=torch.long), lengths, j, ngram_sizes) for j in range(K)]


def committed_per_anchor(ids, steps, hints, threshold: float) -> torch.Tensor:
    """Tokens a K = 5 chain commits at every anchor ``t`` (the drafted tokens accepted, plus the target's own)."""
    t = ids.numel()
    alive = torch.ones(t, dtype=torch.bool)
    committed = torch.ones(t)
    for j, ((tokens, top), (copy, found)) in enumerate(zip(steps, hints)):
        chosen = torch.where(found & (top <= threshold), copy, tokens) if threshold > 0 else tokens
        pos = torch.arange(t) + 2 + j
        truth = ids[pos.clamp(max=t - 1)]
        alive &= (chosen == truth) & (pos < t)
        committed += alive.float()
    return committed


def walk(committed: torch.Tensor, scored: torch.Tensor) -> tuple[int, int]:
    """``(passes, tokens)`` of the live loop over the answer: a pass at the answer's first anchor, each next pass at
    the anchor after the tokens the last one committed. Averaging the chains of every anchor instead would count a
    copyable stretch once per position in it, where the loop passes over it in a few long passes: on Spec-Bench that
    average overstated τ with the copies by a quarter (2.94 against 2.37), the drafter alone by 9 % (1.98 against
    1.82)."""
    anchors = scored.nonzero()[:, 0].tolist()
    if not anchors:
        return 0, 0
    passes = tokens = 0
    anchor, end = anchors[0], anchors[-1]
    while anchor <= end:
        step = int(committed[anchor])
        passes, tokens, anchor = passes + 1, tokens + step, anchor + step
    return passes, tokens


def score_folder(drafter, folder: str, skip: int, rules: dict) -> dict:
    """``{rule: τ}``: tokens per pass of the live loop's walk over every answer in ``folder``."""
    totals = {name: [0, 0] for name in rules}
    for ids, mask, layers in records(folder, skip):
        steps = chain_steps(drafter, ids, layers)
        hints = {sizes: copies(ids, sizes) for sizes in {sizes for _, sizes in rules.values()}}
        scored = torch.zeros(ids.numel(), dtype=torch.bool)
        scored[:-2] = mask[2:]
        for name, (threshold, sizes) in rules.items():
            passes, tokens = walk(committed_per_anchor(ids, steps, hints[sizes], threshold), scored)
            totals[name][0] += passes
            totals[name][1] += tokens
    return {name: round(tokens / max(passes, 1), 4) for name, (passes, tokens) in totals.items()}


def markdown(result: dict) -> str:
    rows = result["tau"]
    sets = list(rows)
    lines = [
        "# The n-gram copies' threshold, teacher-forced (SmolLM2)",
        "",
        f"Command: `{result['command']}`. Drafter `{result['drafter']}`. Simulated τ of K = 5 chains, teacher-forced, "
        "as the live loop walks each answer (each pass at the anchor after what the last one committed) over the "
        f"bf16 target's greedy answers (Spec-Bench prompts {result['skip'] + 1}–"
        f"{result['per_category']} of each category: the first {result['skip']} are the timed benchmark's); a "
        "position whose drafter's top probability is at or below the threshold drafts the loop's n-gram copy "
        "(latest earlier occurrence of the last 3, else 2 tokens; `1-gram` also 1) where there is one. "
        "Spec-Bench mean: unweighted over the six categories.",
        "",
        "| rule | " + " | ".join(sets) + " | Spec-Bench mean |",
        "|:---|" + "---:|" * (len(sets) + 1),
    ]
    bench = [name for name in sets if name != "held-out chat"]
    for rule in result["rules"]:
        mean = sum(rows[name][rule] for name in bench) / len(bench)
        lines.append(f"| {rule} | " + " | ".join(f"{rows[name][rule]:.2f}" for name in sets) + f" | {mean:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--per-category", type=int, default=40)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9, 1.0])
    p.add_argument("--work", default="runs/specbench-score")
    p.add_argument("--heldout", default="runs/depth-ab/features-eval")
    p.add_argument("--results", default="model_cards/results/smollm2-copy-threshold")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec import AutoModelForDrafting
    from hf_specdec.generation.ngram import NGRAM_SIZES
    from hf_specdec.gguf_target import load_smollm2

    target, tokenizer = load_smollm2(dtype="bfloat16")
    drafter = AutoModelForDrafting.from_pretrained(args.drafter).float().eval()
    drafter.bind_target(target)
    answers = spec_bench_answers(target, tokenizer, args.per_category, 128, args.work)
    folders = features_by_category(target, tokenizer, answers, drafter.config, args.work, 2048)
    rules = {"off (the drafter alone)": (0.0, NGRAM_SIZES)}
    rules.update({f"{t:g}": (t, NGRAM_SIZES) for t in args.thresholds})
    rules["0.7, 1-gram too"] = (0.7, (*NGRAM_SIZES, 1))
    tau = {category: score_folder(drafter, folder, args.skip, rules) for category, folder in folders.items()}
    if os.path.isdir(args.heldout):
        tau["held-out chat"] = score_folder(drafter, args.heldout, 0, rules)
    result = {
        "target": "SmolLM2-135M-Instruct",
        "drafter": args.drafter,
        "command": "python scripts/smollm2_copy_threshold.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "per_category": args.per_category,
        "skip": args.skip,
        "rules": list(rules),
        "tau": tau,
    }
    write_results(args.results, result, markdown(result))


if __name__ == "__main__":
    main()
