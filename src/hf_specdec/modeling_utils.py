"""`DrafterPreTrainedModel`: the base class of every drafter family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel

from .configuration_utils import DrafterConfig, get_text_config
from .generation.proposals import DraftInputs, Proposal, TokenSelector

__all__ = ["DrafterPreTrainedModel", "DraftLossOutput", "target_lm_head_device"]


@dataclass
class DraftLossOutput:
    """What a family's `compute_loss` returns: the loss and sums the trainer aggregates into metrics.

    Attributes:
        loss: scalar training loss.
        correct: ``(K,)`` number of anchors whose draft at depth ``j`` equals the target's argmax (teacher forced).
        valid: ``(K,)`` number of anchors scored at depth ``j``.
        chain_correct: ``(K,)`` number of anchors whose drafts at depths ``0..j`` are all correct.
        anchors: number of anchors (positions where a chain can start).
    """

    loss: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor
    chain_correct: torch.Tensor
    anchors: torch.Tensor


def target_lm_head_device(target: nn.Module) -> torch.device:
    """Device of the target's LM head (where logits are produced), also for accelerate-dispatched models."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return next(target.parameters()).device


class DrafterPreTrainedModel(PreTrainedModel):
    """Base class of all drafters.

    A drafter is bound to a *target* causal LM at generation time (:meth:`bind_target`). Modules it borrows from
    the target (token embeddings, LM head) are held by reference outside the module tree, so they are never saved,
    never moved and never receive gradients through the drafter.

    Capabilities are class attributes that the decoding loop, the trainer and the tests read instead of branching on
    the family:

    * ``proposal_kind``: ``"chain"``, ``"tree"`` or ``"block"``.
    * ``requires_target_hidden_states``: the loop asks the target for ``output_hidden_states``.
    * ``borrows_target_embeddings`` / ``borrows_target_lm_head``: which target modules the family uses.

    The proposal interface the loop calls:

    * :meth:`init_draft_state` once per ``generate`` call,
    * :meth:`observe` with the verified context after the prefill and after each target pass,
    * :meth:`propose` to draft the next tokens.
    """

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    proposal_kind: ClassVar[str] = "chain"
    requires_target_hidden_states: ClassVar[bool] = True
    borrows_target_embeddings: ClassVar[bool] = False
    borrows_target_lm_head: ClassVar[bool] = False
    lora_target_modules: ClassVar[tuple[str, ...]] = ()  # module names LoRA adapts (``--lora``)

    def __init__(self, config: DrafterConfig, *args, **kwargs):
        config.validate_drafter(require_complete=True)
        super().__init__(config, *args, **kwargs)
        # Plain dict: keeps borrowed target modules out of `named_modules()` / `state_dict()`.
        self.__dict__["_bound"] = {}

    # ------------------------------------------------------------------------------------------------------------
    # loading: strict by default
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, allow_missing_weights: bool = False, **kwargs):
        """Loads a drafter checkpoint (safetensors) like any transformers model, but strictly.

        Unlike plain transformers, a checkpoint with missing or mis-shaped drafter weights is an error (a drafter
        with randomly initialised layers silently proposes garbage); pass ``allow_missing_weights=True`` to accept
        it anyway. A truncated or corrupt weights file raises a `ValueError` saying so.
        """
        want_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except SafetensorError as err:
            raise ValueError(
                f"The drafter checkpoint at {pretrained_model_name_or_path!s} is corrupt or truncated ({err}). "
                "Download or save it again."
            ) from err
        missing = sorted(info.get("missing_keys", ()))
        mismatched = sorted(str(m) for m in info.get("mismatched_keys", ()))
        if (missing or mismatched) and not allow_missing_weights:
            raise ValueError(
                f"The drafter checkpoint at {pretrained_model_name_or_path!s} does not match "
                f"{cls.__name__}: missing weights {missing}, mis-shaped weights {mismatched}. It was saved for "
                "another drafter configuration or is incomplete; pass allow_missing_weights=True to initialise the "
                "missing weights randomly (then train the drafter)."
            )
        model.check_loaded_weights()
        return (model, info) if want_info else model

    def check_loaded_weights(self) -> None:
        """Family hook run after `from_pretrained` to validate loaded tensors (e.g. vocabulary maps)."""

    # ------------------------------------------------------------------------------------------------------------
    # binding to a target
    # ------------------------------------------------------------------------------------------------------------
    @property
    def bound_target(self) -> nn.Module | None:
        return self.__dict__.get("_bound", {}).get("target")

    def check_target_compatibility(self, target: nn.Module) -> None:
        """Raises `ValueError` when ``target`` is not the kind of model this drafter was made for."""
        cfg = self.config
        text = get_text_config(target.config)
        name = getattr(target.config, "_name_or_path", "") or type(target).__name__
        made_for = cfg.target_model_name_or_path or "its training target"
        problems = []
        hidden = getattr(text, "hidden_size", None)
        if hidden != cfg.target_hidden_size:
            problems.append(f"hidden size: drafter expects {cfg.target_hidden_size}, target {name} has {hidden}")
        head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        vocab = head.weight.shape[0] if head is not None and getattr(head, "weight", None) is not None else None
        vocab = vocab if vocab is not None else getattr(text, "vocab_size", None)
        if vocab != cfg.target_vocab_size:
            problems.append(f"vocabulary size: drafter expects {cfg.target_vocab_size}, target {name} has {vocab}")
        if self.requires_target_hidden_states:
            layers = getattr(text, "num_hidden_layers", None)
            if layers != cfg.target_num_hidden_layers:
                problems.append(
                    f"number of layers: drafter reads target_layer_ids={cfg.target_layer_ids} of a "
                    f"{cfg.target_num_hidden_layers}-layer target, target {name} has {layers} layers"
                )
        if problems:
            raise ValueError(
                f"{type(self).__name__} (made for {made_for}) does not fit target {name}: "
                + "; ".join(problems)
                + ". Use a drafter trained for this target, or build a fresh one with "
                f"`{type(self.config).__name__}.for_target(target.config)` and train it."
            )
        if self.requires_target_hidden_states and getattr(text, "is_encoder_decoder", False):
            raise ValueError("hf_specdec drafters support decoder-only targets; got an encoder-decoder model.")

    def bind_target(self, target: nn.Module) -> DrafterPreTrainedModel:
        """Checks ``target`` and binds the modules this drafter borrows from it.

        The drafter is moved to the device of the target's LM head (for targets dispatched with
        ``device_map="auto"`` that is where logits come out). Returns ``self``.
        """
        if self.bound_target is target:
            return self
        self.check_target_compatibility(target)
        bound = {"target": target}
        if self.borrows_target_embeddings:
            emb = target.get_input_embeddings()
            if emb is None:
                raise ValueError(f"{type(self).__name__} needs the target's input embeddings; the target has none.")
            bound["embed_tokens"] = emb
        if self.borrows_target_lm_head:
            head = target.get_output_embeddings()
            if head is None:
                raise ValueError(f"{type(self).__name__} needs the target's LM head; the target has none.")
            bound["lm_head"] = head
        self.__dict__["_bound"] = bound
        device = target_lm_head_device(target)
        if self.device != device:
            self.to(device)
        return self

    def unbind_target(self) -> None:
        self.__dict__["_bound"] = {}

    def _borrowed(self, key: str) -> nn.Module:
        module = self.__dict__.get("_bound", {}).get(key)
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a target. Call `drafter.bind_target(target)` first "
                "(generate does this for you)."
            )
        return module

    def embed_target_tokens(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Embeds ids with the target's (frozen) input embeddings, returned on the drafter's device and dtype."""
        emb = self._borrowed("embed_tokens")
        weight = getattr(emb, "weight", None)
        device = weight.device if weight is not None else input_ids.device
        out = emb(input_ids.to(device))
        return out.to(device=self.device, dtype=self.dtype)

    def target_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Applies the target's (frozen) LM head."""
        head = self._borrowed("lm_head")
        return head(hidden.to(device=head.weight.device, dtype=head.weight.dtype))

    # ------------------------------------------------------------------------------------------------------------
    # features
    # ------------------------------------------------------------------------------------------------------------
    @property
    def target_layer_ids(self) -> list[int] | None:
        return self.config.target_layer_ids

    def select_target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Picks ``config.target_layer_ids`` out of an ``output_hidden_states`` tuple, on the drafter's device."""
        ids = self.config.target_layer_ids or []
        if hidden_states is None or len(hidden_states) != self.config.target_num_hidden_layers + 1:
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(
                f"{type(self).__name__} reads target hidden states {ids}, but the target returned "
                f"{got} hidden states (expected {self.config.target_num_hidden_layers + 1}: embeddings + one per "
                "layer). The target must support `output_hidden_states=True`."
            )
        return [hidden_states[i].to(device=self.device, dtype=self.dtype) for i in ids]

    # ------------------------------------------------------------------------------------------------------------
    # proposal interface (implemented by each family)
    # ------------------------------------------------------------------------------------------------------------
    def init_draft_state(self, batch_size: int, max_length: int) -> Any:
        """Creates the per-``generate`` state (caches, last hidden states) for ``batch_size`` rows."""
        raise NotImplementedError(f"{type(self).__name__} must implement `init_draft_state`.")

    def observe(self, state: Any, inputs: DraftInputs) -> None:
        """Consumes verified context: target features and the tokens that follow them.

        Speculative state written by the previous :meth:`propose` (e.g. drafter KV entries of draft tokens) must be
        discarded here; the verified slots replace it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `observe`.")

    def propose(self, state: Any, num_tokens: int, select: TokenSelector) -> Proposal:
        """Drafts ``num_tokens`` tokens continuing each row's verified context."""
        raise NotImplementedError(f"{type(self).__name__} must implement `propose`.")

    # ------------------------------------------------------------------------------------------------------------
    # training interface (implemented by each family; the trainer never branches on the family)
    # ------------------------------------------------------------------------------------------------------------
    def compute_loss(self, batch: dict, features: Any, target_head: nn.Module | None = None) -> DraftLossOutput:
        """The family's training objective on a right-padded batch.

        Args:
            batch: ``input_ids``, ``attention_mask``, ``loss_mask`` (1 on tokens to learn to predict), ``(B, T)``.
            features: :class:`~hf_specdec.training.features.TargetFeatures` of the frozen target for the batch.
            target_head: the target's LM head (soft labels are recomputed from ``features.last_hidden``).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement `compute_loss` yet.")

    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Data-dependent initialisation before training (e.g. a reduced draft vocabulary from token frequencies).

        ``token_counts`` is a ``(target_vocab_size,)`` count of tokens in the training data. Default: nothing.
        """

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        bench: str | dict | None = None,
        base_model: str | None = None,
        license: str = "apache-2.0",
        datasets: list[str] | None = None,
        **kwargs,
    ):
        """Uploads the drafter (weights + config, never the target's) with a generated model card (``README.md``).

        The card (:func:`hf_specdec.cards.drafter_card`) names the target as ``base_model`` (pass it when the
        config's target name is a local path), and takes its results table from an ``hf-specdec bench`` JSON.
        """
        import tempfile

        from .cards import push_drafter

        if kwargs:
            raise TypeError(f"push_to_hub got unsupported arguments {sorted(kwargs)}.")
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return push_drafter(
                tmp,
                repo_id,
                private=private,
                revision=revision,
                commit_message=commit_message,
                token=token,
                endpoint=endpoint,
                bench=bench,
                base_model=base_model,
                license=license,
                datasets=datasets,
            )

    def draft_to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Maps draft-vocabulary logits to the target vocabulary (``-inf`` outside the draft vocabulary)."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return logits
        ids = self.draft_token_ids.to(logits.device)
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        full[..., ids] = logits
        return full

    @property
    def draft_token_ids(self) -> torch.LongTensor:
        """Target ids of the draft vocabulary, in draft order (identity when the vocabulary is not reduced)."""
        return torch.arange(self.config.draft_vocab_size, device=self.device)
