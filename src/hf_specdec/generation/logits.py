"""Applying transformers logits processors at many positions at once, exactly as plain `generate` would.

Plain ``generate`` calls each processor once per step with the batch's prefixes. A speculative pass scores many
positions at once (a chain's draft tokens, or every node of a tree), and each position must be scored with exactly
the prefix plain ``generate`` would have shown at that point: the row's (left-padded) prompt, its committed tokens,
and the draft tokens on the path to that position. That means calling processors more often than plain ``generate``
does, on prefixes that are then thrown away, which is only sound for processors whose output is a pure function of
``(input_ids, scores)``. Such processors are listed here (transformers' own stateless processors); any other
processor, a user's own included, is refused with a clear error unless it is declared stateless with
:func:`register_stateless_logits_processor` (or a class attribute ``hf_specdec_stateless = True``).
"""

from __future__ import annotations

import inspect

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

__all__ = ["ScoreProcessor", "register_stateless_logits_processor", "STATELESS_PROCESSORS"]

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

# Prefix-dependent processors that keep no state between calls: calling them again on other prefixes is harmless.
STATELESS_PROCESSORS: list[type] = [
    *_PREFIX_FREE,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    ExponentialDecayLengthPenalty,
    SuppressTokensAtBeginLogitsProcessor,
]


def register_stateless_logits_processor(cls: type) -> type:
    """Declares a logits processor class safe for speculative decoding (usable as a class decorator).

    Only do this for processors whose output is a pure function of ``(input_ids, scores)`` with the batch layout
    of ``generate`` (row ``b`` of ``input_ids`` is request ``b``): hf_specdec calls them on the prefix of every
    draft position, including positions that are then rejected.
    """
    if cls not in STATELESS_PROCESSORS:
        STATELESS_PROCESSORS.append(cls)
    return cls


def _is_stateless(proc) -> bool:
    return isinstance(proc, tuple(STATELESS_PROCESSORS)) or bool(getattr(proc, "hf_specdec_stateless", False))


def _check_arguments(processors: LogitsProcessorList) -> None:
    """Refuses a processor that needs more than ``(input_ids, scores)``: ``generate`` passes it nothing more, and
    ``LogitsProcessorList`` would refuse it at its first call."""
    for processor in processors:
        names = list(inspect.signature(processor.__call__).parameters)
        if len(names) > 2:
            raise ValueError(
                f"Logits processor {type(processor).__name__} takes {names}, but processors are called with "
                "(input_ids, scores) only; give it its other arguments when you build it."
            )


