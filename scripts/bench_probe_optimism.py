#!/usr/bin/env python
"""``hf-specdec bench`` with the adaptive draft length's hopeful probes on and off, side by side in one run.

Every ``--drafter`` folder whose name ends in ``-no-hopeful`` runs with ``probe_optimism=0`` (probes of the
neighbouring length at doubling gaps only, the controller before the hopeful probes); the others with the default.
All other arguments go to ``hf-specdec bench`` unchanged, so plain decoding and both controllers are interleaved in
the same repeats. Copy the drafter into two folders first, e.g.::

    cp -r src/hf_specdec/assets/smollm2-drafter runs/ab/smollm2-hopeful
    cp -r src/hf_specdec/assets/smollm2-drafter runs/ab/smollm2-no-hopeful
    python scripts/bench_probe_optimism.py --target smollm2 --drafter runs/ab/smollm2-hopeful \\
        runs/ab/smollm2-no-hopeful --prompts spec-bench --max-prompts 2 --max-new-tokens 128 --no-peers \\
        --threads 1 --out model_cards/results --stem smollm2-probe-optimism
"""

from __future__ import annotations

import sys

from hf_specdec.commands import main as hf_specdec_main
from hf_specdec.generation import loop


def controller_without_hopeful_probes_for(marked: str = "-no-hopeful"):
    """A ``controller_for`` that turns the hopeful probes off for drafters loaded from a folder ending in ``marked``."""
    controller_for = loop.controller_for

    def wrapped(drafter, *args, **kwargs):
        controller = controller_for(drafter, *args, **kwargs)
        if str(getattr(drafter, "name_or_path", "")).rstrip("/").endswith(marked):
            controller.probe_optimism = 0.0
        return controller

    return wrapped


if __name__ == "__main__":
    loop.controller_for = controller_without_hopeful_probes_for()
    sys.exit(hf_specdec_main(["bench", *sys.argv[1:]]))
