"""EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840), written for hf_specdec's proposal interface.

Data flow for one slot: the target state at position ``p`` (three fused layers, see :class:`Eagle3Config`) and the
embedding of the token at ``p + 1`` go through one decoder layer; the layer output ``h_p`` predicts the token at
``p + 2`` and, for deeper draft steps, replaces the fused target feature (it is fed back through ``hidden_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from ...generation.proposals import DraftInputs, Proposal, TokenSelector
from ...layers import GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache, apply_rotary, slot_attention
from ...modeling_utils import DrafterPreTrainedModel
from .configuration_eagle3 import Eagle3Config

__all__ = ["Eagle3ForDrafting", "Eagle3DraftState", "Eagle3Output"]


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        bias = config.attention_bias
        # q/k/v read the concatenation [norm(embedding); norm(feature)] (2H wide).
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)

    def forward(self, x, cos, sin, cache: SlotKVCache, valid: torch.Tensor, causal: bool = True):
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values, key_valid = cache.append(k, v, valid)
        out = slot_attention(q, keys, values, key_valid, causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)  # on token embeddings
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)  # on fused target features / draft hidden states
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)

    def forward(self, embeds, hidden, cos, sin, cache, valid):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = residual + self.self_attn(x, cos, sin, cache, valid)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class Eagle3Output(ModelOutput):
    """Output of :meth:`Eagle3ForDrafting.forward`.

    Attributes:
        logits: ``(batch, seq, draft_vocab_size)`` draft logits; slot ``t`` predicts the token at position ``t + 2``.
        hidden_states: ``(batch, seq, hidden_size)`` draft layer outputs (before the final norm), the feature fed
            back for the next draft step.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None


@dataclass
class Eagle3DraftState:
    """Per-``generate`` drafter state: the draft KV cache and the latest verified output per row."""

    cache: SlotKVCache
    committed_slots: int = 0
    last_hidden: torch.Tensor | None = None  # (batch, hidden)
    last_logits: torch.Tensor | None = None  # (batch, draft_vocab)
    last_position: torch.Tensor | None = None  # (batch,)


