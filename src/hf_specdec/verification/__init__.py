"""Verifiers: greedy, lossless speculative sampling, and the registry approximate verifiers plug into."""

from .asd import ASD_OPTION_NAMES, ASDVerifier, asd_accept
from .base import VERIFIERS, VerificationResult, Verifier, get_verifier, register_verifier, verifier_option_owner
from .standard import GreedyVerifier, SpeculativeSamplingVerifier, accepted_prefix_length
from .typical import TypicalAcceptanceVerifier

__all__ = [
    "VERIFIERS",
    "VerificationResult",
    "Verifier",
    "get_verifier",
    "register_verifier",
    "GreedyVerifier",
    "SpeculativeSamplingVerifier",
    "accepted_prefix_length",
    "ASDVerifier",
    "asd_accept",
    "ASD_OPTION_NAMES",
    "TypicalAcceptanceVerifier",
    "verifier_option_owner",
]
