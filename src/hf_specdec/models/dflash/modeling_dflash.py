"""DFlash block drafter (Chen, Liang and Liu, arXiv 2602.06036), written for hf_specdec's proposal interface.

Every draft layer attends to the fused target context (its own projections of ``H_ctx``, cached per layer) and, without
a causal mask, to the block ``[anchor, MASK, ...]``; slot ``i >= 1`` of the block drafts the token ``i`` places after
the anchor. A block's tokens do not depend on each other, so a chain is the slots' choices in order and a tree takes
each node's children from the slot of its depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...features import walk_metrics, walk_passes
from ...layers import GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache, apply_rotary, compaction_index
from ...modeling_utils import DrafterPreTrainedModel, DraftLossOutput
from ...types import DraftInputs, Proposal, TokenSelector
from .configuration_dflash import DFlashConfig

__all__ = ["DFlashForDrafting", "DFlashAttention", "DFlashDecoderLayer", "DFlashDraftState"]


class DFlashAttention(nn.Module):
    """Attention whose keys and values are the layer's projections of the target context followed by the block's
    (``q_norm`` / ``k_norm`` per head, then RoPE)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def key_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        bsz, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """``x``: ``(B, Q, H)`` block slots; ``ctx_k`` / ``ctx_v``: ``(B, kv_heads, S, d)``; ``mask``: ``(B, Q, S + Q)``
        bool (which context and block keys each query sees)."""
        bsz, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.key_values(x, cos, sin)
        keys, values = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DFlashDraftState:
    """Per-``generate`` state: each layer's context keys / values, the anchor (last verified token) and its
    position per row, and the block's draft logits once computed."""

    caches: list
    positions: torch.Tensor | None = None  # (batch, slots) positions of the context slots (sliding windows)
    anchor: torch.Tensor | None = None  # (batch,) the last verified token
    position: torch.Tensor | None = None  # (batch,) its position
    logits: torch.Tensor | None = None  # (batch, drafts per block, draft_vocab): the backbone's slot logits
    hidden: torch.Tensor | None = None  # (batch, drafts per block, hidden): the normed slot states


