"""Prompt lookup merged into a drafter's chain: take n-gram copies where the drafter agrees with them.

Prompt lookup (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) drafts by copying: it finds the latest
earlier occurrence of the text's last few tokens and proposes what followed. On repetitive text (summaries, code
edits, answers quoting their prompt) it proposes long, cheap, often-accepted chains; on novel text it proposes
nothing useful. A trained drafter is the other way round.

:func:`merge_lookup` takes the better of both per row. After the drafter has drafted its chain, each row's n-gram
continuation is looked up (:func:`lookup_continuations`). When the drafter's first ``agree`` tokens equal the
continuation's, the copy is predicted to hold, and the row's chain becomes the drafter's first ``agree`` tokens
followed by the rest of the copy, up to ``num_tokens`` in all. Rows without a match or without agreement keep the
drafter's chain.

Lossless sampling holds: the copied tokens are a deterministic function of the text before them, so they enter the
verifier as point masses (``q = one-hot``), and the decision to copy depends only on tokens already drawn.

:meth:`NgramIndex.next_tokens` copies one position at a time, inside the chain: at each draft position where the
drafter's top probability is at most ``copy_threshold`` (:data:`COPY_THRESHOLD` by default where prompt lookup is on),
a row drafts the token that followed the latest earlier occurrence of its last 3 (else 2) tokens, drafted ones
included, and the drafter goes on from that token. A copy that :func:`merge_lookup` would take only when the drafter
already agrees with it, and that follows one occurrence to its end, is taken here token by token wherever the drafter
does not know better, and finds a new occurrence at every position. Used by the loop's draft selector for every chain
drafter.

The loop keeps the rows' text in a :class:`NgramIndex` (extended with each pass's committed tokens), which answers
both look-ups from dictionaries; :func:`lookup_continuations` is the same look-up as a scan of the text.
"""

from __future__ import annotations

from collections import deque

import torch

from ..types import Proposal
from .adaptive import batch_progress

__all__ = [
    "AGREE",
    "COPY_THRESHOLD",
    "NGRAM_SIZES",
    "CopyOutcomes",
    "NgramIndex",
    "lookup_continuations",
    "merge_lookup",
]

AGREE = 2  # leading draft tokens that must equal the copy's before a row switches to it
NGRAM_SIZES = (3, 2)  # n-gram sizes looked up, longest first
COPY_THRESHOLD = 0.7  # a chain drafts the n-gram copy's token where the drafter's top probability is at most this


