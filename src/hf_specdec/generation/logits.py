"""Applying transformers logits processors at many positions at once, exactly as plain `generate` would."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

__all__ = ["ScoreProcessor"]

# Processors whose output depends only on the scores, never on the prefix: safe to apply to many positions at once.
_PREFIX_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)


class ScoreProcessor:
    """Processes target or draft logits at arbitrary positions of ragged rows.

    Plain ``generate`` calls its processors with ``input_ids`` of shape ``(batch, prompt + t)`` at step ``t``. Here
    rows advance at different speeds and several positions are scored per target pass, so each position is processed
    with exactly the prefix plain ``generate`` would have shown: the row's (left-padded) prompt, its committed tokens
    and the draft tokens before that position. Prefix-free processors (temperature, top-k/p, ...) run once over all
    positions. Prefix-dependent ones (repetition penalty, min-new-tokens, n-gram blocking, ...) run once per distinct
    prefix length, always on the whole batch so that processors holding per-row state (e.g. a per-row
    ``prompt_ignore_length``, ``prefix_allowed_tokens_fn``'s batch index) see the batch layout they were built for;
    only the rows whose prefix has that length keep the result.
    """

    def __init__(self, processors: LogitsProcessorList | None, batch_size: int):
        self.processors = processors if processors is not None else LogitsProcessorList()
        self.prefix_free = all(isinstance(p, _PREFIX_FREE) for p in self.processors)

    @property
    def is_identity(self) -> bool:
        return len(self.processors) == 0

    def __call__(self, logits: torch.Tensor, seq: torch.LongTensor, prefix_len: torch.LongTensor) -> torch.Tensor:
        """Processes ``logits`` of shape ``(batch, T, vocab)``.

        Position ``t`` of row ``b`` is scored with prefix ``seq[b, : prefix_len[b] + t]``.
        """
        if self.is_identity:
            return logits
        bsz, t_len, vocab = logits.shape
        if self.prefix_free:
            ids = seq[:, :1].repeat_interleave(t_len, dim=0)
            return self.processors(ids, logits.reshape(bsz * t_len, vocab)).reshape(bsz, t_len, vocab)
        out = torch.empty_like(logits)
        lens = prefix_len.to(logits.device)[:, None] + torch.arange(t_len, device=logits.device)[None]
        rows = torch.arange(bsz, device=logits.device)
        for length in torch.unique(lens).tolist():
            match = lens == length  # (bsz, t_len): at most one position per row
            has = match.any(dim=1)
            t_idx = match.long().argmax(dim=1)
            scores = self.processors(seq[:, :length], logits[rows, t_idx].clone())
            out[rows[has], t_idx[has]] = scores[has]
        return out
