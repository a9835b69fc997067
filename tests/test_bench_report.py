"""Benchmark report writers: Markdown / console tables, the category table, the plot and write_report."""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest

from hf_specdec.bench.report import (
    category_table,
    category_verdicts,
    format_console_table,
    markdown_table,
    save_plots,
    write_report,
)


def record(method, kind, category, speedup, tau, **extra):
    base = {
        "method": method,
        "kind": kind,
        "mode": "greedy",
        "temperature": 0.0,
        "batch_size": 1,
        "category": category,
        "num_prompts": 4,
        "new_tokens": 256,
        "wall_s": 5.0,
        "tokens_per_s": 51.23,
        "speedup": speedup,
        "mean_accepted_length": tau,
        "acceptance_by_position": None,
        "alpha": None,
        "draft_cost_ratio": None,
        "speedup_bound": None,
        "identical": True,
    }
    base.update(extra)
    return base


@pytest.fixture
def report():
    eagle = {"acceptance_by_position": [0.85, 0.74, 0.66, 0.6, 0.52], "alpha": 0.82, "draft_cost_ratio": 0.17}
    eagle.update(plain_step_share=0.25, lookup_pass_share=0.05, cache_length_ratio=1.0312)
    records = [
        record("plain", "plain", "all", 1.0, 1.0),
        record("eagle3:demo-eagle3", "drafter", "all", 1.62, 3.9, speedup_bound=5.5, tokens_per_s=82.96, **eagle),
        record("prompt-lookup", "prompt_lookup", "all", 1.21, 2.1, tokens_per_s=None),
        record(
            "eagle3:demo-eagle3",
            "drafter",
            "all",
            1.31,
            3.1,
            mode="sampling",
            temperature=0.7,
            identical=None,
            acceptance_by_position=[0.7, 0.5, 0.4],
            alpha=0.7,
            draft_cost_ratio=0.2,
        ),
        record("plain", "plain", "qa", 1.0, 1.0),
        record("plain", "plain", "translation", 1.0, 1.0),
        record("eagle3:demo-eagle3", "drafter", "qa", 1.45, 3.2),
        record("eagle3:demo-eagle3", "drafter", "translation", 1.8, None, identical=False),
    ]
    return {
        "hardware": {"device": "cpu", "device_name": "Test CPU 9000", "torch": "2.13.0", "threads": 2},
        "config": {"target": "tiny-llama", "max_new_tokens": 64},
        "records": records,
    }


def table_rows(table):
    lines = table.splitlines()
    assert lines[1].startswith("|") and set(lines[1]) <= set("|-: ")
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_markdown_table_all_category(report):
    table = markdown_table(report)
    header = table.splitlines()[0]
    assert header == (
        "| Method | Mode | Batch | tokens/s | Speedup | Verdict | τ | α | c | Bound | Plain/lookup | Cache | Identical |"
    )
    rows = table_rows(table)
    assert len(rows) == 4
    assert rows[0] == ["plain", "greedy", "1", "51.2", "1.00×", "—", "1.00", "—", "—", "—", "—", "—", "yes"]
    # Records without per-repeat speedups (older reports): the pooled speedup, no verdict.
    assert rows[1][:10] == ["eagle3:demo-eagle3", "greedy", "1", "83.0", "1.62×", "—", "3.90", "0.82", "0.17", "5.50×"]
    assert rows[1][10:] == ["25%/5%", "1.03", "yes"]  # shares of plain steps / lookup passes, cache over sequence
    assert rows[2][0] == "prompt-lookup" and rows[2][3] == "—" and rows[2][9] == "—"
    # Sampling: no stored bound, so min(1/c, 1/(1-α)) = min(5, 3.33); identical unknown.
    assert rows[3][1:3] == ["sampling T=0.7", "1"]
    assert rows[3][9] == "3.33×" and rows[3][12] == "—"
    assert "1.62×" in table and "—" in table


def test_markdown_table_other_categories(report):
    rows = table_rows(markdown_table(report, "translation"))
    assert [r[0] for r in rows] == ["plain", "eagle3:demo-eagle3"]
    assert rows[1][4:7] == ["1.80×", "—", "—"] and rows[1][-1] == "no"
    table = markdown_table(report, None)
    assert table.splitlines()[0].startswith("| Method | Category | Mode |")
    assert len(table_rows(table)) == len(report["records"])
    with pytest.raises(ValueError, match="available.*qa"):
        markdown_table(report, "rag")


def test_markdown_table_bad_report():
    with pytest.raises(ValueError, match="records"):
        markdown_table({"hardware": {}})
    assert len(markdown_table({"records": []}).splitlines()) == 2


