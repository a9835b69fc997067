"""MTP drafter: DeepSeek-V3-style multi-token prediction modules (arXiv 2412.19437 §2.2), trained post hoc for any
target and written for hf_specdec's proposal interface.

Module and parameter names follow transformers' ``MtpLayer`` (``layers.{k}.enorm / hnorm / eh_proj / mtp_block.* /
post_norm``), so a drafter's state dict reads like the MTP layers that some targets ship natively.
"""

from __future__ import annotations

import torch
from torch import nn

from ...feature_drafting import FeatureAutoregressiveMixin, FeatureDraftState
from ...layers import DraftDecoderLayer, RMSNorm, RotaryEmbedding, SlotKVCache, SlotKVCaches
from ...modeling_utils import DrafterPreTrainedModel, depthwise_distillation_loss
from .configuration_mtp import MtpConfig

__all__ = ["MtpForDrafting", "MtpModule", "MtpBlock", "MtpCaches", "MtpDraftState"]

MtpDraftState = FeatureDraftState


MtpBlock = DraftDecoderLayer  # one Llama-style decoder layer per module (``mtp_block``)


class MtpModule(nn.Module):
    """``post_norm(Block(eh_proj([enorm(e); hnorm(h)])))``: one MTP module."""

    def __init__(self, config: MtpConfig):
        super().__init__()
        h = config.hidden_size
        self.hidden_states_first = bool(config.hidden_states_first)
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.mtp_block = MtpBlock(config, qkv_bias=config.qkv_bias)
        self.post_norm = RMSNorm(h, config.rms_norm_eps) if config.use_post_norm else nn.Identity()

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e, h = self.enorm(embeds.to(hidden.dtype)), self.hnorm(hidden)
        return self.eh_proj(torch.cat([h, e] if self.hidden_states_first else [e, h], dim=-1))

    def forward(self, embeds, hidden, cos, sin, cache: SlotKVCache, valid, attn_mask=None) -> torch.Tensor:
        x = self.mtp_block(self.project(embeds, hidden), cos, sin, cache, valid, attn_mask=attn_mask)
        return self.post_norm(x)

    def context_kv(self, embeds, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of verified slots only (what later draft slots of this module attend to)."""
        _, k, v = self.mtp_block.self_attn._qkv(self.mtp_block.input_layernorm(self.project(embeds, hidden)), cos, sin)
        return k, v


MtpCaches = SlotKVCaches  # one cache per module; a drafted slot goes to the module that drafted it


class MtpForDrafting(FeatureAutoregressiveMixin, DrafterPreTrainedModel):
    """MTP: ``D`` chained modules on the target's final hidden state, sharing its embeddings and LM head.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(MtpConfig.for_target(target.config, num_mtp_modules=2))
        >>> out = target.generate(**inputs, assistant_model=drafter)
    """

    config_class = MtpConfig
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    borrows_target_lm_head = True
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "eh_proj")
    loss_kwargs = ("steps", "decay")
    _no_split_modules = ["MtpModule"]

    def __init__(self, config: MtpConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(MtpModule(config) for _ in range(config.num_mtp_modules))
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    @property
    def num_modules(self) -> int:
        return len(self.layers)

    # -- the pieces FeatureAutoregressiveMixin drafts with ------------------------------------------------------------
    def new_draft_cache(self) -> MtpCaches:
        return MtpCaches(self.num_modules)

    def draft_cache_index(self, step: int | None) -> int:
        """Module of draft step ``step`` (it produces draft token ``step``): ``min(step, D - 1)``, 0-based."""
        return 0 if step is None else min(int(step), self.num_modules - 1)

    def fuse_target_features(self, features) -> torch.Tensor:
        feats = features[0] if isinstance(features, (list, tuple)) else features
        return feats.to(device=self.device, dtype=self.layers[0].eh_proj.weight.dtype)

    def draft_layer(self, embeds, hidden, cos, sin, cache: MtpCaches, valid, attn_mask=None, step=None):
        if step is None:  # verified context: module 1 drafts token 0; the others only keep the context's keys
            for module, own in zip(self.layers[1:], cache.caches[1:]):
                k, v = module.context_kv(embeds, hidden, cos, sin)
                own.append(k, v, valid)
            return self.layers[0](embeds, hidden, cos, sin, cache.caches[0], valid, attn_mask=attn_mask)
        index = self.draft_cache_index(step)
        return self.layers[index](embeds, hidden, cos, sin, cache.caches[index], valid, attn_mask=attn_mask)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (shared) on module outputs."""
        return self.target_head_logits(hidden)

    # -- training ----------------------------------------------------------------------------------------------------
    def unroll(self, input_ids, target_feature, attention_mask=None, steps: int | None = None) -> list[torch.Tensor]:
        """The draft steps of decoding over a whole sequence (teacher-forced tokens): step ``j`` runs module
        ``min(j, D - 1)`` on step ``j - 1``'s output at the same anchor (the target's feature for step 0) and the
        token ``t + 1 + j``, attending to that module's keys of the verified context and its own earlier steps.
        Returns per step ``(batch, seq, draft_vocab)`` logits, anchor ``t`` predicting token ``t + 2 + j``."""
        steps = self.config.unrolled_steps if steps is None else int(steps)
        bsz, t = input_ids.shape
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=self.device)
            if attention_mask is None
            else attention_mask.to(self.device).bool()
        )
        positions = torch.arange(t, device=self.device)[None].expand(bsz, t)
        feats = self.fuse_target_features(target_feature)
        embeds_all = self.embed_target_tokens(input_ids).to(feats.dtype)

        def next_tokens(j):  # embedding of token t + 1 + j at anchor t (the last one repeated past the end)
            shift = min(1 + j, t)
            return torch.cat([embeds_all[:, shift:], embeds_all[:, -1:].expand(bsz, shift, -1)], dim=1)

        cos0, sin0 = self.rotary_emb(positions, feats.dtype)
        context: dict[int, list] = {}  # module -> [(k, v) of the verified context, then of its draft steps]
        hidden, outs = feats, []
        for j in range(steps):
            index = self.draft_cache_index(j)
            module = self.layers[index]
            if index not in context:
                context[index] = [] if j == 0 else [module.context_kv(next_tokens(0), feats, cos0, sin0)]
            x = module.project(next_tokens(j), hidden)
            cos, sin = self.rotary_emb(positions + j, x.dtype)
            hidden = module.post_norm(module.mtp_block.ttt(x, cos, sin, valid, context[index]))
            outs.append(self.draft_logits(hidden))
        return outs

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``(1 / S) sum_j ttt_decay ** j * CE_j`` over the ``S`` unrolled steps (DeepSeek's ``λ / D`` objective with
        ``S = D``), against the target's distribution (``loss_labels="soft"``) or the data's tokens (``"hard"``)."""
        cfg = self.config
        steps = int(loss_kwargs.get("steps") or cfg.unrolled_steps)
        decay = float(cfg.ttt_decay if loss_kwargs.get("decay") is None else loss_kwargs["decay"])
        loss_mask, soft, in_vocab, hard = self.loss_targets(batch, features, target_head, loss_kwargs, cfg.loss_labels)
        (feat,) = features.hidden_states
        outs = self.unroll(batch["input_ids"].to(self.device), feat.to(self.device, self.dtype),
                           batch.get("attention_mask"), steps)  # fmt: skip
        weights = [decay**j / len(outs) for j in range(len(outs))]
        return depthwise_distillation_loss(
            outs, soft, loss_mask, in_vocab, weights, min(cfg.num_draft_tokens, steps), hard_targets=hard
        )
