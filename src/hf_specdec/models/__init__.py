"""Drafter families, one folder each. Importing this module registers every family (each folder's ``__init__``
makes its one ``register_drafter`` call and registers its checkpoint layouts)."""

from . import blockwise, dflash, eagle1, eagle3, hydra, medusa, mtp, specblock
from .blockwise import BlockwiseConfig, BlockwiseForDrafting
from .dflash import DFlashConfig, DFlashForDrafting, DSparkConfig, DSparkForDrafting
from .eagle1 import Eagle1Config, Eagle1ForDrafting
from .eagle3 import Eagle3Config, Eagle3ForDrafting
from .hydra import HydraConfig, HydraForDrafting
from .medusa import Medusa2Config, Medusa2ForDrafting, MedusaConfig, MedusaForDrafting
from .mtp import MtpConfig, MtpForDrafting
from .specblock import SpecBlockConfig, SpecBlockForDrafting

# Public names re-exported by ``hf_specdec`` (it never names a family itself).
__all__ = [
    "blockwise",
    "dflash",
    "eagle1",
    "eagle3",
    "hydra",
    "medusa",
    "mtp",
    "specblock",
    "BlockwiseConfig",
    "BlockwiseForDrafting",
    "DFlashConfig",
    "DFlashForDrafting",
    "DSparkConfig",
    "DSparkForDrafting",
    "Eagle1Config",
    "Eagle1ForDrafting",
    "Eagle3Config",
    "Eagle3ForDrafting",
    "HydraConfig",
    "HydraForDrafting",
    "MedusaConfig",
    "MedusaForDrafting",
    "Medusa2Config",
    "Medusa2ForDrafting",
    "MtpConfig",
    "MtpForDrafting",
    "SpecBlockConfig",
    "SpecBlockForDrafting",
]
