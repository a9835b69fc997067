"""Prompt and chat data in the formats people already have, as hf_specdec records.

:func:`load_prompt_source` reads a local JSON/JSONL file or a Hub dataset and turns every row into a record that
:func:`hf_specdec.training.data.tokenize_record` and :func:`hf_specdec.training.regenerate.regenerate` take::

    {"messages": [{"role": "user", "content": "..."}]}        # OpenAI chat, as is
    {"conversations": [{"from": "human", "value": "..."}]}     # ShareGPT (as SpecForge and SafeAILab read it)
    {"instruction": "...", "input": "...", "output": "..."}    # Alpaca
    {"prompt": "...", "response": "..."}                       # plain prompts, as is

ShareGPT and Alpaca rows become ``{"messages": [...]}``; other keys of a row (``id``, ``category``, ...) are kept.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..text_files import read_text
from .data import RecordList, _validate_record

__all__ = ["load_prompt_source", "normalize_record", "SHAREGPT_ROLES"]

# ShareGPT speaker names (``from``) -> chat roles; the role/content dialect of ``conversations`` maps through it too.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}
_JSON_EXTENSIONS = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_KNOWN = "'messages' (OpenAI chat), 'conversations' (ShareGPT), 'instruction' (Alpaca) or 'prompt'"


def _extras(row: Mapping[str, Any], consumed: Iterable[str]) -> dict:
    drop = set(consumed)
    return {k: v for k, v in row.items() if k not in drop}


def _text_content(content: Any, where: str) -> Any:
    """OpenAI content given as parts (``[{"type": "text", "text": ...}]``) joined into one string."""
    if not isinstance(content, list):
        return content
    texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
    if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are supported")
    return "".join(texts)


def _from_messages(row: Mapping[str, Any]) -> dict:
    messages = row["messages"]
    if isinstance(messages, list):
        messages = [
            {**m, "content": _text_content(m["content"], f"messages[{j}]")}
            if isinstance(m, Mapping) and "content" in m
            else m
            for j, m in enumerate(messages)
        ]
    return {**row, "messages": messages}


def _sharegpt_turn(turn: Any, j: int) -> dict:
    if not isinstance(turn, Mapping):
        raise ValueError(f"conversations[{j}] must be an object with 'from' and 'value', got {turn!r:.80}")
    speaker, text = (turn.get("from"), turn.get("value")) if "from" in turn else (turn.get("role"), turn.get("content"))
    if speaker is None or text is None:
        raise ValueError(f"conversations[{j}] must have 'from' and 'value' keys; got keys: {', '.join(map(str, turn))}")
    role = SHAREGPT_ROLES.get(str(speaker).strip().lower())
    if role is None:
        raise ValueError(f"conversations[{j}] is from {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}")
    return {"role": role, "content": text}


def _from_sharegpt(row: Mapping[str, Any]) -> dict:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise ValueError("'conversations' must be a non-empty list of {'from': ..., 'value': ...} objects")
    messages = [_sharegpt_turn(turn, j) for j, turn in enumerate(turns)]
    if row.get("system") and messages[0]["role"] != "system":  # LLaMA-Factory's top-level system prompt
        messages.insert(0, {"role": "system", "content": row["system"]})
    return {"messages": messages, **_extras(row, ("conversations", "system"))}


def _from_alpaca(row: Mapping[str, Any]) -> dict:
    instruction, extra = row["instruction"], row.get("input") or ""
    if not isinstance(instruction, str) or not isinstance(extra, str):
        raise ValueError("'instruction' and 'input' must be strings")
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    messages.append({"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction})
    if row.get("output"):  # without an answer the record is a prompt only, for regenerate
        messages.append({"role": "assistant", "content": row["output"]})
    return {"messages": messages, **_extras(row, ("instruction", "input", "output", "system"))}


def normalize_record(row: Mapping[str, Any], where: str = "record") -> dict:
    """Turns one row of prompt or chat data into an hf_specdec record.

    The first of these keys a row has decides its format (keys whose value is None count as absent):

    * ``messages``: OpenAI chat, ``[{"role", "content"}, ...]``; kept as is, except that content given as text
      parts (``[{"type": "text", "text": ...}]``) is joined into a string;
    * ``conversations``: ShareGPT, ``[{"from", "value"}, ...]`` with ``from`` one of ``human``/``user``,
      ``gpt``/``assistant``/``chatgpt``/``bard`` or ``system`` (``role``/``content`` turns are read too); a top-level
      ``system`` string becomes a leading system message;
    * ``instruction``: Alpaca; the user turn is ``instruction``, or ``instruction + "\\n\\n" + input`` when ``input`` is
      non-empty, followed by the assistant turn ``output`` when it is non-empty (an optional ``system`` string leads);
    * ``prompt``: a plain prompt (optional ``response``), kept as is.

    ShareGPT and Alpaca rows become ``{"messages": [...]}``; every key that is not part of the format (``id``, ...)
    is kept (but those whose value is None).

    Args:
        row: A decoded JSON object or a Hub dataset row.
        where: Where the row comes from (``"file.jsonl:3"``, ``"org/data (train) row 3"``), for error messages.

    Returns:
        A validated ``messages`` or ``prompt`` record (a new dict).

    Raises:
        ValueError: If the row is in none of the formats above or is malformed; the message starts with ``where`` and
            names the keys found.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    # Hub datasets give every column to every row, None where the row has no value: such keys are absent.
    row = {k: v for k, v in row.items() if v is not None}
    converters = (("messages", _from_messages), ("conversations", _from_sharegpt), ("instruction", _from_alpaca))
    try:
        convert = next((fn for key, fn in converters if key in row), None)
        if convert is None and "prompt" not in row:
            keys = ", ".join(sorted(map(str, row))) or "none"
            raise ValueError(f"a row in no known format: expected the key {_KNOWN}; found keys: {keys}")
        record = convert(row) if convert is not None else row
        _validate_record(record)
    except ValueError as e:
        raise ValueError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None
    return record


