"""The speculative decoding loop: one function, generic over drafters (proposal kinds) and verifiers.

Reached from ``target.generate(..., assistant_model=drafter)`` (see :mod:`hf_specdec.generation.hook`) or from
``target.generate(..., custom_generate=hf_specdec.speculative_generate, drafter=drafter)``.

Batching: rows accept different numbers of tokens per step. Rather than per-row cache surgery, every token fed to
the target keeps a slot in its KV cache; slots of rejected draft tokens are masked out with zeros in the 2-D attention
mask, positions are passed explicitly so they skip those slots, and trailing slots rejected by every row are cropped.
With batch size 1 the cache is simply cropped, so no slot is ever wasted.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from ..verification import get_verifier
from .logits import ScoreProcessor
from .outputs import SpeculativeDecoderOnlyOutput
from .proposals import DraftInputs, Proposal

__all__ = ["speculative_generate"]

_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "past_key_values"}


class _DraftSelector:
    """Token selection for drafters: same logits processors and decoding mode as the verifier."""

    def __init__(
        self, processor: ScoreProcessor, seq: torch.Tensor, lengths: torch.Tensor, do_sample: bool, gen, vocab_size
    ):
        self.processor = processor
        self.vocab_size = vocab_size
        self.seq = seq
        self.lengths = lengths  # committed length (prompt + generated) per row
        self.do_sample = do_sample
        self.generator = gen

    def __call__(self, logits: torch.Tensor, depth: int, vocab_ids: torch.LongTensor | None = None):
        logits = logits.to(self.seq.device, torch.float32)
        if vocab_ids is not None:
            vocab_ids = vocab_ids.to(self.seq.device)
            if self.processor.is_identity and not self.do_sample:
                # Greedy without processors: the argmax over the draft vocabulary is the argmax over the target
                # vocabulary with -inf outside it, without building the full-vocabulary tensor.
                return vocab_ids[logits.argmax(dim=-1)], None
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, vocab_ids] = logits
            logits = full
        if self.processor.is_identity:
            scores = logits
        else:
            scores = self.processor(logits[:, None], self.seq, self.lengths + depth)[:, 0]
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        else:
            probs, tokens = None, scores.argmax(dim=-1)
        if not self.processor.is_identity:
            # Later draft positions see this token in their processors' prefix.
            rows = torch.arange(tokens.shape[0], device=self.seq.device)
            self.seq[rows, self.lengths + depth] = tokens
        return tokens, probs


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


def _validate(model, drafter, generation_config, model_kwargs) -> None:
    from ..modeling_utils import DrafterPreTrainedModel  # deferred: modeling_utils imports this package

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
        num_draft_tokens: draft tokens per step (``num_assistant_tokens`` in ``generate``); defaults to the
            drafter's ``config.num_draft_tokens``.
        verifier: ``None`` (greedy or lossless sampling, following ``do_sample``), a registered verifier name, or a
            :class:`~hf_specdec.verification.Verifier` instance; ``verifier_options`` are passed to its constructor.
        spec_timing: synchronise the accelerator around the drafter and target calls so that the wall-clock split
            reported in ``timings`` is exact on CUDA (costs a little speed; on CPU the split is always exact).

    Returns:
        ``torch.LongTensor`` of sequences, or a :class:`SpeculativeDecoderOnlyOutput` with
        ``return_dict_in_generate=True``.
    """
    if generation_config is None:
        generation_config = model.generation_config
    streamer = spec_streamer if spec_streamer is not None else streamer
    _validate(model, drafter, generation_config, model_kwargs)
    if synced_gpus:
        raise ValueError("synced_gpus (DeepSpeed ZeRO-3 / FSDP generation) is not supported by hf_specdec yet.")

    drafter.bind_target(model)
    k_max = int(num_draft_tokens if num_draft_tokens is not None else drafter.config.num_draft_tokens)
    if k_max < 1:
        raise ValueError(f"num_draft_tokens / num_assistant_tokens must be >= 1, got {k_max}.")

    do_sample = bool(generation_config.do_sample)
    verifier_options = dict(verifier_options or {})
    if verifier is None:
        verifier = getattr(generation_config, "verifier", None)
    if verifier == "asd":
        # Frozen ASD settings may live in the generation config (asd_budget, asd_gate, ...); call options win.
        from ..verification import ASD_OPTION_NAMES

        for key, arg in ASD_OPTION_NAMES.items():
            value = getattr(generation_config, key, None)
            if value is not None:
                verifier_options.setdefault(arg, value)
    ver = get_verifier(verifier, do_sample, **verifier_options)

    bsz, prompt_len = input_ids.shape
    work = drafter.device  # = device of the target's LM head
    in_device = input_ids.device
    input_ids = input_ids.to(work)
    gen = None  # global RNG, like plain generate
    ver.start(bsz, work, do_sample, gen)

    max_length = generation_config.max_length
    max_new = max_length - prompt_len
    if max_new < 1:
        raise ValueError(f"max_length={max_length} leaves no room for new tokens after a {prompt_len}-token prompt.")
    processor = ScoreProcessor(logits_processor, bsz)
    eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria)
    if eos_ids is not None:
        eos_ids = eos_ids.to(work)
    pad_id = generation_config._pad_token_tensor
    pad_value = int(pad_id) if pad_id is not None else (int(eos_ids[0]) if eos_ids is not None else 0)

    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones(bsz, prompt_len, dtype=torch.long, device=work)
    attention_mask = attention_mask.to(work).long()
    position_ids = model_kwargs.get("position_ids")
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    position_ids = position_ids.to(work)
    # Rows may develop holes (rejected slots) only when several rows share a cache.
    use_slot_mask = bsz > 1 or bool((attention_mask == 0).any())

    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        cache = DynamicCache(config=model.config)
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False):
            if use_slot_mask and max_length + k_max > getattr(layer, "sliding_window", max_length + k_max + 1):
                raise ValueError(
                    f"This target uses sliding-window attention (window {layer.sliding_window}); with batch size "
                    "> 1 or padding, hf_specdec keeps rejected slots in the cache, which would shift the window. "
                    f"Use batch size 1 without padding, or max_length <= {layer.sliding_window - k_max}."
                )
            layer.activate_past_recording()

    need_hidden = drafter.requires_target_hidden_states
    ret_dict = generation_config.return_dict_in_generate
    want_scores = ret_dict and generation_config.output_scores
    want_logits = ret_dict and generation_config.output_logits
    score_log: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    # Row buffer: [left-padded prompt | committed tokens | scratch for draft tokens].
    seq = torch.full((bsz, max_length + k_max + 1), pad_value, dtype=torch.long, device=work)
    seq[:, :prompt_len] = input_ids
    n_gen = torch.zeros(bsz, dtype=torch.long, device=work)
    finished = torch.zeros(bsz, dtype=torch.bool, device=work)
    rows = torch.arange(bsz, device=work)
    steps = torch.arange(k_max + 1, device=work)[None]  # column offsets, sliced to the width in use
    forwards = torch.zeros(bsz, dtype=torch.long, device=work)
    accept_log: list[torch.Tensor] = []
    stats_log: dict[str, list[torch.Tensor]] = {}

    if streamer is not None:
        if bsz > 1:
            raise ValueError(f"Streamers support batch size 1 (as in transformers); got a batch of {bsz}.")
        streamer.put(input_ids.cpu())

    sync = spec_timing and work.type != "cpu"
    timings = {"draft_s": 0.0, "target_s": 0.0, "verify_s": 0.0}
    draft_log: list[int] = []

    def clock() -> float:
        if sync:
            synchronize(work)
        return time.perf_counter()

    t_start = clock()

    def target_forward(ids, mask, pos, keep_all: bool):
        kwargs = {"use_cache": True, "output_hidden_states": need_hidden, "return_dict": True}
        if not keep_all and _supports_logits_to_keep(model):
            kwargs["logits_to_keep"] = 1
        out = model(
            input_ids=ids.to(in_device),
            attention_mask=None if mask is None else mask.to(in_device),
            position_ids=pos.to(in_device),
            cache=cache,
            **kwargs,
        )
        hidden = out.hidden_states if need_hidden else None
        if need_hidden and hidden is None:
            raise ValueError(
                f"{type(model).__name__} did not return hidden states with output_hidden_states=True, but "
                f"{type(drafter).__name__} reads target features. Use a target that supports output_hidden_states."
            )
        return out.logits, hidden

    def commit(new_tokens: torch.Tensor, count: torch.Tensor, scores, raw) -> torch.Tensor:
        """Appends up to ``count`` tokens per unfinished row; applies EOS, length and custom stop criteria."""
        nonlocal finished, n_gen
        width = new_tokens.shape[1]
        count = torch.minimum(count.masked_fill(finished, 0), max_new - n_gen)
        col = steps[:, :width]
        if eos_ids is not None:
            is_eos = (new_tokens[..., None] == eos_ids).any(-1) & (col < count[:, None])
            stop = is_eos.any(dim=1)
            count = torch.where(stop, is_eos.long().argmax(dim=1) + 1, count)
        else:
            stop = torch.zeros_like(finished)
        # Scatter without a data-dependent shape: rows keep their old values beyond `count`.
        pos = (prompt_len + n_gen)[:, None] + col
        seq.scatter_(1, pos, torch.where(col < count[:, None], new_tokens, seq.gather(1, pos)))
        if other_criteria:
            counts = count.tolist()
            for b in range(bsz):
                for j in range(counts[b]):
                    prefix = seq[b : b + 1, : prompt_len + int(n_gen[b]) + j + 1]
                    hit = any(bool(c(prefix, None).any()) for c in other_criteria)
                    if hit:
                        count[b] = j + 1
                        stop[b] = True
                        break
        if want_scores or want_logits:
            score_log.append((n_gen.clone(), count.clone(), scores, raw))
        if streamer is not None:
            streamer.put(new_tokens[0, : int(count[0])].cpu())
        n_gen = n_gen + count
        finished = finished | stop | (n_gen >= max_new)
        return count

    # ---------------------------------------------------------------- prefill: one target pass over the prompt
    prefill_mask = attention_mask if use_slot_mask else None
    t0 = clock()
    logits, hidden = target_forward(input_ids, prefill_mask, position_ids, keep_all=False)
    t1 = clock()
    timings["prefill_s"] = t1 - t0
    forwards += 1
    raw0 = logits[:, -1].to(device=work, dtype=torch.float32)
    scores0 = processor(raw0[:, None], seq, torch.full_like(n_gen, prompt_len))[:, 0]
    if do_sample:
        first = torch.multinomial(torch.softmax(scores0, dim=-1), 1, generator=gen).squeeze(-1)
    else:
        first = scores0.argmax(dim=-1)
    commit(first[:, None], torch.ones_like(n_gen), scores0[:, None], raw0[:, None])
    last_token = first
    next_pos = position_ids[:, -1] + 1
    slot_mask = attention_mask if use_slot_mask else None

    t0 = clock()
    state = drafter.init_draft_state(bsz, max_length + k_max + 1)
    drafter.observe(
        state,
        DraftInputs(
            next_token_ids=torch.cat([input_ids[:, 1:], first[:, None]], dim=1),
            position_ids=position_ids,
            valid=attention_mask.bool(),
            hidden_states=hidden,
        ),
    )
    del hidden, logits
    timings["draft_s"] += clock() - t0
    selector = _DraftSelector(processor, seq, prompt_len + n_gen, do_sample, gen, raw0.shape[-1])

    # ---------------------------------------------------------------- decoding steps
    done = bool(finished.all())
    while not done:
        active = ~finished
        remaining = int((max_new - n_gen).masked_fill(finished, 0).max())
        k = min(k_max, remaining - 1)
        lengths = prompt_len + n_gen
        t0 = clock()
        if k > 0:
            selector.lengths = lengths
            proposal = drafter.propose(state, k, selector)
            if proposal.kind == "tree":
                raise NotImplementedError("Tree proposals are not supported by this release of the loop.")
            draft = proposal.tokens.to(work)
            seq.scatter_(1, lengths[:, None] + steps[:, :k], draft)
        else:
            draft = seq.new_empty(bsz, 0)
            proposal = Proposal(tokens=draft)
        draft_log.append(k)
        t1 = clock()
        timings["draft_s"] += t1 - t0
        feed = torch.cat([last_token[:, None], draft], dim=1)  # (bsz, k + 1)
        offsets = steps[:, : k + 1]
        pos = next_pos[:, None] + offsets
        if slot_mask is not None:
            slot_mask = torch.cat([slot_mask, slot_mask.new_ones(bsz, k + 1)], dim=1)
        logits, hidden = target_forward(feed, slot_mask, pos, keep_all=True)
        t2 = clock()
        timings["target_s"] += t2 - t1
        forwards += active.long()
        raw = logits.to(device=work, dtype=torch.float32)
        scores = processor(raw, seq, lengths)
        result = ver.verify(proposal, scores)
        n = result.num_accepted.to(work)
        for key, value in result.stats.items():
            stats_log.setdefault(key, []).append(value.to(work).masked_fill(finished, 0))
        n_max = int(n.max())
        new_tokens = result.tokens[:, : n_max + 1].to(work)
        accept_log.append(commit(new_tokens, n + 1, scores, raw))  # 0 for rows already finished

        # Target cache: keep slots of [last_token, accepted drafts]; drop the rest.
        if slot_mask is not None:
            base = slot_mask.shape[1] - (k + 1)
            slot_mask[:, base:] = (offsets <= n[:, None]).to(slot_mask.dtype)
            slot_mask = slot_mask[:, : base + n_max + 1]
        if k > n_max:
            cache.crop(n_max - k)
        t3 = clock()
        timings["verify_s"] += t3 - t2

        done = bool(finished.all())
        if done:
            break
        width = n_max + 1
        drafter.observe(
            state,
            DraftInputs(
                next_token_ids=new_tokens,
                position_ids=pos[:, :width],
                valid=offsets[:, :width] <= n[:, None],
                hidden_states=None if hidden is None else tuple(h[:, :width] for h in hidden),
                logits=raw[:, :width],
            ),
        )
        last_token = new_tokens[rows, n]
        next_pos = next_pos + n + 1
        del hidden, logits
        timings["draft_s"] += clock() - t3

    if streamer is not None:
        streamer.end()
    timings["total_s"] = clock() - t_start
    timings["draft_steps"] = sum(draft_log)  # draft tokens proposed, over all passes (batch-level)
    timings["passes"] = len(draft_log)

    total = int(n_gen.max())
    col = torch.arange(total, device=work)[None]
    out_seq = seq[:, : prompt_len + total].clone()
    out_seq[:, prompt_len:] = torch.where(col < n_gen[:, None], out_seq[:, prompt_len:], pad_value)
    out_seq = out_seq.to(in_device)
    if not ret_dict:
        return out_seq

    def assemble(index: int):
        if not score_log:
            return None
        vocab = score_log[0][index].shape[-1]
        buf = torch.zeros(total, bsz, vocab, dtype=torch.float32, device=work)
        for start, cnt, sc, rw in score_log:
            src = sc if index == 2 else rw
            for b in range(bsz):
                c = int(cnt[b])
                if c:
                    s0 = int(start[b])
                    buf[s0 : s0 + c, b] = src[b, :c]
        return tuple(buf.unbind(0))

    acc = torch.stack(accept_log, dim=1) if accept_log else torch.zeros(bsz, 0, dtype=torch.long, device=work)
    # Drop the passes after a row finished.
    accepted_lengths = [[x for x in row if x > 0] for row in acc.tolist()]
    draft_lengths = [[k for x, k in zip(row, draft_log) if x > 0] for row in acc.tolist()]
    stats = {key: torch.stack(vals, 1).sum(1) for key, vals in stats_log.items()} or None
    return SpeculativeDecoderOnlyOutput(
        sequences=out_seq,
        scores=assemble(2) if want_scores else None,
        logits=assemble(3) if want_logits else None,
        # A batched run's cache holds masked slots of rejected tokens, so it is only returned for batch size 1.
        cache=cache if not use_slot_mask else None,
        accepted_lengths=accepted_lengths,
        draft_lengths=draft_lengths,
        timings=timings,
        num_target_forwards=forwards.to(in_device),
        num_draft_tokens=k_max,
        verifier=ver.name,
        approximate=ver.approximate,
        verifier_stats=stats,
    )
