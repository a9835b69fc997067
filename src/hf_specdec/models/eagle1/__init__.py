"""EAGLE-1 (Li et al. 2024, arXiv 2401.15077): config, modeling, checkpoint layout and the family's registration."""

from ...registry import register_drafter
from . import convert_eagle1  # noqa: F401  (registers the SafeAILab / vLLM layout)
from .configuration_eagle1 import Eagle1Config
from .modeling_eagle1 import Eagle1DraftState, Eagle1ForDrafting

register_drafter(
    "eagle1",
    Eagle1Config,
    Eagle1ForDrafting,
    "EAGLE-1: feature-level autoregression on the target's top feature, one layer, target LM head",
    display_name="EAGLE-1",
    card_description=(
        "EAGLE-1 (Li et al. 2024) predicts the target's next top-layer feature from the current feature and the "
        "embedding of the next token with one decoder layer, and reads draft tokens off the target's own LM head; "
        "it is trained with a feature regression loss plus a tenth of the cross-entropy. EAGLE-2's dynamic trees draft with "
        "the same weights (tree='eagle2')."
    ),
)

__all__ = ["Eagle1Config", "Eagle1ForDrafting", "Eagle1DraftState"]
