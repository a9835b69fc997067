"""The speculative decoding loop: one loop, generic over drafters (chains, variable-length chains, trees, blocks) and
verifiers (greedy, lossless sampling, typical acceptance, ASD).

Reached from ``target.generate(..., assistant_model=drafter)`` (see :mod:`hf_specdec.generation.hook`) or from
``target.generate(..., custom_generate=hf_specdec.speculative_generate, drafter=drafter)``.

The loop has three named parts, each readable on its own:

* :class:`TargetPasses` runs the target: the prefill, then one pass per step over ``[last committed token, draft
  nodes]``. It owns the KV cache, the positions and the masks. Batched rows accept different numbers of tokens; rather
  than per-row cache surgery, every token fed to the target keeps a slot in the cache, slots of rejected tokens are
  masked out with zeros in the 2-D attention mask, and positions are passed explicitly so that they skip those slots.
  Trees are verified with ``position_ids`` = committed length + depth and a 4-D mask (each node sees the committed
  slots and its ancestors); afterwards the accepted path is compacted into place in the cache. With batch size 1 and
  no padding the cache is simply cropped, so no slot is ever wasted.
* :class:`Committer` appends accepted tokens per row and applies the stopping rules (EOS, length, custom criteria),
  the streamer, and the ``output_scores`` / ``output_logits`` log.
* :class:`LoopStats` keeps the timings and the per-pass acceptance and draft lengths.

:func:`speculative_generate` ties them together: prefill, then ``propose -> target pass -> verify -> commit -> keep
the accepted path -> feed back to the drafter`` until every row has finished.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..cpu_kernels import grouped_query_sdpa
from ..layers import compaction_index
from ..modeling_utils import DrafterPreTrainedModel
from ..tree.policies import TREE_OPTIONS, make_tree_policy
from ..tree.structure import tree_structure, validate_parents
from ..types import DraftInputs, Proposal, SpeculativeDecoderOnlyOutput, VerificationFeedback
from ..verification import get_verifier
from .adaptive import DRAFT_LENGTH_MODES, controller_for
from .logits import ScoreProcessor
from .ngram import (
    COPY_THRESHOLD,
    CopyOutcomes,
    NgramIndex,
    merge_lookup,
)
from .options import option_names, route_options

__all__ = ["speculative_generate", "TargetPasses", "Committer", "LoopStats"]

_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "past_key_values"}
# Attention implementations that take a custom 4-D mask (bool for sdpa, additive float for eager).
_TREE_ATTENTION = ("sdpa", "eager")


class _DraftSelector:
    """Token selection for chain drafters: same logits processors and decoding mode as the verifier.

    With ``copy_threshold`` > 0, a draft position where the drafter's top probability is at most that drafts the token
    that followed the latest earlier occurrence of the text's last 2-3 tokens instead, where there is one
    (:meth:`~hf_specdec.generation.ngram.NgramIndex.next_tokens` over the rows' committed text; the tokens drafted
    before it count as text). The choice is a function of the text and the drafter's distribution, so a copied token
    enters the verifier as a point mass (``q`` one-hot) and sampling stays lossless."""

    def __init__(self, processor: ScoreProcessor, seq: torch.Tensor, lengths: torch.Tensor, do_sample: bool,
                 vocab_size: int, copy_threshold: float = 0.0, ngrams: NgramIndex | None = None):  # fmt: skip
        self.processor = processor
        self.vocab_size = vocab_size
        self.seq = seq
        self.lengths = lengths  # committed length (prompt + generated) per row
        self.do_sample = do_sample
        self.copy_threshold = copy_threshold
        self.ngrams = ngrams  # the rows' committed text (with copy_threshold > 0)
        self._drafted: list[list[int]] = []  # per depth of the chain being drafted, the rows' tokens

    def __call__(self, logits: torch.Tensor, depth: int, vocab_ids: torch.LongTensor | None = None):
        tokens, probs, scores = self._select(logits.to(self.seq.device, torch.float32), depth, vocab_ids)
        if self.copy_threshold > 0:
            tokens, probs = self._copy_where_unsure(tokens, probs, scores, depth)
        if not self.processor.is_identity:
            # Later draft positions see this token in their processors' prefix.
            rows = torch.arange(tokens.shape[0], device=self.seq.device)
            self.seq[rows, self.lengths + depth] = tokens
        return tokens, probs

    def _select(self, logits: torch.Tensor, depth: int, vocab_ids):
        """``(tokens, q, scores)``: the drafter's tokens (target ids), their distribution when sampling, and the
        scores they were chosen from (over the draft vocabulary on the greedy path without processors)."""
        if vocab_ids is not None:
            vocab_ids = vocab_ids.to(self.seq.device)
            if self.processor.is_identity and not self.do_sample:
                # Greedy without processors: the argmax over the draft vocabulary is the argmax over the target
                # vocabulary with -inf outside it, without building the full-vocabulary tensor.
                return _target_ids(vocab_ids, logits.argmax(dim=-1)), None, logits
            logits = _full_vocabulary(logits, vocab_ids, self.vocab_size)
        if self.processor.is_identity:
            scores = logits
        else:
            scores = self.processor(logits[:, None], self.seq, self.lengths + depth)[:, 0]
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            return torch.multinomial(probs, 1).squeeze(-1), probs, scores
        return scores.argmax(dim=-1), None, scores

    def _copy_where_unsure(self, tokens, probs, scores, depth: int):
        """The rows whose drafter is unsure (top probability at most ``copy_threshold``) and whose text has an n-gram
        continuation draft that token instead, as a point mass."""
        del self._drafted[depth:]  # a new chain starts at depth 0
        copy, found = self.ngrams.next_tokens(list(zip(*self._drafted)) or [()] * tokens.shape[0])
        top = (probs if probs is not None else torch.softmax(scores, dim=-1)).amax(dim=-1)  # sampling: q is known
        use = found & (top <= self.copy_threshold)
        if scores.shape[-1] == self.vocab_size:  # a copy the processors rule out would only be rejected
            use &= scores.gather(1, copy[:, None])[:, 0] > float("-inf")
        tokens = torch.where(use, copy, tokens)
        self._drafted.append(tokens.tolist())
        if probs is not None:
            point = torch.nn.functional.one_hot(copy, probs.shape[-1]).to(probs.dtype)
            probs = torch.where(use[:, None], point, probs)
        return tokens, probs


def _target_ids(vocab_ids: torch.LongTensor, index: torch.LongTensor) -> torch.LongTensor:
    """Target ids of column ``index`` (``(batch,)``) of draft logits over ``vocab_ids``: one ``(V,)`` for every row,
    or ``(batch, V)`` per row (a context vocabulary)."""
    return vocab_ids[index] if vocab_ids.dim() == 1 else vocab_ids.gather(1, index[:, None])[:, 0]


def _full_vocabulary(logits: torch.Tensor, vocab_ids: torch.LongTensor, vocab_size: int) -> torch.Tensor:
    """``(batch, vocab_size)`` logits, ``-inf`` outside ``vocab_ids``; per-row ids may repeat an id on padding
    columns (``-inf`` there), so a repeated id keeps its largest logit."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    if vocab_ids.dim() == 1:
        full[:, vocab_ids] = logits
        return full
    return full.scatter_reduce(1, vocab_ids, logits, reduce="amax")


