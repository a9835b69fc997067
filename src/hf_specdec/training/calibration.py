"""Held-out batches for calibrating a drafter's confidence head (``hf-specdec calibrate``)."""

from __future__ import annotations

from ..features import TargetFeatures, logit_softcap

__all__ = ["collect_calibration_batches"]


def collect_calibration_batches(
    features_dir, target, drafter, eval_fraction: float = 0.05, batch_size: int = 8, seed=0
):
    """The held-out split of an offline features dump, exactly as ``hf-specdec train --features`` holds it out (same
    fraction and seed), as ``(batch, TargetFeatures)`` pairs restricted to the layers ``drafter`` reads."""
    from .data import split_train_eval
    from .offline import OfflineFeatureDataset, collate_offline
    from .recipes import _split_indices

    dataset = OfflineFeatureDataset(features_dir)
    dataset.check_compatible(drafter.config)
    _, held_out = _split_indices(dataset, eval_fraction, seed, split_train_eval)
    if held_out is None or len(held_out) == 0:
        raise ValueError(
            "Calibration needs held-out examples: pass an eval fraction > 0 and a dump of several examples."
        )
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    softcap = logit_softcap(target.config)
    out = []
    items = [held_out[i] for i in range(len(held_out))]
    for start in range(0, len(items), batch_size):
        batch = collate_offline(items[start : start + batch_size], pad)
        hs = batch["target_hidden_states"]
        hs = list(hs) if isinstance(hs, (list, tuple)) else list(hs.unbind(1))
        feats = TargetFeatures(hidden_states=hs, last_hidden=batch["target_last_hidden"], softcap=softcap)
        out.append((batch, feats.to(drafter.device, drafter.dtype)))
    return out
