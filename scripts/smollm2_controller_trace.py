#!/usr/bin/env python
"""Traces the adaptive draft length over the SmolLM2 demo's prompts: what the controller chose, pass by pass.

Runs ``generate(assistant_model=drafter)`` with the packaged SmolLM2 drafter on the demo's six Spec-Bench prompts
(greedy, batch 1, 96 new tokens, one thread) for ``--rounds`` rounds, with one controller across all calls as the
demo has, and records each call's draft lengths (``p`` marks a probe) and wall time, what the controller believed
after it (per-depth acceptance, each length's cost in plain steps, the probes' loss against their budget), and each
round's share of plain steps. ``--probe-optimism 0`` traces the controller as it was before probes asked the hopeful
estimate. The target and drafter run on the kernels the demo gives them (``--linear-kernels`` / ``--draft-kernels``,
the demo's defaults; the target's masked attention on SDPA's grouped-query kernel).

Usage::

    python scripts/smollm2_controller_trace.py --dtype bfloat16 --out model_cards/results/smollm2-controller-trace
    python scripts/smollm2_controller_trace.py --dtype bfloat16 --probe-optimism 0 \\
        --out model_cards/results/smollm2-controller-trace-before-hopeful
    python scripts/smollm2_controller_trace.py --dtype float32 --threads 2 --draft-kernels bf16 --out runs/trace
    python scripts/smollm2_controller_trace.py --dtype float32 \
        --tree eagle2:tree_depth=6,tree_top_k=4,tree_total_tokens=16 --out runs/trace-tree

With ``--tree`` (``bench``'s syntax) the calls draft that tree, a length is a tree size, and the state records each
size's estimated tokens per pass.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_specdec.cpu_kernels import (
    DEFAULT_DRAFT_KERNELS,
    DRAFT_KERNELS,
    LINEAR_KERNELS,
    draft_kernels_for,
    grouped_query_sdpa,
    linear_kernels_for,
)


def trace_calls(model, tokenizer, drafter, prompts, rounds: int, probe_optimism: float, tree=None) -> list[dict]:
    """One record per ``generate`` call: its round, category, prompt length, seconds and draft lengths (``tree``:
    the calls' tree options)."""
    from hf_specdec.bench.prompts import render_prompt
    from hf_specdec.generation import adaptive

    choices: list[str] = []
    controllers: list = []
    choose = adaptive.DraftLengthController.choose

    def traced_choose(self, limit, pending_slots=0):
        self.probe_optimism = probe_optimism
        k = choose(self, limit, pending_slots)
        choices.append(("p" if self._probing else "") + str(k))
        controllers[:] = [self]
        return k

    adaptive.DraftLengthController.choose = traced_choose
    adaptive.draft_length_memory(drafter).reset()
    calls = []
    try:
        for round_ in range(rounds):
            for item in prompts:
                ids = tokenizer(render_prompt(item, tokenizer), return_tensors="pt")
                choices.clear()
                start = time.perf_counter()
                model.generate(**ids, assistant_model=drafter, max_new_tokens=96, do_sample=False, **(tree or {}))
                calls.append(
                    {"round": round_, "category": item.category, "prompt_tokens": ids.input_ids.shape[1],
                     "seconds": round(time.perf_counter() - start, 2), "draft_lengths": " ".join(choices),
                     "controller": controller_state(controllers[0]) if controllers else None}
                )  # fmt: skip
    finally:
        adaptive.DraftLengthController.choose = choose
    return calls


def controller_state(controller) -> dict:
    """What the controller believes: per-depth acceptance (a tree's tokens per pass for each size), each measured
    length's cost in plain steps, a plain step's seconds, a 100-slot catch-up's cost per slot (in plain steps), and
    the probes' loss against their budget."""
    costs = {k: controller.relative_cost(k) for k in sorted(controller.times)}
    catchup = controller.catchup_cost(100) / 100 if controller.catchup else None
    belief = (
        {"tree_tokens": {n: round(controller.tree_tokens(n), 3) for n in controller.budgets}}
        if controller.tree
        else {"alphas": [round(a, 3) for a in controller.alphas()]}
    )
    return {
        **belief,
        "costs": {k: round(c, 3) for k, c in costs.items() if c is not None},
        "step_ms": round(1000 * controller.step_time, 2) if controller.step_time else None,
        "catchup_per_slot": round(catchup, 4) if catchup is not None else None,
        "probe_loss_share": round(controller.probe_loss_seconds / max(controller.measured_seconds, 1e-9), 4),
    }


def plain_share(calls: list[dict]) -> float:
    """The share of passes the controller chose as plain steps (lookup passes replace some of them)."""
    lengths = [c.lstrip("p") for call in calls for c in call["draft_lengths"].split()]
    return round(lengths.count("0") / max(len(lengths), 1), 3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--probe-optimism", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--linear-kernels", default="packed", choices=LINEAR_KERNELS)
    p.add_argument("--draft-kernels", default=DEFAULT_DRAFT_KERNELS, choices=DRAFT_KERNELS)
    p.add_argument("--tree", default=None, help="a tree to draft, as bench's --tree (e.g. eagle2:tree_depth=6,...)")
    p.add_argument("--out", required=True, help="writes OUT.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from hf_specdec.auto import AutoModelForDrafting
    from hf_specdec.commands.bench import tree_options
    from hf_specdec.demo import demo_drafter_path, demo_prompts, get_demo_target

    spec = get_demo_target("smollm2")
    model, tokenizer = spec.load(dtype=args.dtype)
    drafter = AutoModelForDrafting.from_pretrained(demo_drafter_path(spec)).eval()
    with (
        linear_kernels_for(model, args.linear_kernels),
        draft_kernels_for([drafter], args.draft_kernels, [model]),
        grouped_query_sdpa(model),
    ):
        tree = tree_options(args, args.tree)
        calls = trace_calls(model, tokenizer, drafter, demo_prompts(spec), args.rounds, args.probe_optimism, tree)
    rounds = [
        {"round": r, "seconds": round(sum(c["seconds"] for c in calls if c["round"] == r), 2),
         "plain_step_share": plain_share([c for c in calls if c["round"] == r])}
        for r in range(args.rounds)
    ]  # fmt: skip
    result = {"config": vars(args), "rounds": rounds, "calls": calls}
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    for r in rounds:
        print(f"round {r['round']}: {r['seconds']} s, plain steps {r['plain_step_share']:.0%}")
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
