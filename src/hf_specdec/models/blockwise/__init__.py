"""Blockwise parallel decoding (Stern et al. 2018, arXiv 1811.03115): config, modeling and the family's
registration."""

from ...registry import register_drafter
from .configuration_blockwise import BlockwiseConfig
from .modeling_blockwise import BlockwiseForDrafting

register_drafter(
    "blockwise",
    BlockwiseConfig,
    BlockwiseForDrafting,
    "Blockwise parallel decoding: residual feed-forward heads sharing the target's LM head",
    display_name="Blockwise",
    card_description=(
        "Blockwise parallel decoding (Stern et al. 2018) adds k feed-forward heads with residual connections on the "
        "target's last hidden state; head j predicts the token j + 1 positions ahead through the target's own LM "
        "head, so the drafter holds only the heads. All heads run once per pass."
    ),
)

__all__ = ["BlockwiseConfig", "BlockwiseForDrafting"]
