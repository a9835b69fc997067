"""``hf-specdec``: the command line, one module per group of commands. Thin: parses arguments and calls library
functions."""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, convert, data, demo, families, push, train, tuning
from .common import one_line

__all__ = ["main", "build_parser"]

# the order of `hf-specdec -h`
COMMAND_GROUPS = (families, tuning, demo, bench, convert, push, data, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.add_parsers(sub)
    _add_debug_option(parser, sub)
    return parser


def _add_debug_option(parser, sub) -> None:
    """``--debug``, before or after the command name: a user mistake shows its traceback instead of one line."""
    text = "on a user mistake, show the traceback instead of one line (also: HF_SPECDEC_TRACEBACK=1)"
    parser.add_argument("--debug", action="store_true", help=text)
    for command in sub.choices.values():  # SUPPRESS: the command's default does not undo a --debug given before it
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=text)


# Integer options that must be >= 1 when given (0 or a negative value is a mistake, never "use the default").
_POSITIVE_INT_OPTIONS = (
    "k", "max_new_tokens", "num_draft_tokens", "repeats", "prompts", "threads", "train_steps", "tree_depth",
    "tree_top_k", "tree_total_tokens", "assistant_tokens", "max_prompts", "max_prompt_tokens", "batch_size",
    "max_length", "grad_accum", "ttt_steps", "draft_vocab_size", "save_steps", "eval_steps", "logging_steps",
    "lora_r", "lora_alpha", "target_num_layers", "max_train_examples", "batch",
)  # fmt: skip


DTYPES = ("auto", "float32", "bfloat16", "float16")


def _check_option_values(parser: argparse.ArgumentParser, args) -> None:
    for name in _POSITIVE_INT_OPTIONS:
        value = getattr(args, name, None)
        values = value if isinstance(value, list) else [value]
        bad = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v < 1]
        if bad:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {bad[0]}")
    dtype = getattr(args, "dtype", None)
    if dtype is not None and dtype not in DTYPES:
        parser.error(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if getattr(args, "command", None) == "selfcheck":
        from ..testing import ARCHS

        unknown = [a for a in args.arch if a not in ARCHS]
        if unknown:
            parser.error(f"--arch {unknown[0]!r} is not a tiny architecture selfcheck builds; choose from "
                         f"{', '.join(ARCHS)}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The ``hf-specdec`` command. A user's mistake (a missing file, a bad option value, an unknown family, a drafter
    that does not fit the target, ...) prints one line saying what to do and returns 2, without a traceback; set
    ``--debug`` (or ``HF_SPECDEC_TRACEBACK=1``) to see the traceback instead."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, for records that name it
    _check_option_values(parser, args)
    command = f"hf-specdec {args.command}"
    try:
        return int(args.func(args) or 0)
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # raise SystemExit("...") inside a command: a user-facing message
            print(f"{command}: error: {one_line(exit_.code)}", file=sys.stderr)
            return 2
        raise
    except (ValueError, OSError) as err:  # OSError: missing files, and transformers' "cannot load" errors
        if args.debug or os.environ.get("HF_SPECDEC_TRACEBACK"):
            raise
        print(f"{command}: error: {_user_message(err)}", file=sys.stderr)
        return 2


def _user_message(err: Exception) -> str:
    message = one_line(err)
    if "Repo id must be" in message:  # a local path that does not exist, read as a Hub id by the Hub client
        return f"no such folder, and not a Hub id: check the path ({message})"
    if isinstance(err, FileNotFoundError) and err.filename and message.startswith("[Errno"):  # the OS's own words
        return f"no such file or folder: {err.filename}; check the path."
    return message
