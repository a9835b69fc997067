"""`AutoModelForDrafting`: the transformers Auto class for drafters."""

from __future__ import annotations

from collections import OrderedDict

import torch
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _LazyAutoMapping

from .checkpoint_files import HUB_OPTIONS, open_checkpoint
from .convert import import_drafter

__all__ = ["AutoModelForDrafting"]


class AutoModelForDrafting(_BaseAutoModelClass):
    """Builds the drafter class matching a config's ``model_type`` (``"<family>_drafter"``).

    Works like every transformers Auto class:

    >>> drafter = AutoModelForDrafting.from_pretrained("org/my-drafter")  # Hub id or local folder
    >>> drafter = AutoModelForDrafting.from_config(MyDrafterConfig.for_target(target.config))
    >>> AutoModelForDrafting.register(MyDrafterConfig, MyDrafter)  # third-party families

    A checkpoint written by another project in a registered layout (``hf-specdec convert --list``; detected from
    ``config.json`` and the tensor names), in a local folder or a Hub repo, is imported on the fly; from the Hub only
    ``config.json``, the weight index or headers, and the weight files the layout reads are downloaded. ``subfolder``,
    ``revision``, ``token``, ``cache_dir`` and ``local_files_only`` work for both kinds of checkpoint. Target facts
    such checkpoints do not record (the target's depth, hence default feature layers) are resolved when ``generate``
    binds the target; pass ``target_config=`` (or ``target_num_hidden_layers=``) to resolve and check them at load
    time instead. A checkpoint that is neither a registered drafter nor in a known layout is refused with a message
    naming the layouts; its config's ``auto_map`` (remote code) is never run.
    """

    _model_mapping = _LazyAutoMapping(OrderedDict(), OrderedDict())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        target_config = kwargs.pop("target_config", None)
        target_layers = kwargs.pop("target_num_hidden_layers", None)
        files = open_checkpoint(pretrained_model_name_or_path, **{k: kwargs[k] for k in HUB_OPTIONS if k in kwargs})
        model_type = str(files.config.get("model_type") or "")
        if model_type in cls._registered_model_types():
            if target_config is not None or target_layers is not None:
                raise ValueError(
                    "target_config / target_num_hidden_layers only apply to checkpoints in another project's layout; "
                    f"{files.where} is an hf_specdec drafter."
                )
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if model_type.endswith("_drafter"):
            raise ValueError(
                f"{files.where} holds a {model_type!r} drafter, a family no installed package registers (registered: "
                f"{sorted(cls._registered_model_types())}). Import the package that defines it (it calls "
                "hf_specdec.register_drafter or AutoModelForDrafting.register) before loading it."
            )
        model = import_drafter(files, "auto", target_config, target_layers)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model

    @classmethod
    def _registered_model_types(cls) -> set[str]:
        return {config_class.model_type for config_class in cls._model_mapping.keys()}
