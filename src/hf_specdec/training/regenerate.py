"""Self-distillation data: regenerate the responses of a data set with the target model itself.

A drafter learns the *target's* distribution best from text the target wrote. :func:`regenerate` keeps each
record's prompt (the conversation up to its last assistant turn, or the ``prompt`` field), lets the target answer it,
and appends the result as JSONL, resumably.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .data import load_records, record_kind

__all__ = ["regenerate", "build_prompt"]


def _last_assistant(messages: list[dict]) -> int | None:
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].get("role") == "assistant":
            return k
    return None


def build_prompt(tokenizer, record: dict) -> tuple[str, bool]:
    """The prompt text the target answers for ``record``.

    Args:
        tokenizer: the target's tokenizer.
        record: a ``{"messages": [...]}`` or ``{"prompt": str, ...}`` record.

    Returns:
        ``(text, templated)``: the prompt and whether it was rendered with the chat template (then it already holds
        its special tokens and is tokenized without adding more).

    Raises:
        ValueError: for text/token records (no prompt to answer) or chat records without a chat template.
    """
    kind = record_kind(record)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if kind == "messages":
        messages = record["messages"]
        k = _last_assistant(messages)
        context = list(messages if k is None else messages[:k])
        if not context:
            raise ValueError("A chat record whose first message is the assistant's has no prompt to regenerate from.")
        if not has_template:
            raise ValueError("Regenerating chat records needs a tokenizer with a chat_template.")
        return tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=False), True
    if kind == "prompt":
        prompt = record["prompt"]
        if has_template:
            messages = [{"role": "user", "content": prompt}]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True
        return prompt, False
    raise ValueError(
        f"Cannot regenerate a {kind!r} record: it has no prompt/response split (nothing to regenerate). "
        "Use chat ('messages') or 'prompt' records."
    )


def _output_record(record: dict, kind: str, generated: str, index: int) -> dict:
    out = {k: copy.deepcopy(v) for k, v in record.items()}
    if kind == "messages":
        messages = out["messages"]
        k = _last_assistant(messages)
        reply = {"role": "assistant", "content": generated}
        if k is None:
            messages.append(reply)
        else:
            messages[k] = reply
    else:
        out["response"] = generated
    out["regenerated"] = True
    out["source_index"] = index
    return out


def _read_done(path: str, log: Callable[[str], Any]) -> set[int]:
    """Source indices already in ``path``; a truncated last line is dropped (the file is cut back to it)."""
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        log(f"{path}: dropping a truncated last line ({len(data) - end} bytes).")
        with open(path, "r+b") as f:
            f.truncate(end)
        data = data[:end]
    done: set[int] = set()
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            done.add(int(json.loads(line)["source_index"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno} is not a regenerated record ({e}); cannot resume. Use resume=False or another path."
            ) from e
    return done


def _context_length(target: nn.Module) -> int | None:
    return getattr(getattr(target, "config", None), "max_position_embeddings", None)


def _too_long(encoded: list[list[int]], max_new_tokens: int, target: nn.Module, truncate_left: bool) -> set[int]:
    """Indices of prompts with no room for ``max_new_tokens`` in the target's context (none when truncating)."""
    limit = _context_length(target)
    if limit is None or truncate_left:
        return set()
    return {i for i, ids in enumerate(encoded) if len(ids) + max_new_tokens > limit}


def _clip(ids: list[int], max_new_tokens: int, target: nn.Module) -> list[int]:
    limit = _context_length(target)
    if limit is None or len(ids) + max_new_tokens <= limit:
        return ids
    keep = limit - max_new_tokens
    if keep < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} does not fit the target's context of {limit} positions.")
    return ids[-keep:]


def _batches(indices: list[int], lengths: list[int], batch_size: int, bucket_by_length: bool) -> list[list[int]]:
    order = sorted(indices, key=lambda i: lengths[i]) if bucket_by_length else list(indices)
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def _end_ids(tokenizer) -> list[int]:
    """EOS plus the chat template's end-of-turn token when the vocabulary has one (e.g. ``<|im_end|>``)."""
    ends = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None and tid not in ends:
            ends.append(tid)
    return ends


