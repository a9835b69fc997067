"""The `push` command: a drafter folder and its generated model card to the Hub."""

from __future__ import annotations


def _push(args) -> int:
    from ..cards import drafter_card, push_drafter

    recommended = None
    if args.asd_tune:
        import json

        with open(args.asd_tune, encoding="utf-8") as fh:
            frozen = json.load(fh).get("recommended")
        recommended = {"verifier": "asd", **frozen} if frozen else None
    card_kwargs = dict(bench=args.bench, base_model=args.base_model, license=args.license, datasets=args.datasets,
                       recommended_settings=recommended)  # fmt: skip
    if args.card_only:
        card = drafter_card(args.folder, repo_id=args.repo_id, layout=args.layout, **card_kwargs)
        card.save(args.card_only)
        print(f"wrote {args.card_only}")
        return 0
    target = None
    if args.target:  # layouts that ship target weights (e.g. embeddings) take them from here
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target)
    info = push_drafter(args.folder, args.repo_id, private=args.private, revision=args.revision,
                        commit_message=args.commit_message, token=args.token, endpoint=args.endpoint,
                        layout=args.layout, target=target, **card_kwargs)  # fmt: skip
    where = f" in the {args.layout!r} layout" if args.layout else ""
    print(f"pushed {args.folder} to {args.repo_id}{where}: {getattr(info, 'commit_url', info)}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("push", help="upload a trained drafter folder with a generated model card to the Hub")
    p.add_argument("folder", help="drafter folder (loads with AutoModelForDrafting)")
    p.add_argument("repo_id", help="org/name on the Hub")
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    p.add_argument("--commit-message", default=None)
    p.add_argument(
        "--bench", nargs="+", default=None, help="hf-specdec bench JSON report(s) for the card's results table"
    )
    p.add_argument("--asd-tune", default=None, help="hf-specdec asd-tune JSON: recommend its frozen ASD settings")
    p.add_argument("--base-model", default=None, help="the target's Hub id (default: from the drafter config)")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--datasets", nargs="+", default=None)
    p.add_argument("--token", default=None)
    p.add_argument("--endpoint", default=None, help="Hub endpoint (default: huggingface.co or HF_ENDPOINT)")
    p.add_argument("--card-only", default=None, metavar="PATH", help="only write the card to PATH, upload nothing")
    p.add_argument(
        "--layout",
        default=None,
        help="publish the weights in another project's layout instead of hf_specdec's (names: hf-specdec convert --list)",
    )
    p.add_argument("--target", default=None, help="the target, for layouts that ship some of its weights")
    p.set_defaults(func=_push)
