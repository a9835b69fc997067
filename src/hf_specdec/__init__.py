"""hf_specdec: speculative decoding for Hugging Face transformers.

Importing the package registers every drafter family with ``AutoConfig`` / :class:`AutoModelForDrafting` and
installs the narrow ``generate`` hook (see :mod:`hf_specdec.generation.hook`) so that
``target.generate(..., assistant_model=drafter)`` runs hf_specdec's loop for hf_specdec drafters only.
"""

from .auto import AutoModelForDrafting
from .configuration_utils import DrafterConfig
from .generation import (
    DraftInputs,
    Proposal,
    SpeculativeDecoderOnlyOutput,
    install_generate_hook,
    is_generate_hook_installed,
    speculative_generate,
    uninstall_generate_hook,
)
from .modeling_utils import DrafterPreTrainedModel
from .models import Eagle3Config, Eagle3ForDrafting
from .registry import DRAFTERS, DrafterSpec, get_drafter_spec, register_drafter
from .verification import VerificationResult, Verifier, get_verifier, register_verifier

__version__ = "0.1.0.dev0"

install_generate_hook()

__all__ = [
    "AutoModelForDrafting",
    "DrafterConfig",
    "DrafterPreTrainedModel",
    "Eagle3Config",
    "Eagle3ForDrafting",
    "speculative_generate",
    "SpeculativeDecoderOnlyOutput",
    "Proposal",
    "DraftInputs",
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
]
