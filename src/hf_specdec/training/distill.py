"""Self-distillation data at scale: prompts from several sources, the target's own answers, resumable shards.

A drafter is only as good as its data, and the data a drafter should learn from is the target's own answers to the
kind of prompts it will serve. :func:`build_distill_dataset` makes such a data set once and keeps it:

* **prompts** from three sources, deduplicated (normalised text) and kept disjoint from every benchmark
  (:func:`hf_specdec.chat_prompts.check_disjoint`):

  - *synthesised* by the target itself (Magpie: the target is given only its chat template's user prefix and
    samples the user turn, so the prompts follow its own chat distribution and need no outside data;
    :func:`synthesize_prompts`);
  - the templated prompts of :func:`hf_specdec.chat_prompts.chat_training_prompts`;
  - the user's own prompt or chat data (:func:`hf_specdec.training.sources.load_prompt_source`);

* **answers** written by the target, greedily, in length-bucketed batches (:func:`regenerate`), optionally in
  bf16 (faster on CPUs with bf16 units and on every GPU);
* **shards**: shard ``s`` holds ``shard_size`` prompts and their answers, written as ``shard-{s:05d}.jsonl.gz`` only
  once complete (atomically); a killed run resumes inside the unfinished shard (its work file lives in
  ``work_dir``) and skips finished shards. ``index.json`` counts records and answer tokens per shard and holds the
  generation settings.

Each output line is a chat record (``{"messages": [system?, user, assistant]}`` plus ``source``, ``category``,
``answer_tokens``, ``finished``), which :func:`hf_specdec.training.data.load_records` reads, with the loss on the
assistant turn only.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..chat_prompts import benchmark_texts, chat_training_prompts, overlap_checker
from .regenerate import _end_ids, _generate_batch, regenerate

__all__ = [
    "user_turn_prefix",
    "synthesize_prompts",
    "normalize_prompt",
    "build_distill_dataset",
    "read_distill_dataset",
    "shard_path",
    "dataset_card",
]

_SENTINEL = "@@hf_specdec:user-turn@@"
INDEX = "index.json"


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a user turn's content: the default system prompt (when the template adds
    one) and the user header, e.g. ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"``.

    Raises:
        ValueError: when the tokenizer has no chat template, or the template does not render a user message's
            content verbatim.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Synthesising prompts needs a tokenizer with a chat_template (Magpie reads its user prefix).")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    cut = text.find(_SENTINEL)
    if cut <= 0:
        raise ValueError("The chat template does not render the user message verbatim; cannot find its user prefix.")
    return text[:cut]


def normalize_prompt(text: str) -> str:
    """The form prompts are deduplicated by: lower-case words joined by single spaces."""
    return " ".join(re.findall(r"\w+", text.lower()))


def _usable(text: str, min_words: int, max_words: int) -> bool:
    words = text.split()
    if not min_words <= len(words) <= max_words:
        return False
    # a degenerate sample repeats itself: fewer than half of its word 3-grams are distinct
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return not grams or len(set(grams)) >= len(grams) / 2


def synthesize_prompts(
    target: nn.Module,
    tokenizer,
    num_prompts: int,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    min_words: int = 4,
    max_words: int = 160,
    max_batches: int | None = None,
    exclude: Callable[[str], bool] | None = None,
) -> list[dict]:
    """Up to ``num_prompts`` user prompts the target writes itself (Magpie).

    The target gets only :func:`user_turn_prefix` and samples (``temperature``, ``top_p``) until its end-of-turn
    token. A sample is kept when it ended within ``max_new_tokens``, has ``min_words..max_words`` words, does not
    repeat itself, is new (by :func:`normalize_prompt`) and is not refused by ``exclude`` (e.g. seen before, or
    overlapping a benchmark). Batch ``b`` is seeded with ``seed + b``, so the same
    arguments give the same prompts. Stops after ``max_batches`` batches (default: ``4 * num_prompts / batch_size
    + 4``) even when fewer prompts were kept.

    Returns:
        ``{"prompt": str, "category": "synthesised", "source": "magpie"}`` records, in sampling order.
    """
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    end_ids = _end_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    gen_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature, "top_p": top_p}
    limit = max_batches if max_batches is not None else 4 * num_prompts // batch_size + 4
    seen: set[str] = set()
    out: list[dict] = []
    for b in range(limit):
        if len(out) >= num_prompts:
            break
        torch.manual_seed(seed + b)
        for ids, finished in _generate_batch(target, [prefix] * batch_size, pad_id, end_ids, gen_kwargs):
            text = tokenizer.decode(ids, skip_special_tokens=True).strip()
            key = normalize_prompt(text)
            usable = finished and key not in seen and _usable(text, min_words, max_words)
            if usable and not (exclude is not None and exclude(text)):
                seen.add(key)
                out.append({"prompt": text, "category": "synthesised", "source": "magpie"})
    return out[:num_prompts]


def shard_path(out_dir: str | os.PathLike, shard: int) -> str:
    return os.path.join(os.fspath(out_dir), f"shard-{shard:05d}.jsonl.gz")


def read_distill_dataset(out_dir: str | os.PathLike, shards: Sequence[int] | None = None) -> list[dict]:
    """The records of the finished shards of a data set made by :func:`build_distill_dataset` (all, or ``shards``),
    in shard order."""
    index = _read_index(out_dir)
    chosen = sorted(int(s) for s in index["shards"]) if shards is None else list(shards)
    records = []
    for s in chosen:
        with gzip.open(shard_path(out_dir, s), "rt", encoding="utf-8") as fh:
            records.extend(json.loads(line) for line in fh if line.strip())
    return records


def _read_index(out_dir) -> dict:
    path = os.path.join(os.fspath(out_dir), INDEX)
    if not os.path.isfile(path):
        return {"shards": {}}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)


def _seen_prompts(out_dir, shards) -> set[str]:
    seen = set()
    for s in shards:
        with gzip.open(shard_path(out_dir, s), "rt", encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    seen.add(normalize_prompt(_user_text(json.loads(line))))
    return seen


def _user_text(record: dict) -> str:
    if "messages" in record:
        return " ".join(m["content"] for m in record["messages"] if m.get("role") == "user")
    return record.get("prompt", "")


def _fresh(candidates: list[dict], seen: set[str], overlaps: Callable[[str], bool]) -> list[dict]:
    """Candidates that are new (not in ``seen``, not repeated) and share no 12-word span with a benchmark."""
    out, keys = [], set()
    for r in candidates:
        key = normalize_prompt(_user_text(r))
        if key and key not in seen and key not in keys and not overlaps(_user_text(r)):
            keys.add(key)
            out.append(r)
    return out


def _shard_prompts(
    target,
    tokenizer,
    shard: int,
    shard_size: int,
    templated_share: float,
    extra: Sequence[dict],
    seen,
    overlaps,
    seed: int,
    synth_kwargs: dict,
) -> list[dict]:
    """Prompts of shard ``shard``: its slice of the user's records, then of the templated prompts, topped up with
    synthesised ones; all fresh and disjoint from the benchmarks."""
    chosen = _fresh(list(extra[shard * shard_size : (shard + 1) * shard_size]), seen, overlaps)
    n_templated = round(templated_share * (shard_size - len(chosen)))
    if n_templated:
        pool = chat_training_prompts(100_000, seed=seed)
        chosen += _fresh(pool[shard * n_templated : (shard + 1) * n_templated], seen | _keys(chosen), overlaps)
    need = shard_size - len(chosen)
    if need > 0:
        taken = seen | _keys(chosen)
        chosen += synthesize_prompts(
            target, tokenizer, need, seed=_shard_seed(seed, shard), **synth_kwargs,
            exclude=lambda text: normalize_prompt(text) in taken or overlaps(text),
        )  # fmt: skip
    return chosen[:shard_size]


def _keys(records) -> set[str]:
    return {normalize_prompt(_user_text(r)) for r in records}


def _shard_seed(seed: int, shard: int) -> int:
    return int(hashlib.sha256(f"{seed}:{shard}".encode()).hexdigest()[:8], 16)


def _as_chat(record: dict, tokenizer) -> dict:
    """A regenerated record as ``{"messages": [...], ...}`` (prompt records become a user and an assistant turn)."""
    out = {k: v for k, v in record.items() if k not in ("prompt", "response", "regenerated")}
    if "messages" not in record:
        out["messages"] = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    return out


def build_distill_dataset(
    target: nn.Module,
    tokenizer,
    out_dir: str | os.PathLike,
    num_shards: int,
    shard_size: int = 512,
    work_dir: str | os.PathLike | None = None,
    extra_records: Sequence[dict] = (),
    templated_share: float = 0.25,
    max_new_tokens: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    synth_batch_size: int = 64,
    synth_max_new_tokens: int = 128,
    synth_temperature: float = 1.0,
    settings: dict | None = None,
    log: Callable[[str], Any] = print,
) -> dict:
    """Builds (or continues) a self-distillation data set of ``num_shards`` shards in ``out_dir``.

    Args:
        target, tokenizer: the target that writes synthesised prompts and all answers (dtype as loaded).
        out_dir: where the finished shards and ``index.json`` go (the part to keep and commit).
        num_shards, shard_size: how many shards of how many prompts; rerun with a larger ``num_shards`` to extend.
        work_dir: where an unfinished shard's prompts and answers are kept while it is made (default
            ``out_dir/.work``).
        extra_records: the user's prompt or chat records (see :mod:`hf_specdec.training.sources`), used first,
            ``shard_size`` per shard.
        templated_share: the share of each shard's remaining prompts taken from ``chat_training_prompts``; the rest
            is synthesised.
        max_new_tokens, batch_size: answer length limit and generation batch (length-bucketed, greedy).
        seed: base seed of the templated order and the synthesis.
        synth_*: the synthesis settings (:func:`synthesize_prompts`).
        settings: extra fields stored in ``index.json`` (e.g. the command that made the data).

    Returns:
        The index: per shard ``{"records", "answer_tokens", "finished", "sources"}``, totals and settings.
    """
    out_dir = os.fspath(out_dir)
    work_dir = os.fspath(work_dir) if work_dir is not None else os.path.join(out_dir, ".work")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)
    index = _read_index(out_dir)
    index["settings"] = {
        "shard_size": shard_size,
        "templated_share": templated_share,
        "max_new_tokens": max_new_tokens,
        "answers": "greedy",
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "seed": seed,
        "synthesis": {
            "method": "magpie (the target samples the user turn after its chat template's user prefix)",
            "temperature": synth_temperature,
            "top_p": 1.0,
            "max_new_tokens": synth_max_new_tokens,
        },
        **(settings or {}),
    }
    overlaps = overlap_checker(benchmark_texts())
    synth_kwargs = {
        "batch_size": synth_batch_size,
        "max_new_tokens": synth_max_new_tokens,
        "temperature": synth_temperature,
    }
    for shard in range(num_shards):
        if str(shard) in index["shards"] and os.path.isfile(shard_path(out_dir, shard)):
            continue
        index["shards"][str(shard)] = _make_shard(
            target,
            tokenizer,
            out_dir,
            work_dir,
            shard,
            shard_size,
            templated_share,
            extra_records,
            overlaps,
            seed,
            synth_kwargs,
            max_new_tokens,
            batch_size,
            log,
        )
        _summarise(index)
        _write_json_atomic(os.path.join(out_dir, INDEX), index)
        _write_card(out_dir, index)
        log(f"shard {shard}: {index['shards'][str(shard)]['records']} records, total {index['answer_tokens']} tokens")
    _summarise(index)
    _write_json_atomic(os.path.join(out_dir, INDEX), index)
    _write_card(out_dir, index)
    return index


def _make_shard(
    target,
    tokenizer,
    out_dir,
    work_dir,
    shard,
    shard_size,
    templated_share,
    extra,
    overlaps,
    seed,
    synth_kwargs,
    max_new_tokens,
    batch_size,
    log,
) -> dict:
    prompts_file = os.path.join(work_dir, f"shard-{shard:05d}.prompts.jsonl")
    answers_file = os.path.join(work_dir, f"shard-{shard:05d}.answers.jsonl")
    if os.path.isfile(prompts_file):
        with open(prompts_file, encoding="utf-8") as fh:
            prompts = [json.loads(line) for line in fh if line.strip()]
    else:
        earlier = [s for s in range(shard) if os.path.isfile(shard_path(out_dir, s))]
        seen = _seen_prompts(out_dir, earlier)
        prompts = _shard_prompts(
            target, tokenizer, shard, shard_size, templated_share, extra, seen, overlaps, seed, synth_kwargs
        )
        with open(prompts_file + ".tmp", "w", encoding="utf-8") as fh:
            for r in prompts:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(prompts_file + ".tmp", prompts_file)
        log(f"shard {shard}: {len(prompts)} prompts")
    regenerate(target, tokenizer, prompts, answers_file, max_new_tokens=max_new_tokens, batch_size=batch_size, log=log)
    with open(answers_file, encoding="utf-8") as fh:
        answers = sorted((json.loads(line) for line in fh if line.strip()), key=lambda r: r["source_index"])
    records = [_as_chat(r, tokenizer) for r in answers]
    tmp = shard_path(out_dir, shard) + ".tmp"
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, shard_path(out_dir, shard))
    os.remove(prompts_file)
    os.remove(answers_file)
    sources: dict[str, int] = {}
    for r in records:
        sources[r.get("source", "user")] = sources.get(r.get("source", "user"), 0) + 1
    return {
        "records": len(records),
        "answer_tokens": sum(r["answer_tokens"] for r in records),
        "finished": sum(bool(r["finished"]) for r in records),
        "sources": sources,
    }


def _summarise(index: dict) -> None:
    shards = index["shards"].values()
    index["records"] = sum(s["records"] for s in shards)
    index["answer_tokens"] = sum(s["answer_tokens"] for s in shards)
    sources: dict[str, int] = {}
    for s in shards:
        for k, v in s["sources"].items():
            sources[k] = sources.get(k, 0) + v
    index["sources"] = sources


_SOURCE_NAMES = {
    "magpie": "synthesised by the target (Magpie: it samples the user turn after its chat template's user prefix)",
    "hf_specdec.chat_prompts": "hf_specdec's templated prompts (`hf_specdec.chat_prompts.chat_training_prompts`)",
    "hf_specdec.chat_prompts.long_context": "hf_specdec's long-context prompts (`hf_specdec.chat_prompts."
    "long_context_prompts`: documents to summarise, passages with a question, German sentences to translate)",
    "hf_specdec.chat_prompts.answer_documents": "hf_specdec's answer-document prompts (`hf_specdec.chat_prompts."
    "answer_document_prompts`: the target's own texts, earlier answers or documents it sampled, as documents to "
    "summarise and passages with a question)",
    "user": "the user's own records (`extra_records`)",
}
_LONG_CONTEXT_LICENSE = (
    " The long-context prompts also quote the Python language reference (`pydoc_data`, PSF) and German sentences of "
    "the message catalogs installed under /usr/share/locale/de (translations of GNU/Linux programs' messages, "
    "under those programs' licenses, mostly GPL/LGPL)."
)


def _synthesis_row(index: dict) -> str:
    """The card's synthesis settings, or that no prompt was synthesised (sets made only from given prompts)."""
    if not index.get("sources", {}).get("magpie"):
        return "| synthesis | none: every prompt comes from the sources below |"
    return f"| synthesis | {json.dumps(index.get('settings', {}).get('synthesis', {}))} |"


