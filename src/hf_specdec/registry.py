"""Registry of drafter families: one spec per family that the Auto class, loop, trainer and CLI read."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig

from .configuration_utils import DrafterConfig
from .modeling_utils import DrafterPreTrainedModel

__all__ = ["DrafterSpec", "register_drafter", "get_drafter_spec", "DRAFTERS"]


@dataclass(frozen=True)
class DrafterSpec:
    """What the library knows about one drafter family."""

    name: str  # short CLI name, e.g. "eagle3"
    config_class: type[DrafterConfig]
    model_class: type[DrafterPreTrainedModel]
    description: str = ""

    @property
    def model_type(self) -> str:
        return self.config_class.model_type


DRAFTERS: dict[str, DrafterSpec] = {}


def register_drafter(
    name: str, config_class: type[DrafterConfig], model_class: type[DrafterPreTrainedModel], description: str = ""
) -> DrafterSpec:
    """Registers a drafter family with hf_specdec, ``AutoConfig`` and ``AutoModelForDrafting``.

    ``config_class.model_type`` must end in ``"_drafter"`` so it can never collide with a transformers model type.
    """
    from .auto import AutoModelForDrafting

    model_type = config_class.model_type
    if not model_type.endswith("_drafter"):
        raise ValueError(f"Drafter model_type must end with '_drafter', got {model_type!r}.")
    if model_class.config_class is not config_class:
        raise ValueError(f"{model_class.__name__}.config_class must be {config_class.__name__}.")
    if name in DRAFTERS and DRAFTERS[name].model_class is not model_class:
        raise ValueError(f"A drafter family named {name!r} is already registered.")
    spec = DrafterSpec(name, config_class, model_class, description)
    if name not in DRAFTERS:
        AutoConfig.register(model_type, config_class, exist_ok=True)
        AutoModelForDrafting.register(config_class, model_class, exist_ok=True)
    DRAFTERS[name] = spec
    return spec


def get_drafter_spec(name_or_type: str) -> DrafterSpec:
    """Looks a family up by short name (``"eagle3"``) or ``model_type`` (``"eagle3_drafter"``)."""
    for spec in DRAFTERS.values():
        if name_or_type in (spec.name, spec.model_type):
            return spec
    raise ValueError(f"Unknown drafter family {name_or_type!r}. Registered: {sorted(DRAFTERS)}.")
