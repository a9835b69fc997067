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

from ...feature_drafting import FeatureAutoregressiveMixin, FeatureDraftState
from ...layers import DraftAttention, GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache
from ...modeling_utils import DrafterPreTrainedModel, depthwise_distillation_loss
from .configuration_eagle3 import Eagle3Config

__all__ = ["Eagle3ForDrafting", "Eagle3DraftState", "Eagle3Output"]


class Eagle3Attention(DraftAttention):
    """The draft layer's attention: q/k/v read ``[norm(embedding); norm(feature)]`` (``2 * hidden`` wide)."""

    def __init__(self, config: Eagle3Config):
        h, hd = config.hidden_size, config.head_dim
        super().__init__(2 * h, h, config.num_attention_heads, config.num_key_value_heads, hd, config.attention_bias)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)  # on token embeddings
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)  # on fused target features / draft hidden states
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, embeds, hidden):
        """``([norm(embeds); hidden_norm(hidden)], residual)``; the residual is the normalised feature when
        ``norm_before_residual`` is set (vLLM's flag), else the raw one (the reference EAGLE-3 layer)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def forward(self, embeds, hidden, cos, sin, cache, valid, attn_mask=None):
        x, residual = self.attention_input(embeds, hidden)
        hidden = residual + self.self_attn(x, cos, sin, cache, valid, attn_mask=attn_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class Eagle3Output(ModelOutput):
    """Output of :meth:`Eagle3ForDrafting.forward`.

    Attributes:
        logits: ``(batch, seq, draft_vocab_size)`` draft logits; slot ``t`` predicts the token at position ``t + 2``.
        hidden_states: ``(batch, seq, hidden_size)`` draft layer outputs (before the final norm, after it with
            ``norm_feedback``), the feature fed back for the next draft step.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None


Eagle3DraftState = FeatureDraftState  # the state of the shared feature-autoregressive decoding


