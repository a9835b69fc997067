"""The decoding loop, its data types and the ``generate`` hook."""

from ..types import DraftInputs, Proposal, SpeculativeDecoderOnlyOutput, TokenSelector, VerificationFeedback
from .grammar import GrammarLogitsProcessor
from .hook import install_generate_hook, is_generate_hook_installed, uninstall_generate_hook
from .logits import register_stateless_logits_processor
from .loop import speculative_generate

__all__ = [
    "speculative_generate",
    "SpeculativeDecoderOnlyOutput",
    "Proposal",
    "DraftInputs",
    "TokenSelector",
    "VerificationFeedback",
    "register_stateless_logits_processor",
    "GrammarLogitsProcessor",
    "install_generate_hook",
    "uninstall_generate_hook",
    "is_generate_hook_installed",
]
