"""The narrow hook that routes ``generate(assistant_model=<hf_specdec drafter>)`` to hf_specdec's loop.

transformers picks its assisted-generation candidate generator from a fixed list and offers no public extension
point for third-party drafters. Importing :mod:`hf_specdec` therefore wraps ``GenerationMixin.generate`` once:

* if ``assistant_model`` is an hf_specdec drafter (a :class:`~hf_specdec.DrafterPreTrainedModel`), or
  ``custom_generate`` is :func:`hf_specdec.speculative_generate`, the call is forwarded to transformers' own
  ``generate`` with ``custom_generate=speculative_generate`` (so input preparation, generation config, logits
  processors and stopping criteria are transformers' own), translating ``assistant_model`` → ``drafter``,
  ``num_assistant_tokens`` → ``num_draft_tokens`` and passing the ``streamer`` through;
* every other call, including any other ``assistant_model``, goes to transformers unchanged.

:func:`uninstall_generate_hook` restores the original method.
"""

from __future__ import annotations

import copy
import functools
import inspect

from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from ..modeling_utils import DrafterPreTrainedModel
from .loop import speculative_generate
from .options import route_options

__all__ = ["install_generate_hook", "uninstall_generate_hook", "is_generate_hook_installed"]

_ORIGINAL = None
_SPEC_OPTIONS = ("verifier", "verifier_options")


def as_drafter(obj):
    """``obj`` if it is an hf_specdec drafter, the drafter inside a PEFT wrapper (LoRA-adapted drafter), else None."""
    if isinstance(obj, DrafterPreTrainedModel):
        return obj
    get_base = getattr(obj, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, DrafterPreTrainedModel):
            return base  # adapter layers are injected in place: the base module runs with them
    return None


def _route(self, original, bound: inspect.BoundArguments):
    args = dict(bound.arguments)
    kwargs = args.pop("kwargs", {}) or {}
    assistant = args.get("assistant_model")
    custom = args.get("custom_generate")
    unwrapped = as_drafter(assistant)
    is_drafter = unwrapped is not None
    if is_drafter:
        assistant = unwrapped
    if not is_drafter and custom is not speculative_generate:
        return None
    if is_drafter and custom is not None:
        raise ValueError("Pass either assistant_model=<drafter> or custom_generate=..., not both.")
    drafter = assistant if is_drafter else as_drafter(kwargs.get("drafter")) or kwargs.pop("drafter", None)
    kwargs.pop("drafter", None)
    if drafter is None:
        raise ValueError("custom_generate=hf_specdec.speculative_generate needs `drafter=<hf_specdec drafter>`.")
    if not is_drafter and assistant is not None:
        raise ValueError("Pass the hf_specdec drafter as `drafter=`; `assistant_model` must not be set as well.")
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "hf_specdec drafters share the target's vocabulary; `assistant_tokenizer` is not used. Remove it."
        )
    _move_stop_strings(self, args, kwargs)
    kwargs.pop("tokenizer", None)
    args["assistant_model"] = None
    args["custom_generate"] = speculative_generate
    kwargs["drafter"] = drafter
    _move_verifier_options(kwargs, drafter)
    if "num_assistant_tokens" in kwargs:
        kwargs["num_draft_tokens"] = kwargs.pop("num_assistant_tokens")
    streamer = args.pop("streamer", None)
    if streamer is not None:
        kwargs["spec_streamer"] = streamer
    args.pop("self", None)
    return original(self, **args, **kwargs)


def _move_verifier_options(kwargs: dict, drafter) -> None:
    """Moves the call's option keywords to their owners (:func:`~hf_specdec.generation.options.route_options`):
    the chosen verifier's into ``verifier_options``, tree and family options into ``draft_options``."""
    options, draft, taken = route_options(kwargs, kwargs.get("verifier"), drafter, strict=True)
    for key in taken:
        kwargs.pop(key)
    if options:
        kwargs["verifier_options"] = {**dict(kwargs.get("verifier_options") or {}), **options}
    if draft:
        kwargs["draft_options"] = {**dict(kwargs.get("draft_options") or {}), **draft}


def _move_stop_strings(model, args: dict, kwargs: dict) -> None:
    """transformers drops `tokenizer` for callable `custom_generate`s, so stop strings would fail there. Build the
    `StopStringCriteria` here and pass it as an ordinary stopping criterion instead."""
    stop_strings = kwargs.pop("stop_strings", None)
    config = args.get("generation_config")
    if stop_strings is None:
        source = config if config is not None else model.generation_config
        if getattr(source, "stop_strings", None):
            stop_strings = source.stop_strings
            config = copy.deepcopy(source)
            config.stop_strings = None
            args["generation_config"] = config
    if not stop_strings:
        return
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        raise ValueError("stop_strings need the target's tokenizer: pass `tokenizer=` to generate.")
    criteria = StoppingCriteriaList(args.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    args["stopping_criteria"] = criteria


def install_generate_hook() -> None:
    """Installs the hook (idempotent). Called when :mod:`hf_specdec` is imported."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    original = GenerationMixin.generate
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if kwargs.get("assistant_model") is None and kwargs.get("custom_generate") is None and len(args) < 7:
            return original(self, *args, **kwargs)  # fast path: nothing for hf_specdec
        bound = signature.bind(self, *args, **kwargs)
        routed = _route(self, original, bound)
        if routed is None:
            return original(self, *args, **kwargs)
        return routed

    generate.__hf_specdec_hook__ = True
    GenerationMixin.generate = generate
    _ORIGINAL = original


def uninstall_generate_hook() -> None:
    """Restores transformers' original ``GenerationMixin.generate``."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        GenerationMixin.generate = _ORIGINAL
        _ORIGINAL = None


def is_generate_hook_installed() -> bool:
    return _ORIGINAL is not None
