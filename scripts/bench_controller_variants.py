#!/usr/bin/env python
"""``hf-specdec bench`` with adaptive-length controllers of other settings side by side in one run.

``--variant SUFFIX NAME=VALUE [NAME=VALUE ...]`` (repeatable, before the bench arguments): every ``--drafter`` folder
whose name ends in ``SUFFIX`` runs with those :class:`~hf_specdec.generation.adaptive.DraftLengthController`
attributes set (numbers); the others with the defaults. All other arguments go to ``hf-specdec bench`` unchanged, so
plain decoding and every controller are interleaved in the same repeats. Copy the drafter into one folder per
controller first, e.g.::

    cp -r src/hf_specdec/assets/demo-drafter runs/ab/code
    cp -r src/hf_specdec/assets/demo-drafter runs/ab/code-wide-margin
    python scripts/bench_controller_variants.py --variant -wide-margin margin=0.15 \\
        --drafter runs/ab/code runs/ab/code-wide-margin --prompts spec-bench --max-prompts 4 \\
        --max-new-tokens 64 --temperature 0.7 --no-peers --threads 1 --out runs/ab --stem code-margin
"""

from __future__ import annotations

import sys

from hf_specdec.commands import main as hf_specdec_main
from hf_specdec.generation import adaptive, loop


def parse_variants(argv: list[str]) -> tuple[dict[str, dict], list[str]]:
    """``({suffix: {attribute: value}}, the remaining arguments)`` from leading ``--variant`` groups."""
    variants: dict[str, dict] = {}
    rest = list(argv)
    while rest and rest[0] == "--variant":
        if len(rest) < 3 or "=" in rest[1]:
            raise SystemExit("--variant takes a folder suffix and then NAME=VALUE settings.")
        suffix, settings = rest[1], {}
        rest = rest[2:]
        while rest and not rest[0].startswith("-") and "=" in rest[0]:
            name, value = rest.pop(0).split("=", 1)
            settings[name] = _setting(name, value)
        if not settings:
            raise SystemExit(f"--variant {suffix} names no NAME=VALUE setting.")
        variants[suffix] = settings
    return variants, rest


def _setting(name: str, value: str) -> int | float:
    default = getattr(adaptive.DraftLengthController(1), name, None)
    if not isinstance(default, (int, float)) or isinstance(default, bool):
        raise SystemExit(f"{name!r} is not a numeric DraftLengthController setting.")
    return type(default)(value)


def controller_variants_for(variants: dict[str, dict]):
    """A ``controller_for`` that sets each variant's attributes for drafters loaded from a folder ending in its
    suffix."""
    controller_for = loop.controller_for

    def wrapped(drafter, *args, **kwargs):
        controller = controller_for(drafter, *args, **kwargs)
        folder = str(getattr(drafter, "name_or_path", "")).rstrip("/")
        for suffix, settings in variants.items():
            if folder.endswith(suffix):
                for name, value in settings.items():
                    setattr(controller, name, value)
        return controller

    return wrapped


def main(argv: list[str]) -> int:
    variants, rest = parse_variants(argv)
    loop.controller_for = controller_variants_for(variants)
    return hf_specdec_main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
