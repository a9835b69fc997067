"""Honest figures: every speedup and τ figure in README.md and model_cards/*.md comes from a results file.

A figure is a number with decimals followed by ``×`` (or ``x``), a number after ``τ`` / ``tau``, or a number in a
Markdown table column headed by ``τ``, ``speedup`` or ``bound``. It is backed when a results file under
``model_cards/results/`` holds a value that rounds to it: in JSON, under a key naming a speedup (``speedup``,
``predicted_speedup``, ``speedup_bound``, ...) or a τ (``mean_accepted_length``, ``simulated_tau``, ...); in the
Markdown reports, as a ``×`` figure or in a τ column. README.md names the command that writes each results file.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "model_cards" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "model_cards").glob("*.md"))]

NUMBER = r"(\d+\.\d+)"
SPEEDUP_RE = re.compile(r"(?<![\w.])" + NUMBER + r"\s?(?:×|x(?![\w]))")
TAU_RE = re.compile(r"(?:τ|\btau\b)\s*(?:=|≈|was|is|of|:)?\s*" + NUMBER)
SPEEDUP_KEYS = ("speedup", "bound")
TAU_KEYS = ("tau", "accepted_length")


def _table_figures(text: str) -> list[tuple[str, str]]:
    """``(kind, figure)`` for the numbers in Markdown table columns headed by τ, speedup or bound."""
    out = []
    header = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if all(set(c) <= set(":- ") for c in cells):
            continue
        for name, cell in zip(header, cells):
            low = name.lower()
            kind = "tau" if "τ" in name or low == "tau" else "speedup" if ("speedup" in low or low == "bound") else None
            if kind:
                out += [(kind, m) for m in re.findall(NUMBER, cell)]
    return out


def figures(text: str) -> list[tuple[str, str]]:
    """Every speedup / τ figure of a Markdown text, as ``(kind, figure)``."""
    found = [("speedup", m) for m in SPEEDUP_RE.findall(text)]
    found += [("tau", m) for m in TAU_RE.findall(text)]
    return found + _table_figures(text)


def _walk(node, key=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, str(k).lower())
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v, key)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield key, float(node)


def backed_values(paths=None) -> dict[str, set[float]]:
    """The speedup and τ values that the results files hold (``paths``: those files only)."""
    values: dict[str, set[float]] = {"speedup": set(), "tau": set()}
    for path in sorted(RESULTS.rglob("*")) if paths is None else paths:
        if path.suffix == ".json":
            for key, value in _walk(json.loads(path.read_text(encoding="utf-8"))):
                if any(k in key for k in SPEEDUP_KEYS):
                    values["speedup"].add(value)
                if any(k in key for k in TAU_KEYS):
                    values["tau"].add(value)
        elif path.suffix == ".md":
            for kind, figure in figures(path.read_text(encoding="utf-8")):
                values[kind].add(float(figure))
    return values


def is_backed(kind: str, figure: str, values: dict[str, set[float]]) -> bool:
    decimals = len(figure.split(".")[1])
    x = float(figure)
    return any(abs(v - x) <= 0.5 * 10**-decimals + 1e-9 for v in values[kind])


def test_figure_parser_finds_what_it_must():
    text = (
        "speculative decoding: 1.68x faster, tau = 4.39 tokens; EAGLE-3 1.19× (τ 3.11), a 3 × 384 matrix, "
        "simulated τ 4.57\n\n| Method | Speedup | τ | α |\n|:--|--:|--:|--:|\n| a | **1.60×** | 4.31 | 0.88 |\n"
    )
    got = sorted(figures(text))
    assert got == sorted(
        [("speedup", "1.68"), ("speedup", "1.19"), ("speedup", "1.60"), ("speedup", "1.60")]
        + [("tau", "4.39"), ("tau", "3.11"), ("tau", "4.57"), ("tau", "4.31")]
    )
    values = {"speedup": {1.6812, 1.19}, "tau": {4.3051}}
    assert is_backed("speedup", "1.68", values) and is_backed("tau", "4.31", values)
    assert not is_backed("speedup", "1.75", values) and not is_backed("tau", "4.3", {"tau": {4.36}})
    assert is_backed("tau", "4.3", values)


def test_results_files_exist_and_readme_names_their_commands():
    files = sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".md"))
    assert files, "model_cards/results/ is empty"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
            assert f"`{path.name}`" in readme or f"`{path.stem}.{{" in readme, (
                f"README.md's table of results files does not name {path.name} (and the command that writes it)"
            )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_speedup_and_tau_figure_has_a_results_file(doc):
    values = backed_values()
    text = doc.read_text(encoding="utf-8")
    orphans = sorted({f"{kind} {figure}" for kind, figure in figures(text) if not is_backed(kind, figure, values)})
    assert not orphans, f"{doc.name}: figures without a results file in model_cards/results/: {orphans}"


def _expand_braces(name: str) -> list[str]:
    """``a.{json,md}`` -> ``a.json``, ``a.md`` (the README's table writes a file's siblings that way)."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[part] if i % 2 == 0 else part.split(",") for i, part in enumerate(parts)]
    return ["".join(pick) for pick in itertools.product(*choices)]


