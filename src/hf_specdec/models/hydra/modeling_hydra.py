"""Hydra drafter (Ankner et al. 2024, arXiv 2402.05109): sequentially dependent draft heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...configuration_utils import decoder_layer_defaults, get_text_config
from ...heads import last_verified
from ...layers import ACT2FN_SIMPLE, DraftDecoderLayer, RMSNorm, RotaryEmbedding, SlotKVCache
from ...modeling_utils import DrafterPreTrainedModel, depthwise_distillation_loss
from ...types import DraftInputs, Proposal, TokenSelector
from .configuration_hydra import HydraConfig

__all__ = ["HydraForDrafting", "HydraHead", "HydraPrefixLayer", "HydraDraftState"]


class HydraHead(nn.Module):
    """Head ``k``: ``P x + SiLU(W x + b)`` on ``x = [h; E(x_{t+1}); ...; E(x_{t+k})]``, then residual blocks and
    the vocabulary projection."""

    def __init__(
        self, in_features: int, hidden_size: int, num_layers: int, vocab_size: int, dropout: float, bias: bool = False
    ):
        super().__init__()
        self.proj = nn.Linear(in_features, hidden_size, bias=bias)  # the linear residual path
        self.first = nn.Linear(in_features, hidden_size)
        self.first.zero_init = True
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers - 1))
        for block in self.blocks:
            block.zero_init = True
        self.act = nn.SiLU()
        self.dropout = nn.Dropout(dropout)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) + self.dropout(self.act(self.first(x)))
        for block in self.blocks:
            y = y + self.dropout(self.act(block(y)))
        return self.lm_head(y)


class HydraPrefixLayer(DraftDecoderLayer):
    """Hydra++'s prefix attention: a Llama decoder layer over the target's hidden states (with its own KV cache),
    and with ``prefix_norm`` a final RMSNorm, as zankner/Hydra's one-layer ``LlamaModel`` has."""

    def __init__(self, config: HydraConfig):
        super().__init__(config)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.prefix_norm else None

    def forward(self, hidden, position_ids, valid, cache: SlotKVCache):
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = super().forward(hidden, cos, sin, cache, valid)
        return out if self.norm is None else self.norm(out)

    def retune(self, config: HydraConfig) -> None:
        """Takes the norm epsilon and RoPE of ``config`` (facts a foreign checkpoint leaves to the target)."""
        for norm in (self.input_layernorm, self.post_attention_layernorm, self.norm):
            if norm is not None:
                norm.eps = config.rms_norm_eps
        self.mlp.act = ACT2FN_SIMPLE[config.hidden_act]
        device = self.rotary_emb.inv_freq.device
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        ).to(device)


@dataclass
class HydraDraftState:
    last_hidden: torch.Tensor | None = None  # (batch, hidden): the target state at the last verified position
    last_token: torch.Tensor | None = None  # (batch,): the token that follows it (committed by the target)
    root_path: torch.Tensor | None = None  # tree drafting: (batch, 1, hidden) embedding of last_token
    level_inputs: torch.Tensor | None = None  # tree drafting: path embeddings of the last expanded level
    level_offset: int = 0  # index of that level's first node in expansion order
    expanded: int = 0  # nodes expanded so far in this tree
    cache: SlotKVCache | None = None  # the prefix layer's KV cache (prefix_layer=True)


