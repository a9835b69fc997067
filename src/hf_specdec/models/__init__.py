"""Drafter families, one folder each. Importing this module registers every family."""

from ..registry import register_drafter
from .eagle3 import Eagle3Config, Eagle3ForDrafting

register_drafter("eagle3", Eagle3Config, Eagle3ForDrafting, "EAGLE-3: fused low/mid/high target features, one layer")

__all__ = ["Eagle3Config", "Eagle3ForDrafting"]
