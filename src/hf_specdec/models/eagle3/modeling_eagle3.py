"""EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840), written for hf_specdec's proposal interface.

Data flow for one slot: the target state at position ``p`` (three fused layers, see :class:`Eagle3Config`) and the
embedding of the token at ``p + 1`` go through one decoder layer (and ``num_hidden_layers - 1`` plain layers after it);
the output ``h_p`` predicts the token at ``p + 2`` and, for deeper draft steps, replaces the fused target feature (it
is fed back through ``hidden_norm``).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from ...context_vocab import ContextVocabulary, widen_step_logits
from ...feature_drafting import FeatureAutoregressiveMixin, FeatureDraftState
from ...layers import (
    DraftAttention,
    DraftDecoderLayer,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SlotKVCache,
    SlotKVCaches,
)
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

    def ttt(self, embeds, hidden, cos, sin, key_valid, prev_kv: list):
        """The layer in one training-time-test step (see :meth:`~hf_specdec.layers.DraftAttention.ttt`)."""
        x, residual = self.attention_input(embeds, hidden)
        hidden = residual + self.self_attn.ttt(x, cos, sin, key_valid, prev_kv)
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
    """EAGLE-3 drafter: fused low/mid/high target features, one decoder layer (``midlayer``; with
    ``num_hidden_layers > 1`` plain layers ``upper_layers`` after it, each with its own KV cache), optional reduced
    vocabulary.

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
    _no_split_modules = ["Eagle3DecoderLayer", "DraftDecoderLayer"]

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
        if config.num_hidden_layers > 1:
            self.upper_layers = nn.ModuleList(DraftDecoderLayer(config) for _ in range(config.num_hidden_layers - 1))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        if config.context_vocabulary:
            self.context_vocab = ContextVocabulary(config.target_hidden_size, config.hidden_size)
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

    def output_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of draft layer outputs: their final ``norm`` unless ``norm_output`` is off, or
        they are already through it (``norm_feedback``: :meth:`layer_output` applied it)."""
        if self.config.norm_output and not self.config.norm_feedback:
            return self.norm(hidden)
        return hidden

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of draft layer outputs (the LM head on :meth:`output_features`)."""
        return self.lm_head(self.output_features(hidden))

    def layer_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a draft step hands on (to the LM head and the next step): the layer output, or its final norm with
        ``norm_feedback`` (EAGLE-3.1's post-norm feedback)."""
        return self.norm(hidden) if self.config.norm_feedback else hidden

    @property
    def draft_layers(self) -> list[nn.Module]:
        """The draft decoder layers in order: ``midlayer``, then ``upper_layers``."""
        return [self.midlayer, *getattr(self, "upper_layers", ())]

    def new_draft_cache(self) -> SlotKVCache | SlotKVCaches:
        """One slot cache per draft layer (a bare :class:`~hf_specdec.layers.SlotKVCache` for one layer)."""
        return SlotKVCache() if self.config.num_hidden_layers == 1 else SlotKVCaches(self.config.num_hidden_layers)

    def layer_caches(self, cache: SlotKVCache | SlotKVCaches) -> list[SlotKVCache]:
        """The per-layer caches of ``cache`` (from :meth:`new_draft_cache`); refuses one shaped for another depth."""
        caches = cache.caches if isinstance(cache, SlotKVCaches) else [cache]
        if len(caches) != self.config.num_hidden_layers:
            raise ValueError(
                f"{type(self).__name__} has {self.config.num_hidden_layers} draft layers but got a cache for "
                f"{len(caches)}: pass `drafter.new_draft_cache()` (or no cache)."
            )
        return caches

    def draft_layer(self, embeds, hidden, cos, sin, cache, valid, attn_mask=None, step=None):
        """The draft decoder layers on token embeddings and features (fused target features or their own outputs)."""
        caches = self.layer_caches(cache)
        hidden = self.midlayer(embeds, hidden, cos, sin, caches[0], valid, attn_mask=attn_mask)
        for layer, own in zip(self.draft_layers[1:], caches[1:]):
            hidden = layer(hidden, cos, sin, own, valid, attn_mask=attn_mask)
        return self.layer_output(hidden)

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
            cache: the cache of :meth:`new_draft_cache` to extend (a fresh one if ``None``).
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
        cache = self.new_draft_cache() if cache is None else cache
        out, logits = self._step(inputs_embeds.to(hidden.dtype), hidden, position_ids, valid, cache)
        return Eagle3Output(logits=logits, hidden_states=out)

    @torch.no_grad()
    def with_draft_layers(self, num_hidden_layers: int) -> Eagle3ForDrafting:
        """A deeper copy of this drafter that drafts exactly as it does until trained: every weight is copied, and
        each added layer starts with zero ``o_proj`` and ``down_proj``, so it passes its input through unchanged.
        The copy is unbound (bind it, or let the trainer bind it, to a target). Growing a trained drafter this way
        starts the deeper one at the trained one's acceptance instead of from scratch."""
        if num_hidden_layers < self.config.num_hidden_layers:
            raise ValueError(
                f"with_draft_layers adds layers: this drafter has {self.config.num_hidden_layers}, asked for "
                f"{num_hidden_layers}. Train a new drafter for fewer layers."
            )
        config = copy.deepcopy(self.config)
        config.num_hidden_layers = num_hidden_layers
        deeper = type(self)(config).to(device=self.device, dtype=self.dtype)
        deeper.load_state_dict(self.state_dict(), strict=False)  # a superset: only the added layers are missing
        for layer in deeper.draft_layers[self.config.num_hidden_layers :]:
            for out_proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                nn.init.zeros_(out_proj.weight)
                if out_proj.bias is not None:
                    nn.init.zeros_(out_proj.bias)
        return deeper

    # ------------------------------------------------------------------------------------------------------------
    # training: training-time test (TTT)
    # ------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Starts the output side in the target's own output space: ``lm_head`` holds the target's LM-head rows of
        the draft vocabulary (set by :meth:`init_from_data`, which runs first) and ``norm`` the target's final norm
        (see :meth:`~hf_specdec.DrafterPreTrainedModel.init_output_from_target`)."""
        self.init_output_from_target(target, self.lm_head, self.norm if self.config.norm_output else None)
        if self.config.context_vocabulary:
            self.fit_context_vocabulary(target)
            warnings.warn(
                "Training a drafter with a context vocabulary from scratch: on SmolLM2 this scored below the same "
                "drafter without one (simulated tau 1.43 against 1.48, smollm2-context-vocab-levers.md), because the "
                "map falls behind the LM head as it trains. Train the drafter first, then add the context vocabulary "
                "in a fine-tuning stage (`hf-specdec train --drafter TRAINED --context-vocabulary`).",
                stacklevel=2,
            )

    @torch.no_grad()
    def fit_context_vocabulary(self, target: nn.Module) -> float:
        """Fits ``context_vocab``'s map so that the target's LM-head rows of the draft vocabulary score as this
        drafter's own ``lm_head`` rows do (least squares; the copy prior starts at 0); returns the mean cosine
        between mapped and own rows."""
        head = target.get_output_embeddings().weight
        return self.context_vocab.fit(head[self.draft_token_ids.to(head.device)], self.lm_head.weight)

    @torch.no_grad()
    def with_context_vocabulary(self, target: nn.Module) -> Eagle3ForDrafting:
        """A copy of this drafter that also drafts the sequence's own tokens outside its draft vocabulary
        (``context_vocabulary``), every weight kept and the map fitted to its LM head (:meth:`fit_context_vocabulary`).
        Until trained it drafts as this one does wherever the mapped rows score below its own best token. The copy
        is unbound; a drafter that has a context vocabulary already is returned as it is."""
        if self.config.context_vocabulary:
            return self
        config = copy.deepcopy(self.config)
        config.context_vocabulary = True
        config.validate_context_vocabulary()
        wider = type(self)(config).to(device=self.device, dtype=self.dtype)
        wider.load_state_dict(self.state_dict(), strict=False)  # a superset: only the map is missing
        wider.fit_context_vocabulary(target)
        return wider.train(self.training)

    def ttt_forward(self, input_ids, target_hidden_states, attention_mask=None, steps: int | None = None):
        """Unrolls ``steps`` draft steps over a sequence (training-time test).

        Step 0 reads the fused target features; step ``j`` reads the draft's own step ``j - 1`` output at the same
        anchor and the teacher-forced token ``input_ids[t + 1 + j]``. Each draft layer attends to its own keys. Step ``j`` at anchor ``t`` predicts the token
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
        valid = valid.to(hidden.device)
        prev_kv: list[list] = [[] for _ in self.draft_layers]  # per layer: (k, v) of each step so far
        outputs = []
        for j in range(steps):
            # token at t + 1 + j, shifted left; the tail is padded with the last token (masked by the caller)
            shift = min(1 + j, t)
            emb = torch.cat([embeds_all[:, shift:], embeds_all[:, -1:].expand(bsz, shift, -1)], dim=1)
            cos, sin = self.rotary_emb(positions + j, hidden.dtype)
            hidden = self.midlayer.ttt(emb, hidden, cos, sin, valid, prev_kv[0])
            for layer, kv in zip(self.draft_layers[1:], prev_kv[1:]):
                hidden = layer.ttt(hidden, cos, sin, valid, kv)
            hidden = self.layer_output(hidden)
            outputs.append((self.draft_logits(hidden), hidden))
        return outputs

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """EAGLE-3 objective: ``Σ_j decay^j · CE(target distribution, draft distribution)`` over TTT steps.

        Soft labels are the target's distribution over the draft vocabulary
        (:meth:`~hf_specdec.features.TargetFeatures.soft_labels`); anchor ``t`` at step ``j`` is scored when the
        predicted token ``t + 2 + j`` exists, is a loss token (``loss_mask``) and, with a reduced vocabulary, the
        target's argmax is in the draft vocabulary. With ``context_vocabulary`` the labels and each step's logits
        cover the draft vocabulary and each row's candidates too (:mod:`hf_specdec.context_vocab`), and an anchor is
        also scored where the target's argmax is a candidate seen by then.

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
        step_logits = [logits for logits, _ in outs]
        if cfg.context_vocabulary:
            step_features = [self.output_features(hidden) for _, hidden in outs]
            step_logits = widen_step_logits(step_logits, step_features, labels, self.context_vocab, target_head.weight)
        return depthwise_distillation_loss(
            step_logits,
            labels,
            loss_mask,
            in_vocab,
            [decay**j for j in range(len(outs))],
            min(cfg.num_draft_tokens, steps),
        )
