"""hf_specdec: speculative decoding for Hugging Face transformers.

Importing the package registers every drafter family with ``AutoConfig`` / :class:`AutoModelForDrafting` and
installs the narrow ``generate`` hook (see :mod:`hf_specdec.generation.hook`) so that
``target.generate(..., assistant_model=drafter)`` runs hf_specdec's loop for hf_specdec drafters only.
"""

from . import models
from .auto import AutoModelForDrafting
from .configuration_utils import DrafterConfig
from .cpu_kernels import PackedLinears, pack_draft_weights, pack_linear_weights
from .generation import (
    DraftInputs,
    GrammarLogitsProcessor,
    Proposal,
    SpeculativeDecoderOnlyOutput,
    VerificationFeedback,
    install_generate_hook,
    is_generate_hook_installed,
    speculative_generate,
    uninstall_generate_hook,
)
from .modeling_utils import DrafterPreTrainedModel
from .models import *  # noqa: F403  (each family's public classes; see models.__all__)
from .registry import DRAFTERS, DrafterSpec, get_drafter_spec, register_drafter
from .verification import VerificationResult, Verifier, get_verifier, register_verifier

__version__ = "0.1.0.dev0"

install_generate_hook()

__all__ = [
    "AutoModelForDrafting",
    "DrafterConfig",
    "DrafterPreTrainedModel",
    "speculative_generate",
    "pack_draft_weights",
    "pack_linear_weights",
    "PackedLinears",
    "GrammarLogitsProcessor",
    "SpeculativeDecoderOnlyOutput",
    "Proposal",
    "DraftInputs",
    "VerificationFeedback",
    "Verifier",
    "VerificationResult",
    "get_verifier",
    "register_verifier",
    "register_drafter",
    "get_drafter_spec",
    "DRAFTERS",
    "DrafterSpec",
    "install_generate_hook",
    "uninstall_generate_hook",
    "is_generate_hook_installed",
    "__version__",
    *(name for name in models.__all__ if name[:1].isupper()),
]
