"""Hydra (Ankner et al. 2024, arXiv 2402.05109): config, modeling, checkpoint layout and the family's registration."""

from ...registry import register_drafter
from . import convert_hydra  # noqa: F401  (registers the zankner/Hydra layout)
from .configuration_hydra import HydraConfig
from .modeling_hydra import HydraDraftState, HydraForDrafting

register_drafter(
    "hydra",
    HydraConfig,
    HydraForDrafting,
    "Hydra: sequentially dependent heads reading the draft path's token embeddings",
    display_name="Hydra",
    card_description=(
        "Hydra (Ankner et al. 2024) extends Medusa's heads on the target's last hidden state with the embeddings "
        "of the tokens already on the draft path, so each head conditions on the tokens drafted before it. Heads "
        "are small MLPs; a chain or tree is drafted head by head, with no draft-side attention."
    ),
)

__all__ = ["HydraConfig", "HydraForDrafting", "HydraDraftState"]