class Eagle3ForDrafting(DrafterPreTrainedModel):
    """EAGLE-3 drafter: fused low/mid/high target features, one decoder layer, optional reduced vocabulary.

    The token embeddings are borrowed from the target at :meth:`bind_target` time and never saved. With a reduced
    draft vocabulary (``draft_vocab_size < target_vocab_size``), buffer ``d2t`` maps draft id ``i`` to target id
    ``i + d2t[i]`` and ``t2d`` marks the target ids that are in the draft vocabulary (the layout of the reference
    implementation).

    Example:
        >>> drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)
    """

    config_class = Eagle3Config
    proposal_kind = "chain"
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    _no_split_modules = ["Eagle3DecoderLayer"]

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        n_feats = len(config.target_layer_ids)
        self.fc = nn.Linear(n_feats * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.reset_parameters()

    # ------------------------------------------------------------------------------------------------------------
    # vocabulary mapping
    # ------------------------------------------------------------------------------------------------------------
    @property
    def draft_token_ids(self) -> torch.LongTensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_token_ids: torch.LongTensor) -> None:
        """Sets the reduced draft vocabulary from sorted target ids (``draft_vocab_size`` of them)."""
        ids = torch.as_tensor(target_token_ids, dtype=torch.long).flatten().sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"set_draft_vocab needs {self.config.draft_vocab_size} distinct target ids, got {ids.numel()} "
                f"({ids.unique().numel()} distinct)."
            )
        if ids.min() < 0 or ids.max() >= self.config.target_vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.config.target_vocab_size}).")
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def check_loaded_weights(self) -> None:
        self.check_draft_vocab()

    def check_draft_vocab(self) -> None:
        """Raises if ``d2t`` / ``t2d`` are inconsistent (e.g. a checkpoint with an all-zero ``d2t`` but a reduced
        vocabulary that is not the first ids)."""
        ids = self.draft_token_ids
        if ids.max() >= self.config.target_vocab_size or ids.min() < 0:
            raise ValueError("Eagle3ForDrafting: d2t maps draft ids outside the target vocabulary.")
        if not bool(self.t2d[ids].all()) or int(self.t2d.sum()) != self.config.draft_vocab_size:
            raise ValueError(
                "Eagle3ForDrafting: d2t and t2d disagree (t2d must mark exactly the target ids i + d2t[i]). "
                "The checkpoint's vocabulary mapping is corrupt; rebuild it with `set_draft_vocab`."
            )

    # ------------------------------------------------------------------------------------------------------------
    # core computation
    # ------------------------------------------------------------------------------------------------------------
    def fuse_target_features(self, features: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target states (list of ``(batch, seq, H)`` or one ``(batch, seq, n·H)``)."""
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=-1)
        return self.fc(features.to(self.fc.weight.dtype))

    def _step(self, embeds, hidden, position_ids, valid, cache: SlotKVCache):
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, cache, valid)
        logits = self.lm_head(self.norm(out))
        return out, logits

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | list[torch.Tensor] | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: SlotKVCache | None = None,
        **kwargs,
    ) -> Eagle3Output:
        """Runs the draft layer over a sequence (causal).

        Args:
            input_ids: ``(batch, seq)`` the token at ``p + 1`` for each target position ``p``.
            target_hidden_states: the target states at ``config.target_layer_ids`` (list of ``(batch, seq, H)``
                or their concatenation); mutually exclusive with ``hidden_states``.
            hidden_states: ``(batch, seq, hidden)`` draft hidden states to use instead of fused target features
                (the deeper steps of drafting and of training-time test).
            position_ids: ``(batch, seq)``; defaults to ``0..seq-1``.
            attention_mask: ``(batch, seq)`` 1 for real tokens, 0 for padding.
            inputs_embeds: precomputed token embeddings instead of ``input_ids``.
            cache: a :class:`~hf_specdec.layers.SlotKVCache` to extend (a fresh one if ``None``).
        """
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError("Pass exactly one of `target_hidden_states` or `hidden_states`.")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("Pass `input_ids` or `inputs_embeds`.")
            inputs_embeds = self.embed_target_tokens(input_ids)
        hidden = self.fuse_target_features(target_hidden_states) if hidden_states is None else hidden_states
        bsz, seq = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device)[None].expand(bsz, seq)
        valid = (
            torch.ones(bsz, seq, dtype=torch.bool, device=hidden.device)
            if attention_mask is None
            else attention_mask.to(hidden.device).bool()
        )
        out, logits = self._step(inputs_embeds.to(hidden.dtype), hidden, position_ids, valid, cache or SlotKVCache())
        return Eagle3Output(logits=logits, hidden_states=out)

    # ------------------------------------------------------------------------------------------------------------
    # proposal interface
    # ------------------------------------------------------------------------------------------------------------
    def init_draft_state(self, batch_size: int, max_length: int) -> Eagle3DraftState:
        return Eagle3DraftState(cache=SlotKVCache())

    def observe(self, state: Eagle3DraftState, inputs: DraftInputs) -> None:
        # Drop the speculative slots of the last proposal; the verified slots below replace them.
        state.cache.crop(state.committed_slots)
        feats = self.select_target_features(inputs.hidden_states)
        hidden = self.fuse_target_features(feats)
        embeds = self.embed_target_tokens(inputs.next_token_ids)
        valid = inputs.valid.to(self.device)
        positions = inputs.position_ids.to(self.device)
        out, logits = self._step(embeds, hidden, positions, valid, state.cache)
        state.committed_slots = state.cache.length
        # Latest verified slot of each row.
        slot = torch.arange(valid.shape[1], device=valid.device)
        last = torch.where(valid, slot, -1).max(dim=1).values.clamp(min=0)
        rows = torch.arange(valid.shape[0], device=valid.device)
        state.last_hidden = out[rows, last]
        state.last_logits = logits[rows, last]
        state.last_position = positions[rows, last]

    def propose(self, state: Eagle3DraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        tokens, probs = [], []
        logits, hidden = state.last_logits, state.last_hidden
        bsz = hidden.shape[0]
        ones = torch.ones(bsz, 1, dtype=torch.bool, device=hidden.device)
        for depth in range(num_tokens):
            tok, q = select(self.draft_to_target_logits(logits.float()), depth)
            tokens.append(tok)
            probs.append(q)
            if depth == num_tokens - 1:
                break
            pos = (state.last_position + 1 + depth)[:, None]
            out, step_logits = self._step(
                self.embed_target_tokens(tok[:, None]), hidden[:, None], pos, ones, state.cache
            )
            hidden, logits = out[:, 0], step_logits[:, 0]
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs, kind="chain")
