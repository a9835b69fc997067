"""SpecBlock drafter (Shi et al., arXiv 2605.07243), written for hf_specdec's proposal interface.

Every verified position ``t`` leaves one *context entry* in the draft KV cache: slot 0 of its block,
``fuse([c_t; e_t; q_0])`` at position ``t + 1``, run causally through the draft layers (it drafts the token at
``t + 2``). Drafting after the last verified position runs the block's slots ``1..K-1`` in one pass; each attends to
the context entries and to the slots of its own block up to itself, and the layer-wise shift hands each slot the state
of the slot before it between layers. A further block continues from slot ``M - 1`` of its parent (its state as the
condition, the token drafted there as the input, the parent's slots ``< M`` visible), so a chain longer than ``K`` and
the rank tree are made of block passes.

Design choice [not from the paper]: by default (``context_slots="first"``) earlier positions are seen through their
context entry (slot 0) only, so the draft cache holds one entry per verified token, as EAGLE-3's. The reference
implementation keeps all ``K`` slots of every verified position's block (its training mask shows a slot every slot of
earlier positions); ``context_slots="all"`` does the same: the blocks at the ``N`` newly verified positions run whole
(slot ``k`` at position ``t`` sees every cached slot and slots ``<= k`` of its own block) and all ``N * K`` slots enter
the cache; the block at the last verified position is the first block of the proposal, and a further block sees the
cached blocks of the positions before it and its ancestors' slots ``< M`` (the reference's block-2 mask) and sits at
the first block's RoPE positions (the reference's too). Reference checkpoints (layout ``specblock-reference``) load in
that mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...features import walk_metrics, walk_passes
from ...layers import DraftAttention, GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache, compaction_index
from ...modeling_utils import DrafterPreTrainedModel, DraftLossOutput
from ...types import DraftInputs, Proposal, TokenSelector
from .configuration_specblock import SpecBlockConfig

__all__ = ["SpecBlockForDrafting", "SpecBlockDraftState", "rank_features", "rank_bucket"]


def rank_features(logits: torch.Tensor) -> torch.Tensor:
    """The rank head's 15 statistics of a draft distribution (``(..., V')`` logits -> ``(..., 15)``): the top-10
    log-probabilities renormalised over the top 20, the gaps top1 - top2, top1 - top3 and top1 - top5, the top-1
    probability and the entropy, both of the renormalised top 20 (the reference's "top-20 fast path")."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(min(20, logp.shape[-1]), dim=-1).values  # (a draft vocabulary under 20 tokens: all of them)
    norm = top - torch.logsumexp(top, dim=-1, keepdim=True)
    last = top.shape[-1] - 1
    gaps = torch.stack([top[..., 0] - top[..., min(i, last)] for i in (1, 2, 4)], dim=-1)
    entropy = -(norm.exp() * norm).sum(-1, keepdim=True)
    top10 = norm[..., :10]
    first = norm[..., :1].exp()
    if top10.shape[-1] < 10:
        top10 = torch.cat([top10, top10.new_full((*top10.shape[:-1], 10 - top10.shape[-1]), -30.0)], dim=-1)
    return torch.cat([top10, gaps, first, entropy], dim=-1)


def rank_bucket(logits: torch.Tensor, target: torch.LongTensor, edges=SpecBlockConfig.rank_bucket_edges):
    """Bucket of the rank of draft index ``target`` in ``logits`` (rank 1, 2-4, 5-10, > 10 -> 0, 1, 2, 3)."""
    own = logits.gather(-1, target[..., None])
    rank = (logits > own).sum(-1) + 1
    bucket = torch.zeros_like(rank)
    for edge in edges:
        bucket = bucket + (rank > edge).long()
    return bucket


class SpecBlockAttention(DraftAttention):
    """Llama attention with two key sets: the context entries (shared by every block of a row; :meth:`forward` adds
    new ones to a :class:`~hf_specdec.layers.SlotKVCache`, causally) and each block's own ``local`` keys (its
    ancestors' visible slots and its own slots; :meth:`block`)."""

    def __init__(self, config: SpecBlockConfig):
        h = config.hidden_size
        super().__init__(h, h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         config.attention_bias)  # fmt: skip

    def block(self, x, cos, sin, ctx, ctx_mask, local, local_mask):
        """Block slots ``x`` ``(B, A, Q, H)`` (``A`` blocks of ``Q`` slots); ``ctx`` ``(keys, values)`` of the context
        ``(B, kv, S, d)`` with ``ctx_mask`` ``(B, A, S)``; ``local`` ``(keys, values)`` ``(B, kv, A, E, d)`` of earlier
        blocks' slots (or ``None``) with ``local_mask`` ``(B, A, Q, E)``. Slot ``k`` also sees its block's slots
        ``<= k``. Returns the output and the block's own ``(keys, values)`` ``(B, kv, A, Q, d)``."""
        bsz, a, nq, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(x.reshape(bsz, a * nq, -1), cos, sin)
        q = q.view(bsz, h, a, nq, d)
        own_k, own_v = k.view(bsz, kvh, a, nq, d), v.view(bsz, kvh, a, nq, d)
        causal = torch.ones(nq, nq, dtype=torch.bool, device=x.device).tril()[None, None].expand(bsz, a, nq, nq)
        if local is None:
            lk, lv, lmask = own_k, own_v, causal
        else:
            lk, lv = torch.cat([local[0], own_k], dim=3), torch.cat([local[1], own_v], dim=3)
            lmask = torch.cat([local_mask, causal], dim=3)
        rep = h // kvh
        ck, cv = ctx
        if rep > 1:
            ck, cv = ck.repeat_interleave(rep, dim=1), cv.repeat_interleave(rep, dim=1)
            lk, lv = lk.repeat_interleave(rep, dim=1), lv.repeat_interleave(rep, dim=1)
        scale = d**-0.5
        s_ctx = torch.einsum("bhaqd,bhsd->bhaqs", q, ck) * scale
        s_loc = torch.einsum("bhaqd,bhald->bhaql", q, lk) * scale
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, :, None, :], torch.finfo(s_ctx.dtype).min)
        s_loc = s_loc.masked_fill(~lmask[:, None], torch.finfo(s_loc.dtype).min)
        probs = torch.softmax(torch.cat([s_ctx, s_loc], dim=-1).float(), dim=-1).to(q.dtype)
        n_ctx = ck.shape[2]
        out = torch.einsum("bhaqs,bhsd->bhaqd", probs[..., :n_ctx], cv)
        out = out + torch.einsum("bhaql,bhald->bhaqd", probs[..., n_ctx:], lv)
        out = out.permute(0, 2, 3, 1, 4).reshape(bsz, a * nq, h * d)
        return self.o_proj(out).view(bsz, a, nq, -1), (own_k, own_v)