class Eagle3ForDrafting(FeatureAutoregressiveMixin, DrafterPreTrainedModel):
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
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc")
    loss_kwargs = ("steps", "decay")  # TTT steps and their decay (defaults: config.ttt_steps / ttt_decay)
    _no_split_modules = ["Eagle3DecoderLayer"]

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        # Unresolved layer ids (a foreign checkpoint loaded without its target): the family's default count.
        n_feats = len(config.target_layer_ids or ()) or config.num_default_target_features
        width = config.target_hidden_size
        if config.norm_before_fc:  # speculators / vLLM: one norm over the concatenated target states
            self.input_norm = RMSNorm(n_feats * width, config.rms_norm_eps)
        if config.fc_norm:  # EAGLE-3.1: one norm per target state
            self.fc_norm = nn.ModuleList([RMSNorm(width, config.rms_norm_eps) for _ in range(n_feats)])
        self.fc = nn.Linear(n_feats * width, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    def check_target_layer_ids(self) -> None:
        n_feats = self.fc.in_features // self.config.target_hidden_size
        if len(self.config.target_layer_ids or ()) != n_feats:
            raise ValueError(
                f"Eagle3ForDrafting fuses {n_feats} target states (fc), but target_layer_ids is "
                f"{self.config.target_layer_ids}: set target_layer_ids to {n_feats} ids."
            )

    # ------------------------------------------------------------------------------------------------------------
    # core computation
    # ------------------------------------------------------------------------------------------------------------
    def fuse_target_features(self, features: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target states (list of ``(batch, seq, H)`` or one ``(batch, seq, n·H)``),
        after ``input_norm`` (``norm_before_fc``) or the per-state ``fc_norm`` when the config has one."""
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=-1)
        features = features.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        if self.config.fc_norm:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(features)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of draft layer outputs: through the final ``norm`` unless ``norm_output`` is off,
        or already through it (``norm_feedback``: :meth:`layer_output` applied it)."""
        if self.config.norm_output and not self.config.norm_feedback:
            hidden = self.norm(hidden)
        return self.lm_head(hidden)

    def layer_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a draft step hands on (to the LM head and the next step): the layer output, or its final norm with
        ``norm_feedback`` (EAGLE-3.1's post-norm feedback)."""
        return self.norm(hidden) if self.config.norm_feedback else hidden

    def draft_layer(self, embeds, hidden, cos, sin, cache: SlotKVCache, valid, attn_mask=None, step=None):
        """The draft decoder layer on token embeddings and features (fused target features or its own outputs)."""
        return self.layer_output(self.midlayer(embeds, hidden, cos, sin, cache, valid, attn_mask=attn_mask))

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
    # training: training-time test (TTT)
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Starts the output side in the target's own output space: ``lm_head`` holds the target's LM-head rows of
        the draft vocabulary (set by :meth:`init_from_data`, which runs first) and ``norm`` the target's final norm
        (see :meth:`~hf_specdec.DrafterPreTrainedModel.init_output_from_target`)."""
        self.init_output_from_target(target, self.lm_head, self.norm if self.config.norm_output else None)

    def _ttt_attention(self, x, position_ids, key_valid, prev_kv):
        """Attention of one TTT step (see :meth:`~hf_specdec.layers.DraftAttention.ttt`)."""
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        return self.midlayer.self_attn.ttt(x, cos, sin, key_valid, prev_kv)

    def ttt_forward(self, input_ids, target_hidden_states, attention_mask=None, steps: int | None = None):
        """Unrolls ``steps`` draft steps over a sequence (training-time test).

        Step 0 reads the fused target features; step ``j`` reads the draft's own step ``j - 1`` output at the same
        anchor and the teacher-forced token ``input_ids[t + 1 + j]``. Step ``j`` at anchor ``t`` predicts the token
        at ``t + 2 + j`` and sits at position ``t + j`` (as the ``j``-th drafted slot does at inference).

        Returns:
            list of ``(logits, hidden)`` per step, each ``(batch, seq, ·)``; positions whose teacher-forced token
            lies beyond the sequence hold garbage and must be masked by the caller.
        """
        steps = steps or self.config.num_draft_tokens
        bsz, t = input_ids.shape
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        positions = torch.arange(t, device=input_ids.device)[None].expand(bsz, t)
        hidden = self.fuse_target_features(target_hidden_states)
        embeds_all = self.embed_target_tokens(input_ids).to(hidden.dtype)
        layer = self.midlayer
        prev_kv: list = []
        outputs = []
        for j in range(steps):
            # token at t + 1 + j, shifted left; the tail is padded with the last token (masked by the caller)
            shift = min(1 + j, t)
            emb = torch.cat([embeds_all[:, shift:], embeds_all[:, -1:].expand(bsz, shift, -1)], dim=1)
            x, residual = layer.attention_input(emb, hidden)
            hidden = residual + self._ttt_attention(x, positions + j, valid.to(x.device), prev_kv)
            hidden = self.layer_output(hidden + layer.mlp(layer.post_attention_layernorm(hidden)))
            outputs.append((self.draft_logits(hidden), hidden))
        return outputs

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """EAGLE-3 objective: ``Σ_j decay^j · CE(target distribution, draft distribution)`` over TTT steps.

        Soft labels are the target's distribution over the draft vocabulary
        (:meth:`~hf_specdec.features.TargetFeatures.soft_labels`); anchor ``t`` at step ``j`` is scored when the
        predicted token ``t + 2 + j`` exists, is a loss token (``loss_mask``) and, with a reduced vocabulary, the
        target's argmax is in the draft vocabulary.

        Loss kwargs (``loss_kwargs``): ``steps`` (default ``config.ttt_steps``, else ``num_draft_tokens``) and
        ``decay`` (default ``config.ttt_decay``). Metrics: ``correct`` / ``valid`` per step, and the pass-by-pass
        walk of :func:`~hf_specdec.features.walk_metrics` with ``K = min(num_draft_tokens, steps)``.
        """
        loss_mask, labels, in_vocab, _ = self.loss_targets(batch, features, target_head, loss_kwargs)
        cfg = self.config
        steps = loss_kwargs.get("steps") or getattr(cfg, "ttt_steps", None) or cfg.num_draft_tokens
        decay = loss_kwargs.get("decay")
        decay = float(getattr(cfg, "ttt_decay", 0.8) if decay is None else decay)
        input_ids = batch["input_ids"]
        attn_mask = batch.get("attention_mask")
        outs = self.ttt_forward(input_ids, features.hidden_states, attn_mask, steps)
        return depthwise_distillation_loss(
            [logits for logits, _ in outs],
            labels,
            loss_mask,
            in_vocab,
            [decay**j for j in range(len(outs))],
            min(cfg.num_draft_tokens, steps),
        )
