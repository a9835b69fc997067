"""`AutoModelForDrafting`: the transformers Auto class for drafters."""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _LazyAutoMapping

__all__ = ["AutoModelForDrafting"]


class AutoModelForDrafting(_BaseAutoModelClass):
    """Builds the drafter class matching a config's ``model_type`` (``"<family>_drafter"``).

    Works like every transformers Auto class:

    >>> drafter = AutoModelForDrafting.from_pretrained("org/my-drafter")  # Hub id or local folder
    >>> drafter = AutoModelForDrafting.from_config(MyDrafterConfig.for_target(target.config))
    >>> AutoModelForDrafting.register(MyDrafterConfig, MyDrafter)  # third-party families

    A local folder written by another project in a registered layout (``hf-specdec convert --list``; detected from
    ``config.json`` and the tensor names) is imported on the fly. Target facts such checkpoints do not record (the
    target's depth, hence default feature layers) are resolved when ``generate`` binds the target; pass
    ``target_config=`` (or ``target_num_hidden_layers=``) to resolve and check them at load time instead.
    """

    _model_mapping = _LazyAutoMapping(OrderedDict(), OrderedDict())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        target_config = kwargs.pop("target_config", None)
        target_layers = kwargs.pop("target_num_hidden_layers", None)
        path = str(pretrained_model_name_or_path)
        if os.path.isfile(os.path.join(path, "config.json")):
            from .convert import detect_layout, import_drafter

            layout = detect_layout(path)
            if layout is not None:
                model = import_drafter(path, layout, target_config, target_layers)
                dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
                if isinstance(dtype, torch.dtype):
                    model = model.to(dtype)
                return model
        if target_config is not None or target_layers is not None:
            raise ValueError(
                "target_config / target_num_hidden_layers only apply to checkpoints in another project's layout; "
                f"{path} is not one."
            )
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