class SpecBlockDecoderLayer(nn.Module):
    def __init__(self, config: SpecBlockConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SpecBlockAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def context(self, x, cos, sin, cache, valid, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, valid, attn_mask=attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def block(self, x, cos, sin, ctx, ctx_mask, local, local_mask):
        out, kv = self.self_attn.block(self.input_layernorm(x), cos, sin, ctx, ctx_mask, local, local_mask)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LayerShift(nn.Linear):
    """``h_k <- W_s [h_k; h_{k-1}]`` (``2H -> H``, no bias). Initialised to pass ``h_k`` through (``W_s = [I 0]``), so
    training starts from the model without the shift. [design choice: the reference uses nn.Linear's default init]"""

    def __init__(self, hidden_size: int):
        super().__init__(2 * hidden_size, hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        h = self.out_features
        self.weight.zero_()
        self.weight[:, :h].copy_(torch.eye(h))


@dataclass
class _Blocks:
    """Blocks drafted in one pass: ``hidden`` ``(B, A, K, H)`` (all ``K`` slots; block 1's slot 0 is the context
    entry), ``logits`` ``(B, A, K, V')``, and what later blocks see of them: ``kv`` per layer ``(B, kv, A, Q, d)`` of
    the slots this pass computed, ``slots`` ``(Q,)`` their slot numbers, ``base`` ``(B, A)`` the position of slot 0."""

    hidden: torch.Tensor
    logits: torch.Tensor
    kv: list
    slots: torch.Tensor
    base: torch.Tensor
    ancestry: list = field(default_factory=list)  # per earlier pass: ((B, A) block index, (B, A) M)


@dataclass
class SpecBlockDraftState:
    """Per-``generate`` state: each layer's context cache and, for the last verified position of each row, its
    condition ``c``, anchor token and position, the context entry's state after each layer (for the shift of slot 1)
    and its final state; ``first`` caches the first block of the current proposal."""

    caches: list
    cond: torch.Tensor | None = None  # (B, H)
    token: torch.Tensor | None = None  # (B,) token at position + 1
    position: torch.Tensor | None = None  # (B,) the last verified position
    layer_states: list | None = None  # per shifted layer: (B, H) input of that layer before the shift
    hidden: torch.Tensor | None = None  # (B, H) the context entry's final state (slot 0)
    block_hidden: torch.Tensor | None = None  # context_slots="all": (B, K, H) the last verified position's block
    block_kv: list | None = None  # context_slots="all": per layer (keys, values) (B, kv, K, d) of that block
    entry_pos: torch.Tensor | None = None  # context_slots="all": (B, S) the verified position of each cache entry
    first: _Blocks | None = None
    adapter: object | None = None  # serving-time adaptation (see adaptation.py), when on


class SpecBlockForDrafting(DrafterPreTrainedModel):
    """SpecBlock: ``K`` positions per pass with prefix broadcast, position queries and the layer-wise shift; a rank
    head for dynamic trees (``generate(..., tree="rank")``); optional serving-time adaptation
    (``generate(..., online_adaptation=True)``).

    Example:
        >>> drafter = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter)
    """

    config_class = SpecBlockConfig
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    supports_tree_drafting = True
    draft_options = {"online_adaptation": False, "adaptation_lr": 1e-5, "adaptation_seed": 0}
    weight_changing_draft_options = ("online_adaptation",)
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc", "fuse")
    _no_split_modules = ["SpecBlockDecoderLayer"]

    def __init__(self, config: SpecBlockConfig):
        super().__init__(config)
        h = config.hidden_size
        n_feats = len(config.target_layer_ids or ()) or config.num_default_target_features
        self.fc = nn.Linear(n_feats * config.target_hidden_size, h, bias=False)
        # c: the fused target states (block 1) or a parent slot's state (further blocks)
        self.cond_norm = RMSNorm(h, config.rms_norm_eps)
        self.embed_norm = RMSNorm(h, config.rms_norm_eps)
        self.query_norm = RMSNorm(h, config.rms_norm_eps)
        self.position_queries = nn.Embedding(config.block_size, h)
        self.fuse = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList(SpecBlockDecoderLayer(config) for _ in range(config.num_hidden_layers))
        n_shift = config.num_hidden_layers - 1 if config.layer_shift else 0
        self.shift_proj = nn.ModuleList(LayerShift(h) for _ in range(n_shift))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rank_head = nn.Sequential(
            nn.Linear(h + config.num_rank_features, config.rank_head_size, bias=False),
            nn.SiLU(),
            nn.Linear(config.rank_head_size, 4, bias=False),
        )
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, LayerShift):
            module.reset_parameters()
        else:
            super()._init_weights(module)

    def init_from_target(self, target: nn.Module) -> None:
        """``lm_head`` and ``norm`` start as the target's LM-head rows of the draft vocabulary and its final norm (as
        EAGLE-3's)."""
        self.init_output_from_target(target, self.lm_head, self.norm)

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    @property
    def all_slots(self) -> bool:
        """Whether the draft cache holds all ``K`` slots of each verified position's block (``context_slots="all"``)."""
        return self.config.context_slots == "all"

    def check_target_layer_ids(self) -> None:
        n_feats = self.fc.in_features // self.config.target_hidden_size
        if len(self.config.target_layer_ids or ()) != n_feats:
            raise ValueError(
                f"SpecBlockForDrafting fuses {n_feats} target states (fc), but target_layer_ids is "
                f"{self.config.target_layer_ids}: set target_layer_ids to {n_feats} ids."
            )

    # -- pieces --------------------------------------------------------------------------------------------------
    def condition(self, features) -> torch.Tensor:
        """``c = cond_norm(fc([H_low; H_mid; H_high]))``."""
        feats = torch.cat([f.to(device=self.device, dtype=self.fc.weight.dtype) for f in features], dim=-1)
        return self.cond_norm(self.fc(feats))

    def slot_inputs(self, cond, tokens, slots) -> torch.Tensor:
        """``fuse([c; RMSNorm(Emb(x)); RMSNorm(q_k)])``: ``cond`` ``(..., H)``, ``tokens`` ``(...)``, ``slots``
        broadcastable to the leading shape (slot numbers ``k``)."""
        e = self.embed_norm(self.embed_target_tokens(tokens).to(cond.dtype))
        q = self.query_norm(self.position_queries(slots.to(self.device))).to(cond.dtype)
        q = q.expand(*cond.shape[:-1], q.shape[-1])
        return self.fuse(torch.cat([cond, e, q], dim=-1))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def rank_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Rank-bucket logits ``(..., 4)`` of slots with final states ``hidden`` and draft ``logits``."""
        feats = rank_features(logits.detach()).to(hidden.dtype)
        return self.rank_head(torch.cat([self.norm(hidden).detach(), feats], dim=-1))

    def _shift(self, i: int, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.shift_proj[i](torch.cat([x, prev], dim=-1))

    def context_pass_all(self, x, positions, valid, caches):
        """``context_slots="all"``: the blocks of ``N`` verified positions, ``x`` ``(B, N, K, H)`` (``positions``
        ``(B, N)`` the verified positions, slot ``k`` sits at ``t + 1 + k``), through the layers, appending all their
        slots to ``caches``: slot ``k`` at ``t`` sees every cached slot, every slot of earlier new positions and slots
        ``<= k`` of its own block. Returns the final states ``(B, N, K, H)``."""
        bsz, n, k, h = x.shape
        slot = torch.arange(k, device=x.device)
        cos, sin = self.rotary_emb((positions[:, :, None] + 1 + slot).reshape(bsz, n * k), x.dtype)
        src, own = torch.arange(n, device=x.device).repeat_interleave(k), slot.repeat(n)
        new = (src[None] < src[:, None]) | ((src[None] == src[:, None]) & (own[None] <= own[:, None]))
        old = torch.ones(n * k, caches[0].length, dtype=torch.bool, device=x.device)
        mask = torch.cat([old, new], dim=1)[None].expand(bsz, -1, -1)
        flat_valid = valid[:, :, None].expand(-1, -1, k).reshape(bsz, n * k)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if i > 0 and self.shift_proj:
                x = self._shift(i - 1, x, torch.cat([x[:, :, :1], x[:, :, :-1]], dim=2))
            x = layer.context(x.reshape(bsz, n * k, h), cos, sin, cache, flat_valid, attn_mask=mask).view(bsz, n, k, h)
        return x

    def context_pass(self, x, positions, valid, caches):
        """Context entries ``x`` ``(B, N, H)`` at ``positions`` through the layers (appending to ``caches``). Returns
        the final states and, per shifted layer, the states before its shift."""
        cos, sin = self.rotary_emb(positions, x.dtype)
        before = []
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if i > 0 and self.shift_proj:
                before.append(x)
                x = self._shift(i - 1, x, x)
            x = layer.context(x, cos, sin, cache, valid)
        return x, before

    def block_pass(self, x, positions, ctx, ctx_mask, local, local_mask, first_prev=None):
        """Block slots ``x`` ``(B, A, Q, H)`` at ``positions`` ``(B, A, Q)`` through the layers. ``ctx``: per layer
        ``(keys, values)``; ``local``: per layer ``(keys, values)`` of earlier blocks or ``None``; ``first_prev``: per
        shifted layer ``(B, A, H)``, the state of the slot before the first one (``None``: it shifts with itself).
        Returns the final states and the per-layer ``(keys, values)`` of these slots."""
        bsz, a, nq, _ = x.shape
        cos, sin = self.rotary_emb(positions.reshape(bsz, a * nq), x.dtype)
        kvs = []
        for i, layer in enumerate(self.layers):
            if i > 0 and self.shift_proj:
                head = x[:, :, :1] if first_prev is None else first_prev[i - 1][:, :, None].to(x.dtype)
                x = self._shift(i - 1, x, torch.cat([head, x[:, :, :-1]], dim=2))
            lk = None if local is None else local[i]
            x, kv = layer.block(x, cos, sin, ctx[i], ctx_mask, lk, local_mask)
            kvs.append(kv)
        return x, kvs

    def _local(self, parents: list[_Blocks], ancestry: list) -> tuple:
        """The keys earlier blocks show a new block: per layer ``(keys, values)`` ``(B, kv, A, E, d)`` and the mask
        ``(B, A, E)`` (a parent's slots ``< M``); ``ancestry`` gives per earlier pass the block index and ``M``."""
        per_layer = [([], []) for _ in self.layers]
        masks = []
        for blocks, (index, m) in zip(parents, ancestry):
            if blocks.slots.numel() == 0:
                continue
            for i, (k, v) in enumerate(blocks.kv):
                idx = index[:, None, :, None, None].expand(-1, k.shape[1], -1, k.shape[3], k.shape[4])
                per_layer[i][0].append(k.gather(2, idx))
                per_layer[i][1].append(v.gather(2, idx))
            masks.append(blocks.slots.to(m.device)[None, None] < m[..., None])
        if not masks:
            return None, None
        local = [(torch.cat(ks, dim=3), torch.cat(vs, dim=3)) for ks, vs in per_layer]
        return local, torch.cat(masks, dim=-1)

    def next_blocks(self, parents: list[_Blocks], ancestry, cond, tokens, base, ctx, ctx_mask) -> _Blocks:
        """Blocks continuing from parent slots: ``cond`` ``(B, A, H)`` the parents' slot states (before
        ``cond_norm``), ``tokens`` ``(B, A)`` the tokens drafted there, ``base`` ``(B, A)`` the position of the new
        slot 0; ``ancestry`` per earlier pass ``(index, M)`` ``(B, A)``. With ``context_slots="all"`` the new slots
        take the first block's RoPE positions, as the reference trains and serves further blocks (the labels still
        follow ``base``)."""
        k = self.block_size
        slots = torch.arange(k, device=self.device)
        c = self.cond_norm(cond)[:, :, None].expand(-1, -1, k, -1)
        x = self.slot_inputs(c, tokens[:, :, None].expand(-1, -1, k), slots)
        positions = (parents[0].base.expand_as(base) if self.all_slots else base)[:, :, None] + slots
        local, lmask = self._local(parents, ancestry)
        if lmask is not None:
            lmask = lmask[:, :, None].expand(-1, -1, k, -1)
        hidden, kv = self.block_pass(x, positions, ctx, ctx_mask, local, lmask)
        return _Blocks(hidden, self.draft_logits(hidden).float(), kv, slots, base, list(ancestry))

    # -- decoding ------------------------------------------------------------------------------------------------
    def init_draft_state(
        self, batch_size: int, max_length: int, online_adaptation=False, adaptation_lr=1e-5, adaptation_seed=0
    ) -> SpecBlockDraftState:
        state = SpecBlockDraftState(caches=[SlotKVCache() for _ in self.layers])
        if online_adaptation:
            from .adaptation import ServingAdapter

            state.adapter = ServingAdapter(self, lr=float(adaptation_lr), seed=int(adaptation_seed))
        return state

    def observe(self, state: SpecBlockDraftState, inputs: DraftInputs) -> None:
        feats = self.select_target_features(inputs.hidden_states)
        if state.adapter is not None:  # serving-time adaptation: learn from this round before drafting the next
            state.adapter.remember(inputs, [f.to(self.device) for f in feats])
            if inputs.feedback is not None:
                state.adapter.after_verification(inputs)
        cond = self.condition(feats)
        tokens = inputs.next_token_ids.to(self.device)
        positions = inputs.position_ids.to(self.device)
        valid = inputs.valid.to(self.device)
        bsz, n = tokens.shape
        slot = torch.arange(n, device=valid.device)
        last = torch.where(valid, slot, -1).max(dim=1).values
        rows = torch.arange(bsz, device=valid.device)
        at = last.clamp(min=0)
        new = {"cond": cond[rows, at], "token": tokens[rows, at], "position": positions[rows, at]}
        if self.all_slots:
            k = self.block_size
            slots = torch.arange(k, device=self.device)
            x = self.slot_inputs(cond[:, :, None].expand(-1, -1, k, -1), tokens[:, :, None].expand(-1, -1, k), slots)
            out = self.context_pass_all(x, positions, valid, state.caches)
            new["block_hidden"] = out[rows, at]
            new["hidden"] = new["block_hidden"][:, 0]
            for i, cache in enumerate(state.caches):  # the new block's keys and values, before any compaction
                keys, values = (z[:, :, -n * k :].unflatten(2, (n, k))[rows, :, at] for z in (cache.keys, cache.values))
                new[f"kv{i}"] = torch.stack([keys, values])
            entry_pos = positions[:, :, None].expand(-1, -1, k).reshape(bsz, n * k)
            state.entry_pos = entry_pos if state.entry_pos is None else torch.cat([state.entry_pos, entry_pos], dim=1)
            layer_states = []
        else:
            x = self.slot_inputs(cond, tokens, torch.zeros((), dtype=torch.long, device=self.device))
            out, before = self.context_pass(x, positions + 1, valid, state.caches)
            new["hidden"] = out[rows, at]
            layer_states = [b[rows, at] for b in before]
        plan = compaction_index(state.caches[0].valid)  # every layer holds the same slots: one plan for all
        if plan is not None:
            for cache in state.caches:
                cache.compact()
            if state.entry_pos is not None:
                state.entry_pos = state.entry_pos.gather(1, plan[0])
        if state.cond is not None:  # a row without a verified slot here (it finished) keeps its anchor
            keep = last < 0
            old_kv = {f"kv{i}": torch.stack(kv) for i, kv in enumerate(state.block_kv or [])}
            for key in new:
                old = old_kv[key] if key in old_kv else getattr(state, key)
                shape = (1, -1, *[1] * (old.dim() - 2)) if key in old_kv else (-1, *[1] * (old.dim() - 1))
                new[key] = torch.where(keep.view(*shape), old, new[key])
            layer_states = [torch.where(keep[:, None], o, n) for o, n in zip(state.layer_states, layer_states)]
        if self.all_slots:
            state.block_kv = [tuple(new.pop(f"kv{i}")) for i in range(len(self.layers))]
        for key, value in new.items():
            setattr(state, key, value)
        state.layer_states = layer_states
        state.first = None

    def _context(self, state: SpecBlockDraftState, num_blocks: int):
        """What further blocks see of the cache: every entry (``"first"``: the context entries up to the anchor's,
        whose slot 0 is one) or, with ``context_slots="all"``, the blocks of the positions before the anchor (the
        anchor's own block reaches them as an ancestor)."""
        ctx = [(c.keys, c.values) for c in state.caches]
        valid = state.caches[0].valid
        if self.all_slots:
            valid = valid & (state.entry_pos < state.position[:, None])
        return ctx, valid[:, None].expand(-1, num_blocks, -1)

    def first_block(self, state: SpecBlockDraftState) -> _Blocks:
        """The block after the last verified position (slot 0 is its context entry; slots ``1..K-1`` run now; with
        ``context_slots="all"`` :meth:`observe` already ran the whole block)."""
        if state.first is None and self.all_slots:  # observe ran the whole block
            hidden = state.block_hidden[:, None]
            kv = [(keys[:, :, None], values[:, :, None]) for keys, values in state.block_kv]
            slots = torch.arange(self.block_size, device=self.device)
            state.first = _Blocks(hidden, self.draft_logits(hidden).float(), kv, slots, (state.position + 1)[:, None])
        if state.first is None:
            k = self.block_size
            hidden0 = state.hidden[:, None, None]
            base = (state.position + 1)[:, None]
            slots = torch.arange(1, k, device=self.device)
            if k > 1:
                c = state.cond[:, None, None].expand(-1, 1, k - 1, -1)
                x = self.slot_inputs(c, state.token[:, None, None].expand(-1, 1, k - 1), slots)
                ctx, cmask = self._context(state, 1)
                prev = [s[:, None] for s in state.layer_states]
                hidden, kv = self.block_pass(x, base[:, :, None] + slots, ctx, cmask, None, None, prev)
                hidden = torch.cat([hidden0, hidden], dim=2)
            else:
                hidden, kv = hidden0, []
            state.first = _Blocks(hidden, self.draft_logits(hidden).float(), kv, slots, base)
        return state.first

    def propose(self, state: SpecBlockDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """A chain: the first block's slots in order; past ``K`` tokens a block continues from the last slot with the
        token drafted there (``M = K``), and so on."""
        vocab_ids = self.reduced_vocab_ids()
        k = self.block_size
        blocks = [self.first_block(state)]
        bsz = state.token.shape[0]
        tokens, probs = [], []
        for depth in range(int(num_tokens)):
            b, slot = divmod(depth, k)
            if b == len(blocks):
                whole = torch.zeros(bsz, 1, dtype=torch.long, device=self.device)
                ancestry = [(whole, torch.full_like(whole, k)) for _ in blocks]
                ctx, cmask = self._context(state, 1)
                prev = blocks[-1]
                blocks.append(
                    self.next_blocks(
                        blocks, ancestry, prev.hidden[:, :, -1], tokens[-1][:, None], prev.base + k, ctx, cmask
                    )
                )
            tok, q = select(blocks[b].logits[:, 0, slot], depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        extras = {}
        if state.adapter is not None:  # the adapter reads the draft distribution where a draft was rejected
            logits = torch.cat([b.logits[:, 0] for b in blocks], dim=1)[:, : len(tokens)]
            extras = {"draft_logits": logits, "vocab_ids": vocab_ids}
        return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs, kind="chain", extras=extras)

    # -- the rank tree -------------------------------------------------------------------------------------------
    def tree_start(self, state: SpecBlockDraftState):
        """Trees of other policies (EAGLE-2, static) within the first block: slot ``d``'s distribution for the nodes
        at depth ``d`` (a block's slots do not read the tokens drafted before them). ``tree="rank"`` goes deeper."""
        return self.first_block(state).logits[:, 0, 0], self.reduced_vocab_ids()

    def tree_expand(self, state: SpecBlockDraftState, expansion) -> torch.Tensor:
        depth = int(expansion.depth)
        if depth >= self.block_size:
            raise ValueError(
                f"SpecBlockForDrafting's EAGLE-2 and static trees stay within one block of {self.block_size} slots; "
                f"this tree expands nodes at depth {depth}. Use tree_depth <= {self.block_size}, or tree='rank' (its "
                "own trees continue with further blocks)."
            )
        logits = self.first_block(state).logits[:, 0, depth]
        return logits[:, None].expand(*expansion.tokens.shape, logits.shape[-1])

    def rank_tree(self, state: SpecBlockDraftState, num_blocks: int, top_k: int, total_tokens: int) -> Proposal:
        """The rank tree: block passes from the pending leaves (all leaves of a pass in one batched drafter call).
        In each block the greedy slots are walked up to the first slot ``j`` whose predicted bucket is not 0; slot
        ``j`` branches into ``rank_branch_widths[bucket]`` tokens (at most ``top_k``), each of which may continue
        with a new block from slot ``j``'s state (``M = j + 1``); the last bucket gives up (the block's greedy
        slots are kept, no block follows). The first block's slot 0 always branches ``top_k`` wide (its alternatives
        continue too, ``M = 1``). The ``top_k`` best continuations by path log-probability form the next pass; finally
        the ``total_tokens`` best nodes by path log-probability (an ancestor-closed set) form the tree. The all-top-1
        path always continues and is always kept, so the tree holds the chain of the same depth. [design choice, as
        EAGLE-2's keep_greedy_path here]"""
        k = self.block_size
        widths = torch.tensor(self.config.rank_branch_widths, device=self.device).clamp(max=top_k)
        vocab_ids = self.reduced_vocab_ids()
        blocks = [self.first_block(state)]
        bsz = state.token.shape[0]
        leaf_value = torch.zeros(bsz, 1, device=self.device)
        leaf_node = torch.full((bsz, 1), -1, dtype=torch.long, device=self.device)
        leaf_greedy = torch.ones(bsz, 1, dtype=torch.bool, device=self.device)  # the leaf on the all-top-1 path
        pool_tokens, pool_value, pool_parent, pool_greedy = [], [], [], []
        size = 0
        w = int(top_k)
        for it in range(num_blocks):
            cur = blocks[-1]
            a = cur.logits.shape[1]
            logp = torch.log_softmax(cur.logits, dim=-1)
            cand_lp, cand_ids = logp.topk(min(w, logp.shape[-1]), dim=-1)  # (B, A, K, W)
            wk = cand_ids.shape[-1]
            bucket = self.rank_logits(cur.hidden, cur.logits).argmax(-1)  # (B, A, K)
            branching = bucket != 0
            has = branching.any(-1)
            j = torch.where(has, branching.long().argmax(-1), torch.full_like(has, k - 1, dtype=torch.long))
            bj = bucket.gather(2, j[..., None])[..., 0]
            give_up = bj == 3
            width_j = widths[bj]
            slot = torch.arange(k, device=self.device)[None, None, :, None]
            rank = torch.arange(wk, device=self.device)[None, None, None, :]
            jj = j[:, :, None, None]
            allowed = (rank == 0) & ((slot <= jj) | give_up[:, :, None, None])
            allowed |= (slot == jj) & (rank < width_j[:, :, None, None]) & ~give_up[:, :, None, None]
            if it == 0:
                allowed |= (slot == 0) & (rank < w)
            greedy = leaf_greedy[:, :, None, None] & (rank == 0) & allowed
            greedy_prefix = torch.cumsum(cand_lp[..., 0], dim=-1) - cand_lp[..., 0]  # sum of top-1 before each slot
            value = leaf_value[:, :, None, None] + greedy_prefix[..., None] + cand_lp
            value = value.masked_fill(~allowed, float("-inf"))
            # parents: slot 0 -> the leaf's node; slot s -> the top-1 node of slot s - 1 of the same block
            node = size + torch.arange(a * k * wk, device=self.device).view(1, a, k, wk)
            prev_top = node[:, :, :, :1].expand(-1, -1, -1, wk) - wk  # node (a, s - 1, 0)
            parent = torch.where(
                slot == 0, leaf_node[:, :, None, None].expand(-1, -1, k, wk), prev_top.expand(bsz, -1, -1, -1)
            )
            pool_tokens.append(cand_ids.reshape(bsz, -1))
            pool_value.append(value.reshape(bsz, -1))
            pool_parent.append(parent.reshape(bsz, -1))
            pool_greedy.append(greedy.reshape(bsz, -1))
            size += a * k * wk
            if it == num_blocks - 1:
                break
            # continuations: the branch tokens at slot j (and the first block's slot-0 siblings)
            seed = (slot == jj) & (rank < width_j[:, :, None, None]) & ~give_up[:, :, None, None]
            if it == 0:
                seed |= (slot == 0) & (rank >= 1) & (rank < w)  # the first slot's alternatives
            seed_value = value.masked_fill(~seed, float("-inf")).reshape(bsz, -1)
            # the greedy path's continuation always goes on (so the tree holds the chain of the same depth)
            rank_value = seed_value.masked_fill((greedy & seed).reshape(bsz, -1), float("inf"))
            n_next = min(w, seed_value.shape[1])
            best = rank_value.topk(n_next, dim=1).indices
            best_value = seed_value.gather(1, best)
            leaf_greedy = (greedy & seed).reshape(bsz, -1).gather(1, best)
            blk = best // (k * wk)
            s = (best // wk) % k
            hidden = cur.hidden.reshape(bsz, a * k, -1).gather(
                1, (blk * k + s)[..., None].expand(-1, -1, cur.hidden.shape[-1])
            )
            toks = cand_ids.reshape(bsz, -1).gather(1, best)
            m = s + 1
            ancestry = [(anc_i.gather(1, blk), anc_m.gather(1, blk)) for anc_i, anc_m in cur.ancestry] + [(blk, m)]
            ctx, cmask = self._context(state, n_next)
            target_toks = toks if vocab_ids is None else vocab_ids[toks]
            blocks.append(
                self.next_blocks(blocks, ancestry, hidden, target_toks, cur.base.gather(1, blk) + m, ctx, cmask)
            )
            leaf_value = best_value
            leaf_node = node.reshape(1, -1).expand(bsz, -1).gather(1, best)
        return self._best_nodes(pool_tokens, pool_value, pool_parent, pool_greedy, total_tokens, vocab_ids)

    def _best_nodes(self, pool_tokens, pool_value, pool_parent, pool_greedy, total_tokens, vocab_ids) -> Proposal:
        """The ``total_tokens`` nodes of best path log-probability among every block's candidates (the all-top-1
        path first), as a tree proposal in target ids."""
        bsz = pool_tokens[0].shape[0]
        tokens = torch.cat(pool_tokens, dim=1)
        raw = torch.cat(pool_value, dim=1)
        values = raw.masked_fill(torch.cat(pool_greedy, dim=1), float("inf"))
        parents_all = torch.cat(pool_parent, dim=1)
        n = min(int(total_tokens), tokens.shape[1])
        order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :n]
        # Real nodes first, in creation order (parents first); a row with fewer real nodes than the budget pads with
        # masked ones, which `lengths` marks as padding (no verifier accepts them).
        real = raw.gather(1, order) > float("-inf")
        key = order + (~real).long() * tokens.shape[1]
        chosen = order.gather(1, torch.sort(key, dim=1).indices)
        new_index = torch.full((bsz, tokens.shape[1]), -1, dtype=torch.long, device=self.device)
        new_index.scatter_(1, chosen, torch.arange(n, device=self.device)[None].expand(bsz, n))
        old_parent = parents_all.gather(1, chosen)
        parents = torch.where(old_parent >= 0, new_index.gather(1, old_parent.clamp_min(0)), old_parent)
        if bool((parents[old_parent >= 0] < 0).any()):  # pragma: no cover - values fall along every path
            raise RuntimeError("The rank tree selection produced a node without its parent.")
        chosen_tokens = tokens.gather(1, chosen)
        if vocab_ids is not None:
            chosen_tokens = vocab_ids[chosen_tokens]
        return Proposal(tokens=chosen_tokens, kind="tree", parents=parents, lengths=real.sum(1))

    # -- training ------------------------------------------------------------------------------------------------
    def _training_inputs(self, ids, features, attention_mask):
        """``(valid, next tokens, condition)`` of a whole sequence: position ``t`` pairs the target state at ``t`` with
        token ``t + 1``."""
        valid = (
            torch.ones(ids.shape, dtype=torch.bool, device=self.device)
            if attention_mask is None
            else attention_mask.to(self.device).bool()
        )
        return valid, torch.cat([ids[:, 1:], ids[:, -1:]], dim=1), self.condition(features)

    def _training_context(self, input_ids, features, attention_mask):
        """The context pass over a whole sequence: ``(cond, final states, states before each shift, per-layer
        (keys, values), valid)``; position ``t``'s entry pairs the target state at ``t`` with token ``t + 1``."""
        bsz, t = input_ids.shape
        ids = input_ids.to(self.device)
        valid, nxt, cond = self._training_inputs(ids, features, attention_mask)
        x = self.slot_inputs(cond, nxt, torch.zeros((), dtype=torch.long, device=self.device))
        caches = [SlotKVCache() for _ in self.layers]
        positions = torch.arange(t, device=self.device)[None].expand(bsz, t) + 1
        out, before = self.context_pass(x, positions, valid, caches)
        return cond, nxt, out, before, [(c.keys, c.values) for c in caches], valid

    def training_blocks(self, input_ids, features, attention_mask, anchors, offsets):
        """Teacher-forced blocks at ``anchors`` ``(B, A)`` (``None``: every position): the context pass over the whole
        sequence, block 1 after each anchor, then ``len(offsets)`` further blocks, block ``b + 1`` continuing from slot
        ``offsets[b] - 1`` of block ``b`` (``offsets[b]`` ``(B, A)`` in ``1..K``) with the true token there. Returns
        ``(first, further)``, each block a :class:`_Blocks` over the anchors."""
        bsz, t = input_ids.shape
        k = self.block_size
        ids = input_ids.to(self.device)
        if anchors is None:
            anchors = torch.arange(t, device=self.device)[None].expand(bsz, t)
        anchors = anchors.to(self.device)
        a = anchors.shape[1]

        def at(z):  # (B, T, ...) -> (B, A, ...) at the anchors
            return z.gather(1, anchors.view(bsz, a, *[1] * (z.dim() - 2)).expand(-1, -1, *z.shape[2:]))

        if self.all_slots:
            first, ctx, ctx_mask = self._first_blocks_all(ids, features, attention_mask, anchors, at)
            return first, self._further_blocks(ids, first, offsets, ctx, ctx_mask)
        cond, nxt, out0, before, ctx, valid = self._training_context(ids, features, attention_mask)
        position = torch.arange(t, device=self.device)
        ctx_mask = (anchors[:, :, None] >= position[None, None, :]) & valid[:, None, :]  # (B, A, S)
        slots = torch.arange(1, k, device=self.device)
        base = anchors + 1
        hidden0 = at(out0)[:, :, None]
        if k > 1:
            x = self.slot_inputs(
                at(cond)[:, :, None].expand(-1, -1, k - 1, -1), at(nxt)[:, :, None].expand(-1, -1, k - 1), slots
            )
            prev = [at(b) for b in before]
            hidden, kv = self.block_pass(x, base[:, :, None] + slots, ctx, ctx_mask, None, None, prev)
            hidden = torch.cat([hidden0, hidden], dim=2)
        else:
            hidden, kv = hidden0, []
        first = _Blocks(hidden, self.draft_logits(hidden), kv, slots, base)
        return first, self._further_blocks(ids, first, offsets, ctx, ctx_mask)

    def _first_blocks_all(self, ids, features, attention_mask, anchors, at):
        """``context_slots="all"``: the block of every position in one pass (the cache inference builds), block 1 at
        the anchors, and the context further blocks see (the blocks of positions before the anchor)."""
        bsz, t = ids.shape
        k = self.block_size
        valid, nxt, cond = self._training_inputs(ids, features, attention_mask)
        slots = torch.arange(k, device=self.device)
        x = self.slot_inputs(cond[:, :, None].expand(-1, -1, k, -1), nxt[:, :, None].expand(-1, -1, k), slots)
        caches = [SlotKVCache() for _ in self.layers]
        states = self.context_pass_all(x, torch.arange(t, device=self.device)[None].expand(bsz, t), valid, caches)
        hidden = at(states)
        kv = [
            tuple(at(z.unflatten(2, (t, k)).transpose(1, 2)).transpose(1, 2) for z in (c.keys, c.values))
            for c in caches
        ]
        entry = torch.arange(t, device=self.device).repeat_interleave(k)
        ctx_mask = (entry[None, None] < anchors[:, :, None]) & valid.repeat_interleave(k, dim=1)[:, None]
        first = _Blocks(hidden, self.draft_logits(hidden), kv, slots, anchors + 1)
        return first, [(c.keys, c.values) for c in caches], ctx_mask

    def _further_blocks(self, ids, first: _Blocks, offsets, ctx, ctx_mask) -> list:
        """Blocks ``2..`` of :meth:`training_blocks`: block ``b + 1`` continues from slot ``offsets[b] - 1`` of block
        ``b`` with the true token there."""
        bsz, t = ids.shape
        a = first.base.shape[1]
        cur, chain, further = first, [first], []
        whole = torch.arange(a, device=self.device)[None].expand(bsz, -1)
        offsets = [m.to(self.device) for m in offsets]
        for b, m in enumerate(offsets):
            width = first.hidden.shape[-1]
            parent_state = cur.hidden.gather(2, (m - 1)[:, :, None, None].expand(-1, -1, 1, width))[:, :, 0]
            start = cur.base + m
            token = ids.gather(1, start.clamp(max=t - 1))
            ancestry = [(whole, offsets[i]) for i in range(b + 1)]
            cur = self.next_blocks(chain, ancestry, parent_state, token, start, ctx, ctx_mask)
            chain.append(cur)
            further.append(cur)
        return further

    def teacher_forced_logits(self, input_ids, features, attention_mask=None, steps: int | None = None):
        """Per depth ``j``: ``(B, T, V')``, anchor ``t`` predicting token ``t + 2 + j`` with the true tokens fed where a
        block continues (``M = K``), as :meth:`propose` drafts after ``observe``."""
        bsz, t = input_ids.shape
        k = self.block_size
        steps = int(steps or self.config.num_draft_tokens)
        n_more = (steps - 1) // k
        anchors = torch.arange(t, device=self.device)[None].expand(bsz, t)
        offsets = [torch.full((bsz, t), k, dtype=torch.long, device=self.device)] * n_more
        first, further = self.training_blocks(input_ids, features, attention_mask, anchors, offsets)
        logits = [first.logits] + [b.logits for b in further]
        return [logits[j // k][:, :, j % k] for j in range(steps)]

    def _block_loss(self, blocks: _Blocks, keep, soft, loss_mask, in_vocab):
        """One block's losses over its slots: ``(draft, rank, stats)``; slot ``k`` at base ``s`` predicts the token at
        ``s + 1 + k`` (label: the teacher's distribution at ``s + k``) and is scored while the slots before it are the
        teacher's argmax (valid-prefix mask)."""
        cfg = self.config
        k = self.block_size
        probs, top = soft.probs.to(self.device), soft.argmax.to(self.device)
        bsz, t = loss_mask.shape
        lab = blocks.base[..., None] + torch.arange(k, device=self.device)  # (B, A, K)
        pred = lab + 1
        lab_c, pred_c = lab.clamp(max=t - 1), pred.clamp(max=t - 1)
        flat = lambda z: z.reshape(bsz, -1)  # noqa: E731
        ok = keep[..., None] & (pred < t)
        ok = ok & loss_mask.gather(1, flat(pred_c)).view_as(ok) & in_vocab.gather(1, flat(lab_c)).view_as(ok)
        labels = probs.gather(1, flat(lab_c)[..., None].expand(-1, -1, probs.shape[-1])).view(*lab.shape, -1)
        want = top.gather(1, flat(lab_c)).view_as(lab)
        logits = blocks.logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        ce = -(labels * logp).sum(-1)
        hit = (logits.argmax(-1) == want) & ok
        before = torch.cumprod(torch.cat([torch.ones_like(hit[..., :1]), hit[..., :-1]], dim=-1).long(), dim=-1).bool()
        scored = ok & before
        # one denominator for every slot, the anchors scored at slot 0: a later slot counts in proportion to how often
        # the slots before it are right (a per-slot mean would give the few anchors that reach slot 3 the weight of
        # all of slot 0's, and their noise swamps training)
        count = ok[..., 0].sum().float()
        decay = torch.tensor([float(cfg.slot_decay) ** i for i in range(k)], device=self.device)
        draft = ((ce * scored).sum(dim=(0, 1)) * decay).sum() / count.clamp(min=1)
        # rank head: bucket of the teacher's choice in the draft distribution, soft ordinal targets
        bucket = rank_bucket(logits.detach(), want)
        rl = self.rank_logits(blocks.hidden, logits).float()
        classes = torch.arange(4, device=self.device)
        gap = classes - bucket[..., None]  # c - t
        smooth = 1.0 / (1.0 + gap.abs() + (-gap).clamp(min=0)).float() ** 2
        smooth = smooth / smooth.sum(-1, keepdim=True)
        rce = -(smooth * torch.log_softmax(rl, dim=-1)).sum(-1)
        guess = rl.argmax(-1)
        dist = 1.0 + (bucket - guess).abs() + (bucket - guess).clamp(min=0)
        per_class = torch.stack([((bucket == c) & scored).sum(dim=(0, 1)) for c in range(4)])  # (4, K)
        class_w = (10.0 / per_class.float().clamp(min=1)).clamp(max=1.0)  # (4, K)
        cw = class_w.gather(0, bucket.reshape(-1, k)).view_as(bucket) if bucket.numel() else bucket.float()
        rank = (rce * dist.float() * cw * scored).sum() / scored.sum().clamp(min=1)
        stats = {
            "ok": ok,
            "hit": hit,
            "rank_correct": ((guess == bucket) & scored).sum().float().detach(),
            "rank_count": scored.sum().float().detach(),
        }
        return draft, rank, stats

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """Draft loss (soft cross-entropy against the teacher, valid-prefix masked, slot weight ``slot_decay**k``)
        summed over the first block and ``num_train_blocks - 1`` further blocks (each continuing from a slot ``M - 1``,
        ``M`` uniform in ``1..K``), plus ``rank_loss_weight`` times the rank head's loss; at ``num_anchors`` random
        anchors per sequence in training and at every anchor in evaluation (with fixed offsets). Metrics: the first
        block's per-slot accuracy and simulated walk, and the rank accuracy."""
        cfg = self.config
        loss_mask, soft, in_vocab, _ = self.loss_targets(batch, features, target_head, loss_kwargs)
        ids = batch["input_ids"].to(self.device)
        attn = batch.get("attention_mask")
        feats = [f.to(self.device, self.dtype) for f in features.hidden_states]
        bsz, t = ids.shape
        k = self.block_size
        useful = torch.zeros(bsz, t, dtype=torch.bool, device=self.device)
        useful[:, : max(t - 2, 0)] = loss_mask[:, 2:]
        gen = None
        if not self.training:  # evaluation: the same anchors and offsets every time
            gen = torch.Generator(device=self.device).manual_seed(0)
        if self.training:
            scores = torch.rand(bsz, t, device=self.device).masked_fill(~useful, -1.0)
            picked, anchors = scores.topk(min(int(cfg.num_anchors), t), dim=1)
            keep = picked >= 0
        else:
            anchors = torch.arange(t, device=self.device)[None].expand(bsz, t)
            keep = torch.ones(bsz, t, dtype=torch.bool, device=self.device)
        offsets = [
            torch.randint(1, k + 1, anchors.shape, device=self.device, generator=gen)
            for _ in range(int(cfg.num_train_blocks) - 1)
        ]
        first, further = self.training_blocks(ids, feats, attn, anchors, offsets)
        draft, rank, stats = self._block_loss(first, keep, soft, loss_mask, in_vocab)
        rank_correct, rank_count = stats["rank_correct"], stats["rank_count"]
        ok, hit = stats["ok"], stats["hit"]
        for blocks in further:
            d, r, st = self._block_loss(blocks, keep, soft, loss_mask, in_vocab)
            draft, rank = draft + d, rank + r
            rank_correct, rank_count = rank_correct + st["rank_correct"], rank_count + st["rank_count"]
        loss = draft + float(cfg.rank_loss_weight) * rank
        # the first block's accepted chain per anchor (anchors not drawn in this training batch count 0)
        accepted = torch.zeros(bsz, t, dtype=torch.long, device=self.device)
        accepted.scatter_(1, anchors, torch.cumprod(hit.long(), dim=-1).sum(-1))
        metrics = {
            "correct": hit.sum(dim=(0, 1)).float().detach(),
            "valid": ok.sum(dim=(0, 1)).float().detach(),
            "rank_correct": rank_correct,
            "rank_count": rank_count,
        }
        n = min(int(cfg.num_draft_tokens or k), k)
        metrics.update(walk_metrics(walk_passes(accepted, loss_mask, n), device=self.device))
        out = DraftLossOutput(loss=loss, metrics=metrics, accepted=accepted)
        out.rates["rank_accuracy"] = ("rank_correct", "rank_count")
        return out
