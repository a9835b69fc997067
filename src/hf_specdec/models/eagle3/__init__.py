"""EAGLE-3 (Li et al. 2025, arXiv 2503.01840): config, modeling, checkpoint layouts and the family's registration."""

from ...registry import register_drafter
from . import (
    convert_eagle3,  # noqa: F401  (registers the SafeAILab / SpecForge / vLLM / ModelOpt layouts)
    convert_eagle3_speculators,  # noqa: F401  (registers the speculators layout)
)
from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3DraftState, Eagle3ForDrafting, Eagle3Output

register_drafter(
    "eagle3",
    Eagle3Config,
    Eagle3ForDrafting,
    "EAGLE-3: fused low/mid/high target features, one layer (or a stack)",
    display_name="EAGLE-3",
    card_description=(
        "EAGLE-3 (Li et al. 2025) fuses three hidden states of the target (low, mid and high layers) and runs one "
        "decoder layer (or a stack of them, `num_hidden_layers`) on them together with the embedding of the next token; it drafts a chain token by token, "
        "feeding its own hidden state back, and is trained with training-time test (its own drafts as inputs)."
    ),
    default=True,
)

__all__ = ["Eagle3Config", "Eagle3ForDrafting", "Eagle3DraftState", "Eagle3Output"]
