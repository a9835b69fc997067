"""EAGLE-1 drafter (Li et al. 2024, arXiv 2401.15077), written for hf_specdec's proposal interface.

Slot ``t`` pairs the target's top feature at position ``t`` with the embedding of the token at ``t + 1``; the layer's
output ``f̂`` estimates the feature at ``t + 1``, whose LM-head logits predict the token at ``t + 2``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...feature_drafting import FeatureAutoregressiveMixin, FeatureDraftState
from ...layers import DraftAttention, GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache
from ...modeling_utils import DrafterPreTrainedModel, depthwise_distillation_loss
from .configuration_eagle1 import Eagle1Config

__all__ = ["Eagle1ForDrafting", "Eagle1DecoderLayer", "Eagle1DraftState"]

Eagle1DraftState = FeatureDraftState


class Eagle1DecoderLayer(nn.Module):
    """A Llama decoder layer without input norm (EAGLE-1's layer 0)."""

    def __init__(self, config: Eagle1Config):
        super().__init__()
        h = config.hidden_size
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        qkv_bias = config.attention_bias or config.qkv_bias
        self.self_attn = DraftAttention(h, h, heads, kv_heads, head_dim, qkv_bias, o_bias=config.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, cache, valid, attn_mask=None):
        x = x + self.self_attn(x, cos, sin, cache, valid, attn_mask=attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle1ForDrafting(FeatureAutoregressiveMixin, DrafterPreTrainedModel):
    """EAGLE-1: ``FC([embedding; feature])`` and one decoder layer; the target's embeddings and LM head are borrowed.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(Eagle1Config.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter, tree="eagle2")
    """

    config_class = Eagle1Config
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    borrows_target_lm_head = True
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc")
    loss_kwargs = ("steps", "decay")
    _no_split_modules = ["Eagle1DecoderLayer"]

    def __init__(self, config: Eagle1Config):
        super().__init__(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(config)])  # the reference layout's `layers.0.*`
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    # -- the pieces FeatureAutoregressiveMixin drafts with ------------------------------------------------------------
    def fuse_target_features(self, features) -> torch.Tensor:
        feats = features[0] if isinstance(features, (list, tuple)) else features
        return feats.to(device=self.device, dtype=self.fc.weight.dtype)

    def draft_layer(self, embeds, hidden, cos, sin, cache: SlotKVCache, valid, attn_mask=None, step=None):
        x = self.fc(torch.cat([embeds.to(hidden.dtype), hidden], dim=-1))
        return self.layers[0](x, cos, sin, cache, valid, attn_mask=attn_mask)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on drafted features (its draft-vocabulary rows with a reduced vocabulary)."""
        return self.target_head_logits(hidden)

    # -- training ----------------------------------------------------------------------------------------------------
    def unroll(self, input_ids, target_feature, attention_mask=None, steps: int = 1, noise: float = 0.0):
        """``steps`` draft steps over a sequence: step 0 reads the target's features (plus ``U(-noise, noise)``),
        step ``j`` its own step ``j - 1`` outputs at the same anchor and the teacher-forced token ``t + 1 + j``.
        Returns per step ``(logits, features)``, anchor ``t`` predicting token ``t + 2 + j`` / feature ``t + 1 + j``.
        """
        bsz, t = input_ids.shape
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=self.device)
            if attention_mask is None
            else attention_mask.to(self.device).bool()
        )
        positions = torch.arange(t, device=self.device)[None].expand(bsz, t)
        hidden = self.fuse_target_features(target_feature)
        if noise > 0:
            hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * noise
        embeds_all = self.embed_target_tokens(input_ids).to(hidden.dtype)
        layer = self.layers[0]
        prev_kv: list = []
        outs = []
        for j in range(steps):
            shift = min(1 + j, t)
            emb = torch.cat([embeds_all[:, shift:], embeds_all[:, -1:].expand(bsz, shift, -1)], dim=1)
            x = self.fc(torch.cat([emb, hidden], dim=-1))
            cos, sin = self.rotary_emb(positions + j, x.dtype)
            x = x + layer.self_attn.ttt(x, cos, sin, valid, prev_kv)
            hidden = x + layer.mlp(layer.post_attention_layernorm(x))
            outs.append((self.draft_logits(hidden), hidden))
        return outs

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``feature_loss_weight * SmoothL1(f, f̂) + token_loss_weight * CE(p, p̂)`` per unrolled step, weighted
        ``ttt_decay ** j``; the CE is against the target's distribution (soft labels), the regression against the
        target's next feature. Metrics: per-step accuracy, the simulated walk and ``feature_l1`` (mean SmoothL1)."""
        cfg = self.config
        steps = int(loss_kwargs.get("steps") or cfg.ttt_steps)
        decay = float(cfg.ttt_decay if loss_kwargs.get("decay") is None else loss_kwargs["decay"])
        input_ids = batch["input_ids"].to(self.device)
        attn = batch.get("attention_mask")
        loss_mask, soft, in_vocab, _ = self.loss_targets(batch, features, target_head, loss_kwargs)
        (feat,) = features.hidden_states
        feat = feat.to(self.device, self.dtype)
        noise = float(cfg.feature_noise) if self.training else 0.0
        outs = self.unroll(input_ids, feat, attn, steps, noise)
        weights = [float(cfg.token_loss_weight) * decay**j for j in range(len(outs))]
        out = depthwise_distillation_loss(
            [logits for logits, _ in outs], soft, loss_mask, in_vocab, weights, min(cfg.num_draft_tokens, steps)
        )
        t = input_ids.shape[1]
        l1_sum = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for j, (_, pred) in enumerate(outs):
            width = t - 1 - j  # anchors whose target feature t + 1 + j exists
            if width <= 0:
                continue
            valid = loss_mask[:, 1 + j : 1 + j + width]  # the feature at t + 1 + j predicts a loss token
            err = F.smooth_l1_loss(pred[:, :width].float(), feat[:, 1 + j : 1 + j + width].float(), reduction="none")
            per = err.mean(-1)
            n = valid.sum()
            out.loss = out.loss + float(cfg.feature_loss_weight) * decay**j * (per * valid).sum() / n.clamp(min=1)
            l1_sum = l1_sum + (per * valid).sum().detach()
            count = count + n
        out.metrics["feature_l1_sum"] = l1_sum
        out.metrics["feature_count"] = count.float()
        out.rates["feature_l1"] = ("feature_l1_sum", "feature_count")
        return out