def _read_local(path: str) -> tuple[list, list[str], list[int]]:
    """``(rows, locations, line numbers)`` of a JSON list or JSONL file (gzip-compressed when it ends in ``.gz``)."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        return rows, [f"{path}: item {i}" for i in range(len(rows))], []
    rows, lines = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            hint = " (a .json file must hold one JSON list of objects, or one object per line)" if lineno == 1 else ""
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno}){hint}") from None
        lines.append(lineno)
    return rows, [f"{path}:{n}" for n in lines], lines


def _looks_local(source: str) -> bool:
    """A path rather than a Hub id (``name`` or ``org/name``)."""
    has_extension = source.lower().endswith(_JSON_EXTENSIONS + (".parquet",))
    return has_extension or source.startswith((".", "/", "~")) or source.count("/") > 1


def _load_dataset(source: str, *args: Any, **kwargs: Any):
    try:
        import datasets
    except ImportError:
        hint = 'pip install "hf_specdec[data]"'
        raise ImportError(f"reading {source} (not a JSON/JSONL file) needs the `datasets` package: {hint}") from None
    return datasets.load_dataset(*args, **kwargs)


def load_prompt_source(
    source: str | os.PathLike, split: str = "train", limit: int | None = None, **hub_kwargs: Any
) -> list[dict]:
    """Loads prompt or chat data from a local file or the Hub as hf_specdec records.

    Each row goes through :func:`normalize_record`: OpenAI ``messages``, ShareGPT ``conversations``, Alpaca
    ``instruction``/``input``/``output`` and plain ``prompt`` rows are accepted, and may be mixed.

    Args:
        source: A local ``.jsonl`` file (one object per line) or ``.json`` file (a JSON list of objects, or JSONL),
            or, read with ``datasets.load_dataset`` (the ``[data]`` extra), a ``.parquet`` file, a dataset folder or
            the id of a Hub dataset (``"org/name"``; ``HF_ENDPOINT`` and the Hub cache apply as to any ``datasets``
            call).
        split: The split of a Hub dataset (``"train"``, ``"test"``, ``"train_sft"``, ...). A local file is a single
            split, named ``"train"`` as ``datasets`` names it.
        limit: Keep only the first ``limit`` rows.
        **hub_kwargs: Passed to ``datasets.load_dataset`` (``name`` for a Hub dataset's configuration, ``revision``,
            ``token``, ``data_files``, ``streaming``, ...); not for JSON/JSONL files, which are read directly.

    Returns:
        The records in source order; for a JSONL file a :class:`~hf_specdec.training.data.RecordList`, which keeps
        each record's line for later error messages.

    Raises:
        FileNotFoundError: If ``source`` looks like a path and no such file exists.
        ImportError: When ``datasets`` is needed and not installed.
        ValueError: For a row in no known format, or a malformed one; the message names the file and line (or the
            row's index) and the keys found. Also for a ``limit`` below 1, or a split other than ``"train"`` or
            ``hub_kwargs`` with a JSON/JSONL file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of rows, got {limit}")
    source = os.fspath(source)
    path = os.path.expanduser(source)
    if os.path.isfile(path) and path.lower().endswith(".parquet"):
        rows, lines = _load_dataset(source, "parquet", data_files=path, split=split, **hub_kwargs), []
        where = (f"{source} row {i}" for i in itertools.count())
    elif os.path.isfile(path):
        if hub_kwargs:
            raise ValueError(f"{source} is a local file: {', '.join(sorted(hub_kwargs))} only apply to Hub datasets")
        if split != "train":
            raise ValueError(f"{source} is a single local file, the 'train' split; there is no split {split!r}")
        rows, where, lines = _read_local(path)
        if not isinstance(rows, list):
            raise ValueError(f"{source}: expected a JSON list of objects or JSONL, got a JSON {type(rows).__name__}")
    elif _looks_local(source) and not os.path.isdir(path):
        raise FileNotFoundError(f"no such file: {source} (give a .jsonl/.json/.parquet file or a Hub dataset id)")
    else:  # a Hub id, or a dataset folder on disk: datasets reads both
        rows, lines = _load_dataset(source, path if os.path.isdir(path) else source, split=split, **hub_kwargs), []
        where = (f"{source} ({split}) row {i}" for i in itertools.count())
    records = [normalize_record(row, loc) for row, loc in zip(itertools.islice(rows, limit), where)]
    if not records:
        raise ValueError(f"{source} holds no rows ({split} split): give at least one prompt, one JSON object per line.")
    return RecordList(records, path=source, lines=lines[: len(records)]) if lines else records
