"""DFlash (Chen, Liang and Liu, arXiv 2602.06036) and DSpark (Cheng et al., DeepSeek DeepSpec), which extends its
backbone: configs, modeling, checkpoint layouts and the two families' registrations."""

from ...registry import register_drafter
from . import (
    convert_dflash,  # noqa: F401  (registers the z-lab, MuseGlimmer and DSpark layouts)
    convert_dflash_speculators,  # noqa: F401  (registers the speculators layouts)
)
from .configuration_dflash import DFlashConfig
from .configuration_dspark import DSparkConfig
from .modeling_dflash import DFlashDraftState, DFlashForDrafting
from .modeling_dspark import DSparkDraftState, DSparkForDrafting

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

register_drafter(
    "dspark",
    DSparkConfig,
    DSparkForDrafting,
    "DSpark: a DFlash-style block with a low-rank sequential correction, a confidence head and a length scheduler",
    display_name="DSpark",
    card_description=(
        "DSpark (Cheng et al., DeepSeek 2026) drafts a block in one DFlash-style pass whose every slot, the anchor "
        "included, predicts the next token, then corrects each slot's distribution with a low-rank term of the "
        "previous draft token and predicts each draft's acceptance with a confidence head; a scheduler uses the "
        "confidences and the target's measured pass times to choose how many drafts each row verifies."
    ),
    commands=("profile", "calibrate"),
)

__all__ = [
    "DFlashConfig",
    "DFlashForDrafting",
    "DFlashDraftState",
    "DSparkConfig",
    "DSparkForDrafting",
    "DSparkDraftState",
]