def _generate_batch(
    target: nn.Module, rows: list[list[int]], pad_id: int, end_ids: list[int], gen_kwargs: dict
) -> list[tuple[list[int], bool]]:
    """Left-padded ``generate`` over ``rows``; per row, the new tokens up to and including the first end token and
    whether an end token came before ``max_new_tokens``."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for row, ids in enumerate(rows):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
    device = next(target.parameters()).device
    with torch.no_grad():
        generated = target.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            pad_token_id=pad_id,
            eos_token_id=end_ids or None,
            **gen_kwargs,
        )
    answers = []
    for row in generated[:, width:].cpu().tolist():
        ends = [k for k, t in enumerate(row) if t in end_ids]
        answers.append((row[: ends[0] + 1], True) if ends else (row, False))
    return answers


def _prepare_output(output_path: str, resume: bool, total: int, log) -> set[int]:
    """Creates ``output_path``'s folder; the source indices already in it when resuming (else it is emptied)."""
    parent = os.path.dirname(output_path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    if not resume:
        open(output_path, "w").close()
        return set()
    done = _read_done(output_path, log) if os.path.exists(output_path) else set()
    if done:
        log(f"Resuming {output_path}: {len(done)} of {total} records already regenerated.")
    return done


def _pad_id(tokenizer) -> int:
    """The tokenizer's pad id, its pad token set to EOS if missing."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer has neither a pad token nor an EOS token to pad with.")
    return tokenizer.pad_token_id


def _check_settings(temperature: float, top_p: float, batch_size: int, max_new_tokens: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be positive.")


def _log_skipped(log, too_long, num_records: int, max_new_tokens: int, target) -> None:
    if too_long:
        log(
            f"Skipping {len(too_long)} of {num_records} records whose prompt leaves no room for {max_new_tokens} new "
            f"tokens in the target's context ({_context_length(target)} positions), e.g. record {min(too_long)}; "
            "pass truncate_left=True (--truncate-left) to keep their last tokens instead."
        )


def _output_line(tokenizer, record: dict, kind: str, index: int, ids, finished: bool) -> str:
    line = _output_record(record, kind, tokenizer.decode(ids, skip_special_tokens=True), index)
    line["answer_tokens"], line["finished"] = len(ids), finished
    return json.dumps(line, ensure_ascii=False) + "\n"


def regenerate(
    target: nn.Module,
    tokenizer,
    records: Sequence[dict] | str | os.PathLike,
    output_path: str | os.PathLike,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    resume: bool = True,
    seed: int = 0,
    progress: bool = True,
    log: Callable[[str], Any] | None = print,
    bucket_by_length: bool = True,
    truncate_left: bool = False,
) -> int:
    """Regenerates the responses of ``records`` with ``target`` and appends them to ``output_path`` (JSONL).

    Prompts (see :func:`build_prompt`): chat records use their messages up to (excluding) the last assistant message
    (all messages if there is none), rendered with the chat template and a generation prompt; prompt records use
    ``[user: prompt]`` with the chat template when the tokenizer has one, else the raw prompt text. Text and token
    records raise ``ValueError`` (checked for all records before anything is generated).

    Records are generated in left-padded batches of ``batch_size``: with ``bucket_by_length`` the records sorted by
    prompt length (stable), so a batch holds prompts of similar length and pads little, else in file order. Decoding
    is greedy when ``temperature == 0`` and otherwise samples with ``temperature``/``top_p``; torch is seeded with
    ``seed + b`` before batch ``b``, so a resumed run reproduces an uninterrupted one. New tokens are decoded with
    ``skip_special_tokens=True``. A row stops at EOS or at the chat template's end-of-turn token. A prompt that
    leaves no room for ``max_new_tokens`` in the target's context (``max_position_embeddings``) is skipped and
    counted in the log, or, with ``truncate_left``, cut to its last tokens.

    Output lines: chat records keep all their keys and messages, with the last assistant message replaced by
    ``{"role": "assistant", "content": generated}`` (appended when there was none); prompt records get
    ``"response": generated``. Every line carries ``"regenerated": true``, ``"source_index": i``,
    ``"answer_tokens"`` (new tokens, end token included) and ``"finished"`` (whether the answer ended before
    ``max_new_tokens``). The progress bar shows records and new tokens per second.

    Args:
        target: the target causal LM (used as is; put it in eval mode).
        tokenizer: its tokenizer. Its pad token is set to EOS if missing.
        records: records (``{"messages": ...}`` or ``{"prompt": ...}``), or a path read with
            :func:`hf_specdec.training.data.load_records`.
        output_path: JSONL file to append to (created if needed).
        max_new_tokens: generation length limit per record.
        temperature: 0 for greedy decoding, > 0 for sampling.
        top_p: nucleus sampling threshold (sampling only).
        batch_size: records per ``generate`` call.
        resume: skip records whose ``source_index`` is already in ``output_path`` (a truncated last line is
            dropped). With ``False``, ``output_path`` is overwritten.
        seed: base seed (batch ``b`` uses ``seed + b``).
        progress: show a tqdm progress bar.
        log: callable receiving status messages; ``None`` silences.
        bucket_by_length: batch records of similar prompt length together (see above).
        truncate_left: keep the last tokens of a prompt too long for the context instead of skipping it.

    Returns:
        The number of records written by this call.

    Raises:
        ValueError: on text/token records, chat records without a chat template, invalid sampling parameters, or an
            unreadable existing output when resuming.
    """
    log = log or (lambda _msg: None)
    _check_settings(temperature, top_p, batch_size, max_new_tokens)
    if isinstance(records, (str, os.PathLike)):
        records = load_records(records)
    records = list(records)
    kinds = [record_kind(r) for r in records]
    prompts = [build_prompt(tokenizer, r) for r in records]  # validates every record before generating

    output_path = os.fspath(output_path)
    done = _prepare_output(output_path, resume, len(records), log)
    pad_id = _pad_id(tokenizer)
    gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        gen_kwargs.update(temperature=float(temperature), top_p=float(top_p))

    encoded = [tokenizer(text, add_special_tokens=not templated)["input_ids"] for text, templated in prompts]
    too_long = _too_long(encoded, max_new_tokens, target, truncate_left)
    _log_skipped(log, too_long, len(records), max_new_tokens, target)
    todo = [i for i in range(len(records)) if i not in too_long]
    batches = _batches(todo, [len(ids) for ids in encoded], batch_size, bucket_by_length)

    def answer(b: int, batch: list[int]):
        # The whole batch is generated even when part of it is done, so outputs match an uninterrupted run.
        torch.manual_seed(seed + b)
        rows = [_clip(encoded[i], max_new_tokens, target) for i in batch]
        return _generate_batch(target, rows, pad_id, _end_ids(tokenizer), gen_kwargs)

    def line(i: int, ids, finished: bool) -> str:
        return _output_line(tokenizer, records[i], kinds[i], i, ids, finished)

    written = _write_batches(output_path, batches, done, len(todo), progress, answer, line)
    log(f"Regenerated {written} records into {output_path}.")
    return written


def _write_batches(output_path: str, batches, done: set, total: int, progress: bool, answer, line) -> int:
    """Generates the batches not yet done, appending each answer's line and syncing after every batch (what a
    resumed run relies on); returns the lines written. The progress bar shows records and new tokens per second."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=len(done & {i for batch in batches for i in batch}), unit="rec",
                   desc="regenerate")  # fmt: skip
    written = new_tokens = 0
    started = time.perf_counter()
    try:
        with open(output_path, "a", encoding="utf-8") as out:
            for b, batch in enumerate(batches):
                if all(i in done for i in batch):
                    continue
                answers = answer(b, batch)
                fresh = [(row, i) for row, i in enumerate(batch) if i not in done]
                for row, i in fresh:
                    ids, finished = answers[row]
                    out.write(line(i, ids, finished))
                    done.add(i)
                    written += 1
                    new_tokens += len(ids)
                out.flush()
                os.fsync(out.fileno())
                if bar is not None:
                    bar.update(len(fresh))
                    rate = new_tokens / max(time.perf_counter() - started, 1e-9)
                    bar.set_postfix_str(f"{new_tokens} tok, {rate:.0f} tok/s")
    finally:
        if bar is not None:
            bar.close()
    return written
