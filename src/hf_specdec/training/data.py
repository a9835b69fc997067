"""Training data for speculative-decoding drafters: loading, tokenisation with loss masks, packing, batching.

The pipeline is::

    records = load_records("train.jsonl")                       # JSONL -> list of validated dicts
    dataset = DrafterDataset.from_records(records, tokenizer, max_length=2048)
    train, held_out = split_train_eval(dataset, eval_fraction=0.02)
    sampler = ResumableBatchSampler(train.lengths, batch_size=8, group_by_length=True)
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=DataCollator(tokenizer.pad_token_id))

Loss-mask convention: ``loss_mask[t] == 1`` means token ``t`` is a *prediction target*: the drafter is trained to
predict ``input_ids[t]`` from ``input_ids[:t]``. The training loop is responsible for the usual shift (logits at
position ``t - 1`` are scored against ``input_ids[t]``), which is why the first token of a sequence (and, after
packing, of every packed document) never carries loss.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from ..text_files import text_lines

__all__ = [
    "load_records",
    "RecordList",
    "check_token_ids",
    "loss_token_counts",
    "record_kind",
    "tokenize_record",
    "DrafterDataset",
    "pack_examples",
    "split_train_eval",
    "DataCollator",
    "ResumableBatchSampler",
]

RECORD_KINDS = ("messages", "prompt", "text", "tokens")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_PLACEHOLDER = "@@hf_specdec:assistant-content@@"


# --------------------------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------------------------


def record_kind(record: Mapping[str, Any]) -> str:
    """Returns the kind of a training record, judged by its keys.

    Keys are checked in the order ``messages``, ``input_ids``, ``prompt``, ``text``; the first one present decides
    (so ``{"prompt": ..., "text": ...}`` is a prompt record whose ``text`` is an extra key).

    Args:
        record: A decoded JSON object.

    Returns:
        One of ``"messages"`` (chat), ``"tokens"`` (pre-tokenised), ``"prompt"`` (prompt/response) or ``"text"``.

    Raises:
        ValueError: If ``record`` is not a mapping or has none of the keys above.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return "messages"
    if "input_ids" in record:
        return "tokens"
    if "prompt" in record:
        return "prompt"
    if "text" in record:
        return "text"
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise ValueError(
        "unknown record kind: expected one of the keys 'messages', 'prompt' (+ optional 'response'), 'text' or "
        f"'input_ids' (+ optional 'loss_mask'); got keys: {keys}"
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_id_error(token: int, position: int, vocab_size: int) -> str:
    return (
        f"token id {token} (position {position} of 'input_ids') is outside the target's vocabulary of {vocab_size} "
        f"tokens (ids 0..{vocab_size - 1}). The ids were made with another tokenizer: tokenise the data with the "
        "target's own tokenizer, or give text/prompt/messages records and let hf-specdec tokenise them"
    )


def _first_out_of_range(ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
    """``(position, id)`` of the first id outside ``[0, vocab_size)``, or ``None``."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # the common case, at C speed
        return None
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            return j, int(t)
    return None


def _validate_record(record: Mapping[str, Any], vocab_size: int | None = None) -> str:
    """Checks a record's structure (and, given ``vocab_size``, its token ids) and returns its kind; raises
    ``ValueError`` describing the first problem."""
    kind = record_kind(record)
    if kind == "messages":
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
        for j, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{j}] must be an object with 'role' and 'content' keys, got {m!r:.80}")
            if not isinstance(m["role"], str) or m["role"] not in CHAT_ROLES:
                raise ValueError(f"messages[{j}] has role {m['role']!r}; expected one of {sorted(CHAT_ROLES)}")
            if not isinstance(m["content"], str):
                raise ValueError(f"messages[{j}]['content'] must be a string, got {type(m['content']).__name__}")
    elif kind == "prompt":
        if not isinstance(record["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(record['prompt']).__name__}")
        response = record.get("response")
        if response is not None and not isinstance(response, str):
            raise ValueError(f"'response' must be a string or null, got {type(response).__name__}")
    elif kind == "text":
        if not isinstance(record["text"], str):
            raise ValueError(f"'text' must be a string, got {type(record['text']).__name__}")
    else:  # tokens
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("'input_ids' must be a non-empty list of non-negative integers")
        bad = _first_out_of_range(ids, vocab_size) if vocab_size is not None else None
        if bad is not None:
            raise ValueError(_token_id_error(bad[1], bad[0], vocab_size))
        mask = record.get("loss_mask")
        if mask is not None:
            if not isinstance(mask, list) or not all(_is_int(v) and v in (0, 1) for v in mask):
                raise ValueError("'loss_mask' must be a list of 0/1 integers")
            if len(mask) != len(ids):
                raise ValueError(f"'loss_mask' has length {len(mask)} but 'input_ids' has length {len(ids)}")
    return kind


class RecordList(list):
    """The records of a JSONL file (a plain ``list`` of dicts) that remembers where each one came from.

    :meth:`DrafterDataset.from_records` copies the location onto its examples, so that errors found later (e.g. a
    token id the target does not have) name the file and line.

    Attributes:
        path: The file.
        lines: The 1-based line number of each record.
    """

    def __init__(
        self,
        records: Iterable[dict] = (),
        path: str | None = None,
        lines: Sequence[int] = (),
        files: Sequence[str] = (),
    ):
        super().__init__(records)
        self.path = path
        self.lines = list(lines)
        self.files = list(files)  # per record, when the records come from several files (a sharded folder)

    def location(self, index: int) -> str | None:
        """``"file:line"`` of record ``index``, or ``None`` when unknown."""
        if self.path is None or not 0 <= index < len(self.lines):
            return None
        return f"{self.files[index] if self.files else self.path}:{self.lines[index]}"


def load_records(path: str | os.PathLike, vocab_size: int | None = None) -> RecordList:
    """Reads and validates a JSONL file of training records (``.jsonl``, or gzip-compressed ``.jsonl.gz``), or a
    folder of them read in name order (the shards of :func:`hf_specdec.training.distill.build_distill_dataset`).

    Each non-blank line holds one JSON object of one of these kinds (extra keys such as ``"id"`` are kept):

    * chat: ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``
      (``"tool"`` and ``"developer"`` roles are accepted too; only assistant turns are trained on);
    * prompt/response: ``{"prompt": str, "response": str}`` (``response`` optional);
    * raw text: ``{"text": str}``;
    * pre-tokenised: ``{"input_ids": [int, ...], "loss_mask": [0 | 1, ...]}`` (``loss_mask`` optional).

    Args:
        path: The JSONL file, or a folder of ``*.jsonl`` / ``*.jsonl.gz`` files.
        vocab_size: The target's vocabulary size; given it, pre-tokenised records with an id outside
            ``[0, vocab_size)`` are refused here (the trainer checks every example against its target anyway).

    Returns:
        The records, in file order, as a :class:`RecordList` (a list that remembers each record's file and line).

    Raises:
        ValueError: On the first bad line; the message names the file, the 1-based line number and the problem; for
            a folder without JSONL files.
    """
    path = os.fspath(path)
    files = _jsonl_files(path)
    records = RecordList(path=path)
    for file in files:
        for lineno, record in _read_jsonl(file, vocab_size):
            records.append(record)
            records.lines.append(lineno)
            if len(files) > 1 or file != path:
                records.files.append(file)
    return records


def _jsonl_files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".jsonl", ".jsonl.gz")))
    if not files:
        raise ValueError(f"{path}: a folder of training data needs *.jsonl or *.jsonl.gz files; it has none.")
    return files


def _read_jsonl(file: str, vocab_size: int | None) -> Iterator[tuple[int, dict]]:
    for lineno, line in text_lines(file):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        try:
            _validate_record(record, vocab_size)
        except ValueError as e:
            raise ValueError(f"{file}:{lineno}: {e}") from None
        yield lineno, record


# --------------------------------------------------------------------------------------------------------------------
# Tokenisation
# --------------------------------------------------------------------------------------------------------------------


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, messages: list, add_generation_prompt: bool = False) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):  # some versions return a list for batched input
        raise ValueError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Renders a conversation and returns ``(text, spans)``: character spans of what the assistant produced.

    Each span covers one assistant turn's rendering minus the header the template puts before it (what
    ``add_generation_prompt=True`` adds), i.e. its content and end-of-turn marker, without trailing whitespace.
    The spans are found by diffing renders of conversation prefixes: render ``messages[:i]`` with the generation
    prompt and ``messages[:i + 1]``; the latter minus their common prefix is the turn. When the template renders
    earlier turns differently once the conversation goes on (e.g. it drops reasoning from past turns), the turn is
    searched for in the full render instead.
    """
    full = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = _render(tokenizer, messages[: i + 1])
        try:
            header = _render(tokenizer, messages[:i], add_generation_prompt=True)
        except Exception:  # e.g. an empty conversation (i == 0), which transformers refuses to render
            # Render the turn with a placeholder content: what precedes the placeholder is the header.
            probe = _render(tokenizer, messages[:i] + [{"role": "assistant", "content": _PLACEHOLDER}])
            cut = probe.find(_PLACEHOLDER)
            header = probe[:cut] if cut >= 0 else ""
        start = _common_prefix_len(upto, header)
        segment = upto[start:].rstrip()
        if not segment:
            continue
        if full.startswith(upto) and start >= cursor:
            span = (start, start + len(segment))
        else:
            # Search from where this turn's header ends in the full render when it agrees with it, else from the
            # end of the previous assistant turn.
            span = _search_turn(full, segment, message["content"], max(cursor, _common_prefix_len(full, header)))
            if span is None:
                span = _search_turn(full, segment, message["content"], cursor)
            if span is None:
                raise ValueError(
                    f"could not locate assistant message {i} in the rendered chat template; the template renders "
                    "conversation prefixes inconsistently (use prompt/response or pre-tokenised records instead)"
                )
        spans.append(span)
        cursor = span[1]
    return full, spans


def _search_turn(full: str, segment: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Fallback: finds an assistant turn in ``full`` at or after ``cursor`` by its rendering or its content."""
    pos = full.find(segment, cursor)
    if pos >= 0:
        return pos, pos + len(segment)
    content = content.strip()
    if not content:
        return None
    pos = full.find(content, cursor)
    if pos < 0:
        return None
    end = pos + len(content)
    cut = segment.rfind(content)
    terminator = segment[cut + len(content) :] if cut >= 0 else ""
    if terminator and full.startswith(terminator, end):
        end += len(terminator)
    return pos, end


def _encode_with_offsets(
    tokenizer: Any, text: str, add_special_tokens: bool
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """``(ids, character offsets)`` of ``text``; ``None`` for a tokenizer without offset support."""
    if getattr(tokenizer, "is_fast", True) is False:
        return None
    try:
        enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError:
        return None
    offsets = enc.get("offset_mapping") if isinstance(enc, Mapping) else None
    if offsets is None:
        return None
    return [int(t) for t in enc["input_ids"]], [(int(s), int(e)) for s, e in offsets]


def _split_straddling(
    tokenizer: Any, text: str, ids: list[int], offsets: list[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Re-tokenises, side by side, every token that straddles a span boundary.

    Whole-text BPE can merge the header's last character with the answer's first: SmolLM2 tokenises
    ``"<|im_start|>assistant\\n"`` + ``"  Paris."`` as ``... 'istant' 'ĊĠ' 'ĠParis' ...``, a token that belongs to
    both, so no mask is right for it. At inference the prompt ends with the header's own tokens and the target
    generates the answer's, so each side is tokenised on its own. The token stays whole when the sides do not decode
    back to the same text (tokenizers that put a prefix space before every call).
    """
    cuts = sorted({c for span in spans for c in span})
    new_ids: list[int] = []
    new_offsets: list[tuple[int, int]] = []
    changed = False
    for token, (s, e) in zip(ids, offsets):
        inner = [c for c in cuts if s < c < e]
        bounds = list(zip([s] + inner, inner + [e])) if inner else []
        pieces = [_encode_with_offsets(tokenizer, text[a:b], False) for a, b in bounds]
        if not pieces or any(p is None for p in pieces):
            new_ids.append(token)
            new_offsets.append((s, e))
            continue
        for (start, _), (piece_ids, piece_offsets) in zip(bounds, pieces):
            new_ids.extend(piece_ids)
            new_offsets.extend((start + a, start + b) for a, b in piece_offsets)
        changed = True
    if not changed:
        return ids, offsets

    def decode(x: list[int]) -> str:
        return tokenizer.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    return (new_ids, new_offsets) if decode(new_ids) == decode(ids) else (ids, offsets)


def _offsets_mask(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool
) -> tuple[list[int], list[int]] | None:
    """Tokenises ``text`` and marks tokens whose character span overlaps a span; ``None`` without offset support.

    No token crosses a span boundary (see :func:`_split_straddling`), so a marked token lies inside a span.
    """
    encoded = _encode_with_offsets(tokenizer, text, add_special_tokens)
    if encoded is None:
        return None
    ids, offsets = _split_straddling(tokenizer, text, *encoded, spans)
    # Zero-width tokens (specials inserted by the tokenizer, e.g. BOS) are never targets.
    mask = [int(e > s and any(s < b and e > a for a, b in spans)) for s, e in offsets]
    return ids, mask


def _piecewise_mask(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool
) -> tuple[list[int], list[int]]:
    """Fallback for tokenizers without offsets: tokenises masked and unmasked pieces separately and concatenates.

    Tokens can differ from tokenising the whole text at piece boundaries; prefer a fast tokenizer.
    """
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for a, b in sorted(spans):
        for piece, flag in ((text[pos:a], 0), (text[a:b], 1)):
            if piece:
                piece_ids = list(tokenizer(piece, add_special_tokens=False)["input_ids"])
                ids.extend(piece_ids)
                mask.extend([flag] * len(piece_ids))
        pos = b
    if pos < len(text):
        tail = list(tokenizer(text[pos:], add_special_tokens=False)["input_ids"])
        ids.extend(tail)
        mask.extend([0] * len(tail))
    if add_special_tokens and hasattr(tokenizer, "build_inputs_with_special_tokens"):
        # Let the tokenizer add its specials (e.g. BOS) where it wants them; they never carry loss.
        built = list(tokenizer.build_inputs_with_special_tokens(ids))
        special = list(tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=False))
        if len(built) == len(special) and special.count(0) == len(ids):
            it = iter(mask)
            mask = [0 if is_special else next(it) for is_special in special]
            ids = built
    return [int(t) for t in ids], mask


def _tokenize_spans(
    tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool
) -> tuple[list[int], list[int]]:
    out = _offsets_mask(tokenizer, text, spans, add_special_tokens)
    if out is None:
        out = _piecewise_mask(tokenizer, text, spans, add_special_tokens)
    return out


def _tokenize_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False):
    if not _has_chat_template(tokenizer):
        raise ValueError(
            "the tokenizer has no chat template: set `tokenizer.chat_template` (e.g. the target model's) or use "
            "prompt/response records instead of chat 'messages'"
        )
    messages = [dict(m) for m in messages]
    if add_generation_prompt:
        # Prompt-only conversation (for regeneration by the target): render the open assistant header, no loss.
        text = _render(tokenizer, messages, add_generation_prompt=True)
        spans: list[tuple[int, int]] = []
    else:
        text, spans = _assistant_spans(tokenizer, messages)
    # Rendered templates carry their own BOS/specials: never let the tokenizer add another.
    return _tokenize_spans(tokenizer, text, spans, add_special_tokens=False)


def tokenize_record(record: Mapping[str, Any], tokenizer: Any, max_length: int | None = None) -> dict:
    """Tokenises one record into ``input_ids`` and a ``loss_mask`` of the same length.

    ``loss_mask[t] == 1`` marks the tokens the drafter must learn to predict (see the module docstring):

    * chat (``messages``): the tokens of every assistant turn's content *and* the end-of-turn token(s) the template
      emits right after it (e.g. ``<|im_end|>``), but not the assistant header (e.g. ``<|im_start|>assistant\\n``),
      whitespace after the end-of-turn marker, or anything from system/user turns. The conversation is rendered with
      ``tokenizer.apply_chat_template(..., tokenize=False)`` and tokenised without adding special tokens (templates
      include their own BOS); the mask comes from character offsets, so it is exact for any template that renders
      each assistant turn as header + content + terminator. A token that whole-text tokenisation would merge across
      the header/answer boundary (e.g. the header's ``"\\n"`` with an answer's leading space) is tokenised as its two
      sides instead, as the target sees them at inference. Requires a chat template.
    * prompt/response: with a chat template, the conversation ``[user: prompt, assistant: response]``; without one,
      ``prompt + response`` (tokenised as one text, with the tokenizer's special tokens) followed by EOS when the
      tokenizer has one; the loss covers the response tokens and that EOS. A record without ``response`` gets an
      all-zero mask (with a chat template it ends with the open assistant header): it is only useful for
      regenerating responses with the target model.
    * text: every token but the first carries loss (nothing precedes the first token to predict it from). The
      tokenizer's special tokens (e.g. BOS) are added; no EOS is appended.
    * tokens (``input_ids``): the given ids, with the given ``loss_mask`` or, without one, ones everywhere but at
      the first token.

    Args:
        record: A record as returned by :func:`load_records` (validated again here).
        tokenizer: A Hugging Face tokenizer; a fast one (with offset mapping) for exact masks. Slow tokenizers fall
            back to tokenising masked and unmasked pieces separately.
        max_length: If given, both lists are truncated from the right to at most this many tokens.

    Returns:
        ``{"input_ids": list[int], "loss_mask": list[int]}``.

    Raises:
        ValueError: If the record is malformed, a chat record meets a tokenizer without chat template, or
            ``max_length < 1``.
    """
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    kind = _validate_record(record)
    if kind == "messages":
        ids, mask = _tokenize_chat(tokenizer, list(record["messages"]))
    elif kind == "prompt":
        prompt, response = record["prompt"], record.get("response")
        if _has_chat_template(tokenizer):
            messages = [{"role": "user", "content": prompt}]
            if response is None:
                ids, mask = _tokenize_chat(tokenizer, messages, add_generation_prompt=True)
            else:
                ids, mask = _tokenize_chat(tokenizer, messages + [{"role": "assistant", "content": response}])
        else:
            text = prompt + (response or "")
            spans = [(len(prompt), len(text))] if response else []
            ids, mask = _tokenize_spans(tokenizer, text, spans, add_special_tokens=True)
            eos = getattr(tokenizer, "eos_token_id", None)
            if response is not None and eos is not None:
                if ids and ids[-1] == eos:  # the tokenizer's post-processor already appended it
                    mask[-1] = 1
                else:
                    ids.append(int(eos))
                    mask.append(1)
    elif kind == "text":
        ids = [int(t) for t in tokenizer(record["text"], add_special_tokens=True)["input_ids"]]
        mask = [0] + [1] * (len(ids) - 1) if ids else []
    else:
        ids = [int(t) for t in record["input_ids"]]
        given = record.get("loss_mask")
        mask = [int(v) for v in given] if given is not None else [0] + [1] * (len(ids) - 1)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


# --------------------------------------------------------------------------------------------------------------------
# Dataset, packing, split
# --------------------------------------------------------------------------------------------------------------------


def _as_list(x: Any) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


class DrafterDataset(Dataset):
    """Tokenised drafter training examples.

    Each example is a dict with ``input_ids`` and ``loss_mask`` (equal-length lists), an optional ``id`` and, for
    packed examples, ``segment_ids``. Items are ``{"input_ids": LongTensor, "loss_mask": LongTensor, "index": int}``
    (plus ``segment_ids`` when present), where ``index`` is the position in this dataset.

    Attributes:
        examples: The examples (lists of ints, not tensors).
        num_dropped: How many records :meth:`from_records` dropped for having too few loss tokens (0 otherwise).
    """

    def __init__(self, examples: Iterable[Mapping[str, Any]], num_dropped: int = 0):
        """Builds a dataset from already tokenised examples.

        Args:
            examples: Dicts with ``input_ids`` and ``loss_mask`` (lists or tensors of equal, non-zero length), and
                optionally ``id`` and ``segment_ids``.
            num_dropped: Recorded as :attr:`num_dropped`.

        Raises:
            ValueError: If an example lacks a key, is empty, or its lists differ in length.
        """
        self.examples: list[dict] = []
        for i, ex in enumerate(examples):
            if "input_ids" not in ex or "loss_mask" not in ex:
                raise ValueError(f"example {i} must have 'input_ids' and 'loss_mask'")
            item = dict(ex)
            item["input_ids"] = _as_list(ex["input_ids"])
            item["loss_mask"] = _as_list(ex["loss_mask"])
            n = len(item["input_ids"])
            if n == 0:
                raise ValueError(f"example {i} is empty")
            if len(item["loss_mask"]) != n:
                raise ValueError(f"example {i}: loss_mask has length {len(item['loss_mask'])}, input_ids has {n}")
            if "segment_ids" in ex:
                item["segment_ids"] = _as_list(ex["segment_ids"])
                if len(item["segment_ids"]) != n:
                    raise ValueError(f"example {i}: segment_ids has length {len(item['segment_ids'])}, expected {n}")
            self.examples.append(item)
        self.num_dropped = int(num_dropped)

    @classmethod
    def from_records(
        cls,
        records: Iterable[Mapping[str, Any]] | str | os.PathLike,
        tokenizer: Any,
        max_length: int | None = None,
        min_loss_tokens: int = 1,
    ) -> DrafterDataset:
        """Tokenises records (see :func:`tokenize_record`), dropping those with too few loss tokens.

        Args:
            records: Records, or the path of a JSONL file to read with :func:`load_records`.
            tokenizer: The target model's tokenizer.
            max_length: Truncation length (applied before counting loss tokens).
            min_loss_tokens: Examples with fewer loss tokens are dropped and counted in :attr:`num_dropped`. Use 0
                to keep prompt-only records.

        Returns:
            The dataset; examples keep their record's ``id`` when it has one, and their ``source`` (``"file:line"``)
            when the records came from :func:`load_records`.
        """
        if isinstance(records, (str, os.PathLike)):
            records = load_records(records)
        locate = records.location if isinstance(records, RecordList) else None
        examples, dropped = [], 0
        for i, record in enumerate(records):
            ex = tokenize_record(record, tokenizer, max_length=max_length)
            if not ex["input_ids"] or sum(ex["loss_mask"]) < min_loss_tokens:
                dropped += 1
                continue
            if "id" in record:
                ex["id"] = record["id"]
            source = locate(i) if locate is not None else None
            if source is not None:
                ex["source"] = source
            examples.append(ex)
        return cls(examples, num_dropped=dropped)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self.examples)
        ex = self.examples[index]
        item = {
            "input_ids": torch.tensor(ex["input_ids"], dtype=torch.long),
            "loss_mask": torch.tensor(ex["loss_mask"], dtype=torch.long),
            "index": int(index),
        }
        if "segment_ids" in ex:
            item["segment_ids"] = torch.tensor(ex["segment_ids"], dtype=torch.long)
        return item

    @property
    def lengths(self) -> list[int]:
        """Token count of each example (e.g. for :class:`ResumableBatchSampler`)."""
        return [len(ex["input_ids"]) for ex in self.examples]

    @property
    def num_tokens(self) -> int:
        """Total number of tokens."""
        return sum(len(ex["input_ids"]) for ex in self.examples)

    @property
    def num_loss_tokens(self) -> int:
        """Total number of tokens carrying loss."""
        return sum(sum(ex["loss_mask"]) for ex in self.examples)


def check_token_ids(dataset: Any, vocab_size: int, split: str = "training") -> list[int]:
    """Checks that every example's ``input_ids`` lie in ``[0, vocab_size)`` and returns the examples' lengths.

    An id the target does not have would otherwise fail deep inside the target (an index error in its embedding),
    or be miscounted. The error names the example's file and 1-based line when it came from :func:`load_records`
    (its ``source``), else its position in ``dataset``.

    Args:
        dataset: A :class:`DrafterDataset`, or any dataset whose items have ``input_ids``.
        vocab_size: The target's vocabulary size.
        split: What the data is, for the message (``"training"``, ``"held-out"``).

    Returns:
        ``len(input_ids)`` of each example, in order.

    Raises:
        ValueError: On the first example with an id outside the vocabulary.
    """
    examples = getattr(dataset, "examples", None)
    lengths = []
    for i in range(len(dataset)):
        ids = examples[i]["input_ids"] if examples is not None else _as_list(dataset[i]["input_ids"])
        lengths.append(len(ids))
        bad = _first_out_of_range(ids, vocab_size)
        if bad is not None:
            source = examples[i].get("source") if examples is not None else None
            where = source or f"{split} example {i}"
            raise ValueError(f"{where}: {_token_id_error(bad[1], bad[0], vocab_size)}.")
    return lengths


def loss_token_counts(dataset: Any, vocab_size: int) -> torch.Tensor:
    """``(vocab_size,)`` counts of the tokens that carry loss in ``dataset`` (the tokens a drafter learns to draft;
    ids are checked against the vocabulary first, :func:`check_token_ids`)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    examples = getattr(dataset, "examples", None)
    for i in range(len(dataset)):
        item = examples[i] if examples is not None else dataset[i]
        ids = torch.as_tensor(item["input_ids"])
        mask = torch.as_tensor(item["loss_mask"]).bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def check_has_loss_tokens(dataset: Any) -> None:
    """Refuses training data with nothing to learn from: no examples, or no example with a loss token.

    Only assistant turns, responses and raw text carry loss; records without them are dropped when tokenised
    (:attr:`DrafterDataset.num_dropped`), and pre-tokenised ones may carry an all-zero ``loss_mask``. Datasets that
    are not a :class:`DrafterDataset` (e.g. dumped features) are checked for emptiness only.
    """
    dropped = getattr(dataset, "num_dropped", 0)
    because = f" ({dropped} records were dropped for having no tokens to train on)" if dropped else ""
    if len(dataset) == 0:
        raise ValueError(f"The training data holds no examples{because}. {_WHAT_CARRIES_LOSS}")
    examples = getattr(dataset, "examples", None)
    if examples is not None and not any(any(ex["loss_mask"]) for ex in examples):
        raise ValueError(
            f"None of the {len(examples)} training examples has a token to train on (every loss_mask is 0){because}. "
            + _WHAT_CARRIES_LOSS
        )


_WHAT_CARRIES_LOSS = (
    "The loss falls on assistant turns, responses and raw text only: give records with an assistant message, a "
    "'response' or a 'text', or pre-tokenised records whose 'loss_mask' marks the tokens to learn."
)


def pack_examples(examples: Iterable[Mapping[str, Any]], max_length: int) -> list[dict]:
    """Greedily packs consecutive examples into sequences of at most ``max_length`` tokens.

    An example is appended to the current pack when it fits, otherwise it starts a new pack; examples longer than
    ``max_length`` are truncated to it first. The first token of every packed example gets loss 0, so nothing is
    predicted across a document boundary.

    Args:
        examples: Dicts (or dataset items) with ``input_ids`` and ``loss_mask``.
        max_length: Maximum packed length (>= 1).

    Returns:
        Dicts with ``input_ids``, ``loss_mask``, ``segment_ids`` (0, 1, ... numbering the original examples inside
        the pack, for attention masks that do not cross documents) and ``example_indices`` (the positions of the
        packed examples in ``examples``).

    Raises:
        ValueError: If ``max_length < 1``.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    packs: list[dict] = []
    current: dict | None = None
    for i, ex in enumerate(examples):
        ids = _as_list(ex["input_ids"])[:max_length]
        mask = _as_list(ex["loss_mask"])[:max_length]
        if not ids:
            continue
        mask[0] = 0
        if current is None or len(current["input_ids"]) + len(ids) > max_length:
            current = {"input_ids": [], "loss_mask": [], "segment_ids": [], "example_indices": []}
            packs.append(current)
        segment = len(current["example_indices"])
        current["input_ids"].extend(ids)
        current["loss_mask"].extend(mask)
        current["segment_ids"].extend([segment] * len(ids))
        current["example_indices"].append(i)
    return packs


def split_train_eval(
    dataset: DrafterDataset, eval_fraction: float, seed: int = 0
) -> tuple[DrafterDataset, DrafterDataset]:
    """Deterministically splits off a held-out evaluation set.

    A permutation of the indices drawn from a ``torch.Generator`` seeded with ``seed`` picks
    ``round(len * eval_fraction)`` evaluation examples (at least 1 when ``eval_fraction > 0`` and the dataset has at
    least 2 examples; at least one example always stays in training). Both parts keep the original order.

    Args:
        dataset: The dataset to split.
        eval_fraction: Fraction in ``[0, 1)`` to hold out.
        seed: Seed of the permutation.

    Returns:
        ``(train, eval)`` datasets.

    Raises:
        ValueError: If ``eval_fraction`` is outside ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(dataset)
    n_eval = 0
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(1, round(n * eval_fraction)), n - 1)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator).tolist()
    eval_idx = set(perm[:n_eval])
    train = [ex for i, ex in enumerate(dataset.examples) if i not in eval_idx]
    held_out = [ex for i, ex in enumerate(dataset.examples) if i in eval_idx]
    return DrafterDataset(train), DrafterDataset(held_out)


# --------------------------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------------------------


class DataCollator:
    """Right-pads dataset items into a batch.

    The batch has ``input_ids`` (padded with ``pad_token_id``), ``attention_mask`` (1 real / 0 padding),
    ``loss_mask`` (0 on padding), ``index`` and, when the items have them, ``segment_ids`` (padded with -1), all
    ``torch.long``.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        """Creates the collator.

        Args:
            pad_token_id: Id used for padding ``input_ids``.
            pad_to_multiple_of: If given, the padded length is rounded up to a multiple of it.

        Raises:
            ValueError: If ``pad_token_id`` is None or ``pad_to_multiple_of < 1``.
        """
        if pad_token_id is None:
            raise ValueError("pad_token_id is required (e.g. tokenizer.pad_token_id or tokenizer.eos_token_id)")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Collates items (dicts with ``input_ids``, ``loss_mask``, optional ``index`` and ``segment_ids``)."""
        if not items:
            raise ValueError("cannot collate an empty batch")
        seqs = [torch.as_tensor(it["input_ids"], dtype=torch.long) for it in items]
        width = max(len(s) for s in seqs)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(items)
        input_ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((b, width), dtype=torch.long)
        loss_mask = torch.zeros((b, width), dtype=torch.long)
        with_segments = any("segment_ids" in it for it in items)
        segment_ids = torch.full((b, width), -1, dtype=torch.long) if with_segments else None
        for row, (it, seq) in enumerate(zip(items, seqs)):
            n = len(seq)
            input_ids[row, :n] = seq
            attention_mask[row, :n] = 1
            loss_mask[row, :n] = torch.as_tensor(it["loss_mask"], dtype=torch.long)
            if segment_ids is not None:
                seg = it.get("segment_ids")
                segment_ids[row, :n] = torch.as_tensor(seg, dtype=torch.long) if seg is not None else 0
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "index": torch.tensor([int(it.get("index", i)) for i, it in enumerate(items)], dtype=torch.long),
        }
        if segment_ids is not None:
            batch["segment_ids"] = segment_ids
        return batch


class ResumableBatchSampler(Sampler[list[int]]):
    """A batch sampler whose position can be saved and restored mid-epoch.

    Every epoch uses its own order, derived only from ``(seed, epoch)``, so a sampler restored with
    :meth:`load_state_dict` yields exactly the batches the original would have yielded next. Iterating the sampler
    covers the rest of the current epoch, after which :attr:`epoch` advances by one and :attr:`batches_yielded`
    returns to 0; stopping early leaves the position where it is, and the next iteration resumes from there.

    With ``group_by_length``, the (shuffled) indices are cut into mega-batches of ``50 * batch_size``, each sorted
    by length (longest first) and cut into batches, and the batches are then shuffled: batches hold similar lengths,
    which reduces padding, while the order of batches stays random.

    :attr:`batches_yielded` counts batches handed out by the iterator. A ``DataLoader`` with workers fetches batches
    ahead of the training loop, so checkpoint the number of batches actually *trained on*, e.g.
    ``state = sampler.state_dict(); state["batches_yielded"] = steps_done_in_epoch``.
    """

    MEGA_BATCH_MULTIPLIER = 50

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        group_by_length: bool = False,
        drop_last: bool = False,
    ):
        """Creates the sampler.

        Args:
            lengths: Length of each example (e.g. ``DrafterDataset.lengths``); only its size matters without
                ``group_by_length``.
            batch_size: Examples per batch.
            shuffle: Draw a new random order each epoch (else dataset order).
            seed: Base seed; epoch ``e`` uses an order derived from ``(seed, e)``.
            group_by_length: Group similar lengths into batches (see class docstring).
            drop_last: Drop the final incomplete batch of each epoch.

        Raises:
            ValueError: If ``batch_size < 1``.
        """
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.lengths = [int(n) for n in lengths]
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.group_by_length = bool(group_by_length)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.batches_yielded = 0

    def __len__(self) -> int:
        n = len(self.lengths)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _generator(self, epoch: int) -> torch.Generator:
        # Mix (seed, epoch) into one 63-bit seed.
        return torch.Generator().manual_seed((self.seed * 1_000_003 + epoch * 7_919 + 12_345) % (2**63))

    def batches_for_epoch(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch``, in order (a pure function of the constructor arguments and ``epoch``)."""
        n = len(self.lengths)
        generator = self._generator(epoch)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        bs = self.batch_size
        if self.group_by_length:
            mega = bs * self.MEGA_BATCH_MULTIPLIER
            batches = []
            for start in range(0, n, mega):
                chunk = sorted(order[start : start + mega], key=lambda i: -self.lengths[i])
                batches.extend(chunk[k : k + bs] for k in range(0, len(chunk), bs))
        else:
            batches = [order[k : k + bs] for k in range(0, n, bs)]
        if self.drop_last:
            batches = [b for b in batches if len(b) == bs]
        if self.group_by_length and self.shuffle:
            batches = [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches_for_epoch(self.epoch)
        while self.batches_yielded < len(batches):
            batch = batches[self.batches_yielded]
            self.batches_yielded += 1  # counted before handing out, so state_dict() after receiving it is current
            yield batch
        self.epoch += 1
        self.batches_yielded = 0

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; a no-op when already in ``epoch`` (so a resumed position survives the
        usual ``sampler.set_epoch(epoch)`` call at the top of a training loop)."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.batches_yielded = 0

    def state_dict(self) -> dict[str, int]:
        """The position (and the settings it depends on) as a JSON-serialisable dict."""
        return {
            "epoch": self.epoch,
            "batches_yielded": self.batches_yielded,
            "seed": self.seed,
            "num_samples": len(self.lengths),
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restores a position saved by :meth:`state_dict` (its seed too).

        Raises:
            ValueError: If the state was saved for a different number of examples or batch size, or its position
                lies beyond the end of the epoch.
        """
        for key, mine in (("num_samples", len(self.lengths)), ("batch_size", self.batch_size)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {mine}")
        batches_yielded = int(state.get("batches_yielded", 0))
        if not 0 <= batches_yielded <= len(self):
            raise ValueError(f"batches_yielded={batches_yielded} is outside [0, {len(self)}]")
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state.get("epoch", 0))
        self.batches_yielded = batches_yielded
