"""DFlash (Chen, Liang and Liu, arXiv 2602.06036): config, modeling, checkpoint layouts and the family's
registration."""

from ...registry import register_drafter
from . import convert_dflash  # noqa: F401  (registers the z-lab and MuseGlimmer layouts)
from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashDraftState, DFlashForDrafting

register_drafter(
    "dflash",
    DFlashConfig,
    DFlashForDrafting,
    "DFlash: a block of [anchor, MASK...] filled in one non-causal pass, target context in every layer's keys",
    display_name="DFlash",
    card_description=(
        "DFlash (Chen, Liang and Liu 2026) drafts a whole block in one pass: the last verified token followed by mask "
        "tokens goes through a few non-causal decoder layers whose keys and values also hold the target's fused "
        "intermediate states, and every masked slot predicts the token at its position through the target's LM head."
    ),
)

__all__ = ["DFlashConfig", "DFlashForDrafting", "DFlashDraftState"]
