"""The data passed between the decoding loop, drafters and verifiers, and what ``generate`` returns.

Below everything: this module imports nothing from hf_specdec, so drafters, trees and verifiers can name these types
without loading the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

__all__ = [
    "Proposal",
    "TokenSelector",
    "DraftInputs",
    "VerificationFeedback",
    "VerificationResult",
    "SpeculativeDecoderOnlyOutput",
]

PROPOSAL_KINDS = ("chain", "tree")


@dataclass
class Proposal:
    """Draft tokens proposed for one decoding step of a batch.

    Attributes:
        tokens: ``(batch, num_nodes)`` proposed target-vocabulary token ids.
        draft_probs: ``(batch, num_nodes, vocab)`` the distribution ``q`` each token was drawn from, in the target
            vocabulary after logits processing; ``None`` when the draft is deterministic (greedy decoding).
        kind: ``"chain"`` (node ``i`` follows node ``i - 1``, however the drafter produced it: token by token or
            a block in one pass) or ``"tree"`` (structure in ``parents``).
        parents: for trees, ``(num_nodes,)`` or ``(batch, num_nodes)`` index of each node's parent, ``-1`` for
            children of the last committed token; parents come before their children. ``None`` for chains.
        lengths: ``(batch,)`` number of real nodes per row (a drafter may propose fewer tokens than asked, per row,
            e.g. when it stops at low confidence); nodes at index ``>= lengths[b]`` are padding that no verifier
            accepts. ``None``: every node is real.
        extras: family-specific data the drafter wants back with the verification feedback.

    A drafter that proposes no tokens at all for every row returns ``num_nodes == 0`` (a plain decoding step).
    For trees, ``draft_probs[b, i]`` is the distribution node ``i`` was drawn from *given its earlier siblings*
    (e.g. renormalised without them when sampling without replacement); ``None`` means every node is a
    deterministic choice (for instance the top-k of the draft distribution), which lossless tree sampling treats as
    a point mass.
    """

    tokens: torch.LongTensor
    draft_probs: torch.FloatTensor | None = None
    kind: str = "chain"
    parents: torch.LongTensor | None = None
    lengths: torch.LongTensor | None = None
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in PROPOSAL_KINDS:
            raise ValueError(f"Proposal.kind must be one of {PROPOSAL_KINDS}, got {self.kind!r}")
        if self.tokens.dim() != 2:
            raise ValueError(f"Proposal.tokens must be (batch, num_nodes); got shape {tuple(self.tokens.shape)}.")
        if self.kind == "tree":
            if self.parents is None:
                raise ValueError("A tree proposal needs `parents`.")
        elif self.parents is not None:
            raise ValueError(f"A {self.kind!r} proposal has no `parents`; use kind='tree' for trees.")
        if self.lengths is not None:
            self.lengths = torch.as_tensor(self.lengths, dtype=torch.long, device=self.tokens.device)
            if self.lengths.shape != (self.tokens.shape[0],):
                raise ValueError(
                    f"Proposal.lengths must have shape (batch,) = ({self.tokens.shape[0]},); got "
                    f"{tuple(self.lengths.shape)}."
                )
            if bool(((self.lengths < 0) | (self.lengths > self.num_nodes)).any()):
                raise ValueError(f"Proposal.lengths must lie in [0, {self.num_nodes}]; got {self.lengths.tolist()}.")

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def is_linear(self) -> bool:
        return self.kind == "chain"

    def node_valid(self) -> torch.BoolTensor:
        """``(batch, num_nodes)`` True for real nodes (False for padding past ``lengths``)."""
        bsz, n = self.tokens.shape
        col = torch.arange(n, device=self.tokens.device)[None].expand(bsz, n)
        if self.lengths is None:
            return torch.ones(bsz, n, dtype=torch.bool, device=self.tokens.device)
        return col < self.lengths[:, None]

    def batched_parents(self) -> torch.LongTensor:
        """``(batch, num_nodes)`` parents (chains: each node's parent is the node before it)."""
        bsz, n = self.tokens.shape
        if self.parents is None:
            return (torch.arange(n, device=self.tokens.device) - 1)[None].expand(bsz, n)
        parents = torch.as_tensor(self.parents, dtype=torch.long, device=self.tokens.device)
        return parents[None].expand(bsz, n) if parents.dim() == 1 else parents


@dataclass
class DraftInputs:
    """Verified context handed to a drafter after each target pass (and after the prefill).

    Slot ``t`` of row ``b`` pairs the target state at position ``position_ids[b, t]`` with the token that follows it,
    ``next_token_ids[b, t]``; slots with ``valid[b, t] == False`` are padding (left padding of the prompt, or
    rejected draft tokens of rows that accepted fewer tokens than others).

    Attributes:
        next_token_ids: ``(batch, slots)`` token at position ``p + 1`` for the target state at position ``p``.
        position_ids: ``(batch, slots)`` target positions of the states.
        valid: ``(batch, slots)`` bool.
        hidden_states: the target's ``output_hidden_states`` tuple restricted to these slots (``None`` if the
            drafter declared it needs none).
        logits: ``(batch, slots, vocab)`` raw target logits for these slots (always given after a decoding pass;
            after the prefill only for drafters that set ``requires_target_logits``).
        feedback: after a decoding pass, what became of the drafter's last proposal (``None`` after the prefill
            and after plain steps, where the drafter proposed nothing).
    """

    next_token_ids: torch.LongTensor
    position_ids: torch.LongTensor
    valid: torch.BoolTensor
    hidden_states: tuple[torch.Tensor | None, ...] | None = None
    logits: torch.Tensor | None = None
    feedback: VerificationFeedback | None = None


@dataclass
class VerificationFeedback:
    """What the verifier did with a proposal, handed back to the drafter (online adaptation, KV reuse of nodes).

    Attributes:
        proposal: the proposal this feedback belongs to (the object :meth:`propose` returned).
        num_accepted: ``(batch,)`` draft tokens kept per row (0 for rows that had finished).
        accepted_nodes: ``(batch, max_accepted)`` node indices of the kept path, in order, ``-1`` padded. For
            chains this is ``0..num_accepted-1``.
        step: 0-based index of the decoding pass within this ``generate`` call.
    """

    proposal: Proposal
    num_accepted: torch.LongTensor
    accepted_nodes: torch.LongTensor
    step: int = 0


class TokenSelector(Protocol):
    """Turns draft logits into draft tokens, consistently with the verifier (supplied by the loop)."""

    do_sample: bool

    def __call__(
        self, logits: torch.Tensor, depth: int, vocab_ids: torch.LongTensor | None = None
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """Selects one token per row.

        Args:
            logits: ``(batch, vocab)`` draft logits in the *target* vocabulary, or, with ``vocab_ids``, over a
                reduced draft vocabulary.
            depth: 0-based index of this token in the proposal (the loop uses it to build the logits processors'
                prefix: the committed tokens plus the ``depth`` draft tokens before it).
            vocab_ids: ``(draft_vocab,)`` target ids of the columns of ``logits`` when they cover a reduced draft
                vocabulary (tokens outside it get probability 0). Lets greedy decoding skip building a
                full-vocabulary tensor.

        Returns:
            ``(tokens, probs)``: ``(batch,)`` token ids and the ``(batch, vocab)`` distribution they were drawn from
            (``None`` when decoding greedily).
        """
        ...


@dataclass
class VerificationResult:
    """Outcome of verifying one proposal for a batch.

    Attributes:
        num_accepted: ``(batch,)`` number of draft tokens kept (the bonus token is not counted here).
        tokens: ``(batch, n + 1)`` for each row, its ``num_accepted`` kept tokens followed by the bonus token at index
            ``num_accepted``; entries after that are unspecified.
        path: ``(batch, n)`` for tree proposals, the node indices of the kept path (``None`` for chains,
            where the kept nodes are ``0..num_accepted-1``).
        stats: verifier-specific per-row statistics of the pass.
        token_stats: verifier-specific statistics per accepted position, ``(batch, L)``, position ``j`` describing
            ``tokens[:, j]`` (e.g. ASD's regret spent on it). The loop sums them over the tokens it actually commits,
            so tokens cut by EOS or the length limit are never counted.
    """

    num_accepted: torch.LongTensor
    tokens: torch.LongTensor
    path: torch.LongTensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    token_stats: dict[str, torch.Tensor] = field(default_factory=dict)


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
