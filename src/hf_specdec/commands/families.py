"""The `families` and `selfcheck` commands: what is registered, and whether it decodes exactly."""

from __future__ import annotations


def _families(args) -> int:
    from .. import DRAFTERS

    width = max(len(name) for name in DRAFTERS)
    for name, spec in sorted(DRAFTERS.items()):
        print(f"{name:<{width}}  {spec.model_type:<20}  {spec.model_class.__name__:<22}  {spec.description}")
    return 0


def _selfcheck(args) -> int:
    from ..selfcheck import run_selfcheck

    ok = run_selfcheck(
        architectures=args.arch, batch_sizes=args.batch, num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens
    )
    return 0 if ok else 1


def add_parsers(sub) -> None:
    p = sub.add_parser("families", help="list the registered drafter families")
    p.set_defaults(func=_families)

    p = sub.add_parser(
        "selfcheck",
        help="build tiny targets of several architectures and check that speculative decoding reproduces plain "
        "generate token for token (greedy), with a fresh drafter of every registered family and a replay drafter",
    )
    p.add_argument("--arch", nargs="+", default=["llama", "qwen2", "qwen3", "mistral", "gemma"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 3])
    p.add_argument("--k", type=int, default=4, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(func=_selfcheck)
