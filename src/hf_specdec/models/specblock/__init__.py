"""SpecBlock (Shi et al., arXiv 2605.07243): config, modeling, its rank tree, serving-time adaptation, the reference
checkpoint layout, and the family's registration."""

from ...registry import register_drafter
from ...tree.policies import register_tree_policy
from . import convert_specblock  # noqa: F401  (registers the reference layout)
from .configuration_specblock import SpecBlockConfig
from .modeling_specblock import SpecBlockDraftState, SpecBlockForDrafting
from .tree import RankTree

register_drafter(
    "specblock",
    SpecBlockConfig,
    SpecBlockForDrafting,
    "SpecBlock: K positions per pass (prefix broadcast, position queries, layer-wise shift), rank-head trees",
    display_name="SpecBlock",
    card_description=(
        "SpecBlock (Shi et al. 2026) drafts a block of positions in one pass: every slot reads the target's fused "
        "states, the last token and a learned position query, and a layer-wise shift hands each slot the state of the "
        "one before it between layers; further blocks continue from a drafted slot, and a rank head sets how wide the "
        "tree branches at each position."
    ),
)
register_tree_policy("rank", RankTree)

__all__ = ["SpecBlockConfig", "SpecBlockForDrafting", "SpecBlockDraftState", "RankTree"]
