#!/usr/bin/env python
"""A trained SmolLM2 EAGLE-3 drafter with a wider MLP that drafts exactly as it does until trained further.

The width lever of ``scripts/smollm2_levers.py`` (``intermediate_size`` 1536 → 4608) was the largest capacity gain at
a short budget, trained from scratch. This grows a trained drafter instead: every trained weight is copied, and each
added MLP unit gets fresh ``gate_proj`` / ``up_proj`` rows and a zero ``down_proj`` column, so it adds nothing to the
layer's output until training moves it. Continue it like any trained drafter
(``scripts/train_smollm2_grown.py --drafter OUT``).

Usage::

    python scripts/widen_smollm2_mlp.py --intermediate-size 4608 --out runs/width/drafter-mlp4608
"""

from __future__ import annotations

import argparse
import copy

import torch


def widened_mlp_drafter(drafter, intermediate_size: int):
    """A copy of ``drafter`` whose draft layers' MLPs have ``intermediate_size`` units, the added ones inert."""
    old = drafter.config.intermediate_size
    if intermediate_size <= old:
        raise SystemExit(f"--intermediate-size {intermediate_size} must exceed the drafter's {old}.")
    config = copy.deepcopy(drafter.config)
    config.intermediate_size = intermediate_size
    wider = type(drafter)(config).to(dtype=drafter.dtype)
    trained = drafter.state_dict()
    state = wider.state_dict()
    for name, value in trained.items():
        target = state[name]
        if target.shape == value.shape:
            target.copy_(value)
        elif name.endswith("mlp.down_proj.weight"):  # (hidden, units): the new units' columns stay zero
            target.zero_()
            target[:, :old].copy_(value)
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):  # (units, hidden): new rows keep init
            target[:old].copy_(value)
        else:
            raise SystemExit(f"{name}: {tuple(value.shape)} -> {tuple(target.shape)}, not an MLP weight; cannot widen.")
    wider.load_state_dict(state)
    return wider


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--intermediate-size", type=int, default=4608)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)

    from hf_specdec import AutoModelForDrafting

    drafter = AutoModelForDrafting.from_pretrained(args.drafter)
    wider = widened_mlp_drafter(drafter, args.intermediate_size)
    wider.save_pretrained(args.out)
    print(f"{args.drafter}: MLP {drafter.config.intermediate_size} -> {args.intermediate_size} units, in {args.out}")


if __name__ == "__main__":
    main()
