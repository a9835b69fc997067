"""MTP (DeepSeek-V3-style multi-token prediction, arXiv 2412.19437): config, modeling, checkpoint layout and the
family's registration."""

from transformers import AutoConfig

from ...auto import AutoModelForDrafting
from ...registry import register_drafter
from . import convert_mtp  # noqa: F401  (registers the DeepSeek / native-target MTP layouts)
from .configuration_mtp import MtpConfig, NativeMtpConfig
from .modeling_mtp import MtpDraftState, MtpForDrafting
from .modeling_native_mtp import NativeMtpForDrafting

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

# A target's own MTP layers load from its checkpoint (layout native-mtp) but are not a family one trains: Auto classes
# only, no `register_drafter` (nothing to build with `for_target` on an arbitrary target).
AutoConfig.register(NativeMtpConfig.model_type, NativeMtpConfig, exist_ok=True)
AutoModelForDrafting.register(NativeMtpConfig, NativeMtpForDrafting, exist_ok=True)

__all__ = ["MtpConfig", "MtpForDrafting", "MtpDraftState", "NativeMtpConfig", "NativeMtpForDrafting"]