def _named_results_files() -> list[tuple[str, str]]:
    """``(where, path)`` for every results file the README's table or a link in the docs names."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("| results file | command |", 1)[1].split("\n\n", 1)[0]
    named = [
        ("README.md's table of results files", f"model_cards/results/{path}")
        for line in table.splitlines()[2:]
        for cell in [line.split("|")[1]]
        for name in re.findall(r"`([^`]+)`", cell)
        for path in _expand_braces(name)
    ]
    for doc in DOCS:
        base = doc.parent
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text(encoding="utf-8")):
            path = (base / target).resolve()
            if RESULTS in path.parents:
                named.append((doc.name, str(path.relative_to(ROOT))))
    return named


def test_every_results_file_the_docs_name_is_in_the_checkout():
    named = _named_results_files()
    assert len(named) > 300, "the README's table of results files was not found"
    missing = sorted({f"{where}: {path}" for where, path in named if not (ROOT / path).is_file()})
    assert not missing, "results files named but not in the checkout (never committed?):\n" + "\n".join(missing)


def test_git_never_ignores_a_results_file():
    """A results file that .gitignore matches stays on the machine that wrote it and is lost with it."""
    probes = [f"model_cards/results/any-new-run/{name}" for name in ("demo_report.json", "demo_report.png", "x.md")]
    probes += ["model_cards/candidates/any/plot.png", "src/hf_specdec/assets/any/plot.png"]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *probes],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    ignored = [
        line.split("\t")[1] for line in done.stdout.splitlines() if not line.startswith("::") and ":!" not in line
    ]
    assert not ignored, f".gitignore ignores results files: {ignored}"


def test_each_results_table_row_is_backed_by_the_files_it_links():
    """Stricter than any results file holding the value: a row of README.md's results tables (the current one and
    the earlier runs') names its files, and every speedup and τ in its result cell must come from one of those."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    tables = [part.split("\n\n", 1)[0] for part in readme.split("| target | what ran | result | results file |")[1:]]
    rows = [[c.strip() for c in line.strip("|").split("|")] for table in tables for line in table.splitlines()[2:]]
    assert len(tables) == 2 and len(rows) > 40, "README.md's two results tables were not found"
    orphans = []
    for _, what, result, files in rows:
        values = backed_values([ROOT / target for target in re.findall(r"\]\(([^)#\s]+)\)", files)])
        found = [("speedup", m) for m in SPEEDUP_RE.findall(result)] + [("tau", m) for m in TAU_RE.findall(result)]
        orphans += [f"{what[:60]}: {kind} {figure}" for kind, figure in found if not is_backed(kind, figure, values)]
    assert not orphans, "results-table figures that the row's own files do not hold:\n" + "\n".join(orphans)


