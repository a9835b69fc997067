"""Context vocabulary: a reduced draft vocabulary widened, per request, by the sequence's own tokens outside it.

A drafter with a reduced draft vocabulary cannot draft a token outside it, and the tokens a target copies from its
prompt (names, numbers, rare words in a translation, a summary or a RAG answer) often lie outside it. With a context
vocabulary the drafter also scores every token that has appeared in the sequence so far (prompt and committed
output, from position 1 on) and is outside its vocabulary: each such token's row of the target's LM head is mapped
into the drafter's output space by one matrix (``proj``), and its logit is the drafter's normed output times that
row plus one learned bias (the copy prior). The drafter draws its tokens from the union, so drafted tokens are still
target ids and verification is unchanged; sampling stays lossless because the verifier takes the draft distribution
over the union as ``q``.

Columns of a union are the draft vocabulary first, then the row's candidates in order of first appearance, padded
with ``-1`` ids (whose logits are ``-inf`` at inference and :data:`MASKED` in training).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["ContextVocabulary", "ContextCandidates", "training_candidates", "context_soft_labels", "widen_step_logits"]

MASKED = -1e9  # training logit of a candidate not visible yet: finite, so 0 * log-prob stays 0 in the loss


class ContextVocabulary(nn.Module):
    """The map from the target's LM-head rows to the drafter's output space, and the copy prior."""

    def __init__(self, target_hidden_size: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(target_hidden_size, hidden_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(1))

    def rows(self, head_weight: torch.Tensor, ids: torch.LongTensor) -> torch.Tensor:
        """``(..., hidden)`` mapped LM-head rows of target ids ``ids`` (``-1`` padding maps row 0; mask it)."""
        picked = head_weight.detach()[ids.clamp_min(0).to(head_weight.device)]  # the target's head stays frozen
        return self.proj(picked.to(device=self.proj.weight.device, dtype=self.proj.weight.dtype))

    def logits(self, features: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``(batch, n, C)`` candidate logits of ``(batch, n, hidden)`` normed drafter outputs and ``(batch, C,
        hidden)`` mapped rows."""
        return torch.einsum("bnh,bch->bnc", features, rows.to(features.dtype)) + self.bias.to(features.dtype)

    @torch.no_grad()
    def fit(self, target_rows: torch.Tensor, drafter_rows: torch.Tensor) -> float:
        """Sets ``proj`` to the least-squares map from the target's LM-head rows of the draft vocabulary to the
        drafter's own LM-head rows (so mapped rows score as the drafter's own would) and the bias to 0; returns the
        mean cosine between the mapped and the drafter's rows."""
        src, dst = target_rows.double().cpu(), drafter_rows.double().cpu()
        solution = torch.linalg.lstsq(src, dst).solution  # (target_hidden, hidden)
        self.proj.weight.copy_(solution.T.to(self.proj.weight))
        self.bias.zero_()
        return nn.functional.cosine_similarity(src @ solution, dst, dim=1).mean().item()


@dataclass
class ContextCandidates:
    """One ``generate`` call's candidates: per row, the tokens seen so far outside the draft vocabulary.

    Attributes:
        ids: ``(batch, C)`` target ids in order of first appearance, ``-1`` padded.
        rows: ``(batch, C, hidden)`` their mapped LM-head rows (:meth:`ContextVocabulary.rows`).
    """

    ids: torch.LongTensor
    rows: torch.Tensor
    seen: list[set] = field(default_factory=list)

    @classmethod
    def empty(cls, batch_size: int, hidden_size: int, device, dtype) -> ContextCandidates:
        return cls(
            ids=torch.full((batch_size, 0), -1, dtype=torch.long, device=device),
            rows=torch.zeros(batch_size, 0, hidden_size, device=device, dtype=dtype),
            seen=[set() for _ in range(batch_size)],
        )

    def add(self, tokens: torch.LongTensor, valid: torch.BoolTensor, outside: torch.BoolTensor, vocab, head_weight):
        """Adds the valid ``tokens`` (``(batch, slots)``) outside the draft vocabulary (``outside``, same shape) that
        a row has not seen yet; maps only the new ones."""
        keep = (valid & outside).cpu()
        new = []
        for row, (toks, ok) in enumerate(zip(tokens.cpu().tolist(), keep.tolist())):
            fresh = [t for t, k in zip(toks, ok) if k and t not in self.seen[row]]
            fresh = list(dict.fromkeys(fresh))  # in order of first appearance
            self.seen[row].update(fresh)
            new.append(fresh)
        width = max(len(f) for f in new)
        if width == 0:
            return
        added = torch.full((len(new), width), -1, dtype=torch.long)
        for row, fresh in enumerate(new):
            added[row, : len(fresh)] = torch.tensor(fresh, dtype=torch.long)
        added = added.to(self.ids.device)
        self.ids = torch.cat([self.ids, added], dim=1)
        self.rows = torch.cat([self.rows, vocab.rows(head_weight, added).to(self.rows)], dim=1)

    def union_ids(self, draft_ids: torch.LongTensor) -> torch.LongTensor:
        """``(batch, V + C)`` target ids of the union's columns (:func:`union_columns`)."""
        return union_columns(draft_ids, self.ids)

    def extend(self, logits: torch.Tensor, features: torch.Tensor, vocab: ContextVocabulary) -> torch.Tensor:
        """Draft-vocabulary logits ``(batch, [n,] V)`` of normed outputs ``features`` (``(batch, [n,] hidden)``)
        widened with the candidates' logits (``-inf`` on padding) to ``(batch, [n,] V + C)``."""
        squeeze = features.dim() == 2
        feats = features[:, None] if squeeze else features
        ctx = vocab.logits(feats, self.rows).float()
        ctx = ctx.masked_fill((self.ids < 0)[:, None, :], float("-inf"))
        ctx = ctx[:, 0] if squeeze else ctx
        return torch.cat([logits.float(), ctx], dim=-1)