def lookup_continuations(
    seq: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    num_tokens: int,
    ngram_sizes: tuple[int, ...] = (3, 2),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the tokens that followed the latest earlier occurrence of the row's last n tokens (largest n first).

    Args:
        seq: ``(batch, width)`` token buffer; row ``b``'s text is ``seq[b, starts[b]:lengths[b]]``.
        starts: ``(batch,)`` first real position (after left padding).
        lengths: ``(batch,)`` end of the text.
        num_tokens: longest continuation returned.
        ngram_sizes: the n-gram sizes tried, in order.

    Returns:
        ``(tokens, counts)``: ``(batch, num_tokens)`` continuations (zero padded) and ``(batch,)`` their lengths
        (0: no match).
    """
    bsz = seq.shape[0]
    out = torch.zeros(bsz, num_tokens, dtype=seq.dtype)
    counts = torch.zeros(bsz, dtype=torch.long)
    rows = seq.detach().cpu()
    for b, (s, e) in enumerate(zip(starts.tolist(), lengths.tolist())):
        text = rows[b, s:e]
        for n in ngram_sizes:
            if text.numel() <= n:
                continue
            windows = text[:-1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == text[-n:]).all(dim=1).nonzero()
            if hits.numel() == 0:
                continue
            i = int(hits[-1]) + n  # the latest occurrence: text[i] followed it
            cont = text[i : i + num_tokens]
            out[b, : cont.numel()] = cont
            counts[b] = cont.numel()
            break
    return out.to(seq.device), counts.to(seq.device)


class NgramIndex:
    """Each row's committed text on the host with, per n-gram size, the position that followed the latest occurrence
    of each n-gram: :func:`lookup_continuations` as one dictionary look-up per row and size, kept up to date token by
    token (:meth:`extend`), instead of a scan of the whole text at every pass (on a 1,000-token prompt, the scan
    took longer than a small target's plain step).

    Args:
        seq, starts, lengths: the rows' text so far, as :func:`lookup_continuations` reads it.
        ngram_sizes: the n-gram sizes tried, in order (default :data:`NGRAM_SIZES`).
    """

    def __init__(self, seq: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, ngram_sizes=None):
        self.sizes = tuple(ngram_sizes or NGRAM_SIZES)
        self.device = seq.device
        rows = seq.detach().cpu().tolist()
        self.texts = [row[s:e] for row, s, e in zip(rows, starts.tolist(), lengths.tolist())]
        self.followers: list[dict[int, dict[tuple, int]]] = [{n: {} for n in self.sizes} for _ in self.texts]
        for b in range(len(self.texts)):
            self._register(b, 0)

    def _register(self, b: int, since: int) -> None:
        """Records, for row ``b``, the n-grams followed by a token at position ``since`` or later (later occurrences
        overwrite earlier ones: the latest wins)."""
        text = self.texts[b]
        for n, table in self.followers[b].items():
            for t in range(max(since, n), len(text)):
                table[tuple(text[t - n : t])] = t

    def extend(self, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Appends each row's first ``counts[b]`` of ``new_tokens[b]`` (the tokens it committed)."""
        tokens, counts = new_tokens.tolist(), counts.tolist()
        for b, c in enumerate(counts):
            if c > 0:
                start = len(self.texts[b])
                self.texts[b].extend(tokens[b][:c])
                self._register(b, start)

    def continuations(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, counts)`` as :func:`lookup_continuations` returns them for the rows' text now."""
        return self._as_tensors([self._continuation(b, num_tokens) for b in range(len(self.texts))], num_tokens)

    def proposal(self, num_tokens: int, active: torch.Tensor) -> Proposal | None:
        """The ``active`` rows' copies as a chain of prompt-lookup copies alone (no drafter), for passes where
        drafting does not pay but copying may (``lengths``: each row's count, 0 without a match); ``None`` when no
        row has one. The copies are point masses (``draft_probs`` is ``None``), as the sampling verifier reads a
        deterministic draft."""
        found = [self._continuation(b, num_tokens) if on else [] for b, on in enumerate(active.tolist())]
        width = max(len(cont) for cont in found)
        if width == 0:
            return None
        tokens, counts = self._as_tensors(found, width)
        return Proposal(tokens=tokens, lengths=counts)

    def _as_tensors(self, found: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [cont + [0] * (width - len(cont)) for cont in found]
        return (
            torch.tensor(tokens, dtype=torch.long, device=self.device).view(len(found), width),
            torch.tensor([len(cont) for cont in found], dtype=torch.long, device=self.device),
        )

    def next_tokens(self, drafted: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the token that followed the latest occurrence, in its committed text, of the last n tokens of
        that text followed by ``drafted[b]`` (the tokens drafted after it so far; largest n first): ``(tokens,
        found)``, ``(batch,)`` the tokens (0 where none) and whether each row has one."""
        found = [self._next_token(b, drafted[b]) for b in range(len(self.texts))]
        return (
            torch.tensor([t if t is not None else 0 for t in found], dtype=torch.long, device=self.device),
            torch.tensor([t is not None for t in found], dtype=torch.bool, device=self.device),
        )

    def _next_token(self, b: int, drafted: tuple[int, ...]) -> int | None:
        text = self.texts[b]
        tail = text[-max(self.sizes) :] + list(drafted)
        for n, table in self.followers[b].items():
            if len(text) + len(drafted) < n:
                continue
            follower = table.get(tuple(tail[-n:]))
            if follower is not None:
                return text[follower]
        return None

    def _continuation(self, b: int, num_tokens: int) -> list[int]:
        text = self.texts[b]
        for n, table in self.followers[b].items():
            if len(text) <= n:
                continue
            follower = table.get(tuple(text[-n:]))
            if follower is not None:
                return text[follower : follower + num_tokens]
        return []


def merge_lookup(
    proposal: Proposal,
    seq: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    num_tokens: int,
    agree: int | None = None,
    ngram_sizes: tuple[int, ...] | None = None,
    continuations: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[Proposal, torch.Tensor]:
    """The drafter's chain ``proposal`` with prompt-lookup copies merged in (see the module docstring); ``agree`` and
    ``ngram_sizes`` default to the module's :data:`AGREE` and :data:`NGRAM_SIZES`. ``continuations``: the rows'
    ``(tokens, counts)`` to merge instead of looking them up (e.g. tokens a grammar forces).

    Returns the merged proposal (unchanged when no row switched) and a ``(batch,)`` bool tensor of the rows that
    switched to a copy.
    """
    bsz, k = proposal.tokens.shape
    device = proposal.tokens.device
    switched = torch.zeros(bsz, dtype=torch.bool, device=device)
    agree = min(AGREE if agree is None else agree, k)
    if k == 0 or num_tokens <= agree:
        return proposal, switched
    if continuations is None:
        continuations = lookup_continuations(seq, starts, lengths, num_tokens, ngram_sizes or NGRAM_SIZES)
    cont, count = continuations
    own = proposal.lengths if proposal.lengths is not None else torch.full((bsz,), k, device=device)
    same = (proposal.tokens[:, :agree] == cont[:, :agree]).all(dim=1)  # all True when agree == 0
    switched = same & (count > agree) & (own >= agree)
    if not bool(switched.any()):
        return proposal, switched
    width = max(k, int(count[switched].max()))
    if cont.shape[1] < width:
        cont = torch.nn.functional.pad(cont, (0, width - cont.shape[1]))
    tokens = torch.zeros(bsz, width, dtype=proposal.tokens.dtype, device=device)
    tokens[:, :k] = proposal.tokens
    tokens[switched] = cont[switched, :width]
    new_lengths = torch.where(switched, count, own)
    probs = proposal.draft_probs
    if probs is not None:
        wide = probs.new_zeros(bsz, width, probs.shape[-1])
        wide[:, :k] = probs
        copied = torch.nn.functional.one_hot(tokens[switched, agree:], probs.shape[-1]).to(probs.dtype)
        rows = wide[switched]
        rows[:, agree:] = copied
        wide[switched] = rows
        probs = wide
    merged = Proposal(
        tokens=tokens, draft_probs=probs, kind=proposal.kind, lengths=new_lengths, extras=dict(proposal.extras)
    )
    return merged, switched


class CopyOutcomes:
    """What lookup passes would commit, learnt from every pass with a copy, whether it verified the copies or not.

    A copy proposed when a row's text ends at ``p`` commits ``a + 1`` tokens in a lookup pass, ``a`` being how many
    of its tokens the row's text from ``p`` on repeats (then the target's own token); a row without a copy commits
    its one token. A batched pass is worth how far it moves the row furthest behind
    (:func:`~hf_specdec.generation.adaptive.batch_progress`): a call runs until its last row is done. Once the rows'
    text is known, the pass's outcome (tokens per row) follows from it alone: exactly when decoding greedily,
    verified or not; when sampling, in expectation (a copied token is accepted with the target's probability of it,
    the chance that the sampled text has it). So the adaptive length learns what lookup passes are worth at every
    match, not only in the passes that verified one, and copies it declined still count
    (:meth:`DraftLengthController.record_copies`).

    The outcomes are those of passes that verify every copy: a copy proposed inside the tokens an earlier copy would
    have committed is not scored (after plain steps through a repeated run, the run counts once, at its start, not
    again one token shorter at each step). Passes are scored in order, each as soon as all its copies' outcomes are
    settled: a copy the text departs from at its first token is scored one token later, not once the text is as long
    as the copy (scored late, a run of failing copies would leave the estimate on what copies committed before).
    """

    def __init__(self):
        self.pending: deque[_PassCopies] = deque()
        # row -> where a pass that verified every copy would have stopped next, or (start, copy) while the text still
        # repeats the copy scored last (every later copy of the row lies inside it)
        self.stops: dict[int, int | tuple[int, list[int]]] = {}

    def add(self, copy: Proposal, lengths: torch.Tensor, active: torch.Tensor) -> None:
        """Keeps a pass's copies (``copy.lengths`` 0: a row without one) proposed at ``lengths``; ``active``: the
        rows still generating."""
        counts, tokens, ends = copy.lengths.tolist(), copy.tokens.tolist(), lengths.tolist()
        rows = [(b, ends[b], tokens[b][:n]) for b, n in enumerate(counts) if n]
        without = [ends[b] for b, (n, live) in enumerate(zip(counts, active.tolist())) if live and not n]
        self.pending.append(_PassCopies(rows, without))

    def resolve(self, seq: torch.Tensor, lengths: torch.Tensor, finished: torch.Tensor) -> list[float]:
        """The outcomes, in tokens per row, of the kept passes whose outcome the text now settles, in the order of
        the passes."""
        if not self.pending:
            return []  # nothing to score: no host-device copy of the lengths
        ends, done = lengths.tolist(), finished.tolist()
        starts = [start for p in self.pending for _, start, _ in p.rows]
        starts += [stop[0] for stop in self.stops.values() if isinstance(stop, tuple)]
        text = _RowText(seq, min(starts, default=max(ends)), max(ends))
        outcomes = []
        while self.pending:
            settled, outcome = self.pending[0].score(text, ends, done, self.stops)
            if not settled:
                break
            self.pending.popleft()
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes


class _RowText:
    """The rows' text from column ``lo`` to ``hi``, copied to the host once for all the passes scored in a call."""

    def __init__(self, seq: torch.Tensor, lo: int, hi: int):
        self.lo = lo
        self.tokens = seq[:, lo:hi].cpu().tolist() if hi > lo else [[] for _ in range(seq.shape[0])]

    def copy_outcome(self, row: int, start: int, end: int, copy: list[int], done: bool) -> tuple[int, bool] | None:
        """``(tokens, settled)``: what a lookup pass verifying ``copy`` at ``start`` commits in ``row``, and whether
        the text settles it (the row finished, its text is as long as the copy or departs from it); unsettled, the
        tokens are a lower bound. ``None`` for a row that finished where the copy began."""
        known = self.tokens[row][start - self.lo : end - self.lo]
        if done and not known:
            return None
        a = next((i for i, (x, y) in enumerate(zip(copy, known)) if x != y), min(len(copy), len(known)))
        if done:
            return min(a + 1, len(known)), True
        return a + 1, len(known) >= len(copy) or a < len(known)


class _PassCopies:
    """One pass's copies (``(row, where its text ended, the copy)``) and where the text of the active rows without
    one ended."""

    def __init__(self, rows: list[tuple[int, int, list[int]]], without: list[int]):
        self.rows, self.without = rows, without

    def score(self, text: _RowText, ends: list[int], done: list[bool], stops: dict) -> tuple[bool, float | None]:
        """``(settled, outcome)``: how far the pass moves the call on with the copies verified
        (:func:`batch_progress` over the rows with a scored copy and those without one), settled once no copy the
        text still repeats can change it (the row furthest behind decides: a copy rejected at its first token
        settles the pass a token later, whatever another row's copy goes on to repeat). The outcome is ``None`` when
        no copy is scored (each lies inside what an earlier copy would have committed, or its row finished where it
        began), unless rows without a copy move the call on by their one token. A settled pass moves each scored
        row's ``stops`` past its copy, or to the copy while the text still repeats it."""
        scored = []
        for b, start, copy in self.rows:
            if _inside_earlier_copy(b, start, text, ends, done, stops):
                continue
            result = text.copy_outcome(b, start, ends[b], copy, done[b])
            if result is not None:
                scored.append((b, start, copy, *result))
        if not scored:  # every copy lies inside an earlier one: the rows without one decide (one token), if any
            return True, (1.0 if self.without else None)
        settled_reach = [start + c for _, start, _, c, settled in scored if settled] + [e + 1 for e in self.without]
        open_reach = [start + c for _, start, _, c, settled in scored if not settled]  # lower bounds: they can grow
        if open_reach and (not settled_reach or min(open_reach) < min(settled_reach)):
            return False, None
        for b, start, copy, c, settled in scored:
            stops[b] = start + c if settled else (start, copy)
        return True, batch_progress(
            [start for _, start, *_ in scored] + self.without, [c for *_, c, _ in scored] + [1] * len(self.without)
        )


def _inside_earlier_copy(b: int, start: int, text: _RowText, ends, done, stops: dict) -> bool:
    """Whether row ``b``'s copy at ``start`` lies inside what the copy scored before it would have committed (a copy
    the text still repeats is settled here first when the text now settles it)."""
    stop = stops.get(b, 0)
    if isinstance(stop, tuple):
        run_start, run_copy = stop
        result = text.copy_outcome(b, run_start, ends[b], run_copy, done[b])
        if result is not None and not result[1]:
            return True  # still repeated: every later copy of the row lies inside it
        stop = stops[b] = run_start + (result[0] if result is not None else 0)
    return start < stop