def _files_a_text_names(text: str) -> set[Path]:
    """The results files a Markdown text names: backticked names and links, with ``a.{json,md}`` expanded, a
    ``<family>`` placeholder read as any name, and a bare suffix (``-before-tree-sizes``) as every file with it."""
    files: set[Path] = set()
    for quoted, linked in re.findall(r"`([^`\s]+)`|\]\(([^)#\s]+)\)", text):
        for name in _expand_braces(quoted or linked):
            if "/" in name and "results/" not in name:  # a card, a script: not a results file
                continue
            base = re.sub(r"<[^>]*>", "*", name.split("/")[-1])
            if not base or base in (".", ".."):
                continue
            files.update(RESULTS.rglob(base))
            if base.startswith("-") or base.endswith("-"):
                files.update(RESULTS.rglob("*" + base.rsplit(".", 1)[0] + "*"))
    return files


def orphans_among_named(text: str, title: str) -> list[str]:
    """Figures of ``text`` that the results files it names do not hold (none when it names no results file: then
    only the check against every file applies)."""
    found = figures(text)
    files = _files_a_text_names(text)
    if not found or not files:
        return []
    values = backed_values(sorted(files))
    return sorted({f"{title}: {kind} {fig}" for kind, fig in found if not is_backed(kind, fig, values)})


def section_orphans(text: str) -> list[str]:
    """:func:`orphans_among_named` for each ``##``-to-``#####`` section of a Markdown text."""
    sections = re.split(r"\n(?=#{2,5} )", text)
    return [o for section in sections for o in orphans_among_named(section, section.splitlines()[0][:60])]


def test_a_sections_figure_must_come_from_a_file_the_section_names():
    named = "## A\n\nThe chain: 1.54× [1.46–1.62], τ 2.16 (`smollm2-bench.md`).\n"
    assert section_orphans(named) == []
    elsewhere = "## B\n\nThe chain: 1.54×, τ 2.16 (`smollm2-pass-cost.md`).\n"  # the figures are in another file
    assert section_orphans(elsewhere) == ["## B: speedup 1.54", "## B: tau 2.16"]
    family = (
        "## C\n\n| family | held-out simulated τ |\n|:--|--:|\n| Hydra | 1.57 |\n\n"
        "Records: `smollm2-<family>-distill-training_record.json`.\n"
    )
    assert section_orphans(family) == []


def test_every_readme_sections_figures_come_from_the_files_it_names():
    """Stricter than any results file holding the value: a figure in a README section must be in a results file
    that section names, so a figure left behind when its run was replaced fails even if another file matches it."""
    orphans = section_orphans((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not orphans, "README figures that no results file named in their section holds:\n" + "\n".join(orphans)


@pytest.mark.parametrize("card", sorted((ROOT / "model_cards").glob("*.md")), ids=lambda p: p.name)
def test_a_cards_figures_come_from_the_bench_reports_it_names(card):
    """A card rendered from bench reports names them (``reports: `smollm2-bench.json`, ...``); its speedups and τ
    must be in those files, not merely in some results file."""
    orphans = orphans_among_named(card.read_text(encoding="utf-8"), card.name)
    assert not orphans, "card figures that the reports it names do not hold:\n" + "\n".join(orphans)


def test_the_shipped_drafters_card_is_what_its_reports_render(tmp_path):
    """``model_cards/smollm2-eagle3.md`` is exactly what the README's ``hf-specdec push ... --card-only`` writes
    from the shipped drafter and the reports the card names: a results file rerun, or a template changed, without
    the card regenerated fails here."""
    from hf_specdec.cards import drafter_card

    committed = (ROOT / "model_cards" / "smollm2-eagle3.md").read_text(encoding="utf-8")
    reports = re.search(r"\(reports: ([^)]*)\)", committed)
    assert reports, "the card does not name the bench reports its results come from"
    bench = [str(RESULTS / name) for name in re.findall(r"`([^`]+)`", reports.group(1))]
    card = drafter_card(
        str(ROOT / "src" / "hf_specdec" / "assets" / "smollm2-drafter"),
        repo_id="hf-specdec/smollm2-eagle3",
        bench=bench,
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    card.save(tmp_path / "card.md")
    assert (tmp_path / "card.md").read_text(encoding="utf-8") == committed, (
        "model_cards/smollm2-eagle3.md is stale: rerun the README's hf-specdec push ... --card-only command"
    )
