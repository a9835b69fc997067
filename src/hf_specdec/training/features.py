"""Target features for drafter training: what the frozen target computes for a batch, captured online."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TargetFeatures", "capture_target_features", "target_logits_from_last_hidden"]


@dataclass
class TargetFeatures:
    """Target states a drafter trains on, for a right-padded batch.

    Attributes:
        hidden_states: one ``(batch, seq, hidden)`` tensor per id in the drafter's ``target_layer_ids``, in that
            order (``output_hidden_states`` convention: 0 = embeddings, ``i + 1`` = output of decoder layer ``i``).
        last_hidden: ``(batch, seq, hidden)`` the target's final hidden state (``output_hidden_states[-1]``, the
            LM-head input); target logits are recomputed from it with :func:`target_logits_from_last_hidden`, which
            keeps offline feature files small (hidden size instead of vocabulary size per token).
    """

    hidden_states: list[torch.Tensor]
    last_hidden: torch.Tensor

    def to(self, device=None, dtype=None) -> TargetFeatures:
        return TargetFeatures(
            hidden_states=[h.to(device=device, dtype=dtype) for h in self.hidden_states],
            last_hidden=self.last_hidden.to(device=device, dtype=dtype),
        )


@torch.no_grad()
def capture_target_features(
    target: nn.Module, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, layer_ids: list[int]
) -> TargetFeatures:
    """Runs the frozen target once (no grad) and keeps only the hidden states the drafter reads.

    The target's logits are not materialised (``logits_to_keep=1`` where supported); they are recomputed from
    ``last_hidden`` over the draft vocabulary only, when the loss needs them.
    """
    kwargs = {"output_hidden_states": True, "use_cache": False, "return_dict": True}
    fn = getattr(target, "_supports_logits_to_keep", None)
    if callable(fn) and fn():
        kwargs["logits_to_keep"] = 1
    out = target(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hs = out.hidden_states
    if hs is None:
        raise ValueError(f"{type(target).__name__} returned no hidden states; drafter training needs them.")
    return TargetFeatures(hidden_states=[hs[i] for i in layer_ids], last_hidden=hs[-1])


def target_logits_from_last_hidden(
    target_head: nn.Module, last_hidden: torch.Tensor, token_ids: torch.LongTensor | None = None, softcap=None
) -> torch.Tensor:
    """Target logits (float32) from the final hidden state, optionally restricted to ``token_ids`` (a draft vocab).

    ``target_head`` is the target's LM head (``target.get_output_embeddings()``); ``softcap`` applies a final logit
    soft-capping (Gemma-2 style) when the target config has one.
    """
    weight = target_head.weight
    bias = getattr(target_head, "bias", None)
    if token_ids is not None:
        weight = weight[token_ids.to(weight.device)]
        bias = None if bias is None else bias[token_ids.to(weight.device)]
    logits = nn.functional.linear(last_hidden.to(device=weight.device, dtype=weight.dtype), weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
