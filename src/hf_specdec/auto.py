"""`AutoModelForDrafting`: the transformers Auto class for drafters."""

from __future__ import annotations

from collections import OrderedDict

from transformers.models.auto.auto_factory import _BaseAutoModelClass, _LazyAutoMapping

__all__ = ["AutoModelForDrafting"]


class AutoModelForDrafting(_BaseAutoModelClass):
    """Builds the drafter class matching a config's ``model_type`` (``"<family>_drafter"``).

    Works like every transformers Auto class:

    >>> drafter = AutoModelForDrafting.from_pretrained("org/eagle3-llama3-8b")  # Hub id or local folder
    >>> drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    >>> AutoModelForDrafting.register(MyDrafterConfig, MyDrafter)  # third-party families
    """

    _model_mapping = _LazyAutoMapping(OrderedDict(), OrderedDict())