def dataset_card(index: dict, out_dir: str | os.PathLike | None = None) -> str:
    """The data set's card (``README.md``): sources, counts, token totals, generation settings, license, size on
    disk and the command that rebuilds it, all read from ``index``."""
    st = index.get("settings", {})
    shards = index.get("shards", {})
    size = sum(os.path.getsize(shard_path(out_dir, int(s))) for s in shards) if out_dir is not None else None
    finished = sum(s["finished"] for s in shards.values())
    lines = [
        "# Self-distillation data for SmolLM2-135M-Instruct drafters"
        if "SmolLM2" in st.get("target", "")
        else "# Self-distillation data",
        "",
        "Prompts and the target's own greedy answers, the data hf_specdec's drafters for this target are trained on "
        "(a drafter learns the target's distribution best from text the target wrote). Made by "
        "`hf_specdec.training.distill.build_distill_dataset`; rows are chat records "
        '(`{"messages": [user, assistant], "source", "category", "answer_tokens", "finished"}`) that '
        "`hf-specdec train --data` and `hf_specdec.training.distill.read_distill_dataset` read; the loss falls on "
        "the assistant turn only.",
        "",
        "| | |",
        "|---|---|",
        f"| target | {st.get('target', '?')} |",
        f"| records | {index.get('records', 0)} in {len(shards)} shards of {st.get('shard_size', '?')} prompts |",
        f"| answer tokens | {index.get('answer_tokens', 0)} (end-of-turn tokens included) |",
        f"| answers ended by the target | {finished} (the rest were cut at {st.get('max_new_tokens', '?')} tokens) |",
    ]
    if size is not None:
        lines.append(f"| size on disk | {size / 2**20:.1f} MiB (gzip-compressed JSONL) |")
    lines += [
        f"| answers | {st.get('answers', 'greedy')}, {st.get('dtype', '?')}, at most {st.get('max_new_tokens', '?')} "
        "new tokens, length-bucketed batches |",
        _synthesis_row(index),
        *([f"| documents | {json.dumps(st['documents'])} |"] if "documents" in st else []),
        "",
        "## Sources",
        "",
        "| source | records |",
        "|---|---|",
    ]
    for name, count in sorted(index.get("sources", {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_SOURCE_NAMES.get(name, name)} | {count} |")
    lines += [
        "",
        "Every prompt is deduplicated (lower-cased words) against all earlier prompts and shares no 12-word span with "
        "a benchmark prompt (Spec-Bench, HumanEval, the demo prompts: `hf_specdec.chat_prompts.check_disjoint`).",
        "",
        "## License",
        "",
        "The answers and the synthesised prompts were written by the target model (SmolLM2-135M-Instruct is "
        "Apache-2.0); the templated prompts are hf_specdec's (Apache-2.0) and quote paragraphs of the Python "
        "standard library's docstrings and of installed packages' README files, under their own licenses (PSF, MIT, "
        "BSD, Apache-2.0). Machine-written text: it can be wrong, and it is meant for training drafters of this "
        "target, not as a source of facts."
        + (_LONG_CONTEXT_LICENSE if "hf_specdec.chat_prompts.long_context" in index.get("sources", {}) else ""),
        "",
        "## Rebuild",
        "",
        "```bash",
        st.get("command", "python scripts/build_smollm2_distill.py"),
        "```",
        "",
        "The command is resumable: rerun it after an interruption and it continues inside the unfinished shard; a "
        "larger `--num-shards` extends the data set. Per-shard counts are in `index.json`." + _shards_held(index),
        "",
    ]
    return "\n".join(lines)


def _shards_held(index: dict) -> str:
    """The card's note of which shards this copy holds (it may be part of the way to the command's ``--num-shards``)."""
    shards = sorted(int(s) for s in index.get("shards", {}))
    if not shards:
        return ""
    return f" This copy holds shards {shards[0]}–{shards[-1]}: `--num-shards {len(shards)}` rebuilds exactly these."


def _write_card(out_dir: str, index: dict) -> None:
    tmp = os.path.join(out_dir, "README.md.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(dataset_card(index, out_dir))
    os.replace(tmp, os.path.join(out_dir, "README.md"))
