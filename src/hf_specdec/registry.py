"""Registry of drafter families: one spec per family that the Auto class, loop, trainer and CLI read."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig

from .configuration_utils import DrafterConfig
from .modeling_utils import DrafterPreTrainedModel

__all__ = ["DrafterSpec", "register_drafter", "get_drafter_spec", "default_drafter_spec", "DRAFTERS"]


@dataclass(frozen=True)
class DrafterSpec:
    """What the library knows about one drafter family; consumers (CLI, cards, bench, training) read it instead of
    naming families.

    Attributes:
        name: short CLI name (``hf-specdec train --drafter NAME``).
        config_class / model_class: the family's config and ``DrafterPreTrainedModel`` subclass.
        description: one line for ``hf-specdec families``.
        display_name: how people write the method (model cards, reports, demo); defaults to ``name``.
        card_description: a paragraph for the model card on how the drafter works.
        default: the family used when a command is given no ``--drafter`` (one family sets it).
        commands: the ``hf-specdec`` commands that work on this family's drafters beyond the common ones
            (``"profile"``: it reads the target's pass times; ``"calibrate"``: it has a confidence head).
    """

    name: str
    config_class: type[DrafterConfig]
    model_class: type[DrafterPreTrainedModel]
    description: str = ""
    display_name: str = ""
    card_description: str = ""
    default: bool = False
    commands: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.display_name or self.name

    @property
    def model_type(self) -> str:
        return self.config_class.model_type


DRAFTERS: dict[str, DrafterSpec] = {}


def register_drafter(
    name: str,
    config_class: type[DrafterConfig],
    model_class: type[DrafterPreTrainedModel],
    description: str = "",
    *,
    display_name: str = "",
    card_description: str = "",
    default: bool = False,
    commands: tuple[str, ...] = (),
) -> DrafterSpec:
    """Registers a drafter family with hf_specdec, ``AutoConfig`` and ``AutoModelForDrafting``.

    A family calls this once, from its ``models/<family>/__init__.py``; see :class:`DrafterSpec` for the fields.

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
    if default and any(s.default and s.name != name for s in DRAFTERS.values()):
        raise ValueError(f"Another family is already the default; {name!r} cannot be one too.")
    spec = DrafterSpec(name, config_class, model_class, description, display_name, card_description, default,
                       tuple(commands))  # fmt: skip
    if name not in DRAFTERS:
        AutoConfig.register(model_type, config_class, exist_ok=True)
        AutoModelForDrafting.register(config_class, model_class, exist_ok=True)
    DRAFTERS[name] = spec
    return spec


def default_drafter_spec() -> DrafterSpec:
    """The family a command uses when given none (the one registered with ``default=True``, else the first)."""
    if not DRAFTERS:
        raise ValueError("No drafter family is registered.")
    return next((s for s in DRAFTERS.values() if s.default), next(iter(DRAFTERS.values())))


def get_drafter_spec(name_or_type: str) -> DrafterSpec:
    """Looks a family up by short name (``spec.name``) or ``model_type`` (``"<name>_drafter"``)."""
    for spec in DRAFTERS.values():
        if name_or_type in (spec.name, spec.model_type):
            return spec
    raise ValueError(f"Unknown drafter family {name_or_type!r}. Registered: {sorted(DRAFTERS)}.")
