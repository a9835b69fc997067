"""The commands for the families that register them (``register_drafter(..., commands=...)``): `profile` (the
target's pass times on this machine, for a verification-length scheduler; stored next to the drafter as
``pass_times.json``) and `calibrate` (a confidence head's temperatures, stored in its config)."""

from __future__ import annotations

import os

from ..modeling_utils import PASS_TIMES_FILE
from .common import add_target_args, load_target


def _profile(args) -> int:
    import json

    import torch

    from ..bench.profile import measure_pass_seconds

    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_target(args)
    if args.drafter:
        _profiled_drafter(args.drafter, target)  # refused before anything is measured
    table = measure_pass_seconds(
        target, args.batch_sizes, args.widths, context=args.context, repeats=args.repeats, warmup=args.warmup
    )
    for rows, line in zip(table["batch_sizes"], table["seconds"]):
        print(f"batch {rows}: " + ", ".join(f"w{w} {s * 1000:.1f} ms" for w, s in zip(table["widths"], line)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=2)
    if args.drafter:
        times = {k: table[k] for k in ("batch_sizes", "widths", "seconds")}
        times["device"] = table["hardware"].get("device_name") or table["hardware"]["device"]
        path = os.path.join(args.drafter, PASS_TIMES_FILE)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(times, fh, indent=1)
        print(f"stored the pass times in {path} (this machine's; config.json is unchanged)")
    return 0


def _profiled_drafter(folder: str, target) -> None:
    """Checks that the pass times can go next to this drafter: a local folder of a family that reads them, made for
    this target."""
    from ..auto import AutoModelForDrafting

    if not os.path.isdir(folder):
        raise SystemExit(f"--drafter {folder!r} is not a local drafter folder (the pass times go next to it).")
    drafter = AutoModelForDrafting.from_pretrained(folder)
    _family_runs(drafter, "profile")
    drafter.check_target_compatibility(target)


def _family_runs(drafter, command: str) -> None:
    """Refuses a drafter whose family did not register ``command`` (``register_drafter(..., commands=...)``)."""
    from ..registry import DRAFTERS, get_drafter_spec

    if command not in get_drafter_spec(drafter.config.model_type).commands:
        able = sorted(name for name, spec in DRAFTERS.items() if command in spec.commands)
        raise SystemExit(
            f"`hf-specdec {command}` does not apply to {type(drafter).__name__}; the families it applies to: "
            f"{', '.join(able) or 'none'}."
        )


def _calibrate(args) -> int:
    import json

    from ..auto import AutoModelForDrafting
    from ..training.calibration import collect_calibration_batches

    drafter = AutoModelForDrafting.from_pretrained(args.drafter)
    _family_runs(drafter, "calibrate")
    target, _ = load_target(args)
    drafter.check_target_compatibility(target)
    drafter.bind_target(target)
    batches = collect_calibration_batches(args.features, target, drafter, eval_fraction=args.eval_fraction)
    report = drafter.calibrate_confidence(batches, target.get_output_embeddings())
    drafter.config.save_pretrained(args.drafter)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "per_depth"}, indent=2))
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="time the target's pass over 1..N tokens per row at several batch sizes on this machine (what a "
        "verification-length scheduler weighs); store the table in a drafter that reads one",
    )
    add_target_args(p)
    p.add_argument("--drafter", default=None, help=f"drafter folder that receives the table as {PASS_TIMES_FILE}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8])
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the table as JSON")
    p.set_defaults(func=_profile)

    p = sub.add_parser(
        "calibrate",
        help="calibrate a drafter's confidence head on held-out offline features (sequential temperature scaling); "
        "stores the temperatures in its config and reports the calibration error before and after",
    )
    add_target_args(p)
    p.add_argument("--drafter", required=True, help="drafter folder (its config is updated)")
    p.add_argument("--features", required=True, help="offline features directory (dump-features)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="the held-out share, as in training")
    p.add_argument("--out", default=None, help="write the report as JSON")
    p.set_defaults(func=_calibrate)