def synchronize(device: torch.device) -> None:
    """Waits for the accelerator behind ``device`` (no-op on CPU), for honest wall-clock timings."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)
    fn = getattr(backend, "synchronize", None)
    if callable(fn):
        fn()


def _validate(model, drafter, generation_config, input_ids, model_kwargs) -> None:
    if not isinstance(drafter, DrafterPreTrainedModel):
        raise TypeError(
            "speculative_generate needs `drafter=` (or `assistant_model=`) to be an hf_specdec drafter "
            f"(DrafterPreTrainedModel), got {type(drafter).__name__}. Load one with "
            "`AutoModelForDrafting.from_pretrained(...)`."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("hf_specdec speculative decoding supports decoder-only targets only.")
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"Speculative decoding does not support beam search (num_beams={generation_config.num_beams}). "
            "Use num_beams=1 (greedy or sampling)."
        )
    if getattr(generation_config, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("Speculative decoding does not support diverse beam search (num_beam_groups > 1).")
    if generation_config.use_cache is False:
        raise ValueError("Speculative decoding needs the target's KV cache; do not pass use_cache=False.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "output_attentions / output_hidden_states are not supported with speculative decoding (each target "
            "pass covers several tokens). Use output_scores / output_logits, or plain generate."
        )
    if getattr(generation_config, "cache_implementation", None) not in (None, "dynamic"):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} is not supported with speculative "
            "decoding; hf_specdec manages a DynamicCache itself."
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("Speculative decoding needs `input_ids`; `inputs_embeds` is not supported.")
    if input_ids.shape[-1] == 0:
        raise ValueError(
            f"generate got an empty prompt (input_ids of shape {tuple(input_ids.shape)}): give at least one token, "
            "e.g. the tokenizer's BOS token or the chat template's prefix."
        )
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError(
            "Continuing from a pre-filled cache is not supported with speculative decoding; pass the full prompt."
        )
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(
            f"Speculative decoding does not know how to extend model inputs {unknown} across verification passes. "
            "Use a text-only target call (input_ids + attention_mask)."
        )


def _supports_logits_to_keep(model) -> bool:
    fn = getattr(model, "_supports_logits_to_keep", None)
    return bool(fn()) if callable(fn) else False


def _split_stopping_criteria(stopping_criteria: StoppingCriteriaList | None):
    eos_ids, others = None, []
    for crit in stopping_criteria or []:
        if isinstance(crit, MaxLengthCriteria):
            continue  # handled through max_length
        if isinstance(crit, EosTokenCriteria):
            ids = crit.eos_token_id.flatten()
            eos_ids = ids if eos_ids is None else torch.cat([eos_ids, ids.to(eos_ids.device)])
        else:
            others.append(crit)
    return eos_ids, others


def _resolve_options(generation_config, verifier, verifier_options, draft_options, drafter):
    """Verifier, verifier options and draft options from the call, falling back to frozen ``GenerationConfig``
    attributes (e.g. ``generation_config.verifier = "asd"``, ``.asd_budget = 8``, ``.tree = "eagle2"``); routed by
    :func:`~hf_specdec.generation.options.route_options`, as the call's keywords are."""
    if verifier is None:
        verifier = getattr(generation_config, "verifier", None)
    named = verifier if isinstance(verifier, str) else None  # an instance brings its own settings
    frozen = {k: getattr(generation_config, k, None) for k in option_names(named, drafter)}
    from_config, draft_from_config, _ = route_options(
        {k: v for k, v in frozen.items() if v is not None}, named, drafter, strict=False
    )
    verifier_options = {**from_config, **dict(verifier_options or {})}  # the call's own options win
    draft_options = {**draft_from_config, **dict(draft_options or {})}
    unknown = sorted(set(draft_options) - set(TREE_OPTIONS) - set(type(drafter).draft_options))
    if unknown:
        raise ValueError(
            f"Unknown drafting option(s) {unknown} for {type(drafter).__name__}. Tree options: {list(TREE_OPTIONS)}; "
            f"this family's options: {sorted(type(drafter).draft_options) or 'none'}."
        )
    return verifier, verifier_options, draft_options


