"""Feature-level autoregressive drafting: the decoding shared by the families that feed their own features back.

A draft decoder layer reads, for each slot, the embedding of the next token and a feature: the target's (fused) hidden
state for verified slots, the layer's own previous output for drafted ones. The family provides:

* ``fuse_target_features(features)``: the target states it reads -> ``(batch, seq, hidden)`` features;
* ``draft_layer(embeds, hidden, cos, sin, cache, valid, attn_mask=None, step=None)``: the layer over a
  :class:`~hf_specdec.layers.SlotKVCache`; ``step`` is ``None`` for verified context and ``j >= 1`` for the draft step
  that produces draft token ``j`` (0-based; token 0 comes from the verified context), so a family with one module
  per step can pick it;
* ``draft_logits(out)``: draft-vocabulary logits of layer outputs; ``rotary_emb``: its rotary embedding;
* optionally ``new_draft_cache()`` (default: one :class:`~hf_specdec.layers.SlotKVCache`) and
  ``draft_cache_index(step)`` (default 0): families whose steps write to different caches say which;

and registers its draft vocabulary (:meth:`~hf_specdec.DrafterPreTrainedModel.register_vocabulary_buffers`). This
mixin gives the draft state, ``observe``, chain ``propose`` (with an optional confidence stop) and tree drafting
(``tree_start`` / ``tree_expand``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .context_vocab import ContextCandidates
from .layers import SlotKVCache
from .types import DraftInputs, Proposal, TokenSelector

__all__ = ["FeatureDraftState", "FeatureAutoregressiveMixin"]


@dataclass
class FeatureDraftState:
    """Per-``generate`` drafter state: the draft KV cache and the latest verified output per row."""

    cache: SlotKVCache
    committed_slots: int = 0
    last_hidden: torch.Tensor | None = None  # (batch, hidden)
    last_logits: torch.Tensor | None = None  # (batch, draft_vocab)
    last_position: torch.Tensor | None = None  # (batch,)
    tree_hidden: torch.Tensor | None = None  # (batch, expanded nodes, hidden) while a tree is being drafted
    tree_nodes: dict | None = None  # draft cache index -> the expanded nodes whose slots it holds, in order
    confidence_threshold: float | None = None  # stop a row's chain when the draft's top probability falls below
    context: ContextCandidates | None = None  # with a context vocabulary: each row's tokens outside the vocabulary


class FeatureAutoregressiveMixin:
    """Decoding of feature-level autoregressive drafters (see the module docstring)."""

    supports_tree_drafting = True
    draft_options = {"draft_confidence_threshold": None}

    def _step(self, embeds, hidden, position_ids, valid, cache: SlotKVCache, step: int | None = None, state=None):
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.draft_layer(embeds, hidden, cos, sin, cache, valid, step=step)
        return out, self.widened_logits(state, out)

    def widened_logits(self, state: FeatureDraftState | None, out: torch.Tensor) -> torch.Tensor:
        """Draft logits of layer outputs: over the draft vocabulary, then (with a context vocabulary) over the row's
        candidates (see :mod:`hf_specdec.context_vocab`)."""
        logits = self.draft_logits(out)
        if state is None or state.context is None:
            return logits
        return state.context.extend(logits, self.output_features(out), self.context_vocab)

    def selector_vocab_ids(self, state: FeatureDraftState) -> torch.LongTensor | None:
        """The target ids of the draft logits' columns: ``None`` (the full vocabulary), the draft vocabulary's, or
        per row the draft vocabulary's and the row's candidates."""
        if state.context is not None:
            return state.context.union_ids(self.draft_token_ids)
        return self.draft_token_ids if self.config.draft_vocab_size != self.config.target_vocab_size else None

    def new_draft_cache(self):
        """The draft KV cache of one ``generate`` call (needs ``length``, ``valid``, ``crop`` and ``compact``)."""
        return SlotKVCache()

    def draft_cache_index(self, step: int) -> int:
        """Which of the draft cache's slot sequences draft step ``step`` writes to (one cache: 0)."""
        return 0

    # ------------------------------------------------------------------------------------------------------------
    # proposal interface
    # ------------------------------------------------------------------------------------------------------------
    def init_draft_state(
        self, batch_size: int, max_length: int, draft_confidence_threshold: float | None = None
    ) -> FeatureDraftState:
        if draft_confidence_threshold is not None and not 0.0 <= float(draft_confidence_threshold) <= 1.0:
            raise ValueError(
                f"draft_confidence_threshold must be a probability in [0, 1], got {draft_confidence_threshold!r}."
            )
        context = None
        if getattr(self, "context_vocab", None) is not None:
            context = ContextCandidates.empty(batch_size, self.config.hidden_size, self.device, self.dtype)
        return FeatureDraftState(
            cache=self.new_draft_cache(), confidence_threshold=draft_confidence_threshold, context=context
        )

    def observe(self, state: FeatureDraftState, inputs: DraftInputs) -> None:
        # Drop the speculative slots of the last proposal; the verified slots below replace them.
        state.cache.crop(state.committed_slots)
        feats = self.select_target_features(inputs.hidden_states)
        hidden = self.fuse_target_features(feats)
        embeds = self.embed_target_tokens(inputs.next_token_ids)
        valid = inputs.valid.to(self.device)
        positions = inputs.position_ids.to(self.device)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        out = self.draft_layer(embeds, hidden, cos, sin, state.cache, valid)
        state.cache.compact()  # batched rows leave dead slots (padding, rejected tokens): drop them now and then
        state.committed_slots = state.cache.length
        # Latest verified slot of each row: only its logits are needed (the first draft token).
        slot = torch.arange(valid.shape[1], device=valid.device)
        last = torch.where(valid, slot, -1).max(dim=1).values.clamp(min=0)
        rows = torch.arange(valid.shape[0], device=valid.device)
        if state.context is not None:
            ids = inputs.next_token_ids.to(self.device)
            head = self._borrowed("lm_head").weight
            state.context.add(ids, valid, ~self.t2d[ids], self.context_vocab, head)
        state.last_hidden = out[rows, last]
        state.last_logits = self.widened_logits(state, state.last_hidden)
        state.last_position = positions[rows, last]

    def propose(self, state: FeatureDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """Drafts a chain; with ``draft_confidence_threshold`` (a ``generate`` option) a row stops before the first
        depth whose draft distribution has a top probability below the threshold, so rows propose different lengths.

        The stop is decided from the distribution *before* its token is drawn, so it never depends on the drawn
        token and lossless sampling stays exact."""
        tokens, probs = [], []
        logits, hidden = state.last_logits, state.last_hidden
        bsz = hidden.shape[0]
        ones = torch.ones(bsz, 1, dtype=torch.bool, device=hidden.device)
        vocab_ids = self.selector_vocab_ids(state)
        threshold = state.confidence_threshold
        lengths = torch.zeros(bsz, dtype=torch.long, device=hidden.device)
        alive = torch.ones(bsz, dtype=torch.bool, device=hidden.device)
        for depth in range(num_tokens):
            if threshold is not None:
                alive &= torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= threshold
                if depth > 0 and not bool(alive.any()):
                    break
                lengths += alive.long()
            tok, q = select(logits.float(), depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
            if depth == num_tokens - 1:
                break
            pos = (state.last_position + 1 + depth)[:, None]
            out, step_logits = self._step(
                self.embed_target_tokens(tok[:, None]),
                hidden[:, None],
                pos,
                ones,
                state.cache,
                step=depth + 1,
                state=state,
            )
            hidden, logits = out[:, 0], step_logits[:, 0]
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            draft_probs=draft_probs,
            kind="chain",
            lengths=lengths if threshold is not None else None,
        )

    # ------------------------------------------------------------------------------------------------------------
    # tree drafting (EAGLE-2 dynamic trees and static trees; see hf_specdec.tree)
    # ------------------------------------------------------------------------------------------------------------
    def tree_start(self, state: FeatureDraftState):
        """Root of a tree proposal: the draft distribution after the last verified token."""
        state.cache.crop(state.committed_slots)  # drop the slots of an earlier tree or chain proposal
        state.tree_hidden = None
        state.tree_nodes = {}
        return state.last_logits, self.selector_vocab_ids(state)

    def tree_expand(self, state: FeatureDraftState, expansion) -> torch.Tensor:
        """One draft-layer step over ``M`` tree nodes of one depth: each reads its parent's draft hidden state (the
        last verified state for children of the root) and its own token, at position ``last + depth``, and attends
        to the verified slots plus the slots of its expanded ancestors. Returns ``(batch, M, draft_vocab)``."""
        bsz, m = expansion.tokens.shape
        dev = state.last_hidden.device
        parent = expansion.parent.to(dev)
        if state.tree_hidden is None:
            parent_hidden = state.last_hidden[:, None].expand(bsz, m, -1)
        else:
            idx = parent.clamp_min(0)[..., None].expand(-1, -1, state.tree_hidden.shape[-1])
            parent_hidden = torch.where(
                (parent >= 0)[..., None], state.tree_hidden.gather(1, idx), state.last_hidden[:, None]
            )
        committed = state.committed_slots
        expanded = 0 if state.tree_hidden is None else state.tree_hidden.shape[1]
        step = int(expansion.depth)
        # the nodes already in the cache this step writes to (all expanded nodes with one cache), in slot order
        earlier = state.tree_nodes.setdefault(self.draft_cache_index(step), [])
        valid_prev = (
            state.cache.valid[:, :committed] if committed else torch.zeros(bsz, 0, dtype=torch.bool, device=dev)
        )
        mask = torch.cat(
            [
                valid_prev[:, None].expand(bsz, m, committed),
                expansion.ancestors.to(dev)[:, :, :expanded][:, :, earlier],
                torch.eye(m, dtype=torch.bool, device=dev)[None].expand(bsz, m, m),
            ],
            dim=2,
        )
        earlier.extend(range(expanded, expanded + m))
        pos = (state.last_position + expansion.depth)[:, None].expand(bsz, m)
        cos, sin = self.rotary_emb(pos, parent_hidden.dtype)
        embeds = self.embed_target_tokens(expansion.tokens)
        ones = torch.ones(bsz, m, dtype=torch.bool, device=dev)
        out = self.draft_layer(embeds, parent_hidden, cos, sin, state.cache, ones, attn_mask=mask, step=step)
        state.tree_hidden = out if state.tree_hidden is None else torch.cat([state.tree_hidden, out], dim=1)
        return self.widened_logits(state, out).float()