class DFlashForDrafting(DrafterPreTrainedModel):
    """DFlash: one non-causal pass over ``[anchor, MASK, ...]`` with the target context in every layer's keys.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(DFlashConfig.for_target(target.config, block_size=8))
        >>> out = target.generate(**inputs, assistant_model=drafter)
    """

    config_class = DFlashConfig
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    borrows_target_lm_head = True
    supports_tree_drafting = True
    max_draft_depth_source = "block_size - 1"
    # Block slot that drafts the first token: 1 (DFlash: slot i predicts the token at its own position); a family
    # whose anchor slot predicts the next token sets 0 (block_size drafts per pass).
    first_draft_slot: int = 1
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc")
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        n = len(config.target_layer_ids or [None])
        self.fc = nn.Linear(n * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_vocabulary_buffers(config)
        self.build_extra_modules(config)
        self.post_init()

    def build_extra_modules(self, config) -> None:
        """Modules a family built on this backbone adds (before ``post_init``, so they get its init)."""

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_draft_slot

    @property
    def max_draft_depth(self) -> int:
        return self.drafts_per_block

    def context(self, features) -> torch.Tensor:
        """``H_ctx = hidden_norm(fc([H_1; ...; H_n]))`` from the selected target states."""
        feats = torch.cat([f.to(device=self.device, dtype=self.fc.weight.dtype) for f in features], dim=-1)
        return self.hidden_norm(self.fc(feats))

    def _layers(self, x, positions, ctx_kv, mask, key_positions) -> torch.Tensor:
        """The draft layers over block slots ``x`` at ``positions`` ``(B, Q)``; ``mask`` ``(B, Q, S + Q)``;
        ``key_positions`` ``(B, S + Q)`` the keys' positions (sliding-window layers also drop keys farther than
        ``sliding_window`` from the query)."""
        cos, sin = self.rotary_emb(positions, x.dtype)
        window = self.config.sliding_window
        near = None
        if window is not None and "sliding_attention" in self.config.layer_types:
            near = mask & ((positions[:, :, None] - key_positions[:, None]).abs() <= int(window))
        for layer, kind, (k, v) in zip(self.layers, self.config.layer_types, ctx_kv):
            x = layer(x, cos, sin, k, v, near if kind == "sliding_attention" else mask)
        return self.norm(x)

    # -- decoding ----------------------------------------------------------------------------------------------------
    def init_draft_state(self, batch_size: int, max_length: int) -> DFlashDraftState:
        return DFlashDraftState(caches=[SlotKVCache() for _ in self.layers])

    def observe(self, state: DFlashDraftState, inputs: DraftInputs) -> None:
        ctx = self.context(self.select_target_features(inputs.hidden_states))
        positions = inputs.position_ids.to(self.device)
        valid = inputs.valid.to(self.device)
        cos, sin = self.rotary_emb(positions, ctx.dtype)
        for layer, cache in zip(self.layers, state.caches):
            k, v = layer.self_attn.key_values(ctx, cos, sin)
            cache.append(k, v, valid)
        state.positions = positions if state.positions is None else torch.cat([state.positions, positions], dim=1)
        plan = compaction_index(state.caches[0].valid)  # every layer holds the same slots: one plan for all
        if plan is not None:
            for cache in state.caches:
                cache.compact()
            state.positions = state.positions.gather(1, plan[0])
        slot = torch.arange(valid.shape[1], device=valid.device)
        last = torch.where(valid, slot, -1).max(dim=1).values
        rows = torch.arange(valid.shape[0], device=valid.device)
        anchor = inputs.next_token_ids.to(self.device)[rows, last.clamp(min=0)]
        position = positions[rows, last.clamp(min=0)] + 1
        if state.anchor is not None:  # a row without a verified slot here (it finished) keeps its anchor
            anchor = torch.where(last < 0, state.anchor, anchor)
            position = torch.where(last < 0, state.position, position)
        state.anchor, state.position, state.logits, state.hidden = anchor, position, None, None

    def _block_logits(self, state: DFlashDraftState) -> torch.Tensor:
        """The backbone's draft-slot logits ``(B, drafts_per_block, V')`` (one block pass per verified context)."""
        if state.logits is None:
            bsz, bs = state.anchor.shape[0], self.block_size
            tokens = torch.full((bsz, bs), int(self.config.mask_token_id), dtype=torch.long, device=self.device)
            tokens[:, 0] = state.anchor
            x = self.embed_target_tokens(tokens).to(self.fc.weight.dtype)
            positions = state.position[:, None] + torch.arange(bs, device=self.device)
            cache0 = state.caches[0]
            mask = torch.cat(
                [cache0.valid[:, None].expand(bsz, bs, -1), torch.ones(bsz, bs, bs, dtype=torch.bool, device=x.device)],
                dim=2,
            )
            kv = [(c.keys, c.values) for c in state.caches]
            key_positions = torch.cat([state.positions, positions], dim=1)
            hidden = self._layers(x, positions, kv, mask, key_positions)[:, self.first_draft_slot :]
            state.hidden = hidden
            state.logits = self.target_head_logits(hidden).float()
        return state.logits

    def slot_logits(self, state: DFlashDraftState, depth: int, previous: torch.Tensor) -> torch.Tensor:
        """The draft distribution of draft token ``depth`` given the token before it (``previous``, ``(B,)`` or
        ``(B, M)`` for tree nodes; the anchor at depth 0). DFlash's slots do not read it."""
        logits = self._block_logits(state)[:, depth]
        return logits if previous.dim() == 1 else logits[:, None].expand(*previous.shape, logits.shape[-1])

    def propose(self, state: DFlashDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """Draft token ``j`` is drawn from block slot ``j + first_draft_slot`` (at most ``drafts_per_block``)."""
        vocab_ids = self.reduced_vocab_ids()
        tokens, probs = [], []
        previous = state.anchor
        for depth in range(min(int(num_tokens), self.drafts_per_block)):
            tok, q = select(self.slot_logits(state, depth, previous), depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
            previous = tok
        draft_probs = torch.stack(probs, dim=1) if probs[0] is not None else None
        return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs)

    def tree_start(self, state: DFlashDraftState):
        return self.slot_logits(state, 0, state.anchor), self.reduced_vocab_ids()

    def tree_expand(self, state: DFlashDraftState, expansion) -> torch.Tensor:
        """The draft distribution after each node at depth ``d``: block slot ``d + first_draft_slot``'s, given the
        node's own token (DFlash's slots do not read it)."""
        depth = int(expansion.depth)
        if depth >= self.drafts_per_block:
            raise ValueError(
                f"{type(self).__name__} drafts {self.drafts_per_block} tokens per block, so its trees are at most that "
                f"deep; this tree expands nodes at depth {depth}. Use tree_depth <= {self.drafts_per_block}."
            )
        return self.slot_logits(state, depth, expansion.tokens.to(self.device)).float()

    # -- training ----------------------------------------------------------------------------------------------------
    def block_states(self, input_ids, features, attention_mask, anchors) -> torch.Tensor:
        """Teacher-forced blocks over a sequence: ``anchors`` ``(B, A)`` are the positions of the blocks' anchor
        tokens; each block sees the target context strictly before its anchor and itself (blocks do not see each
        other). Returns the normed states of the draft slots, ``(B, A, drafts_per_block, hidden)``: draft ``j``
        predicts the token at ``anchor + 1 + j``."""
        bsz, t = input_ids.shape
        bs = self.block_size
        a = anchors.shape[1]
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=self.device)
            if attention_mask is None
            else attention_mask.to(self.device).bool()
        )
        anchors = anchors.to(self.device)
        ctx = self.context(features)
        cos, sin = self.rotary_emb(torch.arange(t, device=self.device)[None].expand(bsz, t), ctx.dtype)
        kv = [layer.self_attn.key_values(ctx, cos, sin) for layer in self.layers]
        tokens = torch.full((bsz, a, bs), int(self.config.mask_token_id), dtype=torch.long, device=self.device)
        tokens[:, :, 0] = input_ids.to(self.device).gather(1, anchors.clamp(0, t - 1))
        x = self.embed_target_tokens(tokens.view(bsz, a * bs)).to(ctx.dtype)
        positions = (anchors[:, :, None] + torch.arange(bs, device=self.device)).view(bsz, a * bs)
        block_of = torch.arange(a, device=self.device).repeat_interleave(bs)
        sees_ctx = torch.arange(t, device=self.device)[None, None] < anchors.repeat_interleave(bs, dim=1)[:, :, None]
        sees_ctx = sees_ctx & valid[:, None]
        same_block = (block_of[:, None] == block_of[None])[None].expand(bsz, -1, -1)
        mask = torch.cat([sees_ctx, same_block], dim=2)
        key_positions = torch.cat([torch.arange(t, device=self.device)[None].expand(bsz, t), positions], dim=1)
        hidden = self._layers(x, positions, kv, mask, key_positions)
        return hidden.view(bsz, a, bs, -1)[:, :, self.first_draft_slot :]

    def block_logits(self, input_ids, features, attention_mask, anchors) -> torch.Tensor:
        """The backbone's logits of the draft slots of blocks at ``anchors``: ``(B, A, drafts_per_block, V')``."""
        return self.target_head_logits(self.block_states(input_ids, features, attention_mask, anchors))

    def teacher_forced_slot_logits(self, states, input_ids, anchors, depth: int) -> torch.Tensor:
        """Draft ``depth``'s logits ``(B, A, V')`` of blocks at ``anchors`` from their :meth:`block_states`, the
        drafts before it teacher-forced from ``input_ids`` (DFlash's slots do not read them)."""
        return self.target_head_logits(states[:, :, depth])

    def teacher_forced_logits(self, input_ids, features, attention_mask=None, steps: int | None = None):
        """Per depth ``j``: ``(B, T - 1, draft_vocab)``, anchor ``t`` (the last verified position) predicting token
        ``t + 2 + j`` (its block's anchor token is ``t + 1``), as :meth:`propose` drafts after ``observe``."""
        bsz, t = input_ids.shape
        anchors = torch.arange(1, t, device=self.device)[None].expand(bsz, t - 1)
        states = self.block_states(input_ids, features, attention_mask, anchors)
        steps = self.drafts_per_block if steps is None else min(int(steps), self.drafts_per_block)
        ids = input_ids.to(self.device)
        return [self.teacher_forced_slot_logits(states, ids, anchors, j) for j in range(steps)]

    def slot_loss(self, depth: int, logits, state, labels, target, ok, previous) -> tuple:
        """One draft slot's loss over blocks: ``(weighted, plain, metrics)``, sums over the scored anchors ``ok``;
        ``weighted`` gets the slot's position decay; ``previous`` ``(B, A)`` is the token before the draft. DFlash:
        the cross-entropy against ``labels`` (the teacher's distribution, ``(B, A, V')``) or, with hard labels,
        against ``target`` (``(B, A)`` draft ids)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(labels * logp).sum(-1) if target is None else -logp.gather(-1, target.clamp_min(0)[..., None])[..., 0]
        return (ce * ok).sum(), logits.new_zeros(()), {}

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``sum_k exp(-(k - 1) / gamma) * L_k`` over the draft slots (each the mean over the scored anchors of
        :meth:`slot_loss`), on ``num_anchors`` random anchors per sequence in training and every anchor in evaluation.
        Metrics: per-slot accuracy and the simulated walk over the anchors computed."""
        cfg = self.config
        loss_mask, soft, in_vocab, hard = self.loss_targets(batch, features, target_head, loss_kwargs, cfg.loss_labels)
        ids = batch["input_ids"].to(self.device)
        attn = batch.get("attention_mask")
        feats = [f.to(self.device, self.dtype) for f in features.hidden_states]
        bsz, t = ids.shape
        depth = self.drafts_per_block
        probs, top = soft.probs.to(self.device), soft.argmax.to(self.device)
        # anchor t (last verified position) drafts tokens t + 2 + j; it is worth scoring if its first label is a loss token
        useful = torch.zeros(bsz, t, dtype=torch.bool, device=self.device)
        useful[:, : t - 2] = loss_mask[:, 2:]
        if self.training:
            scores = torch.rand(bsz, t, device=self.device).masked_fill(~useful, -1.0)
            picked, order = scores.topk(min(int(cfg.num_anchors), t), dim=1)
            chunks = [(order, picked >= 0)]
        else:
            every = torch.arange(t, device=self.device)[None].expand(bsz, t)
            step = int(cfg.num_anchors)
            chunks = [(every[:, i : i + step], useful[:, i : i + step]) for i in range(0, t, step)]
        weighted = [torch.zeros((), device=self.device) for _ in range(depth)]
        plain = torch.zeros((), device=self.device)
        n = torch.zeros(depth, device=self.device)
        correct = torch.zeros(depth, device=self.device)
        extra: dict[str, torch.Tensor] = {}
        accepted = torch.zeros(bsz, t, dtype=torch.long, device=self.device)
        for anchors, keep in chunks:
            block_anchor = (anchors + 1).clamp(max=t - 1)
            states = self.block_states(ids, feats, attn, block_anchor)
            chain = keep.clone()
            for j in range(depth):
                pred = anchors + 2 + j
                pred_c, lab_c = pred.clamp(max=t - 1), (anchors + 1 + j).clamp(max=t - 1)
                ok = keep & (pred < t) & loss_mask.gather(1, pred_c) & in_vocab.gather(1, lab_c)
                target = None
                if hard is not None:
                    target = hard.gather(1, pred_c)
                    ok = ok & (target >= 0)
                logits = self.teacher_forced_slot_logits(states, ids, block_anchor, j)
                labels = probs.gather(1, lab_c[..., None].expand(-1, -1, probs.shape[-1]))
                previous = ids.gather(1, (block_anchor + j).clamp(max=t - 1))  # the token before draft j
                w_sum, p_sum, more = self.slot_loss(j, logits, states[:, :, j], labels, target, ok, previous)
                weighted[j] = weighted[j] + w_sum
                plain = plain + p_sum
                for key, value in more.items():
                    extra[key] = extra.get(key, 0) + value
                n[j] = n[j] + ok.sum()
                hit = (logits.argmax(-1) == top.gather(1, lab_c)) & ok
                correct[j] = correct[j] + hit.sum().detach()
                chain = chain & hit
                accepted.scatter_add_(1, anchors, chain.long())
        decay = [math.exp(-j / cfg.decay_gamma) for j in range(depth)]
        loss = sum(w * term / c.clamp(min=1) for w, term, c in zip(decay, weighted, n)) + plain / n.sum().clamp(min=1)
        metrics = {"correct": correct, "valid": n.detach(), **{k: v.detach() for k, v in extra.items()}}
        k = min(int(cfg.num_draft_tokens or depth), depth)
        metrics.update(walk_metrics(walk_passes(accepted, loss_mask, k), device=self.device))
        return DraftLossOutput(loss=loss, metrics=metrics, accepted=accepted)
