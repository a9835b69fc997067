"""The data commands: `regenerate` (the target answers a prompt set), `distill` (self-distillation data at scale) and `dump-features` (the target features a drafter trains on, offline)."""

from __future__ import annotations

from .common import add_target_args, drafter_overrides, load_target, target_vocab_size


def _regenerate(args) -> int:
    from ..training.regenerate import regenerate
    from ..training.sources import load_prompt_source

    hub_kwargs = {"name": args.data_config} if args.data_config else {}
    try:
        records = load_prompt_source(args.data, split=args.split, limit=args.limit, **hub_kwargs)
    except ImportError as err:  # `datasets` missing: one line saying what to install
        raise SystemExit(str(err)) from None
    target, tokenizer = load_target(args)
    written = regenerate(
        target,
        tokenizer,
        records,
        args.output,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        batch_size=args.batch_size,
        resume=not args.no_resume,
        seed=args.seed,
        truncate_left=args.truncate_left,
    )
    print(f"wrote {written} regenerated records to {args.output}")
    return 0


def _distill(args) -> int:
    import shlex

    from ..training.distill import build_distill_dataset
    from ..training.sources import load_prompt_source

    extra = []
    if args.data:
        try:
            extra = load_prompt_source(args.data, split=args.split, limit=args.limit)
        except ImportError as err:  # `datasets` missing: one line saying what to install
            raise SystemExit(str(err)) from None
    target, tokenizer = load_target(args)
    target.eval()
    index = build_distill_dataset(
        target,
        tokenizer,
        args.output_dir,
        num_shards=args.num_shards,
        shard_size=args.shard_size,
        extra_records=extra,
        templated_share=args.templated_share,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        settings={"target": str(args.target), "command": "hf-specdec " + shlex.join(args.argv)},
    )
    print(f"{index['records']} records, {index['answer_tokens']} answer tokens in {len(index['shards'])} shards")
    return 0


def _dump_features(args) -> int:
    from ..training.data import check_token_ids
    from ..training.offline import dump_features
    from ..training.recipes import build_datasets, make_drafter

    target, tokenizer = load_target(args)
    drafter = make_drafter(target, args.drafter, **drafter_overrides(args))
    dataset, _, info = build_datasets(args.data, tokenizer, args.max_length, eval_fraction=0.0)
    # Ids the target does not have are refused here, naming the file and line, not deep inside the target.
    check_token_ids(dataset, target_vocab_size(target, drafter))
    examples = [dataset[i] for i in range(len(dataset))]
    index = dump_features(
        target,
        examples,
        drafter.config.target_layer_ids,
        args.output_dir,
        dtype=args.feature_dtype,
        batch_size=args.batch_size,
        resume=not args.no_resume,
        tokenizer=tokenizer,
        shard_tokens=args.shard_tokens,
    )
    print(f"dumped features of {index.get('num_examples', len(examples))} examples to {args.output_dir}")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("regenerate", help="self-distillation: let the target answer the prompts of a data set")
    add_target_args(p)
    p.add_argument(
        "--data",
        required=True,
        help="a .jsonl/.json/.parquet file, dataset folder or Hub dataset id; rows in OpenAI (messages), ShareGPT "
        "(conversations), Alpaca (instruction/input/output) or prompt format",
    )
    p.add_argument("--data-config", default=None, help="configuration name of a Hub dataset")
    p.add_argument("--split", default="train", help="split of a Hub dataset (a local file is the train split)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N rows")
    p.add_argument(
        "--truncate-left",
        action="store_true",
        help="keep the last tokens of a prompt too long for the target's context instead of skipping it",
    )
    p.add_argument("--output", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-resume", action="store_true", help="start over instead of continuing an existing output")
    p.set_defaults(func=_regenerate)

    p = sub.add_parser(
        "distill",
        help="self-distillation data at scale: prompts the target writes (Magpie), templated and your own; the "
        "target's answers; resumable compressed shards with a dataset card",
    )
    add_target_args(p)
    p.add_argument("--output-dir", required=True, help="where the shards, index.json and README.md go")
    p.add_argument("--num-shards", type=int, required=True, help="rerun with more to extend the data set")
    p.add_argument("--shard-size", type=int, default=512, help="prompts per shard (the unit of resuming)")
    p.add_argument("--data", default=None, help="your own prompts first (a file or Hub dataset id, as regenerate)")
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--templated-share", type=float, default=0.25, help="share of hf_specdec's templated prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_distill)

    p = sub.add_parser("dump-features", help="write the target features a drafter trains on to disk (offline)")
    add_target_args(p)
    p.add_argument("--data", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument(
        "--drafter",
        default=None,
        help="family name (its default layers; default: the default family) or a drafter path",
    )
    p.add_argument("--layer-ids", type=int, nargs="+", default=None, help="override the target layers to store")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--feature-dtype", default="bfloat16", help="storage dtype: bfloat16, float16 or float32")
    p.add_argument("--shard-tokens", type=int, default=100_000, help="tokens per shard (the unit of resuming)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-resume", action="store_true")
    p.set_defaults(func=_dump_features)