class HydraForDrafting(DrafterPreTrainedModel):
    """Hydra: draft head ``k`` reads the target's state and the embeddings of the tokens on the path.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(HydraConfig.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter, tree="medusa-63")
    """

    config_class = HydraConfig
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    supports_tree_drafting = True
    max_draft_depth_source = "num_heads"
    lora_target_modules = ("proj", "first")
    loss_kwargs = ("decay",)
    _no_split_modules = ["HydraHead"]

    def __init__(self, config: HydraConfig):
        super().__init__(config)
        d = config.hidden_size
        self.heads = nn.ModuleList(
            HydraHead((k + 2) * d, d, config.num_layers, config.draft_vocab_size, config.dropout, config.head_bias)
            for k in range(config.num_heads)
        )
        self.prefix = HydraPrefixLayer(config) if config.prefix_layer else None
        self.register_vocabulary_buffers(config)
        self.post_init()

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def max_draft_depth(self) -> int:
        return self.num_heads

    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Each head's vocabulary projection starts as the target's LM head (its draft-vocabulary rows), and its
        residual projection as the identity on ``h_t`` (zero on the token embeddings), so a fresh head proposes the
        target's own next-token choice for ``h_t``."""
        self.copy_target_head_rows(target, [head.lm_head for head in self.heads])
        d = self.config.hidden_size
        for head in self.heads:
            head.proj.weight.zero_()
            head.proj.weight[:, :d].copy_(torch.eye(d))
            for bias in (head.proj.bias, head.lm_head.bias):
                if bias is not None:
                    bias.zero_()

    def resolve_target_facts(self, target: nn.Module) -> None:
        """Also the prefix layer's norm epsilon, RoPE scaling and activation, for a checkpoint imported without its
        target (zankner/Hydra records the layer's shape in its weights, the rest in the target's config)."""
        if self.config.target_num_hidden_layers is None and self.prefix is not None:
            self.take_prefix_facts(get_text_config(target.config))
        super().resolve_target_facts(target)

    def prefix_shape_mismatch(self, text_config) -> list[str]:
        """The prefix layer's sizes that differ from the target's layers (``"field mine (target theirs)"``)."""
        cfg, facts = self.config, decoder_layer_defaults(text_config)
        shape = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
        return [
            f"{k} {getattr(cfg, k)} (target {facts[k]})"
            for k in shape
            if facts.get(k, getattr(cfg, k)) != getattr(cfg, k)
        ]

    def take_prefix_facts(self, text_config) -> None:
        """Gives the prefix layer the target's norm epsilon, RoPE scaling, context length and activation, after
        checking that the target's layers have the prefix layer's shape (``rope_theta`` stays as the checkpoint's
        layout set it)."""
        cfg, facts = self.config, decoder_layer_defaults(text_config)
        wrong = self.prefix_shape_mismatch(text_config)
        if wrong:
            raise ValueError(f"The prefix layer is one of its target's layers; it does not fit this target: {wrong}.")
        for key in ("rms_norm_eps", "rope_scaling_parameters", "max_position_embeddings", "hidden_act"):
            if key in facts:
                setattr(cfg, key, facts[key])
        self.prefix.retune(cfg)

    def head_logits(self, k: int, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Head ``k`` (0-based) on ``hidden`` ``(..., d)`` and the ``k + 1`` path embeddings ``(..., k + 1, d)``."""
        x = torch.cat([hidden, token_embeds.flatten(-2)], dim=-1)
        return self.heads[k](x.to(self.dtype))

    def prefix_states(self, hidden: torch.Tensor, attention_mask=None, positions=None, cache=None) -> torch.Tensor:
        """The states the heads read: the target's, or with ``prefix_layer`` the prefix layer's output over them
        (causal; ``positions`` default to ``0..T-1``, a fresh cache unless ``cache`` is given)."""
        if self.prefix is None:
            return hidden
        bsz, t, _ = hidden.shape
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=hidden.device)
            if attention_mask is None
            else attention_mask.to(hidden.device).bool()
        )
        if positions is None:
            positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        return self.prefix(hidden, positions.to(hidden.device), valid, cache if cache is not None else SlotKVCache())

    def forward(
        self,
        target_hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        steps: int | None = None,
        attention_mask: torch.Tensor | None = None,
    ):
        """Teacher-forced logits over a sequence: a list over heads ``k < steps`` of ``(batch, seq, draft_vocab)``
        where anchor ``t`` (state at ``t``) reads the true tokens ``t + 1 .. t + 1 + k`` and predicts ``t + 2 + k``
        (anchors whose tokens run past the sequence read the last token and must be masked by the caller)."""
        steps = self.num_heads if steps is None else min(int(steps), self.num_heads)
        hidden = self.prefix_states(target_hidden_states.to(device=self.device, dtype=self.dtype), attention_mask)
        embeds = self.embed_target_tokens(input_ids)
        bsz, t, d = embeds.shape
        shifted = []
        outs = []
        for k in range(steps):
            s = min(1 + k, t)  # the token at t + 1 + k, shifted left and padded with the last token
            shifted.append(torch.cat([embeds[:, s:], embeds[:, -1:].expand(bsz, s, d)], dim=1))
            outs.append(self.head_logits(k, hidden, torch.stack(shifted, dim=-2)))
        return outs

    # -- decoding ----------------------------------------------------------------------------------------------------
    def init_draft_state(self, batch_size: int, max_length: int) -> HydraDraftState:
        return HydraDraftState()

    def observe(self, state: HydraDraftState, inputs: DraftInputs) -> None:
        (feats,) = self.select_target_features(inputs.hidden_states)
        if self.prefix is not None:
            if state.cache is None:
                state.cache = SlotKVCache()
            feats = self.prefix_states(feats, inputs.valid, inputs.position_ids, state.cache)
            state.cache.compact()
        previous = None if state.last_hidden is None else (state.last_hidden, state.last_token)
        state.last_hidden, state.last_token = last_verified(feats, inputs, previous)

    def propose(self, state: HydraDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        vocab_ids = self.reduced_vocab_ids()
        path = [self.embed_target_tokens(state.last_token)]
        tokens, probs = [], []
        for depth in range(min(int(num_tokens), self.num_heads)):
            logits = self.head_logits(depth, state.last_hidden, torch.stack(path, dim=-2)).float()
            tok, q = select(logits, depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
            path.append(self.embed_target_tokens(tok))
        draft_probs = torch.stack(probs, dim=1) if probs[0] is not None else None
        return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs, kind="chain")

    def tree_start(self, state: HydraDraftState):
        root = self.embed_target_tokens(state.last_token)[:, None]  # (B, 1, d)
        state.level_inputs, state.level_offset, state.expanded = None, 0, 0
        state.root_path = root
        return self.head_logits(0, state.last_hidden, root).float(), self.reduced_vocab_ids()

    def tree_expand(self, state: HydraDraftState, expansion) -> torch.Tensor:
        """Head ``d`` (0-based) on every node of depth ``d``: its path's embeddings after the root's."""
        depth = int(expansion.depth)
        if depth >= self.num_heads:
            raise ValueError(
                f"{type(self).__name__} has {self.num_heads} heads, so its trees are at most {self.num_heads} deep; "
                f"this tree expands nodes at depth {depth}. Use a shallower tree (tree_depth <= {self.num_heads})."
            )
        bsz, m = expansion.tokens.shape
        parent = expansion.parent.to(state.last_hidden.device)
        if depth == 1:
            parent_paths = state.root_path[:, None].expand(bsz, m, -1, -1)  # (B, M, 1, d)
        else:
            local = (parent - state.level_offset).clamp(min=0)
            if bool((parent < state.level_offset).any()):
                raise ValueError("Hydra trees expand depth by depth: a node's parent must be in the previous level.")
            prev = state.level_inputs  # (B, M_prev, depth, d)
            idx = local[:, :, None, None].expand(-1, -1, prev.shape[2], prev.shape[3])
            parent_paths = prev.gather(1, idx)
        paths = torch.cat([parent_paths, self.embed_target_tokens(expansion.tokens)[:, :, None]], dim=2)
        hidden = state.last_hidden[:, None].expand(bsz, m, -1)
        logits = self.head_logits(depth, hidden, paths).float()
        state.level_offset, state.level_inputs = state.expanded, paths
        state.expanded += m
        return logits

    # -- training ----------------------------------------------------------------------------------------------------
    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``sum_k decay^(k-1) CE_k`` over the teacher-forced heads, labels per ``config.loss_labels``."""
        cfg = self.config
        decay = float(loss_kwargs.get("decay") or cfg.loss_decay)
        loss_mask, soft, in_vocab, hard = self.loss_targets(batch, features, target_head, loss_kwargs, cfg.loss_labels)
        (hidden,) = features.hidden_states
        outs = self(hidden, batch["input_ids"].to(self.device), attention_mask=batch.get("attention_mask"))
        weights = [decay**j for j in range(len(outs))]
        return depthwise_distillation_loss(outs, soft, loss_mask, in_vocab, weights, self.num_heads, hard_targets=hard)
