"""Verifiers: greedy, lossless speculative sampling, and the registry approximate verifiers plug into."""

from .base import VERIFIERS, VerificationResult, Verifier, get_verifier, register_verifier
from .standard import GreedyVerifier, SpeculativeSamplingVerifier, accepted_prefix_length

__all__ = [
    "VERIFIERS",
    "VerificationResult",
    "Verifier",
    "get_verifier",
    "register_verifier",
    "GreedyVerifier",
    "SpeculativeSamplingVerifier",
    "accepted_prefix_length",
]
