"""Configuration of the DSpark drafter (a DFlash-style backbone with a sequential correction and a confidence head)."""

from __future__ import annotations

from .configuration_dflash import DFlashConfig

__all__ = ["DSparkConfig"]


class DSparkConfig(DFlashConfig):
    r"""Configuration of :class:`DSparkForDrafting` (DSpark, Cheng et al., DeepSeek DeepSpec).

    The DFlash backbone (see :class:`DFlashConfig`) with the anchor as the first prediction slot: ``block_size`` slots
    ``[anchor, MASK, ...]`` give ``block_size`` draft logits ``U_k``, slot ``k`` predicting the token ``k + 1`` places
    after the anchor. A low-rank sequential (Markov) correction turns them into
    ``p_k(v) ∝ exp(U_k(v) + (W2 W1[x_{k-1}])(v))`` (``W1``: an embedding of the previous token, ``W2``: rank ->
    vocabulary; ``x_0`` is the anchor), and a confidence head ``c_k = σ(w·[h_k; W1[x_{k-1}]] + b)`` predicts the
    acceptance of draft ``k``.

    Args:
        block_size (`int`, defaults to 7): slots per pass, all of them drafts (DSpark's γ).
        markov_rank (`int`, defaults to 256): rank ``r`` of the sequential correction.
        ce_weight / tv_weight / confidence_weight (`float`, defaults to 0.1 / 0.9 / 1.0): the loss
            ``sum_k w_k (ce_weight CE_k + tv_weight ||p_d - p_t||_1) + confidence_weight BCE(c_k, 1 - TV_k)`` with
            ``w_k = exp(-k / loss_decay_gamma)`` (``k`` 0-based, ``loss_decay_gamma`` 4 by default, as DeepSpec's code).
        confidence_temperatures (`list[float]`, *optional*): per-slot temperatures ``T_k`` of the calibrated confidence
            ``σ(logit_k / T_k)`` (sequential temperature scaling, ``hf-specdec calibrate``); none: uncalibrated.
        verify_seconds (`dict`, *optional*): the target pass time measured on a machine:
            ``{"batch_sizes": [...], "widths": [...], "seconds": [[...]], "device": ...}``, seconds of one target
            pass over ``width`` tokens per row at each batch size. The verification-length scheduler
            (``generate(..., confidence_schedule=True)``) reads it; unset, it reads ``pass_times.json`` next to a
            drafter loaded from a folder (what ``hf-specdec profile --drafter`` writes there, not into this
            config).
    """

    model_type = "dspark_drafter"
    resolves_target_vocab_at_bind = False  # its Markov head is sized by the vocabulary

    block_size: int = 7
    markov_rank: int = 256
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    confidence_temperatures: list | None = None
    verify_seconds: dict | None = None

    @property
    def drafts_per_block(self) -> int:
        return int(self.block_size)

    @property
    def decay_gamma(self) -> float:
        return 4.0 if self.loss_decay_gamma is None else float(self.loss_decay_gamma)

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            raise ValueError(f"{name}.markov_rank must be a positive integer, got {self.markov_rank!r}.")
        for key in ("ce_weight", "tv_weight", "confidence_weight"):
            if float(getattr(self, key)) < 0:
                raise ValueError(f"{name}.{key} must be >= 0, got {getattr(self, key)!r}.")
        temps = self.confidence_temperatures
        if temps is not None and (len(temps) != self.block_size or any(float(t) <= 0 for t in temps)):
            raise ValueError(
                f"{name}.confidence_temperatures must hold {self.block_size} positive temperatures, got {temps!r}."
            )
        if self.verify_seconds is not None:
            check_pass_times(self.verify_seconds, f"{name}.verify_seconds")


def check_pass_times(table, where: str) -> None:
    """Refuses a pass-time table (``hf-specdec profile``'s) that is not ``{"batch_sizes", "widths" (increasing),
    "seconds": one row of positive times per batch size}``."""
    try:
        rows = [list(map(float, row)) for row in table["seconds"]]
        ok = len(rows) == len(table["batch_sizes"]) and all(len(r) == len(table["widths"]) for r in rows)
        ok = ok and all(x > 0 for r in rows for x in r) and sorted(table["widths"]) == list(table["widths"])
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"{where} must be {{'batch_sizes': [...], 'widths': [...] (increasing), 'seconds': [[...] per batch "
            "size]}} with positive times; rerun `hf-specdec profile`."
        )
