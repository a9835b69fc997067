"""`DrafterPreTrainedModel`: the base class of every drafter family."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel

from .configuration_utils import DrafterConfig, get_text_config
from .context_vocab import context_soft_labels
from .types import DraftInputs, Proposal, TokenSelector

# Guards binding: a drafter stays bound to one target while any `generate` call with it runs (see `generating_for`).
_BINDING_LOCK = threading.RLock()
# This machine's measurements for a drafter that reads them (``hf-specdec profile --drafter``), kept next to its
# weights but out of config.json: timings belong to a machine, not to the model, and are never published.
PASS_TIMES_FILE = "pass_times.json"
# Set by adapt_target in the config of a target whose weights hold a drafter's merged adapter: that adapter's
# fingerprint (saved with the target's config.json, so a merged target saved and loaded again is still known).
MERGED_ADAPTER_ATTR = "hf_specdec_merged_adapter"

__all__ = [
    "DrafterPreTrainedModel",
    "FAMILY_CONTRACT",
    "check_family_contract",
    "DraftLossOutput",
    "depthwise_distillation_loss",
    "DEFAULT_LOSS_RATES",
    "target_lm_head_device",
    "target_vocab_size",
]


DEFAULT_LOSS_RATES: dict[str, tuple[str, str]] = {
    "acc": ("correct", "valid"),
    "simulated_tau": ("walk_tokens", "walk_passes"),
}


@dataclass
class DraftLossOutput:
    """What a family's `compute_loss` returns: the loss and sums the trainer aggregates into metrics.

    Attributes:
        loss: scalar training loss.
        metrics: summable tensors (any shape, fixed per family), e.g. ``correct`` / ``valid`` per depth or head
            (``(n,)``: anchors whose draft at depth ``j`` equals the target's choice / anchors scored there), and
            the walk statistics of :func:`hf_specdec.features.walk_metrics`. The trainer sums every key over
            batches and processes, so their sizes need not equal the number of draft tokens.
        rates: derived metrics ``name -> (numerator key, denominator key)``, computed by the trainer after the sums
            (a vector numerator gives ``name_0, name_1, ...``). Defaults: ``acc_j = correct / valid`` and
            ``simulated_tau = walk_tokens / walk_passes``.
        accepted: optional ``(batch, seq)`` teacher-forced accepted drafts per anchor (for
            :func:`hf_specdec.features.walk_passes`); not aggregated.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    rates: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(DEFAULT_LOSS_RATES))
    accepted: torch.Tensor | None = None


def depthwise_distillation_loss(
    step_logits: list[torch.Tensor],
    labels,
    loss_mask: torch.Tensor,
    in_vocab: torch.Tensor,
    weights: list[float],
    walk_k: int,
    hard_targets: torch.Tensor | None = None,
) -> DraftLossOutput:
    """The loss of a family that drafts depth by depth from every anchor, with its metrics.

    Args:
        step_logits: per depth ``j``, ``(batch, seq, V')`` draft logits where anchor ``t`` predicts the token at
            ``t + 2 + j`` (columns past the sequence are ignored).
        labels: :class:`~hf_specdec.features.SoftLabels` over the draft vocabulary (position ``s`` predicts ``s + 1``).
        loss_mask: ``(batch, seq)`` bool, tokens to learn to predict.
        in_vocab: ``(batch, seq)`` bool, whether the teacher's choice at position ``s`` is in the draft vocabulary.
        weights: the weight of each depth in the loss (e.g. ``0.8 ** j``).
        walk_k: draft tokens per pass of the simulated walk (:func:`~hf_specdec.features.walk_passes`).
        hard_targets: ``(batch, seq)`` draft-vocabulary index of the token at each position (``-1`` outside the
            draft vocabulary): cross-entropy against the data's tokens instead of the teacher's distribution.

    The loss is ``sum_j weights[j] * mean over scored anchors of CE``; an anchor is scored at depth ``j`` when its
    predicted token exists, is a loss token and the teacher's choice there is in the draft vocabulary. Metrics:
    ``correct`` / ``valid`` per depth (draft argmax equals the teacher's) and the walk of
    :func:`~hf_specdec.features.walk_metrics`.
    """
    from .features import walk_metrics, walk_passes

    device = step_logits[0].device
    probs, top = labels.probs.to(device), labels.argmax.to(device)
    loss_mask, in_vocab = loss_mask.to(device), in_vocab.to(device)
    bsz, t = loss_mask.shape
    loss = torch.zeros((), device=device)
    zero = torch.zeros((), device=device)
    correct, valid_n = [], []
    chain_ok = None
    accepted = torch.zeros(bsz, t, dtype=torch.long, device=device)
    for j, logits in enumerate(step_logits):
        width = t - 2 - j  # anchors whose predicted token (t + 2 + j) exists
        if width <= 0:
            correct.append(zero)
            valid_n.append(zero)
            continue
        pred_pos = slice(2 + j, 2 + j + width)  # token positions predicted
        lab_pos = slice(1 + j, 1 + j + width)  # teacher distribution positions
        valid = loss_mask[:, pred_pos] & in_vocab[:, lab_pos]
        logp = torch.log_softmax(logits[:, :width].float(), dim=-1)
        if hard_targets is None:
            ce = -(probs[:, lab_pos] * logp).sum(-1)
        else:
            tgt = hard_targets.to(device)[:, pred_pos]
            valid = valid & (tgt >= 0)
            ce = -logp.gather(-1, tgt.clamp_min(0)[..., None])[..., 0]
        n_valid = valid.sum()
        loss = loss + float(weights[j]) * (ce * valid).sum() / n_valid.clamp(min=1)
        hit = (logits[:, :width].argmax(-1) == top[:, lab_pos]) & valid
        chain_ok = hit if chain_ok is None else chain_ok[:, :width] & hit
        accepted[:, :width] += chain_ok.long()
        correct.append(hit.sum().float())
        valid_n.append(n_valid.float())
    metrics = {"correct": torch.stack(correct), "valid": torch.stack(valid_n)}
    metrics.update(walk_metrics(walk_passes(accepted, loss_mask, walk_k), device=device))
    return DraftLossOutput(loss=loss, metrics=metrics, accepted=accepted)


