"""The `convert` command: other projects' checkpoint layouts in and out."""

from __future__ import annotations

import os


def _convert(args) -> int:
    from ..convert import LAYOUTS, export_drafter, import_drafter

    if args.list:
        for name, layout in sorted(LAYOUTS.items()):
            modes = "/".join(m for m, f in (("import", layout.load), ("export", layout.save)) if f)
            print(f"{name:<22} {layout.family:<18} {modes:<14} {layout.description}")
        return 0
    if not args.src or not args.out:
        raise SystemExit("hf-specdec convert: give SRC and OUT (or --list).")
    _check_convert_output(args.src, args.out)
    if args.to:
        from ..auto import AutoModelForDrafting

        drafter = AutoModelForDrafting.from_pretrained(args.src)
        target = None
        if args.target:  # layouts that ship target weights (e.g. embeddings) take them from here
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(args.target)
            drafter.bind_target(target)
        export_drafter(drafter, args.out, args.to, target=target)
        print(f"wrote {args.out} in the {args.to!r} layout")
        return 0
    target_config = None
    if args.target:
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(args.target)
    drafter = import_drafter(args.src, args.from_layout, target_config, args.target_num_layers)
    drafter.save_pretrained(args.out)
    print(f"imported {args.src} ({drafter.config.model_type}) -> {args.out}; load it with AutoModelForDrafting")
    return 0


def _check_convert_output(src: str, out: str) -> None:
    """OUT must be a new or empty folder: never the source itself, a file, or a folder holding another model (whose
    tokenizer, notes and checkpoints would stay beside the converted weights)."""
    if os.path.exists(src) and os.path.exists(out) and os.path.samefile(src, out):
        raise SystemExit(f"OUT {out!r} is SRC itself; converting in place would overwrite the "
                         "source checkpoint. Give a new folder as OUT.")  # fmt: skip
    if os.path.isfile(out):
        raise SystemExit(f"OUT {out!r} is a file; give a new folder as OUT.")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise SystemExit(f"OUT {out!r} already holds files ({shown}); the converted drafter "
                         "would be mixed with them. Give a new or empty folder as OUT, or remove it first.")  # fmt: skip


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="import a drafter written by another project (layouts: --list) or export one to such a layout",
    )
    p.add_argument("src", nargs="?", help="source checkpoint: a folder or a Hub repo id")
    p.add_argument("out", nargs="?", help="output folder")
    p.add_argument("--from", dest="from_layout", default="auto", help="source layout (default: detect)")
    p.add_argument("--to", default=None, help="export an hf_specdec drafter to this layout instead")
    p.add_argument(
        "--target",
        default=None,
        help="the target: checks depth, width and vocabulary on import; its embeddings for layouts that ship them",
    )
    p.add_argument("--target-num-layers", type=int, default=None, help="the target's depth, without --target")
    p.add_argument("--list", action="store_true", help="list the known layouts")
    p.set_defaults(func=_convert)
