"""The demo (``hf-specdec demo``): the shipped code model, its drafter, and the data they were trained on.

Everything here runs offline. The demo target is a small Llama-style Python code model that hf_specdec trained itself
on the Python standard library (``scripts/train_demo_target.py``); the drafter was trained for it with hf_specdec's own
pipeline (:func:`train_demo_drafter`, also ``scripts/train_demo_drafter.py``). The evaluation prompts
(``assets/demo-prompts.jsonl``) are cut from standard-library files the target never saw in training.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import sysconfig
import time

import torch

__all__ = [
    "ASSETS",
    "DEMO_TARGET",
    "DEMO_DRAFTER",
    "DEMO_ASSISTANT",
    "demo_family",
    "stdlib_files",
    "is_held_out",
    "code_prompts",
    "train_demo_drafter",
    "run_demo",
]

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEMO_TARGET = os.path.join(ASSETS, "demo-target")
DEMO_DRAFTER = os.path.join(ASSETS, "demo-drafter")
DEMO_ASSISTANT = os.path.join(ASSETS, "demo-assistant")


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


def load_demo_target(path: str = DEMO_TARGET):
    """The demo target in float32 (bf16 matmuls are slow on CPUs without native bf16) and its tokenizer."""
    from .training.recipes import load_target

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"No demo target at {path}: reinstall hf_specdec (the weights ship in the package).")
    return load_target(path, dtype="float32")


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
        batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_ratio=0.03,
        save_steps=100,
        eval_steps=100,
        logging_steps=20,
        seed=seed,
        report_to="none",
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
    num_prompts: int = 8,
    max_new_tokens: int = 96,
    num_draft_tokens: int | None = None,
    repeats: int = 1,
    train: bool = False,
    train_steps: int = 400,
    train_dir: str = "runs/demo-train",
    drafter_path: str | None = None,
    progress: bool = True,
) -> dict:
    """Plain ``generate`` against the demo target with its drafter, on held-out code prompts.

    Prints a table, writes ``demo_report.json`` and ``demo_report.png`` to ``out_dir`` and returns the summary:
    ``speedup``, ``mean_accepted_length``, ``identical``, ``tokens_per_s_plain``, ``tokens_per_s_speculative``, plus
    the per-position acceptance, the draft cost ratio and the full benchmark report.
    """
    from .auto import AutoModelForDrafting
    from .bench.prompts import load_prompts
    from .bench.report import format_console_table, save_plots
    from .bench.runner import drafter_method, plain_method, run_benchmark
    from .registry import get_drafter_spec

    if num_draft_tokens is not None and int(num_draft_tokens) < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens} (leave it unset for the drafter's K).")
    t_start = time.time()
    target, tokenizer = load_demo_target()
    if train:
        drafter_path = train_demo_drafter(target, tokenizer, train_dir, max_steps=train_steps)
    drafter = AutoModelForDrafting.from_pretrained(drafter_path or DEMO_DRAFTER).eval()
    prompts = load_prompts("demo")[:num_prompts]
    k = drafter.config.num_draft_tokens if num_draft_tokens is None else int(num_draft_tokens)
    label = get_drafter_spec(drafter.config.model_type).label
    method = drafter_method(drafter, name=f"{label} K={k}", num_draft_tokens=k)
    print(
        f"demo target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M-parameter Llama code model; "
        f"drafter: {label} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M); "
        f"{len(prompts)} held-out prompts x {max_new_tokens} new tokens, greedy, batch size 1",
        flush=True,
    )
    report = run_benchmark(
        target,
        tokenizer,
        [plain_method(), method],
        prompts,
        max_new_tokens=max_new_tokens,
        warmup=1,
        repeats=repeats,
        progress=progress,
        config={"target": "hf_specdec demo-target", "drafter": drafter_path or "hf_specdec demo-drafter"},
    )
    plain = next(r for r in report["records"] if r["kind"] == "plain")
    spec = next(r for r in report["records"] if r["kind"] == "drafter")
    summary = {
        "speedup": spec["speedup"],
        "mean_accepted_length": spec["mean_accepted_length"],
        "identical": bool(spec["identical"]),
        "tokens_per_s_plain": plain["tokens_per_s"],
        "tokens_per_s_speculative": spec["tokens_per_s"],
        "acceptance_by_position": spec["acceptance_by_position"],
        "alpha": spec["alpha"],
        "draft_cost_ratio": spec["draft_cost_ratio"],
        "speedup_bound": spec["speedup_bound"],
        "verify_cost_ratio": spec["verify_cost_ratio"],
        "predicted_speedup": spec["predicted_speedup"],
        "num_draft_tokens": k,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "wall_time_s": None,
        "report": report,
    }
    print()
    print(format_console_table(report))
    sample = _sample_completion(target, tokenizer, drafter, prompts[0], max_new_tokens, k)
    print("\nexample (held-out prompt, last lines, then the speculative completion):")
    print(sample)
    os.makedirs(out_dir, exist_ok=True)
    png = save_plots(report, os.path.join(out_dir, "demo_report.png"))
    summary["plot"] = png
    summary["wall_time_s"] = round(time.time() - t_start, 1)
    path = os.path.join(out_dir, "demo_report.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    verdict = "identical to" if summary["identical"] else "DIFFERENT FROM"
    print(
        f"\nspeculative decoding: {summary['speedup']:.2f}x faster, tau = {summary['mean_accepted_length']:.2f} "
        f"tokens per target pass, outputs {verdict} plain generate."
    )
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return summary


def _sample_completion(target, tokenizer, drafter, item, max_new_tokens: int, k: int) -> str:
    ids = tokenizer(item.text, return_tensors="pt").input_ids
    out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=k, max_new_tokens=max_new_tokens)
    context = "\n".join(item.text.rstrip("\n").splitlines()[-3:])
    completion = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    bar = "-" * 60
    return f"{bar}\n{context}\n{completion}\n{bar}"
