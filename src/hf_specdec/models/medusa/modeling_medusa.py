"""Medusa-1 drafter (Cai et al. 2024, arXiv 2401.10774), written for hf_specdec's proposal interface."""

from __future__ import annotations

import torch
from torch import nn

from ...heads import ParallelHeadsMixin
from ...modeling_utils import DrafterPreTrainedModel
from .configuration_medusa import Medusa2Config, MedusaConfig

__all__ = ["MedusaForDrafting", "Medusa2ForDrafting", "MedusaResBlock", "MedusaHead"]


class MedusaResBlock(nn.Module):
    """``x + SiLU(W x + b)``; ``W`` starts at zero (Cai et al.), so a fresh block only adds ``SiLU(b)`` to ``h_t``."""

    def __init__(self, hidden_size: int, bias: bool = True):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, bias=bias)
        self.linear.zero_init = True  # the paper's zero init: a fresh head starts near the target's LM head
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int, vocab_size: int, bias: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(MedusaResBlock(hidden_size, bias) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


class MedusaForDrafting(ParallelHeadsMixin, DrafterPreTrainedModel):
    """Medusa-1: ``num_heads`` residual heads on the target's final hidden state, one forward per pass.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(MedusaConfig.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter, tree="medusa-63")
    """

    config_class = MedusaConfig
    lora_target_modules = ("linear",)
    loss_kwargs = ("decay",)
    _no_split_modules = ["MedusaHead"]

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.num_layers, config.draft_vocab_size, config.residual_bias)
            for _ in range(config.num_heads)
        )
        self.register_vocabulary_buffers(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """The shared convention (``zero_init`` leaves start at zero), except that a zero-initialised block keeps
        nn.Linear's default bias, as the paper's blocks do."""
        super()._init_weights(module)
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False) and module.bias is not None:
            bound = module.in_features**-0.5
            nn.init.uniform_(module.bias, -bound, bound)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def heads_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def forward(self, target_hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """``(batch, seq, hidden)`` target final hidden states -> ``(batch, seq, num_heads, draft_vocab)`` logits."""
        return self.heads_forward(target_hidden_states)

    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Every head's projection starts as the target's LM head (its rows of the draft vocabulary)."""
        self.copy_target_head_rows(target, [head.lm_head for head in self.heads])

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``sum_k decay^(k-1) CE_k`` over the heads (``decay``: ``config.loss_decay`` unless given), labels per
        ``config.loss_labels``; metrics per head and the simulated walk of a ``num_heads`` chain."""
        decay = float(loss_kwargs.get("decay") or self.config.loss_decay)  # medusa_weight: Medusa2ForDrafting
        weights = [decay**j for j in range(self.num_heads)]
        return self.heads_loss(batch, features, target_head, weights, self.config.loss_labels, **loss_kwargs)


class Medusa2ForDrafting(MedusaForDrafting):
    """Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target (self-distilled).

    ``hf-specdec train --drafter medusa2`` (online features: the adapter changes them) writes the heads and the
    adapter; at generation time load both:

        >>> drafter = AutoModelForDrafting.from_pretrained(folder)
        >>> target = drafter.adapt_target(target)  # the adapted target; the plain one is refused
        >>> out = target.generate(**inputs, assistant_model=drafter)
    """

    config_class = Medusa2Config
    trains_target_adapter = True
    loss_kwargs = ("decay", "medusa_weight")

    def target_adapter_config(self):
        from peft import LoraConfig

        cfg = self.config
        return LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
        )

    def loss_schedule(self, step: int, total_steps: int) -> dict:
        ramp = self.config.lambda_ramp * max(int(total_steps), 1)
        share = 1.0 if ramp <= 0 else min(1.0, step / ramp)
        return {"medusa_weight": float(self.config.lambda_max) * share}

    def optimizer_param_groups(self, learning_rate, weight_decay, adapter_parameters=None):
        groups = super().optimizer_param_groups(learning_rate, weight_decay)
        if adapter_parameters:
            groups.append(
                {
                    "params": list(adapter_parameters),
                    "lr": learning_rate / float(self.config.head_lr_ratio),
                    "weight_decay": weight_decay,
                }
            )
        return groups

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """``KL(teacher || adapted target)`` over the loss tokens plus ``medusa_weight`` times the heads' loss
        (``medusa_weight`` from :meth:`loss_schedule`; ``lambda_max`` when called outside the trainer)."""
        weight = loss_kwargs.get("medusa_weight")
        weight = float(self.config.lambda_max if weight is None else weight)
        heads = super().compute_loss(batch, features, target_head, **loss_kwargs)
        teacher = features.soft_labels(target_head)
        student = torch.log_softmax(features.logits(target_head), dim=-1)
        kl = (teacher.probs * (teacher.probs.clamp_min(1e-12).log() - student)).sum(-1)[:, :-1]
        mask = batch["loss_mask"].bool()
        if batch.get("attention_mask") is not None:
            mask = mask & batch["attention_mask"].bool()
        mask = mask[:, 1:].to(kl.device)  # position s predicts token s + 1
        lm = (kl * mask).sum() / mask.sum().clamp(min=1)
        heads.loss = lm + weight * heads.loss
        heads.metrics["distill_kl_sum"] = (kl * mask).sum().detach()
        heads.metrics["distill_count"] = mask.sum().float()
        heads.rates["distill_kl"] = ("distill_kl_sum", "distill_count")
        return heads
