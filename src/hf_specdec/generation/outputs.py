"""Output type of speculative generation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = ["SpeculativeDecoderOnlyOutput"]


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """:class:`~transformers.generation.GenerateDecoderOnlyOutput` plus speculative-decoding statistics.

    Attributes (in addition to ``sequences``, ``scores``, ``logits``, ``cache``):
        accepted_lengths: per row, the number of tokens committed by each verification pass while the row was
            unfinished, *counting the bonus token* (so every entry is in ``1..num_draft_tokens + 1``; the token
            produced by the prefill pass is not included). Entries are cut by EOS / the length limit.
        draft_lengths: per row, the number of draft tokens proposed for each of those passes (aligned with
            ``accepted_lengths``; smaller than ``num_draft_tokens`` near the length limit or when the drafter stops
            early; for trees, the number of tree nodes).
        timings: wall-clock seconds of the whole call, split into ``prefill_s`` (first target pass), ``target_s``
            (verification passes), ``draft_s`` (drafter: observing verified tokens and proposing) and ``verify_s``
            (acceptance rule and bookkeeping); ``draft_steps`` (sequential draft positions: chain tokens proposed, or
            the depth of each tree) and ``passes`` (verification passes), counted once per batch. Exact on CPU; pass ``spec_timing=True`` for exact figures on CUDA.
        num_target_forwards: ``(batch,)`` target forward passes each row took part in before finishing, the
            prefill included.
        num_draft_tokens: the draft length ``K`` used.
        verifier: name of the verifier; ``approximate`` is ``True`` for verifiers that may deviate from the
            target's own decoding.
        verifier_stats: per-row statistics of the verifier (e.g. ASD's regret spent), if any.

    ``mean_accepted_length`` (τ) is the mean of ``accepted_lengths`` over all iterations of all rows.
    """

    accepted_lengths: list[list[int]] | None = None
    draft_lengths: list[list[int]] | None = None
    timings: dict | None = None
    num_target_forwards: torch.LongTensor | None = None
    num_draft_tokens: int | None = None
    verifier: str | None = None
    approximate: bool | None = None
    verifier_stats: dict | None = None

    @property
    def mean_accepted_length(self) -> float:
        lengths = [x for row in (self.accepted_lengths or []) for x in row]
        return float(sum(lengths) / len(lengths)) if lengths else float("nan")

    def row_mean_accepted_length(self) -> list[float]:
        return [float(sum(r) / len(r)) if r else float("nan") for r in (self.accepted_lengths or [])]
