"""Writing a script's results file pair: ``STEM.json`` (the figures) and ``STEM.md`` (their table), shared by the
SmolLM2 analysis scripts."""

from __future__ import annotations

import json
import os


def write_results(stem: str, result: dict, markdown: str) -> None:
    """Writes ``stem + ".json"`` and ``stem + ".md"`` and prints the Markdown."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
    with open(stem + ".md", "w", encoding="utf-8") as fh:
        fh.write(markdown)
    print(markdown)