def test_category_table(report):
    table = category_table(report)
    assert table.splitlines()[0] == "| Method | qa | translation | Overall |"
    rows = table_rows(table)
    assert rows == [
        ["plain", "1.00× (1.00)", "1.00× (1.00)", "1.00× (1.00)"],
        ["eagle3:demo-eagle3", "1.45× (3.20)", "1.80×", "1.62× (3.90)"],
        ["prompt-lookup", "—", "—", "1.21× (2.10)"],
    ]
    sampling = table_rows(category_table(report, mode="sampling"))
    assert sampling == [["eagle3:demo-eagle3", "1.31× (3.10)"]]
    with pytest.raises(ValueError, match="available"):
        category_table(report, batch_size=8)


def test_category_verdicts_name_each_category_row_slower_than_plain_by_its_interval(report, tmp_path):
    assert category_verdicts(report) is None  # no category row has a verdict (an older report)
    rows = {(r["method"], r["category"]): r for r in report["records"]}
    rows["eagle3:demo-eagle3", "qa"].update(speedup_median=0.86, speedup_ci95=[0.80, 0.93], verdict="slower than plain")
    rows["eagle3:demo-eagle3", "translation"].update(speedup_median=1.8, speedup_ci95=[1.7, 1.9], verdict="faster")
    rows["eagle3:demo-eagle3", "all"].update(speedup_ci95=[0.5, 0.6], verdict="slower than plain")  # not listed
    line = category_verdicts(report)
    assert line == (
        "Category rows by their own interval: 1 faster, 0 within noise; slower than plain: eagle3:demo-eagle3 in qa "
        "0.86× [0.80–0.93]."
    )
    rows["eagle3:demo-eagle3", "qa"].update(speedup_ci95=[0.80, 1.02], verdict="within noise")
    assert category_verdicts(report).endswith("1 within noise; slower than plain: none.")
    assert category_verdicts(report, mode="sampling") is None
    paths = write_report(report, str(tmp_path), stem="bench")
    with open(paths["markdown"], encoding="utf-8") as f:
        assert category_table(report) + "\n\n" + category_verdicts(report) in f.read()


def test_console_table(report):
    text = format_console_table(report)
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert lines[0].split()[:3] == ["Method", "Mode", "Batch"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert "1.62×" in lines[3] and "5.50×" in lines[3]
    # Fixed width: each column starts at the same offset on every line.
    offset = lines[0].index("tokens/s")
    assert all(line[offset - 2 : offset] == "  " for line in lines)


def test_write_report_writes_json_markdown_and_png(report, tmp_path):
    original = copy.deepcopy(report)
    out = tmp_path / "runs" / "bench1"
    paths = write_report(report, str(out), stem="cpu")
    assert paths == {
        "json": os.path.join(str(out), "cpu.json"),
        "markdown": os.path.join(str(out), "cpu.md"),
        "png": os.path.join(str(out), "cpu.png"),
    }
    assert sorted(os.listdir(out)) == ["cpu.json", "cpu.md", "cpu.png"]
    with open(paths["json"], encoding="utf-8") as f:
        assert json.load(f) == original
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(paths["markdown"], encoding="utf-8") as f:
        md = f.read()
    assert md.startswith("# ") and "tiny-llama" in md.splitlines()[0]
    assert "Test CPU 9000" in md
    assert markdown_table(report) in md
    assert category_table(report, "greedy", 1) in md
    assert "By category (sampling" not in md  # sampling was only measured over all prompts


def test_write_report_single_category_has_no_category_table(report, tmp_path):
    report["records"] = [r for r in report["records"] if r["category"] == "all"]
    paths = write_report(report, str(tmp_path), stem="bench")
    with open(paths["markdown"], encoding="utf-8") as f:
        md = f.read()
    assert "Overall" not in md and "1.62×" in md


def test_write_report_rejects_stem_with_folder(report, tmp_path):
    with pytest.raises(ValueError, match="stem"):
        write_report(report, str(tmp_path), stem="a/b")


def test_save_plots_without_drafters(tmp_path):
    report = {"hardware": {}, "config": {}, "records": [record("plain", "plain", "all", 1.0, 1.0)]}
    path = save_plots(report, str(tmp_path / "sub" / "p.png"))
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_save_plots_without_matplotlib_warns(report, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning, match="pip install matplotlib"):
        assert save_plots(report, str(tmp_path / "p.png")) is None
    assert not (tmp_path / "p.png").exists()
    with pytest.warns(UserWarning, match="matplotlib"):
        paths = write_report(report, str(tmp_path / "out"))
    assert paths["png"] is None and os.path.exists(paths["json"]) and os.path.exists(paths["markdown"])
