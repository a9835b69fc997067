#!/usr/bin/env python
"""``hf-specdec bench`` with the adaptive draft length's hopeful probes on and off, side by side in one run.

Every ``--drafter`` folder whose name ends in ``-no-hopeful`` runs with ``probe_optimism=0`` (probes of the
neighbouring length at doubling gaps only, the controller before the hopeful probes); the others with the default.
All other arguments go to ``hf-specdec bench`` unchanged, so plain decoding and both controllers are interleaved in
the same repeats (``scripts/bench_controller_variants.py --variant -no-hopeful probe_optimism=0``). Copy the drafter
into two folders first, e.g.::

    cp -r src/hf_specdec/assets/smollm2-drafter runs/ab/smollm2-hopeful
    cp -r src/hf_specdec/assets/smollm2-drafter runs/ab/smollm2-no-hopeful
    python scripts/bench_probe_optimism.py --target smollm2 --drafter runs/ab/smollm2-hopeful \\
        runs/ab/smollm2-no-hopeful --prompts spec-bench --max-prompts 2 --max-new-tokens 128 --no-peers \\
        --threads 1 --out model_cards/results --stem smollm2-probe-optimism
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_controller_variants import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["--variant", "-no-hopeful", "probe_optimism=0", *sys.argv[1:]]))