def union_columns(draft_ids: torch.LongTensor, candidate_ids: torch.LongTensor) -> torch.LongTensor:
    """``(batch, V + C)`` target ids of a union's columns: the draft vocabulary, then each row's candidates; padding
    columns repeat draft id 0 (their logits are ``-inf`` or :data:`MASKED`)."""
    device = candidate_ids.device
    pad = torch.where(candidate_ids >= 0, candidate_ids, draft_ids[0].to(device))
    return torch.cat([draft_ids.to(device)[None].expand(candidate_ids.shape[0], -1), pad], dim=1)


def training_candidates(input_ids: torch.LongTensor, valid: torch.BoolTensor, outside: torch.BoolTensor):
    """``(ids, first)`` of each row's candidates in a training batch: ``(batch, C)`` the distinct tokens outside the
    draft vocabulary that follow a valid position (``-1`` padded), and the first position each appears at (the
    sequence length for padding). That is what :class:`ContextCandidates` collects while generating: the token after
    each verified slot."""
    bsz, seq = input_ids.shape
    keep = torch.zeros_like(valid)
    keep[:, 1:] = valid[:, 1:] & valid[:, :-1] & outside[:, 1:]
    per_row = []
    for row in range(bsz):
        positions = torch.nonzero(keep[row]).flatten()
        toks = input_ids[row, positions]
        uniq, inverse = torch.unique(toks, return_inverse=True)
        first = torch.full((len(uniq),), seq, dtype=torch.long, device=input_ids.device)
        first = first.scatter_reduce(0, inverse, positions, reduce="amin")
        order = torch.argsort(first)
        per_row.append((uniq[order], first[order]))
    width = max((len(u) for u, _ in per_row), default=0)
    ids = torch.full((bsz, width), -1, dtype=torch.long, device=input_ids.device)
    first = torch.full((bsz, width), seq, dtype=torch.long, device=input_ids.device)
    for row, (u, f) in enumerate(per_row):
        ids[row, : len(u)], first[row, : len(f)] = u, f
    return ids, first


def visible(first: torch.LongTensor, seq: int, shift: int) -> torch.BoolTensor:
    """``(batch, seq, C)``: candidate ``c`` is visible at anchor ``t`` when it first appears at or before
    ``t + shift``."""
    anchors = torch.arange(seq, device=first.device)[None, :, None]
    return first[:, None, :] <= anchors + shift


@torch.no_grad()
def context_soft_labels(features, target_head: nn.Module, draft_ids, t2d, input_ids, valid):
    """``(labels, in_vocab)`` of a training batch over each row's union: the teacher's distribution over the draft
    vocabulary and the candidates visible at each position (those that appeared at or before it), the index of its
    most likely candidate, and whether its greedy token is a candidate at all. ``labels`` carries the candidates
    (``context_ids`` / ``context_first``) for :func:`widen_step_logits`."""
    from .features import SoftLabels, target_logits_from_last_hidden

    teacher = features.teacher_last_hidden if features.teacher_last_hidden is not None else features.last_hidden
    full = target_logits_from_last_hidden(target_head, teacher, None, features.softcap)
    device = full.device
    ids, first = training_candidates(input_ids.to(device), valid.to(device), ~t2d.to(device)[input_ids.to(device)])
    bsz, seq, _ = full.shape
    columns = union_columns(draft_ids, ids)
    union = full.gather(2, columns[:, None, :].expand(bsz, seq, -1))
    hidden_cols = torch.cat(
        [torch.zeros(bsz, seq, len(draft_ids), dtype=torch.bool, device=device), ~visible(first, seq, 0)], dim=2
    )
    union = union.masked_fill(hidden_cols, float("-inf"))
    full_argmax = full.argmax(-1)
    del full
    argmax = union.argmax(-1)
    in_vocab = columns.gather(1, argmax) == full_argmax
    labels = SoftLabels(torch.softmax(union, dim=-1), argmax, full_argmax, context_ids=ids, context_first=first)
    return labels, in_vocab


def widen_step_logits(step_logits, step_features, labels, vocab: ContextVocabulary, head_weight: torch.Tensor):
    """Each draft step's ``(batch, seq, V)`` logits widened with the candidates of ``labels``: step ``j`` at anchor
    ``t`` drafts the token at ``t + 2 + j`` and sees the candidates that appeared at or before ``t + 1 + j``
    (the others get :data:`MASKED`). ``step_features``: each step's normed drafter outputs."""
    ids, first = labels.context_ids, labels.context_first
    rows = vocab.rows(head_weight, ids.to(head_weight.device))
    seq = step_logits[0].shape[1]
    widened = []
    for j, (logits, feats) in enumerate(zip(step_logits, step_features)):
        ctx = vocab.logits(feats, rows.to(feats.device)).float()
        ctx = ctx.masked_fill(~visible(first.to(ctx.device), seq, 1 + j), MASKED)
        widened.append(torch.cat([logits.float(), ctx], dim=-1))
    return widened