# ------------------------------------------------------------------------------------------------------------------
# the target side
# ------------------------------------------------------------------------------------------------------------------
class TargetPasses:
    """Runs the target over the prompt and over each proposal, and keeps its KV cache in step with what is committed.

    Attributes:
        cache: the target's ``DynamicCache``.
        slot_mask: ``(batch, slots)`` 1 for live cache slots, 0 for padding and rejected tokens (``None`` when no
            slot can ever be dead: batch size 1 without padding).
        next_pos: ``(batch,)`` the position of the next token of each row.
    """

    def __init__(self, model, drafter, attention_mask, position_ids, use_slot_mask, cache, in_device):
        self.model = model
        self.in_device = in_device
        self.cache = cache
        self.slot_mask = attention_mask if use_slot_mask else None
        self.next_pos = position_ids[:, -1] + 1
        self.can_keep_last = _supports_logits_to_keep(model)
        # Only the target layers the drafter reads are captured (output_hidden_states=[ids]).
        self.feature_ids = drafter.target_hidden_state_ids() if drafter.requires_target_hidden_states else None
        if self.feature_ids is not None and not self.feature_ids:
            self.feature_ids = True  # a drafter that reads features but names none gets them all
        self.drafter_name = type(drafter).__name__
        self.attn_impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
        self.compactions = 0
        self._check_sliding_window(use_slot_mask)

    def _check_sliding_window(self, use_slot_mask) -> None:
        self._sliding = False
        for layer in getattr(self.cache, "layers", []):
            if getattr(layer, "is_sliding", False):
                self._sliding = True
                self._window = layer.sliding_window
                layer.activate_past_recording()
        self._use_slot_mask = use_slot_mask

    def check_window(self, max_length: int, width: int, tree: bool) -> None:
        """Refuses layouts a sliding-window cache cannot hold (rejected slots or tree nodes would shift the window)."""
        if not self._sliding:
            return
        if (self._use_slot_mask or tree) and max_length + width > self._window:
            what = "tree proposals" if tree else "batch size > 1 or padding"
            raise ValueError(
                f"This target uses sliding-window attention (window {self._window}); with {what}, hf_specdec keeps "
                "extra slots in the cache, which would shift the window. Use batch size 1 without padding and chain "
                f"proposals, or max_length <= {self._window - width}."
            )

    def _forward(self, ids, mask, pos, keep_all: bool):
        kwargs: dict[str, Any] = {"use_cache": True, "return_dict": True}
        if self.feature_ids is not None:
            kwargs["output_hidden_states"] = self.feature_ids
        if not keep_all and self.can_keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=ids.to(self.in_device),
            attention_mask=None if mask is None else mask.to(self.in_device),
            position_ids=pos.to(self.in_device),
            cache=self.cache,
            **kwargs,
        )
        hidden = out.hidden_states if self.feature_ids is not None else None
        if self.feature_ids is not None and hidden is None:
            raise ValueError(
                f"{type(self.model).__name__} did not return hidden states with output_hidden_states, but "
                f"{self.drafter_name} reads target features. Use a target that supports output_hidden_states."
            )
        return out.logits, hidden

    def prefill(self, input_ids, position_ids, keep_all: bool):
        return self._forward(input_ids, self.slot_mask, position_ids, keep_all)

    def run(self, last_token: torch.LongTensor, proposal: Proposal):
        """One pass over ``[last committed token, proposal nodes]``; returns ``(logits, hidden)`` for all of them."""
        bsz = last_token.shape[0]
        feed = torch.cat([last_token[:, None], proposal.tokens.to(last_token.device)], dim=1)  # (bsz, W)
        width = feed.shape[1]
        if proposal.is_linear:
            pos = self.next_pos[:, None] + torch.arange(width, device=feed.device)[None]
            if self.slot_mask is not None:
                self.slot_mask = torch.cat([self.slot_mask, self.slot_mask.new_ones(bsz, width)], dim=1)
            return self._forward(feed, self.slot_mask, pos, keep_all=True)
        _, depths, tree = tree_structure(proposal, feed.device)  # tree: (bsz, W, W), each node sees its ancestors
        depth = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=feed.device), depths], dim=1)
        pos = self.next_pos[:, None] + depth
        past = self.cache.get_seq_length()
        prev = (
            self.slot_mask.bool()
            if self.slot_mask is not None
            else torch.ones(bsz, past, dtype=torch.bool, device=feed.device)
        )
        mask = torch.cat([prev[:, None].expand(bsz, width, past), tree], dim=2)[:, None]
        if self.attn_impl == "eager":
            dtype = self.model.dtype
            mask = torch.zeros(mask.shape, dtype=dtype, device=feed.device).masked_fill(~mask, torch.finfo(dtype).min)
        elif self.attn_impl != "sdpa":
            raise ValueError(
                f"Tree proposals need a target attention implementation that takes a 4-D mask ({_TREE_ATTENTION}); "
                f"this target uses {self.attn_impl!r}. Load it with attn_implementation='sdpa' (or call "
                "target.set_attn_implementation('sdpa')), or use chain proposals (drop `tree=`)."
            )
        if self.slot_mask is not None:
            self.slot_mask = torch.cat([self.slot_mask, self.slot_mask.new_ones(bsz, width)], dim=1)
        return self._forward(feed, mask, pos, keep_all=True)

    def keep(self, num_accepted: torch.LongTensor, keep_cols: torch.LongTensor | None, width: int) -> None:
        """After verification: keep, per row, the slots of the last token and its accepted path; drop the rest.

        ``keep_cols`` (``(batch, n_max + 1)``) are the pass columns to keep in order (trees: the root, then the
        accepted path); ``None`` for chains, whose accepted path is already in place. ``num_accepted`` is ``-1`` for
        rows that have finished: none of their new slots is kept.
        """
        n_max = max(int(num_accepted.max()), 0)  # -1: a finished row keeps nothing
        kept = n_max + 1
        if keep_cols is not None and n_max > 0:
            for layer in getattr(self.cache, "layers", []):
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    start = tensor.shape[2] - width
                    cols = keep_cols[:, :kept].to(tensor.device)
                    idx = cols[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                    tensor[:, :, start : start + kept] = tensor[:, :, start:].gather(2, idx)
        if self.slot_mask is not None:
            base = self.slot_mask.shape[1] - width
            offsets = torch.arange(width, device=self.slot_mask.device)[None]
            self.slot_mask[:, base:] = (offsets <= num_accepted[:, None]).to(self.slot_mask.dtype)
            self.slot_mask = self.slot_mask[:, : base + kept]
        if width > kept:
            self.cache.crop(kept - width)
        self.next_pos = self.next_pos + num_accepted.clamp_min(-1) + 1
        self._compact()

    def _compact(self) -> None:
        """Moves the live slots of a batched cache together once enough slots are dead in every row (padding,
        rejected tokens), so that the cache stays within a small margin of the longest row instead of growing with
        every rejection. Positions are explicit and keys carry their RoPE, so nothing the target computes changes."""
        if self.slot_mask is None or self._sliding:
            return
        plan = compaction_index(self.slot_mask)
        if plan is None:
            return
        index, new_valid = plan
        for layer in getattr(self.cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                idx = index.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
                setattr(layer, name, tensor.gather(2, idx))
        self.slot_mask = new_valid.to(self.slot_mask.dtype)
        self.compactions += 1


# ------------------------------------------------------------------------------------------------------------------
# committing tokens
# ------------------------------------------------------------------------------------------------------------------
class Committer:
    """Appends tokens to each row's buffer and applies the stopping rules, like plain ``generate`` step by step.

    Attributes:
        seq: ``(batch, buffer)`` left-padded prompt, committed tokens, then scratch space (what lies past a row's
            length is never read as its text).
        room: ``(batch,)`` tokens each row may still generate (``n_gen``: those it generated).
        lengths: ``(batch,)`` each row's end in ``seq`` (``prompt_len + n_gen``).
        finished: ``(batch,)`` rows that hit EOS, a stopping criterion or the length limit.
    """

    def __init__(self, seq, prompt_len, max_new, eos_ids, other_criteria, log_scores: bool, streamer):
        self.seq = seq
        self.prompt_len = prompt_len
        self.max_new = max_new
        self.eos_ids = eos_ids
        self.other_criteria = other_criteria
        self.log_scores = log_scores
        self.streamer = streamer
        bsz = seq.shape[0]
        self.room = torch.full((bsz,), max_new, dtype=torch.long, device=seq.device)
        self.lengths = torch.full((bsz,), prompt_len, dtype=torch.long, device=seq.device)
        self.finished = torch.zeros(bsz, dtype=torch.bool, device=seq.device)
        self.score_log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._columns: dict[int, torch.Tensor] = {}  # width -> (1, width) column offsets

    @property
    def n_gen(self) -> torch.LongTensor:
        return self.max_new - self.room

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def remaining(self) -> int:
        return int(self.room.masked_fill(self.finished, 0).max())

    def commit(self, new_tokens: torch.Tensor, count: torch.Tensor, scores=None, raw=None) -> torch.Tensor:
        """Appends up to ``count`` tokens per unfinished row; returns how many each row took."""
        count = torch.minimum(count.masked_fill(self.finished, 0), self.room)
        stop = None
        if self.eos_ids is not None:
            count, stop = self._cut_at_eos(new_tokens, count)
        # Written whole, with no data-dependent shape: what lies past a row's new length is scratch.
        self.seq.scatter_(1, self.lengths[:, None] + self.offsets(new_tokens.shape[1]), new_tokens)
        if self.other_criteria:
            count, stop = self._cut_at_criteria(count, stop)
        if self.log_scores:
            self.score_log.append((self.n_gen, count.clone(), scores, raw))
        if self.streamer is not None:
            self.streamer.put(new_tokens[0, : int(count[0])].cpu())
        self.room = self.room - count
        self.lengths = self.lengths + count
        done = self.room <= 0
        self.finished = self.finished | done if stop is None else self.finished | stop | done
        return count

    def offsets(self, width: int) -> torch.Tensor:
        """``(1, width)`` column offsets ``0 .. width - 1`` (made once per width)."""
        if width not in self._columns:
            self._columns[width] = torch.arange(width, device=self.seq.device)[None]
        return self._columns[width]

    def _cut_at_eos(self, new_tokens: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` cut after each row's first EOS among its tokens, and the rows that committed one."""
        is_eos = torch.isin(new_tokens, self.eos_ids)
        if new_tokens.shape[1] == 1:  # one token: EOS stops the row (a row that takes nothing has finished)
            return count, is_eos[:, 0]
        through_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, new_tokens.shape[1] + 1)
        return torch.minimum(count, through_eos), through_eos <= count

    def _cut_at_criteria(self, count: torch.Tensor, stop: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` cut at the first token after which one of the other stopping criteria holds (checked token by
        token on the row's text, as plain ``generate`` checks each step), and the rows that stop."""
        stop = torch.zeros_like(self.finished) if stop is None else stop
        counts, ends = count.tolist(), self.lengths.tolist()
        for b in range(len(counts)):
            for j in range(counts[b]):
                prefix = self.seq[b : b + 1, : ends[b] + j + 1]
                if any(bool(c(prefix, None).any()) for c in self.other_criteria):
                    count[b] = j + 1
                    stop[b] = True
                    break
        return count, stop

    def sequences(self, pad_value: int) -> torch.LongTensor:
        total = int(self.n_gen.max())
        col = torch.arange(total, device=self.seq.device)[None]
        out = self.seq[:, : self.prompt_len + total].clone()
        out[:, self.prompt_len :] = torch.where(col < self.n_gen[:, None], out[:, self.prompt_len :], pad_value)
        return out

    def assemble(self, index: int):
        """``output_scores`` (``index=2``) or ``output_logits`` (``index=3``) as plain ``generate`` returns them."""
        if not self.score_log:
            return None
        total = int(self.n_gen.max())
        bsz = self.seq.shape[0]
        vocab = self.score_log[0][index].shape[-1]
        buf = torch.zeros(total, bsz, vocab, dtype=torch.float32, device=self.seq.device)
        for start, cnt, sc, rw in self.score_log:
            src = sc if index == 2 else rw
            for b in range(bsz):
                c = int(cnt[b])
                if c:
                    s0 = int(start[b])
                    buf[s0 : s0 + c, b] = src[b, :c]
        return tuple(buf.unbind(0))


# ------------------------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------------------------
class LoopStats:
    """Wall-clock split (prefill, draft, target, verify) and per-pass acceptance / draft lengths."""

    def __init__(self, device: torch.device, sync: bool, bsz: int):
        self.device = device
        self.sync = sync
        # draft_s: all drafter time (its prefill over the prompt, catch-ups after plain steps, drafting passes);
        # drafting_s: the passes that drafted only, without their catch-up: the cost per draft token.
        self.timings = {"draft_s": 0.0, "drafting_s": 0.0, "target_s": 0.0, "verify_s": 0.0}
        self.accept_log: list[torch.Tensor] = []  # per pass: (batch,) tokens committed
        self.draft_log: list[torch.Tensor] = []  # per pass: (batch,) draft tokens proposed
        self.draft_steps = 0  # sequential draft positions, counted once per batch
        self.lookup_rows = 0  # row-passes whose chain was switched to a prompt-lookup copy
        self.lookup_passes = 0  # passes that verified copies or grammar-forced tokens alone (nothing drafted)
        self.forced_rows = 0  # row-passes that verified the tokens their grammar forces
        self.stats_log: dict[str, list[torch.Tensor]] = {}
        self.bsz = bsz
        self.t_start = self.clock()

    def clock(self) -> float:
        if self.sync:
            synchronize(self.device)
        return time.perf_counter()

    def add(self, key: str, since: float) -> float:
        now = self.clock()
        self.timings[key] = self.timings.get(key, 0.0) + now - since
        return now

    def log_verifier(self, result, committed: torch.Tensor, finished: torch.Tensor) -> None:
        """Per-row verifier statistics of a pass; per-position ones count only the draft tokens committed."""
        for key, value in result.stats.items():
            self.stats_log.setdefault(key, []).append(value.to(finished.device).masked_fill(finished, 0))
        if not result.token_stats:
            return
        drafted = torch.minimum(committed, result.num_accepted.to(committed.device)).masked_fill(finished, 0)
        for key, value in result.token_stats.items():
            value = value.to(committed.device)
            col = torch.arange(value.shape[1], device=value.device)[None]
            kept = col < drafted[:, None]
            self.stats_log.setdefault(key, []).append(torch.where(kept, value, torch.zeros_like(value)).sum(dim=1))

    def finish(self) -> None:
        self.timings["total_s"] = self.clock() - self.t_start
        self.timings["draft_steps"] = self.draft_steps
        self.timings["passes"] = len(self.accept_log)

    def per_row(self):
        if not self.accept_log:
            return [[] for _ in range(self.bsz)], [[] for _ in range(self.bsz)]
        acc = torch.stack(self.accept_log, dim=1).tolist()
        drafted = torch.stack(self.draft_log, dim=1).tolist()
        # Drop the passes after a row finished.
        accepted = [[x for x in row if x > 0] for row in acc]
        lengths = [[k for x, k in zip(row, krow) if x > 0] for row, krow in zip(acc, drafted)]
        return accepted, lengths

    def forwards(self) -> torch.LongTensor:
        """Target passes per row: the prefill, then each pass the row was still generating in (it committed at least
        one token there)."""
        if not self.accept_log:
            return torch.ones(self.bsz, dtype=torch.long, device=self.device)
        return 1 + (torch.stack(self.accept_log, dim=1) > 0).sum(dim=1)

    def verifier_totals(self):
        return {key: torch.stack(vals, 1).sum(1) for key, vals in self.stats_log.items()} or None


def _check_proposal(proposal: Proposal, bsz: int, limit: int, drafter) -> None:
    name = type(drafter).__name__
    if proposal.tokens.shape[0] != bsz:
        raise ValueError(f"{name}.propose returned {proposal.tokens.shape[0]} rows for a batch of {bsz}.")
    if proposal.is_linear and proposal.num_nodes > limit:
        raise ValueError(f"{name}.propose returned {proposal.num_nodes} draft tokens; at most {limit} were asked for.")
    if not proposal.is_linear:
        validate_parents(proposal.batched_parents())


# ------------------------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------------------------
def _generation_room(generation_config, prompt_len: int) -> tuple[int, int]:
    """``(max_length, new tokens to generate)``; refuses a prompt that leaves no room."""
    max_length = generation_config.max_length
    if max_length - prompt_len < 1:
        raise ValueError(f"max_length={max_length} leaves no room for new tokens after a {prompt_len}-token prompt.")
    return max_length, max_length - prompt_len


def _tree_policy_for(drafter, tree_kwargs: dict):
    """The tree policy the ``tree=`` options ask for, fitted to the drafter's vocabulary (``None``: chains)."""
    policy = make_tree_policy(**tree_kwargs)
    return None if policy is None else policy.for_vocabulary(drafter.config.draft_vocab_size)


def _holding_the_drafter(generate_fn):
    """Keeps the drafter bound to the target for the whole call (:meth:`DrafterPreTrainedModel.generating_for`), so
    that a call in another thread cannot re-bind it to another target midway."""

    @functools.wraps(generate_fn)
    def generate(model, *args, drafter=None, **kwargs):
        hold = getattr(drafter, "generating_for", None)  # not a drafter: `_validate` says what to pass
        with hold(model) if callable(hold) else contextlib.nullcontext():
            return generate_fn(model, *args, drafter=drafter, **kwargs)

    return generate


@dataclass
class DecodingOptions:
    """What one ``generate`` call asked for, resolved once: the call's keywords first, then the frozen attributes of
    its ``GenerationConfig`` (``generate`` routes its keywords to the same names), checked against the drafter.

    Attributes:
        k_max: most draft tokens of a chain pass (capped at the tokens left to generate).
        do_sample: sampling or greedy.
        verifier: the verifier instance.
        draft_options: the drafter family's own options (``init_draft_state`` keywords).
        tree_kwargs / policy: the tree options and their policy (``None``: chains).
        draft_length: ``"adaptive"`` or ``"fixed"``.
        lookup_tokens: longest prompt-lookup copy merged into chains, or verified alone in place of a pass (0: off;
            with trees, alone only).
        copy_threshold: a chain drafts the n-gram copy's token where the drafter's top probability is at most this
            (0: off; chains, and a tree's chain-shaped sizes).
        forced_tokens: whether chains verify the tokens a grammar processor forces before asking the drafter.
        width_max / depth_max: most draft nodes in a pass / most tokens a pass can accept.
        max_length / max_new: the length limit and the tokens it leaves after the prompt.
    """

    k_max: int
    do_sample: bool
    verifier: Any
    draft_options: dict
    tree_kwargs: dict
    policy: Any
    draft_length: str
    lookup_tokens: int
    copy_threshold: float
    forced_tokens: bool
    width_max: int
    depth_max: int
    max_length: int
    max_new: int

    @classmethod
    def resolve(cls, drafter, generation_config, prompt_len: int, num_draft_tokens, verifier, verifier_options,
                draft_options, draft_length, lookup_tokens, forced_tokens=True,
                copy_threshold=None) -> DecodingOptions:  # fmt: skip
        max_length, max_new = _generation_room(generation_config, prompt_len)
        k_max = int(num_draft_tokens if num_draft_tokens is not None else drafter.config.num_draft_tokens)
        if k_max < 1:
            raise ValueError(f"num_draft_tokens / num_assistant_tokens must be >= 1, got {k_max}.")
        do_sample = bool(generation_config.do_sample)
        verifier, verifier_options, draft_options = _resolve_options(
            generation_config, verifier, verifier_options, draft_options, drafter
        )
        if draft_length is None:
            draft_length = getattr(generation_config, "draft_length", None) or "adaptive"
        if draft_length not in DRAFT_LENGTH_MODES:
            raise ValueError(f"draft_length must be one of {DRAFT_LENGTH_MODES}, got {draft_length!r}.")
        tree_kwargs = {k: draft_options.pop(k) for k in TREE_OPTIONS if k in draft_options}
        policy = _tree_policy_for(drafter, tree_kwargs)
        lookup_tokens = _lookup_tokens(generation_config, lookup_tokens, max_new)
        copy_threshold = _copy_threshold(generation_config, copy_threshold, lookup_tokens)
        k_max = min(k_max, max_new)  # no pass commits more tokens than are left
        _check_draft_depth(drafter, policy, k_max)
        width_max = max(policy.max_nodes if policy is not None else k_max, lookup_tokens)
        return cls(
            k_max=k_max, do_sample=do_sample, verifier=get_verifier(verifier, do_sample, **verifier_options),
            draft_options=draft_options, tree_kwargs=tree_kwargs, policy=policy, draft_length=draft_length,
            lookup_tokens=lookup_tokens, copy_threshold=copy_threshold,
            forced_tokens=bool(forced_tokens), width_max=width_max,
            depth_max=policy.max_depth if policy is not None else width_max, max_length=max_length, max_new=max_new,
        )  # fmt: skip

    def controller_key(self):
        """What the adaptive length keys its memory on, besides the target, batch size, mode and device:
        ``(tree key, k, variant)``. The variant is ``(("copy_threshold", value),)`` where the n-gram copies'
        threshold is not the call's default (``()`` otherwise): the copies change what every draft depth of a chain,
        or of a tree's chain-shaped sizes, accepts, so calls that differ in it learn apart (a benchmark's rows, say)."""
        default = _default_copy_threshold(self.lookup_tokens)
        variant = () if self.copy_threshold == default else (("copy_threshold", self.copy_threshold),)
        if self.policy is not None:
            return tuple(sorted((k, repr(v)) for k, v in self.tree_kwargs.items())), self.policy.max_nodes, variant
        return None, self.k_max, variant


def _lookup_tokens(generation_config, lookup_tokens, max_new: int) -> int:
    if lookup_tokens is None:
        lookup_tokens = getattr(generation_config, "lookup_tokens", None)
    lookup_tokens = 10 if lookup_tokens is None else int(lookup_tokens)
    if lookup_tokens < 0:
        raise ValueError(f"lookup_tokens must be >= 0 (0 turns prompt lookup off), got {lookup_tokens}.")
    return min(lookup_tokens, max_new)


def _default_copy_threshold(lookup_tokens: int) -> float:
    """The n-gram copies inside the chain are on by default wherever prompt lookup is: ``lookup_tokens=0`` means no
    copying from the text unless ``copy_threshold`` asks for it."""
    return COPY_THRESHOLD if lookup_tokens > 0 else 0.0


def _copy_threshold(generation_config, copy_threshold, lookup_tokens: int) -> float:
    if copy_threshold is None:
        copy_threshold = getattr(generation_config, "copy_threshold", None)
    if copy_threshold is None:
        return _default_copy_threshold(lookup_tokens)
    if isinstance(copy_threshold, bool) or not isinstance(copy_threshold, (int, float)) or not 0 <= copy_threshold <= 1:
        raise ValueError(
            f"copy_threshold must be a number in [0, 1] (0 turns the n-gram copies off), got {copy_threshold!r}."
        )
    return float(copy_threshold)


def _check_draft_depth(drafter, policy, k_max: int) -> None:
    cap = drafter.max_draft_depth  # e.g. a head family drafts at most one token per head
    depth = policy.max_depth if policy is not None else k_max
    if cap is not None and depth > cap:
        what = f"a tree of depth {depth}" if policy is not None else f"{k_max} draft tokens per pass"
        raise ValueError(
            f"{type(drafter).__name__} drafts at most {cap} tokens ahead (config.{drafter.max_draft_depth_source}), "
            f"so it cannot propose {what}; ask for at most {cap} (num_assistant_tokens, tree_depth or a shallower "
            "tree)."
        )


def _overlay(copy: Proposal | None, forced: torch.Tensor, counts: torch.Tensor, do_sample: bool, vocab: int):
    """The rows' forced tokens over ``copy`` (rows without forced tokens keep their copy, if any), as one proposal
    of point masses."""
    width = max(forced.shape[1], copy.tokens.shape[1] if copy is not None else 0)
    tokens = forced.new_zeros(forced.shape[0], width)
    lengths = counts.clone()
    if copy is not None:
        keep = counts == 0
        tokens[keep, : copy.tokens.shape[1]] = copy.tokens[keep]
        lengths[keep] = copy.lengths[keep]
    has = counts > 0
    tokens[has, : forced.shape[1]] = forced[has]
    probs = torch.nn.functional.one_hot(tokens, vocab).to(torch.float32) if do_sample else None
    return Proposal(tokens=tokens, draft_probs=probs, lengths=lengths)


@dataclass
class _Pass:
    """One decoding pass, from its plan to its feedback."""

    k: int  # tokens asked of the drafter (0: a plain step, or copies / forced tokens alone)
    limit: int  # most draft tokens the length limit allows
    proposal: Proposal | None = None
    copy: Proposal | None = None  # tokens verified before the drafter's: grammar-forced tokens, lookup copies
    forced: bool = False  # some row verifies tokens its grammar forces (a pass the adaptive length did not choose)
    lookup_only: bool = False  # the pass verifies prompt-lookup copies alone (nothing drafted)
    catchup_s: float = 0.0  # the drafter's catch-up on earlier plain steps, before drafting
    catchup_slots: int = 0
    t_start: float = 0.0


class SpeculativeDecoder:
    """The state of one speculative ``generate`` call: :meth:`prefill` once, then :meth:`step` until :attr:`done`,
    then :meth:`output`.

    Each step plans the pass (the adaptive length's choice: a plain step, a prompt-lookup copy, a chain or a tree),
    proposes it, runs the target over it, verifies, commits the accepted tokens and feeds the verified slots back to
    the drafter (or keeps them for it, after a plain step, until it drafts again).

    The parts: :class:`TargetPasses` (the target's cache and passes), :class:`Committer` (what is committed, stopping,
    the streamer, scores), :class:`LoopStats` (times and per-pass counts), the verifier and, with the adaptive length,
    the :class:`~hf_specdec.generation.adaptive.DraftLengthController` kept for this target and setting.
    """

    def __init__(self, model, drafter, input_ids, options: DecodingOptions, generation_config, logits_processor,
                 stopping_criteria, streamer, spec_timing: bool, model_kwargs: dict):  # fmt: skip
        self.model, self.drafter, self.options = model, drafter, options
        self.bsz, self.prompt_len = input_ids.shape
        self.work = drafter.device  # = device of the target's LM head
        self.in_device = input_ids.device
        self.input_ids = input_ids.to(self.work)
        self.verifier = options.verifier
        self.verifier.start(self.bsz, self.work, options.do_sample)  # sampling uses the global RNG, as generate
        self.processor = ScoreProcessor(logits_processor, self.bsz)
        eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria)
        eos_ids = None if eos_ids is None else eos_ids.to(self.work)
        pad_id = generation_config._pad_token_tensor
        self.pad_value = int(pad_id) if pad_id is not None else (int(eos_ids[0]) if eos_ids is not None else 0)
        self._prepare_target(model_kwargs)
        self.ret_dict = generation_config.return_dict_in_generate
        self.want_scores = self.ret_dict and generation_config.output_scores
        self.want_logits = self.ret_dict and generation_config.output_logits
        # Row buffer: [left-padded prompt | committed tokens | scratch for draft tokens].
        width = options.max_length + max(options.width_max, options.depth_max) + 1
        self.seq = torch.full((self.bsz, width), self.pad_value, dtype=torch.long, device=self.work)
        self.seq[:, : self.prompt_len] = self.input_ids
        self.committed = Committer(self.seq, self.prompt_len, options.max_new, eos_ids, other_criteria,
                                   self.want_scores or self.want_logits, streamer)  # fmt: skip
        self.streamer = streamer
        if streamer is not None:
            if self.bsz > 1:
                raise ValueError(f"Streamers support batch size 1 (as in transformers); got a batch of {self.bsz}.")
            streamer.put(self.input_ids.cpu())
        self.stats = LoopStats(self.work, spec_timing and self.work.type != "cpu", self.bsz)
        self.rows = torch.arange(self.bsz, device=self.work)
        self.starts = (self.attention_mask == 0).long().sum(dim=1)  # first real token of each (left-padded) row
        self.controller = None
        if options.draft_length == "adaptive":
            tree_key, k, variant = options.controller_key()
            budgets = None if options.policy is None else options.policy.node_budgets
            self.controller = controller_for(drafter, model, k, tree_key, self.bsz, options.do_sample, self.work,
                                             variant=variant, budgets=budgets)  # fmt: skip
            self.controller.begin_call(self.prompt_len)
        self.copy_outcomes = CopyOutcomes()  # the rows' lookup copies, scored once their text is known
        self.ngrams: NgramIndex | None = None  # with prompt lookup or copies, from the prefill on
        self.plain_steps = 0
        self.pending: list[DraftInputs] = []  # verified slots (and the prompt) not yet shown to the drafter
        self.pending_slots = 0  # how many
        self.prompt_waits = False  # the prompt is among them (plain steps were winning when the call began)
        self.step_index = 0

    def _prepare_target(self, model_kwargs: dict) -> None:
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones(self.bsz, self.prompt_len, dtype=torch.long, device=self.work)
        self.attention_mask = mask.to(self.work).long()
        position_ids = model_kwargs.get("position_ids")
        if position_ids is None:
            position_ids = (self.attention_mask.cumsum(-1) - 1).clamp_min(0)
        self.position_ids = position_ids.to(self.work)
        # Rows may develop holes (rejected slots) only when several rows share a cache.
        self.use_slot_mask = self.bsz > 1 or bool((self.attention_mask == 0).any())
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        self.cache = DynamicCache(config=self.model.config) if cache is None else cache
        self.target = TargetPasses(self.model, self.drafter, self.attention_mask, self.position_ids,
                                   self.use_slot_mask, self.cache, self.in_device)  # fmt: skip
        self.target.check_window(
            self.options.max_length, self.options.width_max + 1, tree=self.options.policy is not None
        )

    @property
    def done(self) -> bool:
        return self.committed.done

    # ---------------------------------------------------------------- prefill: one target pass over the prompt
    def prefill(self) -> None:
        stats, drafter = self.stats, self.drafter
        t0 = stats.clock()
        logits, hidden = self.target.prefill(self.input_ids, self.position_ids, keep_all=drafter.requires_target_logits)
        stats.timings["prefill_s"] = stats.clock() - t0
        raw0 = logits[:, -1].to(device=self.work, dtype=torch.float32)
        scores0 = self.processor(raw0[:, None], self.seq, torch.full_like(self.committed.n_gen, self.prompt_len))[:, 0]
        if self.options.do_sample:
            first = torch.multinomial(torch.softmax(scores0, dim=-1), 1).squeeze(-1)
        else:
            first = scores0.argmax(dim=-1)
        self.committed.commit(first[:, None], torch.ones_like(self.committed.n_gen), scores0[:, None], raw0[:, None])
        self.last_token = first
        if self.options.lookup_tokens or self.options.copy_threshold > 0:  # the rows' text, indexed for copies
            self.ngrams = NgramIndex(self.seq, self.starts, self.committed.lengths)
        t0 = stats.clock()
        self.state = drafter.init_draft_state(self.bsz, self.seq.shape[1], **self.options.draft_options)
        prompt = DraftInputs(
            next_token_ids=torch.cat([self.input_ids[:, 1:], first[:, None]], dim=1),
            position_ids=self.position_ids,
            valid=self.attention_mask.bool(),
            hidden_states=hidden,
            logits=logits.to(self.work) if drafter.requires_target_logits else None,
        )
        if self._prompt_can_wait():
            self._wait(prompt)
            self.prompt_waits = True
        else:
            self._observe_prompt(prompt)
        stats.add("draft_s", t0)
        self.vocab = raw0.shape[-1]
        self.selector = _DraftSelector(self.processor, self.seq, self.committed.lengths, self.options.do_sample,
                                       self.vocab, self.options.copy_threshold, self.ngrams)  # fmt: skip

    def _observe_prompt(self, prompt: DraftInputs) -> None:
        """The drafter's pass over the prompt, now; for a drafter that observes in batches, timed as a catch-up over
        the prompt's slots (the same batched pass: every call's prompt then tells the adaptive length what a
        catch-up costs per slot, which small catch-ups after a few plain steps, their fixed cost dominating, do
        not)."""
        t0 = self.stats.clock()
        self.drafter.observe(self.state, prompt)
        if self.controller is not None and self.drafter.observe_in_batches:
            self.controller.record_catchup(prompt.next_token_ids.shape[1], self.stats.clock() - t0)

    def _prompt_can_wait(self) -> bool:
        """Whether the drafter's pass over the prompt waits until the adaptive length first drafts: yes when what
        earlier calls measured says plain steps win now (a call that never drafts then never pays for the drafter's
        pass over a long prompt), for a drafter that observes in batches and does not read the target's logits (the
        prompt's hidden states wait with the plain steps' slots; its logits would be too large to keep)."""
        controller, drafter = self.controller, self.drafter
        if controller is None or not drafter.observe_in_batches or drafter.requires_target_logits:
            return False
        limit = self.committed.remaining() - 1
        return controller.step_time is not None and controller.best(limit, self.prompt_len, steps_left=limit) == 0

    # ---------------------------------------------------------------- one pass: plan, propose, verify, commit, feed back
    def step(self) -> None:
        step = self._plan()
        self._propose(step)
        t1 = self.stats.add("draft_s", step.t_start)
        proposal = step.proposal
        if proposal.is_linear and proposal.num_nodes:
            lengths = self.committed.lengths
            cols = lengths[:, None] + torch.arange(proposal.num_nodes, device=self.work)[None]
            self.seq.scatter_(1, cols, proposal.tokens)
        drafted = proposal.node_valid().sum(1) if proposal.num_nodes else self.rows.new_zeros(self.bsz)
        logits, hidden = self.target.run(self.last_token, proposal)
        t2 = self.stats.add("target_s", t1)
        verified, n, committed, finished_before = self._verify_and_commit(step, logits, hidden, drafted)
        if self.controller is not None:
            out = self.committed
            self.controller.record_copies(self.copy_outcomes.resolve(self.seq, out.lengths, out.finished))
        t3 = self.stats.add("verify_s", t2)
        if self.done:
            return
        self._feed_back(step, verified)
        self.last_token = verified.next_token_ids.gather(1, n[:, None])[:, 0]
        t4 = self.stats.add("draft_s", t3)
        if step.k > 0:
            self.stats.timings["drafting_s"] += (t1 - step.t_start - step.catchup_s) + (t4 - t3)
        if self.controller is not None and not step.forced:
            paths = verified.feedback.accepted_nodes if self._nested_tree(step) else None
            self.controller.update(step.k, drafted, committed, ~finished_before, t4 - step.t_start, step.lookup_only,
                                   step.catchup_s, step.catchup_slots, self.committed.lengths, paths)  # fmt: skip
        self.step_index += 1

    def _nested_tree(self, step: _Pass) -> bool:
        """Whether the pass drafted a tree whose first ``n`` nodes are its tree of ``n`` (its accepted path then tells
        the adaptive length what each smaller size would have committed)."""
        policy = self.options.policy
        return step.k > 0 and policy is not None and len(policy.node_budgets) > 1

    def _plan(self) -> _Pass:
        """How many tokens to draft: the adaptive length's choice (0: a plain step), or always ``k_max``; and, with
        the adaptive length, whether the rows' prompt-lookup copies go first (:meth:`_copies_first`)."""
        remaining = self.committed.remaining()
        limit = remaining - 1  # a pass never drafts past the length limit
        pending_slots = self.pending_slots
        if self.controller is None:  # the longest chain that fits, or the whole tree (the loop caps what it commits)
            policy = self.options.policy
            k = min(self.options.k_max, limit) if policy is None or limit <= 0 else policy.max_nodes
        else:  # the pass attends over the prompt and what the row furthest behind has generated
            context = self.prompt_len + self.committed.max_new - remaining
            k = self.controller.choose(limit, pending_slots, context)
        step = _Pass(k=k, limit=limit, t_start=self.stats.clock())
        step.copy = self._copies_first(step, pending_slots)
        if step.copy is not None and self._every_row_has(step.copy):
            step.k = 0  # every row verifies its copy: nothing to draft
        if step.k > 0 and self.pending:  # the drafter catches up on the plain steps (and prompt) it did not see
            self._catch_up()
            step.catchup_s, step.catchup_slots = self.stats.clock() - step.t_start, pending_slots
        return step

    def _every_row_has(self, copy: Proposal) -> bool:
        """Whether every row still generating has a token to verify in ``copy``."""
        return bool((copy.lengths > 0)[~self.committed.finished].all())

    def _wait(self, slots: DraftInputs) -> None:
        """Keeps verified slots (or the prompt) for the drafter's next catch-up."""
        self.pending.append(slots)
        self.pending_slots += slots.next_token_ids.shape[1]

    def _catch_up(self, verified: DraftInputs | None = None) -> None:
        """The drafter observes the slots it has not seen (then ``verified``) in one call."""
        items = self.pending + ([verified] if verified is not None else [])
        self.drafter.observe(self.state, _merge_inputs(items))
        self.pending.clear()
        self.pending_slots = 0
        self.prompt_waits = False

    def _copies_first(self, step: _Pass, pending_slots: int) -> Proposal | None:
        """The tokens rows verify before (or instead of) the drafter's chain: what their grammar forces, always
        (:meth:`GrammarLogitsProcessor.forced_continuations`: tokens its mask allows alone, then the forced text's
        jump-forward tokens), else prompt-lookup copies when they pay (:meth:`_lookup_copies`). ``None`` when no row
        has any."""
        opts, limit = self.options, step.limit
        if limit <= 0:
            return None
        copy = self._lookup_copies(step, pending_slots)
        forced = self._forced_tokens(min(limit, opts.width_max)) if opts.forced_tokens and opts.policy is None else None
        if forced is None:
            return copy
        step.forced = True
        return _overlay(copy, *forced, opts.do_sample, self.vocab)

    def _lookup_copies(self, step: _Pass, pending_slots: int) -> Proposal | None:
        """With the adaptive length, the rows' prompt-lookup copies (where some row's last n-gram occurred before)
        when copies are measured to commit more tokens per second than the chosen draft length (or a plain step)
        would (:meth:`DraftLengthController.use_lookup`); every copy is kept to be scored once its text is known
        (:class:`CopyOutcomes`), taken or not."""
        opts = self.options
        if not opts.lookup_tokens or self.controller is None:
            return None
        active = ~self.committed.finished
        copy = self._grammar_valid(self.ngrams.proposal(min(opts.lookup_tokens, step.limit), active))
        if copy is None or (opts.policy is not None and not self._every_row_has(copy)):
            return None  # a tree pass cannot carry a copy beside the tree: copies only where they replace it
        self.copy_outcomes.add(copy, self.committed.lengths, active)
        chosen = self.controller.rate(step.k, pending_slots) if step.k > 0 else 1.0
        return copy if self.controller.use_lookup(chosen or 1.0) else None

    def _grammar_valid(self, copy: Proposal | None) -> Proposal | None:
        """``copy`` with each row's copy cut where its grammar rejects a token (``None`` when nothing is left)."""
        grammar = self.processor.grammar
        if copy is None or grammar is None:
            return copy
        lengths = grammar.valid_prefix_lengths(self.seq, self.committed.lengths, copy.tokens, copy.lengths)
        if int(lengths.max()) == 0:
            return None
        return Proposal(tokens=copy.tokens, draft_probs=copy.draft_probs, lengths=lengths.to(copy.lengths.device))

    def _copies_to_merge(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' prompt-lookup copies to merge into their chains, each cut where its grammar (if any) rejects a
        token."""
        tokens, counts = self.ngrams.continuations(num_tokens)
        grammar = self.processor.grammar
        if grammar is None:
            return tokens, counts
        return tokens, grammar.valid_prefix_lengths(self.seq, self.committed.lengths, tokens, counts).to(counts.device)

    def _forced_tokens(self, limit: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(tokens, counts)``: per row the tokens its grammar forces next (none for finished rows); ``None`` when
        no row has one or the chain has no grammar processor."""
        grammar = self.processor.grammar
        if grammar is None:
            return None
        rows = grammar.forced_continuations(self.seq, self.committed.lengths, limit)
        counts = torch.tensor([len(r) for r in rows], device=self.work)
        counts.masked_fill_(self.committed.finished, 0)
        if int(counts.max()) == 0:
            return None
        tokens = self.seq.new_zeros(self.bsz, int(counts.max()))
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=tokens.dtype)
        self.stats.forced_rows += int((counts > 0).sum())
        return tokens, counts

    def _propose(self, step: _Pass) -> None:
        """The pass's proposal: empty (a plain step), the prompt-lookup copies alone, a tree, or a drafted chain
        with prompt-lookup copies merged in (every row with a copy when copies go first, else the rows whose copy
        starts like the chain). A tree's size that is the drafter's greedy chain is drafted as a chain, copies and
        all."""
        opts = self.options
        if step.k <= 0:
            step.proposal = Proposal(tokens=self.seq.new_empty(self.bsz, 0))
            if step.copy is not None:
                step.proposal, step.lookup_only = step.copy, True
                self.stats.lookup_passes += 1
            self.plain_steps += not step.lookup_only
            return
        if opts.policy is None:
            step.proposal = self._merge_copies(step, self._draft_chain(step.k))
            return
        policy = opts.policy if step.k >= opts.policy.max_nodes else opts.policy.with_budget(step.k)
        if policy.chain_depth is not None:
            step.proposal = self._merge_copies(step, self._draft_chain(policy.chain_depth))
            return
        step.proposal = policy.propose(self.drafter, self.state)
        self.stats.draft_steps += policy.max_depth
        _check_proposal(step.proposal, self.bsz, step.k, self.drafter)

    def _draft_chain(self, k: int) -> Proposal:
        """The drafter's chain of ``k`` tokens, through the draft selector (processors, sampling, n-gram copies)."""
        self.selector.lengths = self.committed.lengths
        proposal = self.drafter.propose(self.state, k, self.selector)
        self.stats.draft_steps += proposal.num_nodes
        _check_proposal(proposal, self.bsz, k, self.drafter)
        _trim_linear(proposal)
        return proposal

    def _merge_copies(self, step: _Pass, proposal: Proposal) -> Proposal:
        """``proposal`` with the rows' prompt-lookup copies merged in, where they go (see :meth:`_propose`)."""
        opts, lengths = self.options, self.committed.lengths
        copies_first = step.copy is not None
        if copies_first or (opts.lookup_tokens > step.k and step.limit > step.k):
            copy_len = min(opts.lookup_tokens, step.limit)
            copies = (step.copy.tokens, step.copy.lengths) if copies_first else self._copies_to_merge(copy_len)
            proposal, copied = merge_lookup(proposal, self.seq, self.starts, lengths, copy_len,
                                            agree=0 if copies_first else None, continuations=copies)  # fmt: skip
            self.stats.lookup_rows += int(copied.sum())
        return proposal

    def _verify_and_commit(self, step: _Pass, logits, hidden, drafted):
        """Verifies the proposal against the target's processed scores, commits what is accepted (cut at EOS and the
        length limit), keeps the accepted slots in the target's cache; returns the verified slots as the drafter's
        next inputs, the accepted draft tokens per row, the tokens committed and which rows had finished before."""
        proposal, out, stats = step.proposal, self.committed, self.stats
        lengths = out.lengths
        raw = logits.to(device=self.work, dtype=torch.float32)
        if proposal.is_linear:
            scores = self.processor(raw, self.seq, lengths)
        else:
            scores = _tree_scores(self.processor, raw, self.seq, lengths, proposal)
        result = self.verifier.verify(proposal, scores)
        n = result.num_accepted.to(self.work)
        n_max = int(n.max())
        new_tokens = result.tokens[:, : n_max + 1].to(self.work)
        keep_cols, path_scores, path_raw, path_hidden = _along_path(proposal, result, n_max, scores, raw, hidden)
        finished_before = out.finished  # commit replaces it, never changes it in place
        committed = out.commit(new_tokens, n + 1, path_scores, path_raw)  # 0 for rows already finished
        if self.ngrams is not None:
            self.ngrams.extend(new_tokens, committed)
        stats.log_verifier(result, committed, finished_before)
        stats.accept_log.append(committed)
        stats.draft_log.append(drafted.masked_fill(finished_before, 0))
        start_pos = self.target.next_pos
        # Rows that have finished keep no new slot (their later tokens are never used), in either cache.
        n_live = n.masked_fill(out.finished, -1)
        self.target.keep(n_live, keep_cols, proposal.num_nodes + 1)
        offsets = out.offsets(n_max + 1)
        n_fb = n.masked_fill(finished_before, 0)  # rows that had already finished accepted nothing
        verified = DraftInputs(
            next_token_ids=new_tokens,
            position_ids=start_pos[:, None] + offsets,
            valid=offsets <= n_live[:, None],
            hidden_states=path_hidden,
            logits=path_raw,
            # A plain step (K = 0) verified no proposal of the drafter's, so it has no feedback.
            feedback=None
            if step.k <= 0
            else VerificationFeedback(
                proposal=proposal, num_accepted=n_fb, accepted_nodes=_accepted_nodes(n_fb, n_max, keep_cols),
                step=self.step_index,
            ),
        )  # fmt: skip
        return verified, n, committed, finished_before

    def _feed_back(self, step: _Pass, verified: DraftInputs) -> None:
        """The drafter observes the verified slots now, or, after a plain step of a drafter that observes in
        batches, when it drafts again (at least every ``_MAX_PENDING_SLOTS`` slots, unless the prompt waits too: a
        call that never drafts never runs the drafter)."""
        if step.k <= 0 and self.controller is not None and self.drafter.observe_in_batches:
            self._wait(verified)
            if not self.prompt_waits and self.pending_slots >= _MAX_PENDING_SLOTS:
                self._catch_up()
        else:
            self._catch_up(verified)

    # ---------------------------------------------------------------- the result
    def output(self):
        if self.streamer is not None:
            self.streamer.end()
        stats = self.stats
        stats.finish()
        stats.timings.update(
            plain_steps=self.plain_steps, lookup_rows=stats.lookup_rows, lookup_passes=stats.lookup_passes,
            forced_rows=stats.forced_rows,
            cache_compactions=self.target.compactions, cache_length=int(self.cache.get_seq_length()),
        )  # fmt: skip
        out_seq = self.committed.sequences(self.pad_value).to(self.in_device)
        if not self.ret_dict:
            return out_seq
        accepted_lengths, draft_lengths = stats.per_row()
        return SpeculativeDecoderOnlyOutput(
            sequences=out_seq,
            scores=self.committed.assemble(2) if self.want_scores else None,
            logits=self.committed.assemble(3) if self.want_logits else None,
            # A batched run's cache holds masked slots of rejected tokens, so it is only returned for batch size 1.
            cache=self.cache if not self.use_slot_mask else None,
            accepted_lengths=accepted_lengths,
            draft_lengths=draft_lengths,
            timings=stats.timings,
            num_target_forwards=stats.forwards().to(self.in_device),
            num_draft_tokens=self.options.k_max,
            verifier=self.verifier.name,
            approximate=self.verifier.approximate,
            verifier_stats=stats.verifier_totals(),
        )


@_holding_the_drafter
@torch.no_grad()
def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    drafter=None,
    num_draft_tokens: int | None = None,
    verifier: Any = None,
    verifier_options: dict | None = None,
    draft_options: dict | None = None,
    draft_length: str | None = None,
    lookup_tokens: int | None = None,
    copy_threshold: float | None = None,
    grammar_forced_tokens: bool = True,
    spec_streamer=None,
    spec_timing: bool = False,
    **model_kwargs,
):
    """Speculative decoding with an hf_specdec drafter.

    Normally called by ``generate`` (``assistant_model=drafter`` or ``custom_generate=speculative_generate``), which
    prepares ``input_ids``, the logits processors, stopping criteria and generation config.

    Args:
        model: the target causal LM.
        input_ids: ``(batch, prompt_len)`` left-padded prompts.
        drafter: an hf_specdec drafter (bound to ``model`` here; a mismatched drafter raises before generating).
        num_draft_tokens: draft tokens per step for chains (``num_assistant_tokens`` in ``generate``); defaults to
            the drafter's ``config.num_draft_tokens``.
        verifier: ``None`` (greedy or lossless sampling, following ``do_sample``), a registered verifier name, or a
            :class:`~hf_specdec.verification.Verifier` instance; ``verifier_options`` are passed to its constructor.
        draft_options: tree options (``tree="eagle2"``, ``tree_depth``, ``tree_top_k``, ``tree_total_tokens``, a
            static ``tree`` name or ``tree="static", tree_choices=[...]``) and the drafter family's own options.
            ``generate`` routes these keywords here.
        draft_length: ``"adaptive"`` (default): each pass drafts the length, from 0 (a plain step) to
            ``num_draft_tokens``, that maximises the expected tokens per second measured so far (see
            :mod:`hf_specdec.generation.adaptive`); for trees, one of the tree's sizes or a plain step.
            ``"fixed"``: always ``num_draft_tokens`` (or the whole tree). Also read from
            ``generation_config.draft_length``.
        lookup_tokens: prompt lookup merged into chains (:mod:`hf_specdec.generation.ngram`): a row whose
            drafted chain starts like the continuation of the latest earlier occurrence of its last 2-3 tokens
            drafts that copy instead, up to this many tokens. With the adaptive length, a pass that would be a
            plain step verifies the copies alone where that is measured to pay; with a tree, the copies are verified
            alone, in place of the tree pass, where every row has one and that pays. Default 10; 0 turns it off.
            Also read from ``generation_config.lookup_tokens``.
        copy_threshold: at each draft position of a chain where the drafter's top probability is at most this, a row
            drafts the token that followed the latest earlier occurrence of its last 2-3 tokens (committed and
            drafted) instead, where there is one (:mod:`hf_specdec.generation.ngram`). Default 0.7, or 0 with
            ``lookup_tokens=0`` (no copying from the text unless asked); 0 turns it off, 1 copies wherever there is
            a match. Also read from ``generation_config.copy_threshold``. A tree's sizes that are the drafter's
            chain draft with it; its wider sizes without it.
        grammar_forced_tokens: with a grammar processor (``hf_specdec.GrammarLogitsProcessor``, or xgrammar's own
            HF processor, which the loop drives), a pass first verifies the tokens the grammar forces (where its
            mask allows one token alone, then the forced text's jump-forward tokens) without asking the drafter.
            ``False`` turns that off.
        spec_timing: synchronise the accelerator around the drafter and target calls so that the wall-clock split
            reported in ``timings`` is exact on CUDA (costs a little speed; on CPU the split is always exact).

    Returns:
        ``torch.LongTensor`` of sequences, or a :class:`SpeculativeDecoderOnlyOutput` with
        ``return_dict_in_generate=True``.
    """
    if generation_config is None:
        generation_config = model.generation_config
    _validate(model, drafter, generation_config, input_ids, model_kwargs)
    if synced_gpus:
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP generation) is not supported by hf_specdec yet.")
    options = DecodingOptions.resolve(drafter, generation_config, input_ids.shape[1], num_draft_tokens, verifier,
                                      verifier_options, draft_options, draft_length, lookup_tokens,
                                      grammar_forced_tokens, copy_threshold)  # fmt: skip
    decoder = SpeculativeDecoder(model, drafter, input_ids, options, generation_config, logits_processor,
                                 stopping_criteria, spec_streamer if spec_streamer is not None else streamer,
                                 spec_timing, model_kwargs)  # fmt: skip
    with grouped_query_sdpa(model):  # a CPU target's masked passes attend without copying keys and values
        decoder.prefill()
        while not decoder.done:
            decoder.step()
    return decoder.output()


_MAX_PENDING_SLOTS = 64  # a drafter catches up at least this often during a run of plain steps


def _merge_inputs(items: list[DraftInputs]) -> DraftInputs:
    """Several passes' verified slots as one :class:`DraftInputs` (slots concatenated in order; the feedback is the
    last pass's)."""
    if len(items) == 1:
        return items[0]

    def cat(values):
        return None if values[0] is None else torch.cat(values, dim=1)

    hidden = None
    if items[0].hidden_states is not None:
        hidden = tuple(cat([it.hidden_states[j] for it in items]) for j in range(len(items[0].hidden_states)))
    return DraftInputs(
        next_token_ids=cat([it.next_token_ids for it in items]),
        position_ids=cat([it.position_ids for it in items]),
        valid=cat([it.valid for it in items]),
        hidden_states=hidden,
        logits=cat([it.logits for it in items]),
        feedback=items[-1].feedback,
    )


def _along_path(proposal: Proposal, result, n_max: int, scores, raw, hidden):
    """The pass's columns along the accepted path, ``[last token, accepted nodes]``: the columns to keep in the
    cache (``None`` for chains, already in place), and the scores, raw logits and hidden states there."""
    if proposal.is_linear:
        cut = None if hidden is None else tuple(h if h is None else h[:, : n_max + 1] for h in hidden)
        return None, scores[:, : n_max + 1], raw[:, : n_max + 1], cut
    bsz = raw.shape[0]
    path = result.path.to(raw.device)[:, :n_max] if result.path is not None else raw.new_zeros(bsz, 0, dtype=torch.long)
    keep_cols = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=raw.device), path.clamp_min(-1) + 1], dim=1)
    gathered = None if hidden is None else tuple(h if h is None else _gather_cols(h, keep_cols) for h in hidden)
    return keep_cols, _gather_cols(scores, keep_cols), _gather_cols(raw, keep_cols), gathered


