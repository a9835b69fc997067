"""The verifier protocol and its registry.

A verifier receives the drafter's :class:`~hf_specdec.types.Proposal` and the target's processed
scores for every proposal node plus one (the bonus position), and decides, per row, how many draft tokens to keep
and which token follows them. The loop is generic over verifiers: greedy, lossless speculative sampling, and
approximate verifiers (e.g. ASD) all plug in here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..types import Proposal, VerificationResult

__all__ = [
    "Verifier",
    "VerificationResult",
    "register_verifier",
    "get_verifier",
    "VERIFIERS",
    "verifier_option_owner",
]


class Verifier:
    """Base class of verifiers.

    Class attributes:
        name: registry key (``verifier="<name>"`` in ``generate``).
        supports_sampling / supports_greedy: which decoding modes the verifier accepts.
        approximate: ``True`` when the output may deviate from the target's own decoding (flagged in outputs).
        generate_options: ``generate`` keyword / ``GenerationConfig`` attribute name -> constructor argument, for
            the options this verifier takes (e.g. ASD's ``asd_budget`` -> ``budget``). The ``generate`` hook routes
            these names here, and only to the verifier that declares them.
    """

    name: ClassVar[str] = ""
    supports_sampling: ClassVar[bool] = False
    supports_greedy: ClassVar[bool] = True
    approximate: ClassVar[bool] = False
    generate_options: ClassVar[dict[str, str]] = {}
    option_labels: ClassVar[dict[str, str]] = {}  # constructor argument -> short label in benchmark tables

    def __init__(self, **options: Any):
        if options:
            raise ValueError(f"Verifier {self.name!r} takes no options, got {sorted(options)}.")

    def start(self, batch_size: int, device: torch.device, do_sample: bool) -> None:
        """Called once per ``generate`` call, before the first verification."""
        if do_sample and not self.supports_sampling:
            raise ValueError(
                f"The {self.name!r} verifier does not support sampling (do_sample=True). Use do_sample=False, or "
                "the lossless 'sampling' verifier."
            )
        if not do_sample and not self.supports_greedy:
            raise ValueError(f"The {self.name!r} verifier needs do_sample=True.")

    def verify(self, proposal: Proposal, scores: torch.Tensor) -> VerificationResult:
        """Verifies ``proposal`` given the target's processed ``scores``.

        Args:
            proposal: the draft; for chains node ``i`` is the ``i``-th draft token.
            scores: ``(batch, num_nodes + 1, vocab)`` float32 processed target scores; ``scores[:, 0]`` is the
                distribution after the last committed token, ``scores[:, i + 1]`` the one after node ``i``.
        """
        raise NotImplementedError


VERIFIERS: dict[str, type[Verifier]] = {}


def register_verifier(cls: type[Verifier]) -> type[Verifier]:
    """Class decorator registering a verifier under ``cls.name``."""
    if not cls.name:
        raise ValueError("A verifier needs a non-empty `name`.")
    for option in cls.generate_options:
        owner = verifier_option_owner(option)
        if owner is not None and owner is not cls and owner.name != cls.name:
            raise ValueError(f"generate option {option!r} of verifier {cls.name!r} is already taken by {owner.name!r}.")
    VERIFIERS[cls.name] = cls
    return cls


def verifier_option_owner(option: str) -> type[Verifier] | None:
    """The registered verifier class that declares ``generate`` option ``option`` (``None`` if none does)."""
    for cls in VERIFIERS.values():
        if option in cls.generate_options:
            return cls
    return None


def get_verifier(spec: str | Verifier | None, do_sample: bool, **options: Any) -> Verifier:
    """Resolves a verifier name (or instance) for the given decoding mode."""
    if isinstance(spec, Verifier):
        if options:
            raise ValueError("Pass verifier options to the verifier's constructor when passing an instance.")
        return spec
    if spec is None:
        spec = "sampling" if do_sample else "greedy"
    if spec not in VERIFIERS:
        raise ValueError(f"Unknown verifier {spec!r}. Available: {sorted(VERIFIERS)}.")
    return VERIFIERS[spec](**options)
