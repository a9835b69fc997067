"""MTP (DeepSeek-V3-style multi-token prediction, arXiv 2412.19437): config, modeling, checkpoint layout and the
family's registration."""

from ...registry import register_drafter
from . import convert_mtp  # noqa: F401  (registers the DeepSeek / native-target MTP layout)
from .configuration_mtp import MtpConfig
from .modeling_mtp import MtpDraftState, MtpForDrafting

register_drafter(
    "mtp",
    MtpConfig,
    MtpForDrafting,
    "MTP: DeepSeek-V3-style chained multi-token prediction modules on the target's final state, target embedding and LM head",
    display_name="MTP",
    card_description=(
        "MTP (DeepSeek-V3's multi-token prediction, trained post hoc) chains small modules on the target's final "
        "hidden state: each normalises that state and the embedding of the next token, projects them together and "
        "runs one decoder layer, and the target's own LM head reads the draft token off it. Module k drafts token k; "
        "longer drafts reuse the last module."
    ),
)

__all__ = ["MtpConfig", "MtpForDrafting", "MtpDraftState"]