def _accepted_nodes(num_accepted: torch.LongTensor, n_max: int, keep_cols: torch.LongTensor | None):
    """``(batch, n_max)`` node indices of each row's accepted path, ``-1`` padded (feedback to the drafter)."""
    col = torch.arange(n_max, device=num_accepted.device)[None]
    nodes = col.expand(num_accepted.shape[0], -1) if keep_cols is None else keep_cols[:, 1:] - 1
    return torch.where(col < num_accepted[:, None], nodes, torch.full_like(nodes, -1))


def _gather_cols(x: torch.Tensor, cols: torch.LongTensor) -> torch.Tensor:
    """``x[b, cols[b, j]]`` for a ``(batch, T, ...)`` tensor."""
    idx = cols.to(x.device).view(*cols.shape, *([1] * (x.dim() - 2))).expand(*cols.shape, *x.shape[2:])
    return x.gather(1, idx)


def _trim_linear(proposal: Proposal) -> None:
    """Cuts a chain or block whose rows all stop early (``Proposal.lengths``) to its longest row, in place: the target
    pass then runs no node that no row verifies (a scheduler's short lengths shorten the pass)."""
    if not proposal.is_linear or proposal.lengths is None or proposal.num_nodes == 0:
        return
    keep = int(proposal.lengths.max())
    if keep < proposal.num_nodes:
        proposal.tokens = proposal.tokens[:, :keep]
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs[:, :keep]


