"""What several commands share: the target options and loading, one-line messages."""

from __future__ import annotations

import os


def load_target(args):
    """``--target``: a model folder or Hub id, or a demo target's name (``smollm2``, ``demo-code``)."""
    from ..demo import DEMO_TARGETS
    from ..training.recipes import load_target as load_model_and_tokenizer

    shortcut = DEMO_TARGETS.get(str(args.target).strip().lower())
    if shortcut is not None and not os.path.exists(args.target):
        dtype = "float32" if args.dtype in (None, "auto") else args.dtype
        return shortcut.load(dtype=dtype, device_map=args.device_map)
    return load_model_and_tokenizer(args.target, dtype=args.dtype, device_map=args.device_map)


def add_target_args(p, optional_target_help: str | None = None) -> None:
    """``--target`` (required, unless ``optional_target_help`` describes its default), ``--dtype``, ``--device-map``."""
    p.add_argument(
        "--target",
        required=optional_target_help is None,
        default=None,
        help=optional_target_help or "target model: local folder or Hub id, or smollm2 / demo-code (the demo targets)",
    )
    p.add_argument("--dtype", default="auto", help="target dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device-map", default=None, help='accelerate placement of the target, e.g. "auto"')


def add_kernels_flags(p) -> None:
    """``--linear-kernels`` and ``--draft-kernels``: how the target's and the drafters' fp32 CPU linear layers
    compute for a timed run."""
    from ..cpu_kernels import DEFAULT_DRAFT_KERNELS, DRAFT_KERNELS

    p.add_argument(
        "--linear-kernels",
        choices=["packed", "stock"],
        default="packed",
        help="packed (default): the target's fp32 CPU linear layers compute passes over 1-64 tokens with weights "
        "packed once for oneDNN, for plain and speculative runs alike (a pass over a few tokens then costs about "
        "what a one-token step costs); stock: the layers as they are",
    )
    p.add_argument(
        "--draft-kernels",
        choices=DRAFT_KERNELS,
        default=DEFAULT_DRAFT_KERNELS,
        help=f"bf16 / int8 (default: {DEFAULT_DRAFT_KERNELS}): the drafters' (and assistant models') fp32 CPU linear "
        "layers compute with bf16 weights packed once for oneDNN / int8 weights for PyTorch's dynamically quantized "
        "kernel, where the CPU can (a draft step costs less; the output is unchanged, the target verifies every "
        "token); stock: the layers as they are",
    )


def one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def drafter_overrides(args) -> dict:
    out = {}
    if getattr(args, "num_draft_tokens", None):
        out["num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "draft_vocab_size", None):
        out["draft_vocab_size"] = args.draft_vocab_size
    if getattr(args, "draft_layers", None):
        out["num_hidden_layers"] = args.draft_layers
    if getattr(args, "layer_ids", None):
        out["target_layer_ids"] = args.layer_ids
    if getattr(args, "context_vocabulary", False):
        out["context_vocabulary"] = True
    for item in getattr(args, "config", None) or []:  # --config KEY=VALUE (VALUE read as JSON, else a string)
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config expects KEY=VALUE, got {item!r}")
        out[key] = json_or_text(value)
    return out


def json_or_text(value: str):
    import json

    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def target_vocab_size(target, drafter) -> int:
    emb = target.get_input_embeddings()
    rows = emb.weight.shape[0] if emb is not None and getattr(emb, "weight", None) is not None else None
    return min(v for v in (rows, drafter.config.target_vocab_size) if v is not None)
