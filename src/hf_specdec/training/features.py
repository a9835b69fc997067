"""Target features for drafter training: what the target computes for a batch, captured online.

The feature types and the soft-label code live below the families in :mod:`hf_specdec.features` (families import
them from there); they are re-exported here for training code.
"""

from __future__ import annotations

import torch
from torch import nn

from ..features import (
    SoftLabels,
    TargetFeatures,
    logit_softcap,
    soft_labels,
    target_logits_from_last_hidden,
    walk_metrics,
    walk_passes,
)

__all__ = [
    "TargetFeatures",
    "SoftLabels",
    "capture_target_features",
    "logit_softcap",
    "soft_labels",
    "target_logits_from_last_hidden",
    "walk_metrics",
    "walk_passes",
]


def _run_target(target: nn.Module, input_ids, attention_mask, layer_ids=None):
    # Only the layers the drafter reads and the last one are kept (output_hidden_states=[ids]), not every layer.
    selected = True if layer_ids is None else sorted({int(i) for i in layer_ids} | {-1})
    kwargs = {"output_hidden_states": selected, "use_cache": False, "return_dict": True}
    fn = getattr(target, "_supports_logits_to_keep", None)
    if callable(fn) and fn():
        kwargs["logits_to_keep"] = 1
    out = target(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hs = out.hidden_states
    if hs is None:
        raise ValueError(f"{type(target).__name__} returned no hidden states; drafter training needs them.")
    return hs


def capture_target_features(
    target: nn.Module,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    layer_ids: list[int],
    with_grad: bool = False,
    teacher_without_adapter: bool = False,
) -> TargetFeatures:
    """Runs the target once and keeps only the hidden states the drafter reads.

    The target's logits are not materialised (``logits_to_keep=1`` where supported); they are recomputed from
    ``last_hidden`` over the draft vocabulary only, when the loss needs them.

    Args:
        target: the target (a frozen model, or a peft model whose adapter is trained).
        input_ids / attention_mask: the right-padded batch.
        layer_ids: ``output_hidden_states`` indices to keep.
        with_grad: keep the autograd graph (gradients flow into a trainable target adapter).
        teacher_without_adapter: also run ``target`` under ``disable_adapter()`` (no gradients) and keep its final
            hidden state as ``teacher_last_hidden``: the teacher of a family that trains a target adapter.
    """
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        hs = _run_target(target, input_ids, attention_mask, layer_ids)
    teacher = None
    if teacher_without_adapter:
        if not hasattr(target, "disable_adapter"):
            raise ValueError(f"{type(target).__name__} has no adapter to disable (expected a peft model).")
        with torch.no_grad(), target.disable_adapter():
            teacher = _run_target(target, input_ids, attention_mask, [])[-1]
    return TargetFeatures(
        hidden_states=[hs[i] for i in layer_ids],
        last_hidden=hs[-1],
        teacher_last_hidden=teacher,
        softcap=logit_softcap(getattr(target, "config", None)),
    )