def _tree_scores(processor: ScoreProcessor, raw, seq, lengths, proposal: Proposal):
    """Processed target scores at every column of a tree pass, each with its own path as the processors' prefix."""
    if processor.is_identity or processor.prefix_free:
        return processor(raw, seq, lengths)
    bsz = raw.shape[0]
    parents, depths, anc_root = tree_structure(proposal, raw.device)
    anc = anc_root[:, 1:, 1:]  # (bsz, N, N)
    n = parents.shape[1]
    d_max = int(depths.max()) if n else 0
    # path_tokens[b, i + 1, d - 1] = token of node i's ancestor at depth d (column 0, the root, has no path).
    slot = torch.where(anc, depths[:, None, :] - 1, torch.full_like(depths[:, None, :], d_max).expand_as(anc))
    buf = torch.zeros(bsz, n, d_max + 1, dtype=torch.long, device=raw.device)
    buf.scatter_(2, slot, proposal.tokens.to(raw.device)[:, None, :].expand(bsz, n, n))
    path_tokens = torch.cat([buf.new_zeros(bsz, 1, d_max + 1), buf], dim=1)[..., :d_max]
    path_len = torch.cat([depths.new_zeros(bsz, 1), depths], dim=1)
    return processor.process_paths(raw, seq, lengths, path_tokens, path_len)
