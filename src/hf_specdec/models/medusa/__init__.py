"""Medusa-1 (Cai et al. 2024, arXiv 2401.10774): config, modeling, checkpoint layouts and the family's registration."""

from ...registry import register_drafter
from ...tree.policies import register_static_tree
from . import convert_medusa  # noqa: F401  (registers the FasterDecoding and vLLM layouts)
from .configuration_medusa import Medusa2Config, MedusaConfig
from .modeling_medusa import Medusa2ForDrafting, MedusaForDrafting

# Medusa's default sparse tree (FasterDecoding/Medusa ``medusa_choices.mc_sim_7b_63``): 63 nodes, depth <= 4, chosen
# from Vicuna-7B calibration accuracies; as data (paths of child ranks, in the source's order).
MEDUSA_63 = (
    "0;0,0;1;0,1;2;0,0,0;1,0;0,2;3;0,3;4;0,4;2,0;0,5;0,0,1;5;0,6;6;0,7;0,1,0;1,1;7;0,8;0,0,2;3,0;0,9;8;9;1,0,0;0,2,0;"
    "1,2;0,0,3;4,0;2,1;0,0,4;0,0,5;0,0,0,0;0,1,1;0,0,6;0,3,0;5,0;1,3;0,0,7;0,0,8;0,0,9;6,0;0,4,0;1,4;7,0;0,1,2;2,0,0;"
    "3,1;2,2;8,0;0,5,0;1,5;1,0,1;0,2,1;9,0;0,6,0;0,0,0,1;1,6;0,7,0"
)
register_static_tree("medusa-63", [tuple(int(r) for r in path.split(",")) for path in MEDUSA_63.split(";")])

register_drafter(
    "medusa",
    MedusaConfig,
    MedusaForDrafting,
    "Medusa-1: residual heads on the target's last hidden state, one forward per pass, chains or trees",
    display_name="Medusa",
    card_description=(
        "Medusa (Cai et al. 2024) puts several heads on the target's last hidden state; head k is a residual block "
        "and a vocabulary projection that predicts the token k + 1 positions ahead. All heads run once per pass, "
        "with no draft-side attention; a chain takes each head's top token, a tree the Cartesian product of their "
        "top tokens (Medusa's 63-node tree). Medusa-1 trains the heads on a frozen target."
    ),
)

register_drafter(
    "medusa2",
    Medusa2Config,
    Medusa2ForDrafting,
    "Medusa-2: Medusa heads trained jointly with a LoRA adapter on the target (self-distilled)",
    display_name="Medusa-2",
    card_description=(
        "Medusa-2 (Cai et al. 2024) trains the Medusa heads together with a LoRA adapter on the target, with the "
        "unadapted target as the teacher (self-distillation) and a ramped weight on the heads' loss. Generation "
        "uses the adapted target (`target = drafter.adapt_target(target)`), shipped in the drafter's folder."
    ),
)

__all__ = ["MedusaConfig", "MedusaForDrafting", "Medusa2Config", "Medusa2ForDrafting"]
