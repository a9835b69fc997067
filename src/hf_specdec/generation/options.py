"""Where each speculative-decoding option goes, decided in one place for both of its sources: the keywords of a
``generate`` call (the hook) and the attributes of a frozen ``GenerationConfig`` (the loop's fallback).

Nothing here names a verifier or a family: a verifier declares its options (``Verifier.generate_options``, e.g.
ASD's ``asd_budget``), a family its drafting options (``draft_options``), and the tree policies theirs
(``TREE_OPTIONS``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..tree.policies import TREE_OPTIONS
from ..verification import VERIFIERS, verifier_option_owner

__all__ = ["route_options", "option_names"]


def _chosen_verifier(verifier):
    if verifier is None:
        return None
    return VERIFIERS.get(verifier) if isinstance(verifier, str) else type(verifier)


def option_names(verifier, drafter) -> tuple[str, ...]:
    """The option names that apply with this verifier (a name, an instance or ``None``) and drafter."""
    chosen = _chosen_verifier(verifier)
    own = tuple(chosen.generate_options) if chosen is not None else ()
    return (*own, *TREE_OPTIONS, *type(drafter).draft_options)


def route_options(values: Mapping[str, Any], verifier, drafter, strict: bool) -> tuple[dict, dict, list[str]]:
    """Splits ``values`` into the chosen verifier's constructor options and the drafting options (tree options and
    the family's own); returns ``(verifier_options, draft_options, the keys taken)``. Other keys are left alone.

    With ``strict`` (a call's keywords), an option of a verifier that was not chosen is an error that says which
    verifier to pass; without it (a config's attributes) it is not read."""
    chosen = _chosen_verifier(verifier)
    verifier_options: dict = {}
    draft_options: dict = {}
    taken: list[str] = []
    for key, value in values.items():
        owner = verifier_option_owner(key)
        if owner is not None:
            if owner is not chosen:
                if strict:
                    raise ValueError(
                        f"{key!r} is an option of the {owner.name!r} verifier: pass verifier={owner.name!r} as well."
                    )
                continue
            verifier_options[owner.generate_options[key]] = value
        elif key in TREE_OPTIONS or key in type(drafter).draft_options:
            draft_options[key] = value
        else:
            continue
        taken.append(key)
    return verifier_options, draft_options, taken
