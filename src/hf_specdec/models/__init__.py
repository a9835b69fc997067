"""Drafter families, one folder each. Importing this module registers every family (each folder's ``__init__``
makes its one ``register_drafter`` call and registers its checkpoint layouts)."""

from . import eagle3
from .eagle3 import Eagle3Config, Eagle3ForDrafting

# Public names re-exported by ``hf_specdec`` (it never names a family itself).
__all__ = ["eagle3", "Eagle3Config", "Eagle3ForDrafting"]