def adapter_fingerprint(model: nn.Module) -> str:
    """SHA-256 over the active peft adapter's weights (names, shapes, values) of a ``PeftModel``."""
    import hashlib

    from peft import get_peft_model_state_dict

    digest = hashlib.sha256()
    # The same adapter is reached as a PeftModel (names start with "base_model.model.") or, inside generate, as the
    # adapted transformers model itself (no prefix): the names are compared without it.
    state = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(model).items()}
    for name in sorted(state):
        tensor = state[name].detach().to("cpu", torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def target_adapters(target: nn.Module) -> list[str]:
    """The fingerprints of the adapters a target carries: one merged into its weights by
    :meth:`DrafterPreTrainedModel.adapt_target`, then its active peft adapter's; empty for a plain target."""
    merged = getattr(getattr(target, "config", None), MERGED_ADAPTER_ATTR, None)
    return ([merged] if merged else []) + ([adapter_fingerprint(target)] if hasattr(target, "peft_config") else [])


def target_lm_head_device(target: nn.Module) -> torch.device:
    """Device of the target's LM head (where logits are produced), also for accelerate-dispatched models."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return next(target.parameters()).device


def target_vocab_size(target: nn.Module) -> int | None:
    """Rows of the target's LM head (its vocabulary with any padding rows), else its config's ``vocab_size``."""
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    vocab = getattr(get_text_config(target.config), "vocab_size", None)
    return None if vocab is None else int(vocab)


# What a drafter class must implement, by the capability that asks for it (``None``: every drafter). A drafter
# drafts chains (``propose``), trees (``supports_tree_drafting``), or both.
FAMILY_CONTRACT: dict[str | None, tuple[str, ...]] = {
    None: ("init_draft_state", "observe"),
    "supports_tree_drafting": ("tree_start", "tree_expand"),
    "trains_target_adapter": ("target_adapter_config",),
}


def check_family_contract(cls: type) -> None:
    """Raises `TypeError` naming the methods of :data:`FAMILY_CONTRACT` that ``cls`` leaves to the base class."""

    def own(name: str) -> bool:
        return getattr(cls, name) is not getattr(DrafterPreTrainedModel, name)

    missing = [
        name
        for capability, names in FAMILY_CONTRACT.items()
        if capability is None or getattr(cls, capability, False)
        for name in names
        if not own(name)
    ]
    if not own("propose") and not getattr(cls, "supports_tree_drafting", False):
        missing.append("propose")  # no way to draft at all
    if missing:
        raise TypeError(
            f"{cls.__name__} does not implement {missing}, which every drafter with its capabilities must "
            "(DrafterPreTrainedModel's family contract)."
        )


class DrafterPreTrainedModel(PreTrainedModel):
    """Base class of all drafters.

    A drafter is bound to a *target* causal LM at generation time (:meth:`bind_target`). Modules it borrows from
    the target (token embeddings, LM head) are held by reference outside the module tree, so they are never saved,
    never moved and never receive gradients through the drafter.

    Capabilities are class attributes that the decoding loop, the trainer and the tests read instead of branching on
    the family:

    * ``requires_target_hidden_states``: the loop asks the target for ``output_hidden_states``.
    * ``borrows_target_embeddings`` / ``borrows_target_lm_head``: which target modules the family uses.
    * ``loss_kwargs``: the keyword arguments :meth:`compute_loss` takes (the trainer refuses others; ramped ones come
      from :meth:`loss_schedule`).
    * ``trains_target_adapter``: the trainer puts :meth:`target_adapter_config` on the target and trains it with the
      drafter, in the groups of :meth:`optimizer_param_groups` (self-distilled joint fine-tuning).

    The family contract (:data:`FAMILY_CONTRACT`; a drafter class that lacks a part is refused when it is built,
    naming what is missing):

    * decoding, every family: :meth:`init_draft_state` once per ``generate`` call, :meth:`observe` with the verified
      context after the prefill and after each target pass, and :meth:`propose` to draft a chain, unless it drafts
      trees only;
    * trees, a family with ``supports_tree_drafting``: :meth:`tree_start` and :meth:`tree_expand`;
    * a target adapter, a family with ``trains_target_adapter``: :meth:`target_adapter_config`;
    * training: :meth:`compute_loss` (a family without it decodes but cannot be trained; the trainer refuses it);
      optionally :meth:`loss_schedule`, :meth:`optimizer_param_groups`, :meth:`init_from_target`,
      :meth:`init_from_data` (the draft vocabulary is built here already);
    * layouts: a family's ``convert_*`` module registers the checkpoint layouts it imports and exports.
    """

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    requires_target_hidden_states: ClassVar[bool] = True
    borrows_target_embeddings: ClassVar[bool] = False
    borrows_target_lm_head: ClassVar[bool] = False
    lora_target_modules: ClassVar[tuple[str, ...]] = ()  # module names LoRA adapts (``--lora``)
    # Decoding capabilities (read by the loop):
    # - requires_target_logits: `observe` receives the target's raw logits for every verified slot, the prefill too;
    # - supports_tree_drafting: implements `tree_start` / `tree_expand`, so tree policies (`tree="eagle2"`, static
    #   trees) can grow trees from it;
    # - draft_options: `generate` keyword -> default, options this family's `propose` takes (routed by the hook,
    #   handed to `init_draft_state` through `self.draft_options_in_use`);
    # - observe_in_batches: `observe` accepts the verified slots of several passes in one call, so during a run of
    #   plain steps (adaptive draft length K = 0) the loop saves the drafter's forward and hands them over when the
    #   drafter drafts again. A family that must see every pass as it happens (online adaptation) sets False.
    # - weight_changing_draft_options: draft options under which the drafter changes its own weights while it
    #   decodes (serving-time adaptation); a benchmark gives rows with them their own copy of the drafter.
    requires_target_logits: ClassVar[bool] = False
    observe_in_batches: ClassVar[bool] = True
    weight_changing_draft_options: ClassVar[tuple[str, ...]] = ()
    supports_tree_drafting: ClassVar[bool] = False
    draft_options: ClassVar[dict[str, Any]] = {}
    # Training capabilities (read by the trainer): the keyword arguments `compute_loss` accepts besides its three
    # (the trainer refuses any other), and whether the family trains a peft adapter on the target with it.
    loss_kwargs: ClassVar[tuple[str, ...]] = ()
    trains_target_adapter: ClassVar[bool] = False

    @property
    def max_draft_depth(self) -> int | None:
        """The most tokens ahead this drafter can propose in one pass (``None``: no limit). The loop refuses longer
        chains and deeper trees with an error naming :attr:`max_draft_depth_source`."""
        return None

    max_draft_depth_source: ClassVar[str] = ""

    def __init__(self, config: DrafterConfig, *args, **kwargs):
        check_family_contract(type(self))
        config.validate_drafter(require_complete=True)
        super().__init__(config, *args, **kwargs)
        # Plain dict: keeps borrowed target modules out of `named_modules()` / `state_dict()`.
        self.__dict__["_bound"] = {}

    def _init_weights(self, module: nn.Module) -> None:
        """Default initialisation: linear weights ``N(0, initializer_range)`` (zeros for a leaf marked
        ``zero_init = True``), zero biases, embeddings ``N(0, initializer_range)``, norms to one, rotary tables
        rebuilt. Special initialisation belongs on leaf modules (``post_init`` may skip non-leaf branches)."""
        from .layers import RMSNorm, RotaryEmbedding

        std = float(getattr(self.config, "initializer_range", 0.02))
        if isinstance(module, nn.Linear):
            if getattr(module, "zero_init", False):
                nn.init.zeros_(module.weight)
            else:
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.reset_parameters()

    # ------------------------------------------------------------------------------------------------------------
    # loading: strict by default
    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *args,
        allow_missing_weights: bool = False,
        allow_unexpected_weights: bool = False,
        **kwargs,
    ):
        """Loads a drafter checkpoint (safetensors) like any transformers model, but strictly.

        Unlike plain transformers, a checkpoint whose weights do not match the drafter exactly is an error:

        * missing or mis-shaped weights (a drafter with randomly initialised layers silently proposes garbage); pass
          ``allow_missing_weights=True`` to initialise them randomly instead (then train the drafter);
        * unexpected weights, which the drafter has no place for (usually a checkpoint in another project's layout,
          or a config flag this version does not understand, e.g. a layer it would not build); pass
          ``allow_unexpected_weights=True`` to drop them, with a warning listing them.

        A truncated or corrupt weights file raises a `ValueError` saying so.
        """
        want_info = kwargs.pop("output_loading_info", False)
        # Mis-shaped weights are reported (and refused below with their shapes) rather than raised by transformers.
        kwargs.setdefault("ignore_mismatched_sizes", True)
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
        mismatched = sorted(  # transformers' entries: (name, shape in the checkpoint, shape in the model)
            f"{m[0]} (checkpoint {tuple(m[1])}, model {tuple(m[2])})"
            if isinstance(m, tuple) and len(m) == 3
            else str(m)
            for m in info.get("mismatched_keys", ())
        )
        unexpected = sorted(info.get("unexpected_keys", ()))
        problems, fixes = [], []
        if (missing or mismatched) and not allow_missing_weights:
            if missing:
                problems.append(f"missing weights {missing}")
            if mismatched:
                problems.append(f"mis-shaped weights {mismatched}")
            fixes.append(
                "pass allow_missing_weights=True to initialise the missing weights randomly (then train the drafter)"
            )
        if unexpected and not allow_unexpected_weights:
            problems.append(f"unexpected weights {unexpected}, which {cls.__name__} has no place for")
            fixes.append(
                "a checkpoint in another project's layout is imported with AutoModelForDrafting.from_pretrained (or "
                "hf-specdec convert); pass allow_unexpected_weights=True to drop the unexpected weights"
            )
        if problems:
            raise ValueError(
                f"The drafter checkpoint at {pretrained_model_name_or_path!s} does not match {cls.__name__}: "
                f"{'; '.join(problems)}. It was saved for another drafter configuration, in another layout, or is "
                f"incomplete; {'; '.join(fixes)}."
            )
        if unexpected:
            import warnings

            warnings.warn(
                f"{cls.__name__}: dropped the unexpected weights {unexpected} of {pretrained_model_name_or_path!s} "
                "(allow_unexpected_weights=True). If the drafter proposes poorly, check that the checkpoint was saved "
                "for this drafter configuration.",
                stacklevel=2,
            )
        model.refuse_non_finite_weights(pretrained_model_name_or_path)
        model.check_loaded_weights()
        return (model, info) if want_info else model

    def refuse_non_finite_weights(self, where) -> None:
        """Raises `ValueError` naming the weights that hold NaN or infinite values (a corrupt file, or a training run
        that diverged): such a drafter would load silently, then fail in sampling or never be accepted."""
        bad = [name for name, p in self.named_parameters() if p.is_floating_point() and not bool(p.isfinite().all())]
        if bad:
            shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            raise ValueError(
                f"The drafter checkpoint at {where!s} holds NaN or infinite values in {shown}. The file is corrupt or "
                "was saved from a training run that diverged: download it again, or retrain (a lower learning rate, "
                "or bf16 instead of fp16, usually keeps training finite)."
            )

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
        vocab = target_vocab_size(target)
        if vocab is None:
            problems.append(f"vocabulary: target {name} has no LM head and no vocab_size")
        elif cfg.target_vocab_size is not None and vocab != cfg.target_vocab_size:  # None: resolved from the target
            problems.append(f"vocabulary size: drafter expects {cfg.target_vocab_size}, target {name} has {vocab}")
        if self.requires_target_hidden_states:
            layers = getattr(text, "num_hidden_layers", None)
            if cfg.target_num_hidden_layers is None:  # unresolved (foreign checkpoint): the ids must fit the target
                if not isinstance(layers, int):
                    problems.append(f"depth: target {name} does not say how many layers it has (num_hidden_layers)")
                elif any(not 0 <= i <= layers for i in cfg.target_layer_ids or ()):
                    problems.append(
                        f"feature layers: drafter reads target_layer_ids={cfg.target_layer_ids}, target {name} "
                        f"has {layers} layers (valid ids 0..{layers})"
                    )
            elif layers != cfg.target_num_hidden_layers:
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
        with _BINDING_LOCK:
            if self.bound_target is target:
                return self
            self._refuse_rebinding_while_generating()
            return self._bind(target)

    def _bind(self, target: nn.Module) -> DrafterPreTrainedModel:
        self.check_target_compatibility(target)
        self.check_target_adapter(target)
        self.resolve_target_facts(target)
        bound = {"target": target}
        if self.borrows_target_embeddings:
            emb = target.get_input_embeddings()
            if emb is None:
                raise ValueError(f"{type(self).__name__} needs the target's input embeddings; the target has none.")
            bound["embed_tokens"] = emb
        if self.borrows_target_lm_head or getattr(self, "context_vocab", None) is not None:
            head = target.get_output_embeddings()
            if head is None:
                raise ValueError(f"{type(self).__name__} needs the target's LM head; the target has none.")
            bound["lm_head"] = head
        self.__dict__["_bound"] = bound
        device = target_lm_head_device(target)
        if self.device != device:
            self.to(device)
        return self

    def check_target_adapter(self, target: nn.Module) -> None:
        """Refuses a target without the adapter this drafter was trained with (``config.target_adapter``).

        A drafter trained jointly with a target adapter drafts for the *adapted* target; on the plain target it
        would still be lossless but draft for the wrong model, and on another adapter likewise. Load the right one
        with :meth:`adapt_target` (merged into the target's weights, or as a peft adapter).
        """
        required = self.config.target_adapter
        if not required:
            return
        found = target_adapters(target)
        if not found:
            where = os.path.join(str(self.name_or_path or "the drafter's folder"), required.get("subfolder", ""))
            raise ValueError(
                f"{type(self).__name__} was trained together with a target adapter and needs the adapted target; "
                f"got a plain {type(target).__name__}. Load it with `target = drafter.adapt_target(target)` (the "
                f"adapter is in {where})."
            )
        if found != [required.get("fingerprint")]:
            raise ValueError(
                f"The target's adapter (fingerprint {', '.join(f[:12] for f in found)}) is not the one "
                f"{type(self).__name__} was trained with ({str(required.get('fingerprint'))[:12]}). Load the "
                "drafter's own adapter with `target = drafter.adapt_target(base_target)`."
            )

    def adapt_target(self, target: nn.Module, merge: bool = True) -> nn.Module:
        """The target with this drafter's trained adapter, ready for ``generate``: merged into its weights (default:
        a plain transformers model again, which runs as fast as the target and takes every CPU kernel the target
        takes; peft's ``merge_and_unload``), or with ``merge=False`` as a ``peft.PeftModel`` (the adapter's layers
        computed beside the target's, so it can be switched off). Either way ``target`` itself is changed in
        place, as peft changes the model it wraps; a merged target's config records the adapter's fingerprint, so
        it is recognised after ``save_pretrained`` and ``from_pretrained`` too."""
        adapted = self._load_target_adapter(target).eval()
        self.check_target_adapter(adapted)
        if not merge:
            return adapted
        merged = adapted.merge_and_unload()
        setattr(merged.config, MERGED_ADAPTER_ATTR, self.config.target_adapter["fingerprint"])
        return merged

    def _load_target_adapter(self, target: nn.Module) -> nn.Module:
        """``peft.PeftModel`` of ``target`` with the adapter saved next to this drafter (its folder or Hub repo)."""
        required = self.config.target_adapter
        if not required:
            raise ValueError(f"{type(self).__name__} declares no target adapter; use the target as it is.")
        from peft import PeftModel

        source = str(self.name_or_path or "")
        folder = os.path.join(source, required["subfolder"])
        if os.path.isdir(folder):
            return PeftModel.from_pretrained(target, folder)
        if source and not os.path.isdir(source):  # a Hub id: the adapter is a subfolder of that repository
            return PeftModel.from_pretrained(target, source, subfolder=required["subfolder"])
        raise ValueError(
            f"The target adapter of this drafter is expected in {folder}, which does not exist. Load the drafter "
            "from the folder `hf-specdec train` wrote (it holds the adapter next to the drafter's weights)."
        )

    def resolve_target_facts(self, target: nn.Module) -> None:
        """Fills in target facts the checkpoint did not record, from ``target`` (called by :meth:`bind_target`).

        Checkpoints in other projects' layouts do not record the target's depth, hence the family's default
        ``target_layer_ids``, and some not its vocabulary (families with ``resolves_target_vocab_at_bind``); like
        vLLM, hf_specdec resolves them when the drafter meets its target, then checks them (config ranges and
        :meth:`check_target_layer_ids`). A resolved drafter is tied to that depth and vocabulary.
        """
        cfg = self.config
        text = get_text_config(target.config)
        layers = None if cfg.target_num_hidden_layers is not None else int(text.num_hidden_layers)
        vocab = None if cfg.target_vocab_size is not None else target_vocab_size(target)
        if layers is None and vocab is None:
            return
        fields = ("target_num_hidden_layers", "target_layer_ids", "target_vocab_size", "draft_vocab_size")
        old = {key: getattr(cfg, key) for key in fields}
        if layers is not None:
            ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else cfg.default_target_layer_ids(layers)
            cfg.target_num_hidden_layers, cfg.target_layer_ids = layers, None if ids is None else [int(i) for i in ids]
        if vocab is not None:  # an unrecorded vocabulary is drafted over in full
            cfg.target_vocab_size = cfg.draft_vocab_size = vocab
        try:
            cfg.validate_drafter(require_complete=True)
            self.check_target_layer_ids()
        except ValueError as err:
            for key, value in old.items():
                setattr(cfg, key, value)
            depth = getattr(text, "num_hidden_layers", "?")
            what = f"{depth}-layer target" + (f" (vocabulary {vocab})" if vocab else "")
            raise ValueError(f"{type(self).__name__} cannot be bound to this {what}: {err}") from err
        if vocab is not None and self.has_vocabulary_maps:  # the (until then empty) maps of a full vocabulary
            self.register_vocabulary_buffers(cfg, device=self.t2d.device)

    def check_target_layer_ids(self) -> None:
        """Family hook: raises `ValueError` when ``config.target_layer_ids`` do not fit the weights (e.g. the number
        of fused features). Run after :meth:`resolve_target_facts`."""

    def unbind_target(self) -> None:
        with _BINDING_LOCK:
            self._refuse_rebinding_while_generating()
            self.__dict__["_bound"] = {}

    @contextlib.contextmanager
    def generating_for(self, target: nn.Module):
        """Binds the drafter to ``target`` for the whole of one ``generate`` call (the loop enters this).

        Calls in several threads may share one drafter with the same target. While any of them runs, binding the
        drafter to another target is refused: the running calls would go on drafting with that target's embeddings
        and head, still lossless but with their acceptance silently lost.
        """
        with _BINDING_LOCK:
            self.bind_target(target)
            self.__dict__["_generations"] = self.__dict__.get("_generations", 0) + 1
        try:
            yield self
        finally:
            with _BINDING_LOCK:
                self.__dict__["_generations"] -= 1

    def _refuse_rebinding_while_generating(self) -> None:
        running = self.__dict__.get("_generations", 0)
        if running:
            bound = self.bound_target
            name = getattr(getattr(bound, "config", None), "_name_or_path", "") or type(bound).__name__
            raise RuntimeError(
                f"This {type(self).__name__} is generating for another target ({name}, {running} call(s) running, "
                "e.g. in another thread), and stays bound to it until they end. Give each target its own drafter: "
                "load it again with `AutoModelForDrafting.from_pretrained(...)` for the second target."
            )

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

    def target_hidden_state_ids(self) -> list[int]:
        """The ``output_hidden_states`` indices this drafter reads (the loop asks the target for these only)."""
        return list(self.config.target_layer_ids or []) if self.requires_target_hidden_states else []

    def select_target_features(self, hidden_states: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
        """Picks ``config.target_layer_ids`` out of an ``output_hidden_states`` tuple, on the drafter's device.

        The tuple may hold ``None`` for layers that were not captured (``output_hidden_states=[ids]``).
        """
        ids = self.config.target_layer_ids or []
        if hidden_states is None or len(hidden_states) != self.config.target_num_hidden_layers + 1:
            got = None if hidden_states is None else len(hidden_states)
            raise ValueError(
                f"{type(self).__name__} reads target hidden states {ids}, but the target returned "
                f"{got} hidden states (expected {self.config.target_num_hidden_layers + 1}: embeddings + one per "
                "layer). The target must support `output_hidden_states=True`."
            )
        missing = [i for i in ids if hidden_states[i] is None]
        if missing:
            raise ValueError(f"{type(self).__name__} reads target hidden states {missing}, which were not captured.")
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
        """Drafts up to ``num_tokens`` tokens continuing each row's verified context.

        A drafter may propose fewer tokens, per row (``Proposal.lengths``), e.g. when its confidence drops; it
        learns what was accepted from ``DraftInputs.feedback`` at the next :meth:`observe`.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement `propose`.")

    def tree_start(self, state: Any):
        """Tree drafting: ``(root_logits, vocab_ids)``, the draft distribution after the last verified token
        (``(batch, draft_vocab)``) and the target ids of the draft vocabulary (``None``: the full vocabulary).
        Families with ``supports_tree_drafting`` implement it (see :mod:`hf_specdec.tree`)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft trees.")

    def tree_expand(self, state: Any, expansion) -> torch.Tensor:
        """Tree drafting: the draft distribution after each node of a :class:`~hf_specdec.tree.TreeExpansion`,
        ``(batch, M, draft_vocab)``."""
        raise NotImplementedError(f"{type(self).__name__} does not draft trees.")

    # ------------------------------------------------------------------------------------------------------------
    # training interface (implemented by each family; the trainer never branches on the family)
    # ------------------------------------------------------------------------------------------------------------
    def compute_loss(
        self, batch: dict, features: Any, target_head: nn.Module | None = None, **loss_kwargs
    ) -> DraftLossOutput:
        """The family's training objective on a right-padded batch.

        Args:
            batch: ``input_ids``, ``attention_mask``, ``loss_mask`` (1 on tokens to learn to predict), ``(B, T)``.
            features: :class:`~hf_specdec.features.TargetFeatures` of the target for the batch (soft labels and
                soft-capped logits come from its ``soft_labels`` / ``logits``).
            target_head: the target's LM head (soft labels are recomputed from ``features.last_hidden``).
            **loss_kwargs: only the names the family lists in ``loss_kwargs`` (e.g. a loss weight the trainer
                ramps through :meth:`loss_schedule`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement `compute_loss` yet.")

    def loss_schedule(self, step: int, total_steps: int) -> dict[str, Any]:
        """Loss kwargs that change during training (e.g. a ramped loss weight), for optimizer step ``step``
        (0-based) of ``total_steps``. Keys must be in ``loss_kwargs``. Default: none."""
        return {}

    def target_adapter_config(self):
        """The peft config (e.g. a ``LoraConfig``) of the target adapter a family with ``trains_target_adapter``
        trains together with the drafter."""
        raise NotImplementedError(f"{type(self).__name__} sets trains_target_adapter but has no adapter config.")

    def optimizer_param_groups(
        self, learning_rate: float, weight_decay: float, adapter_parameters: list[nn.Parameter] | None = None
    ) -> list[dict]:
        """Optimizer parameter groups over the trainable drafter parameters and the target adapter's.

        Every trainable parameter must appear in exactly one group; a group without ``lr`` uses ``learning_rate``.
        Default: weight decay on matrices only, one learning rate for all (adapter included).
        """
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if adapter_parameters:
            groups.append({"params": list(adapter_parameters), "weight_decay": weight_decay})
        return [g for g in groups if g["params"]]

    def init_from_target(self, target: nn.Module) -> None:
        """Target-dependent initialisation of a fresh drafter before training, e.g. heads whose output layer starts
        as a copy of the target's LM head (residual heads). Called by the trainer on a drafter that does not resume
        from a checkpoint, after :meth:`bind_target` and :meth:`init_from_data`. Default: nothing."""

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
        The upload is :func:`hf_specdec.cards.push_drafter`'s.
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

    # ------------------------------------------------------------------------------------------------------------
    # the draft vocabulary: the target's, or a reduced one mapped to target ids
    # ------------------------------------------------------------------------------------------------------------
    # A draft vocabulary smaller than the target's is mapped to target ids in the ``d2t`` / ``t2d`` layout of the
    # reference implementations: buffer ``d2t`` maps draft id ``i`` to target id ``i + d2t[i]``; ``t2d`` marks the
    # target ids in the draft vocabulary. A family calls :meth:`register_vocabulary_buffers` in ``__init__`` and gets
    # the mapping, its checks (run after loading), the frequency-based choice of the vocabulary
    # (:meth:`init_from_data`) and the copy of the target's LM-head rows into its own output layers
    # (:meth:`copy_target_head_rows`).
    def register_vocabulary_buffers(self, config, device=None) -> None:
        # Empty while the target's vocabulary is unresolved (a checkpoint that does not record it); sized by
        # `resolve_target_facts` when `bind_target` resolves it.
        draft, full = config.draft_vocab_size or 0, config.target_vocab_size or 0
        self.register_buffer("d2t", torch.zeros(draft, dtype=torch.long, device=device))
        t2d = torch.zeros(full, dtype=torch.bool, device=device)
        t2d[:draft] = True
        self.register_buffer("t2d", t2d)

    @property
    def reduced_vocabulary(self) -> bool:
        return self.config.draft_vocab_size != self.config.target_vocab_size

    @property
    def has_vocabulary_maps(self) -> bool:
        """Whether the family registered ``d2t`` / ``t2d`` (a family that always drafts over the target's full
        vocabulary, e.g. a layer the target ships with, registers none)."""
        return "d2t" in self._buffers

    @property
    def draft_token_ids(self) -> torch.LongTensor:
        """Target ids of the draft vocabulary, in draft order (identity when the vocabulary is not reduced)."""
        if not self.has_vocabulary_maps:
            return torch.arange(self.config.draft_vocab_size, device=self.device)
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Maps draft-vocabulary logits to the target vocabulary (``-inf`` outside the draft vocabulary)."""
        if not self.reduced_vocabulary:
            return logits
        ids = self.draft_token_ids.to(logits.device)
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        full[..., ids] = logits
        return full

    def set_draft_vocab(self, target_token_ids: torch.LongTensor) -> None:
        """Sets the reduced draft vocabulary from sorted target ids (``draft_vocab_size`` of them)."""
        if not self.has_vocabulary_maps:
            raise ValueError(
                f"{type(self).__name__} drafts over the target's full vocabulary; it has no draft vocabulary to set."
            )
        ids = torch.as_tensor(target_token_ids, dtype=torch.long).flatten().sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"set_draft_vocab needs {self.config.draft_vocab_size} distinct target ids, got {ids.numel()} "
                f"({ids.unique().numel()} distinct)."
            )
        if ids.min() < 0 or ids.max() >= self.config.target_vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.config.target_vocab_size}).")
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def check_loaded_weights(self) -> None:
        """Validates loaded tensors after `from_pretrained`: the vocabulary maps here; a family adds its own checks
        (calling this one)."""
        self.check_draft_vocab()

    def check_draft_vocab(self) -> None:
        """Raises if ``d2t`` / ``t2d`` are inconsistent (e.g. a checkpoint with an all-zero ``d2t`` but a reduced
        vocabulary that is not the first ids)."""
        if self.config.target_vocab_size is None or not self.has_vocabulary_maps:  # unresolved, or no maps at all
            return
        name = type(self).__name__
        ids = self.draft_token_ids
        if ids.max() >= self.config.target_vocab_size or ids.min() < 0:
            raise ValueError(f"{name}: d2t maps draft ids outside the target vocabulary.")
        if not bool(self.t2d[ids].all()) or int(self.t2d.sum()) != self.config.draft_vocab_size:
            raise ValueError(
                f"{name}: d2t and t2d disagree (t2d must mark exactly the target ids i + d2t[i]). "
                "The checkpoint's vocabulary mapping is corrupt; rebuild it with `set_draft_vocab`."
            )

    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Data-dependent initialisation before training: the reduced draft vocabulary from token frequencies (the
        most frequent ids, sorted by id). ``token_counts`` is a ``(target_vocab_size,)`` count of tokens in the
        training data. A family adds its own (calling this one)."""
        if not self.reduced_vocabulary:
            return
        counts = token_counts.to(torch.float64).clone()
        # Ties (and never-seen ids) are broken by id, so the choice is deterministic.
        order = torch.argsort(-counts, stable=True)
        self.set_draft_vocab(order[: self.config.draft_vocab_size])

    @torch.no_grad()
    def widened_draft_vocabulary(
        self, draft_vocab_size: int, token_counts: torch.Tensor, target: nn.Module
    ) -> DrafterPreTrainedModel:
        """A copy of this (trained) drafter whose draft vocabulary is its own plus the most frequent other tokens of
        ``token_counts`` (ties by id), ``draft_vocab_size`` in all. Fine-tuning it then teaches the new tokens
        without starting over.

        Every trained weight is kept; a weight with a draft-vocabulary dimension keeps its trained rows (moved to
        their tokens' new places: the draft order is the target ids' order) and gets rows for the new tokens from the
        target's LM-head rows of those tokens, through the affine map that best takes the target's rows of the old
        tokens to the trained rows (least squares). The target's rows themselves would not do: the drafter's output
        space has drifted from the target's in training, and raw target rows outscore the trained ones everywhere."""
        name, old_size = type(self).__name__, self.config.draft_vocab_size
        if not self.has_vocabulary_maps:
            raise ValueError(f"{name} drafts over the target's full vocabulary; there is no draft vocabulary to widen.")
        if not old_size < draft_vocab_size <= self.config.target_vocab_size:
            raise ValueError(
                f"A draft vocabulary can only grow: {name} has {old_size} tokens, the target "
                f"{self.config.target_vocab_size}; got draft_vocab_size={draft_vocab_size}."
            )
        old_ids = self.draft_token_ids.cpu()
        counts = token_counts.to(torch.float64).clone()
        counts[old_ids] = float("-inf")
        new_ids = torch.cat([old_ids, torch.argsort(-counts, stable=True)[: draft_vocab_size - old_size]]).sort().values
        config = copy.deepcopy(self.config)
        config.draft_vocab_size = draft_vocab_size
        wider = type(self)(config).to(device=self.device, dtype=self.dtype)
        wider.set_draft_vocab(new_ids)
        rows = _VocabularyRows(target.get_output_embeddings().weight, old_ids, new_ids)
        for key, value in self.state_dict().items():
            if key not in ("d2t", "t2d"):
                rows.copy_into(wider.state_dict()[key], value, f"{name}.{key}")
        wider.config.name_or_path = self.config.name_or_path  # a trained drafter: never initialised again
        return wider.train(self.training)

    def target_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's (borrowed) LM head on ``hidden``, restricted to the draft vocabulary's rows when it is
        reduced; on ``hidden``'s device."""
        head = self._borrowed("lm_head")
        weight, bias = head.weight, getattr(head, "bias", None)
        if self.reduced_vocabulary:
            ids = self.draft_token_ids.to(weight.device)
            weight, bias = weight[ids], None if bias is None else bias[ids]
        return F.linear(hidden.to(device=weight.device, dtype=weight.dtype), weight, bias).to(hidden.device)

    @torch.no_grad()
    def copy_target_head_rows(self, target: nn.Module, heads: list[nn.Linear]) -> bool:
        """Copies the target's LM-head rows of the draft vocabulary into each of ``heads`` (where the shapes fit);
        returns whether it did."""
        head = target.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is None:
            return False
        rows = weight[self.draft_token_ids.to(weight.device)]
        done = False
        for lin in heads:
            if lin.weight.shape == rows.shape:
                lin.weight.copy_(rows.to(lin.weight))
                done = True
        return done

    @torch.no_grad()
    def init_output_from_target(self, target: nn.Module, lm_head: nn.Linear, norm: nn.Module | None) -> None:
        """Starts a drafter's own output side in the target's output space: ``lm_head`` gets the target's LM-head rows
        of the draft vocabulary (:meth:`init_from_data` chose it first) and ``norm`` (if given) the target's final
        norm. The norm's effective scale is read by applying the target's norm to a vector of ones, so norms that
        scale by ``1 + w`` (Gemma) map too. Each part is skipped where the shapes differ (a drafter narrower than its
        target). On small data this matters: every draft-vocabulary token starts with a meaningful output row instead
        of a random one."""
        self.copy_target_head_rows(target, [lm_head])
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        target_norm = getattr(decoder, "norm", None)
        if norm is None or not isinstance(target_norm, nn.Module):
            return
        param = next(target_norm.parameters(), None)
        if param is not None and param.numel() == norm.weight.numel():
            ones = torch.ones(1, norm.weight.numel(), device=param.device, dtype=torch.float32)
            scale = target_norm(ones.to(param.dtype)).float()[0]
            # RMS(ones) = 1, so the output is the norm's effective scale (up to its eps, irrelevant here).
            norm.weight.copy_(scale.to(norm.weight))

    def loss_targets(self, batch: dict, features, target_head, loss_kwargs: dict, labels: str = "soft"):
        """What a depthwise loss needs, checked: ``(loss_mask, soft_labels, in_vocab, hard_targets)``.

        Refuses loss kwargs the family does not declare and a missing LM head. ``loss_mask`` is the batch's loss
        mask within its attention mask; ``soft_labels`` the teacher's distribution over the draft vocabulary;
        ``in_vocab`` whether the teacher's choice at each position is in it (with a context vocabulary, both cover the
        draft vocabulary and each row's candidates: :func:`~hf_specdec.context_vocab.context_soft_labels`);
        ``hard_targets`` (``labels="hard"``) the draft index of each token (``-1`` outside the draft vocabulary), else
        ``None``."""
        name = type(self).__name__
        unknown = sorted(set(loss_kwargs) - set(self.loss_kwargs))
        if unknown:
            raise TypeError(
                f"{name}.compute_loss got unknown loss kwargs {unknown}; it takes {list(self.loss_kwargs)}."
            )
        if target_head is None:
            raise ValueError(f"{name}.compute_loss needs the target's LM head for its labels.")
        if labels not in ("soft", "hard"):
            raise ValueError(f"labels must be 'soft' or 'hard', got {labels!r}.")
        loss_mask = batch["loss_mask"].bool()
        attn = batch.get("attention_mask")
        if attn is not None:
            loss_mask = loss_mask & attn.bool()
        loss_mask = loss_mask.to(self.device)
        reduced = self.reduced_vocabulary
        if getattr(self, "context_vocab", None) is not None:  # the draft vocabulary and each row's candidates
            if labels == "hard":
                raise ValueError(f"{name} drafts over a context vocabulary, which trains on soft labels only.")
            valid = attn.bool() if attn is not None else torch.ones_like(batch["loss_mask"].bool())
            soft, in_vocab = context_soft_labels(
                features, target_head, self.draft_token_ids, self.t2d, batch["input_ids"], valid
            )
            in_vocab = in_vocab.to(self.device)
        else:
            soft = features.soft_labels(target_head, self.draft_token_ids if reduced else None)
            in_vocab = self.t2d[soft.full_argmax.to(self.device)] if reduced else torch.ones_like(loss_mask)
        hard = None
        if labels == "hard":
            ids = batch["input_ids"].to(self.device)
            if reduced:
                index = torch.full((self.config.target_vocab_size,), -1, dtype=torch.long, device=self.device)
                index[self.draft_token_ids] = torch.arange(self.config.draft_vocab_size, device=self.device)
                hard = index[ids]
            else:
                hard = ids
        return loss_mask, soft, in_vocab, hard

    def reduced_vocab_ids(self) -> torch.LongTensor | None:
        """The ``vocab_ids`` argument of a :class:`~hf_specdec.types.TokenSelector` (``None`` for the
        full vocabulary)."""
        return self.draft_token_ids if self.reduced_vocabulary else None


class _VocabularyRows:
    """Moves a drafter's weights to a wider draft vocabulary (see
    :meth:`DrafterPreTrainedModel.widened_draft_vocabulary`): the trained rows to their new places, and the new
    tokens' rows from the target's LM-head rows through the least-squares affine map fitted on the old tokens."""

    def __init__(self, target_head: torch.Tensor, old_ids: torch.Tensor, new_ids: torch.Tensor):
        head = target_head.detach().to("cpu", torch.float64)
        with_one = torch.cat([head, head.new_ones(head.shape[0], 1)], dim=1)  # [row, 1]: the map's intercept
        self.places = torch.searchsorted(new_ids, old_ids)
        added = torch.ones(new_ids.numel(), dtype=torch.bool)
        added[self.places] = False
        self.added = added.nonzero().flatten()
        self.old_rows, self.added_rows = with_one[old_ids], with_one[new_ids[self.added]]
        self.old_size, self.new_size = old_ids.numel(), new_ids.numel()

    def copy_into(self, dest: torch.Tensor, value: torch.Tensor, name: str) -> None:
        differ = [d for d in range(value.dim()) if value.shape[d] != dest.shape[d]]
        if not differ:
            dest.copy_(value)
            return
        dim = differ[0]
        if len(differ) > 1 or value.shape[dim] != self.old_size or dest.shape[dim] != self.new_size:
            raise ValueError(f"{name} changes shape beyond its draft vocabulary ({value.shape} -> {dest.shape}).")
        dest.index_copy_(dim, self.places.to(dest.device), value.to(dest))
        trained = value.detach().movedim(dim, 0).reshape(self.old_size, -1).to("cpu", torch.float64)
        mapping = torch.linalg.lstsq(self.old_rows, trained).solution
        added = (self.added_rows @ mapping).reshape(-1, *value.movedim(dim, 0).shape[1:]).movedim(0, dim)
        dest.index_copy_(dim, self.added.to(dest.device), added.to(dest))