class ScoreProcessor:
    """Processes target or draft logits at arbitrary positions of ragged rows.

    Prefix-free processors (temperature, top-k/p, ...) run once over all positions. Prefix-dependent ones
    (repetition penalty, min-new-tokens, n-gram blocking, ...) run once per distinct prefix (length), always on the
    whole batch so that processors holding per-row configuration (e.g. ``prefix_allowed_tokens_fn``'s batch index)
    see the batch layout they were built for; only the rows whose prefix it is keep the result.
    """

    def __init__(self, processors: LogitsProcessorList | None, batch_size: int):
        from .grammar import speculation_safe_processor

        self.processors = LogitsProcessorList(speculation_safe_processor(p) for p in processors or ())
        unsafe = [type(p).__name__ for p in self.processors if not _is_stateless(p)]
        if unsafe:
            raise ValueError(
                f"Logits processor(s) {unsafe} cannot be used with speculative decoding: hf_specdec scores every "
                "draft position with its own prefix, so a processor runs on prefixes that are later rejected, which "
                "is only sound for processors that keep no state between calls. If yours is a pure function of "
                "(input_ids, scores), declare it with hf_specdec.generation.register_stateless_logits_processor(cls) "
                "(or set `hf_specdec_stateless = True` on the class); otherwise use plain generate. For grammar-"
                "constrained output pass xgrammar.contrib.hf.LogitsProcessor, outlines' XGrammarLogitsProcessor, "
                "OutlinesCoreLogitsProcessor or LLGuidanceLogitsProcessor, or hf_specdec.GrammarLogitsProcessor "
                "(xgrammar, outlines-core or llguidance states), whose grammar state hf_specdec drives itself."
            )
        _check_arguments(self.processors)
        self.prefix_free = all(isinstance(p, _PREFIX_FREE) for p in self.processors)
        grammars = [p for p in self.processors if hasattr(p, "forced_continuations")]
        self.grammar = grammars[0] if len(grammars) == 1 else None  # forced tokens: one grammar processor only

    def _apply(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """The processors in order, as ``LogitsProcessorList`` calls them without keywords (their arguments were
        checked once, in :func:`_check_arguments`, not at every call)."""
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores

    @property
    def is_identity(self) -> bool:
        return len(self.processors) == 0

    def _flat(self, seq: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        bsz, t_len, vocab = logits.shape
        ids = seq[:, :1] if t_len == 1 else seq[:, :1].repeat_interleave(t_len, dim=0)
        return self._apply(ids, logits.reshape(bsz * t_len, vocab)).reshape(bsz, t_len, vocab)

    def __call__(self, logits: torch.Tensor, seq: torch.LongTensor, prefix_len: torch.LongTensor) -> torch.Tensor:
        """Processes ``logits`` of shape ``(batch, T, vocab)`` along a chain.

        Position ``t`` of row ``b`` is scored with prefix ``seq[b, : prefix_len[b] + t]`` (the caller has written
        the chain's draft tokens into ``seq`` after each row's committed tokens).
        """
        if self.is_identity:
            return logits
        if self.prefix_free:
            return self._flat(seq, logits)
        bsz, t_len, _ = logits.shape
        out = torch.empty_like(logits)
        lens = prefix_len.to(logits.device)[:, None] + torch.arange(t_len, device=logits.device)[None]
        rows = torch.arange(bsz, device=logits.device)
        for length in torch.unique(lens).tolist():
            match = lens == length  # (bsz, t_len): at most one position per row
            has = match.any(dim=1)
            t_idx = match.long().argmax(dim=1)
            scores = self._apply(seq[:, :length], logits[rows, t_idx].clone())
            out[rows[has], t_idx[has]] = scores[has]
        return out

    def process_paths(
        self,
        logits: torch.Tensor,
        seq: torch.LongTensor,
        prefix_len: torch.LongTensor,
        path_tokens: torch.LongTensor,
        path_len: torch.LongTensor,
    ) -> torch.Tensor:
        """Processes ``logits`` of shape ``(batch, T, vocab)`` at positions with their own draft paths (trees).

        Position ``t`` of row ``b`` is scored with prefix ``seq[b, : prefix_len[b]] + path_tokens[b, t, :
        path_len[b, t]]``: the row's committed tokens, then the draft tokens from the root to that position.
        """
        if self.is_identity:
            return logits
        if self.prefix_free:
            return self._flat(seq, logits)
        bsz, t_len, _ = logits.shape
        dev = logits.device
        out = torch.empty_like(logits)
        rows = torch.arange(bsz, device=dev)
        prefix_len = prefix_len.to(dev)
        depth_max = path_tokens.shape[2]
        cols = torch.arange(depth_max, device=dev)[None]
        lens = prefix_len[:, None] + path_len.to(dev)  # (bsz, t_len)
        for t in range(t_len):
            for length in torch.unique(lens[:, t]).tolist():
                has = lens[:, t] == length
                ids = seq[:, :length].clone()
                pos = prefix_len[:, None] + cols  # where this position's path tokens go
                put = (cols < path_len[:, t, None].to(dev)) & (pos < length) & has[:, None]
                if depth_max:
                    ids[rows[:, None].expand_as(pos)[put], pos[put]] = path_tokens[:, t].to(dev)[put]
                scores = self._apply(ids, logits[:, t].clone())
                out[has, t] = scores[has]
        return out
