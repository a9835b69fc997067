"""Reading users' text files (training data, prompt files): UTF-8, gzip-compressed when the name ends in ``.gz``.

A line that is not UTF-8 raises a `ValueError` that names the file, the line and the byte, instead of Python's
``'utf-8' codec can't decode byte ...`` with neither.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator

__all__ = ["text_lines", "read_text"]


def text_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(1-based line number, line)`` of a UTF-8 text file, line endings kept."""
    path = os.fspath(path)
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            yield lineno, _decode(raw, path, lineno)


def read_text(path: str | os.PathLike) -> str:
    """The whole of a UTF-8 text file (see :func:`text_lines`)."""
    return "".join(line for _, line in text_lines(path))


def _decode(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}:{lineno}: not UTF-8 text (byte {raw[err.start : err.start + 1]!r} at column {err.start + 1}). "
            "Save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or drop that line."
        ) from None
