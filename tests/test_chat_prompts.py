"""The long-context prompt source: its styles, shares, determinism and where its German comes from."""

import struct
from collections import Counter

import pytest

from hf_specdec import chat_prompts
from hf_specdec.chat_prompts import german_sentences, long_context_prompts


def write_mo(path, pairs: dict[str, str]) -> None:
    """A GNU message catalog (the .mo format msgfmt writes) holding ``pairs``."""
    keys = sorted(pairs)
    ids = b"".join(k.encode() + b"\0" for k in keys)
    strs = b"".join(pairs[k].encode() + b"\0" for k in keys)
    n = len(keys)
    header = 7 * 4
    key_start = header + 16 * n
    value_start = key_start + len(ids)
    key_table, value_table = [], []
    offset = 0
    for k in keys:
        key_table += [len(k.encode()), key_start + offset]
        offset += len(k.encode()) + 1
    offset = 0
    for k in keys:
        value_table += [len(pairs[k].encode()), value_start + offset]
        offset += len(pairs[k].encode()) + 1
    data = struct.pack("<7I", 0x950412DE, 0, n, header, header + 8 * n, 0, 0)
    data += struct.pack(f"<{2 * n}I", *key_table) + struct.pack(f"<{2 * n}I", *value_table) + ids + strs
    path.write_bytes(data)


GERMAN = {
    "": "Content-Type: text/plain; charset=UTF-8\n",  # the header real catalogs carry
    "The file could not be opened.": "Die Datei konnte nicht geöffnet werden, weil sie fehlt.",
    "Try again later.": "Versuchen Sie es bitte später noch einmal.",
    "%s: not found": "%s: nicht gefunden und auch nicht angelegt",  # a placeholder: not a sentence
    "  -v, --verbose  say more": "  -v, --verbose  gibt mehr Meldungen aus",  # an option table line
    "Ok": "In Ordnung",  # too short and no end mark
}


def test_german_sentences_come_from_the_catalogs_without_placeholders_or_option_lines(tmp_path):
    write_mo(tmp_path / "demo.mo", GERMAN)
    (tmp_path / "broken.mo").write_bytes(b"not a catalog")
    assert german_sentences(str(tmp_path)) == [
        "Die Datei konnte nicht geöffnet werden, weil sie fehlt.",
        "Versuchen Sie es bitte später noch einmal.",
    ]
    assert german_sentences(str(tmp_path / "missing")) == []


@pytest.fixture
def german(monkeypatch):
    sentences = [f"Die Stadt Nummer {i} plant ein großes Fest für alle Bürger." for i in range(50)]
    monkeypatch.setattr(chat_prompts, "german_sentences", lambda: sentences)
    return sentences


def test_long_context_prompts_have_spec_bench_styles_in_their_shares(german):
    prompts = long_context_prompts(200, seed=3)
    counts = Counter(r["category"] for r in prompts)
    assert len(prompts) == 200 and counts == {"translation": 50, "rag": 70, "summarization": 80}
    for r in prompts:
        text = r["prompt"]
        if r["category"] == "translation":
            assert text.startswith("Translate German to English: ") and text.split(": ", 1)[1] in german
        elif r["category"] == "summarization":
            assert 2000 <= len(text) <= 4600 and ("Summarize" in text or text.endswith("TL;DR:"))
        else:
            passages, question = text.rsplit("\n", 1)
            assert passages.count("\n") >= 2 and len(passages) >= 1000 and question.endswith(("?", "."))
            assert any(f" {kind}" in question for kind in ("package", "module", "feature"))


def test_long_context_prompts_are_deterministic_per_seed(german):
    assert long_context_prompts(40, seed=1) == long_context_prompts(40, seed=1)
    assert long_context_prompts(40, seed=1) != long_context_prompts(40, seed=2)


def test_without_german_catalogs_the_other_styles_fill_the_set(monkeypatch):
    monkeypatch.setattr(chat_prompts, "german_sentences", lambda: [])
    counts = Counter(r["category"] for r in long_context_prompts(100, seed=0))
    assert counts == {"rag": 47, "summarization": 53}
