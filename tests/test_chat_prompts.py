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


def chat_record(question: str, answer: str, finished: bool = True) -> dict:
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "finished": finished,
    }


def answer_records() -> list[dict]:
    prose = [
        chat_record(f"Why is topic {i} important?", f"Topic {i} matters to many people. " * 12 + f"End of answer {i}.")
        for i in range(12)
    ]
    cut = chat_record("What was cut?", "The cut answer has full sentences. " * 12 + "And then a half", finished=False)
    code = chat_record("Write code?", "Here it is:\n```python\nprint('x')\n```\n" + "Explained at length. " * 20)
    listed = chat_record("List things?", "\n".join(f"- item {i} of a long list of things" for i in range(12)))
    refusal = chat_record("Help me?", "I'm sorry, but as a chatbot I cannot do that for you today. " * 8)
    return prose + [cut, code, listed, refusal]


def test_answer_document_prompts_build_summaries_and_passages_from_finished_prose_answers():
    from hf_specdec.chat_prompts import answer_document_prompts

    prompts = answer_document_prompts(answer_records(), 40, seed=0)
    openings = {f"Why is topic {i} important?": f"Topic {i} matters" for i in range(12)}
    openings["What was cut?"] = "The cut answer"
    assert Counter(r["category"] for r in prompts) == {"rag": 20, "summarization": 20}
    assert {r["source"] for r in prompts} == {"hf_specdec.chat_prompts.answer_documents"}
    for r in prompts:
        text = r["prompt"]
        assert "And then a half" not in text and "```" not in text and "item 3 of" not in text
        assert "chatbot" not in text
        if r["category"] == "summarization":
            assert 2000 <= len(text) <= 4600 and ("Summarize" in text or text.endswith("TL;DR:"))
        else:
            *passages, question = text.split("\n")
            assert 3 <= len(passages) <= 5 and all(300 <= len(p) <= 1100 for p in passages)
            opening = openings[question]  # the question's own answer is one of the passages
            assert any(p.startswith(opening) for p in passages)


def test_answer_document_prompts_are_deterministic_and_refuse_too_few_answers():
    from hf_specdec.chat_prompts import answer_document_prompts

    records = answer_records()
    assert answer_document_prompts(records, 10, seed=1) == answer_document_prompts(records, 10, seed=1)
    assert answer_document_prompts(records, 10, seed=1) != answer_document_prompts(records, 10, seed=2)
    with pytest.raises(ValueError, match="at least 5 prose answers"):
        answer_document_prompts(records[:3] + records[12:], 10)  # the cut answer counts, its half sentence cut off


def test_answer_document_prompts_use_cut_answers_up_to_their_last_sentence():
    from hf_specdec.chat_prompts import answer_document_prompts

    texts = " ".join(r["prompt"] for r in answer_document_prompts(answer_records(), 60, seed=0))
    assert "The cut answer has full sentences." in texts and "And then a half" not in texts


def test_document_writing_prompts_pair_each_request_with_its_question_and_cycle_the_topics():
    from hf_specdec.chat_prompts import answer_document_prompts, document_writing_prompts

    prompts = document_writing_prompts(700, seed=0)
    assert len(prompts) == 700 and prompts == document_writing_prompts(700, seed=0)
    assert len({r["prompt"] for r in prompts}) > 500  # every style-topic pair before any repeats
    for r in prompts:
        topic = r["prompt"].rstrip(".").split(" about ")[-1].split(" involving ")[-1]
        assert r["question"].endswith(f"{topic}?") and r["source"] == "hf_specdec.chat_prompts.documents"
    documents = [{**chat_record(r["prompt"], f"About {i}. " + "A sampled sentence. " * 20), "question": r["question"]}
                 for i, r in enumerate(prompts[:8])]  # fmt: skip
    rag = [r["prompt"] for r in answer_document_prompts(documents, 6, seed=0) if r["category"] == "rag"]
    assert rag and all(text.split("\n")[-1] in {r["question"] for r in prompts[:8]} for text in rag)
