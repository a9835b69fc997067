"""Grammar-constrained generation with speculation: one grammar state per row, driven by prefix.

Constrained-decoding libraries plug into ``generate`` as logits processors that keep a matcher and advance it on
every call (``xgrammar.contrib.hf.LogitsProcessor`` accepts ``input_ids[:, -1]`` each step and never rolls back).
A speculative pass scores many positions at once, on prefixes that are then partly rejected, so such a processor's
state would be silently wrong. :class:`GrammarLogitsProcessor` keeps a grammar state per row and, on every call,
rolls it back to the longest common prefix of what it has accepted and the prefix it is shown, then advances along
the rest: its mask is a pure function of the prefix, so the loop may call it at any position, for the draft tokens
(the drafter drafts from masked scores) and for the target's verified positions alike.

Backends (each an optional dependency) implement :class:`GrammarState`:

* xgrammar (:class:`XGrammarState`): ``GrammarMatcher.accept_token`` / ``rollback`` / ``fill_next_token_bitmask``;
* outlines-core (:class:`OutlinesCoreState`): ``Guide(index, max_rollback=...)`` with ``advance`` /
  ``rollback_state`` / ``write_mask_into``;
* llguidance (:class:`LLGuidanceState`): ``LLMatcher.consume_token`` / ``validate_tokens`` / ``rollback`` and
  ``llguidance.torch.fill_next_token_bitmask``.

A user's own ``xgrammar.contrib.hf.LogitsProcessor``, or outlines' ``XGrammarLogitsProcessor``,
``OutlinesCoreLogitsProcessor`` or ``LLGuidanceLogitsProcessor``, is recognised (:func:`speculation_safe_processor`):
the loop takes its grammar and drives fresh states of its own, at the processor's place in the chain, and the user's
processor object is left untouched.

Forced tokens are free drafts: where the grammar allows exactly one continuation (JSON keys and punctuation, fixed
literals), :meth:`GrammarLogitsProcessor.forced_continuations` gives it (the tokens its mask allows one at a time,
then xgrammar's jump-forward tokens: the forced text in one tokenization of the several a BPE vocabulary may allow),
and the loop verifies it before asking the drafter, as point masses (lossless, greedy or sampled; a token the mask
allows alone is always accepted, a jump-forward token when the target picks that tokenization).

Masks follow the processor they replace exactly, so greedy output equals plain constrained ``generate``: the first
call of a row is its prompt (no token accepted); a prefix the grammar rejects is never committed (the target gives
it probability zero) and its scores are left as they are; after the grammar has terminated (it accepted a stop
token) the mask stays the one before that token, as xgrammar's processor leaves its bitmask.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import LogitsProcessor

__all__ = [
    "GrammarState",
    "GrammarLogitsProcessor",
    "XGrammarState",
    "OutlinesCoreState",
    "LLGuidanceState",
    "speculation_safe_processor",
    "xgrammar_compiler",
    "unpack_bitmask",
]


class GrammarState(Protocol):
    """One row's grammar state: what the constrained-decoding backend must offer."""

    def allowed(self) -> torch.Tensor:
        """``(vocab,)`` bool: the tokens the grammar allows next (does not change the state)."""

    def advance(self, token: int) -> bool:
        """Accepts ``token``; ``False`` (state unchanged) when the grammar rejects it."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its stop token."""


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An int32 bitmask (32 tokens per word, bit ``i % 32`` of word ``i // 32`` set when token ``i`` is allowed) as a
    ``(vocab_size,)`` bool tensor."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.to(torch.int32)[:, None] >> shifts) & 1
    return bits.reshape(-1)[:vocab_size].bool()


class XGrammarState:
    """A row's state as an ``xgrammar.GrammarMatcher`` over ``compiled_grammar`` (rollback is unlimited)."""

    def __init__(self, compiled_grammar):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled_grammar)
        self.vocab_size = compiled_grammar.tokenizer_info.vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)

    def allowed(self) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        return unpack_bitmask(self._bitmask[0], self.vocab_size)

    def advance(self, token: int) -> bool:
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def jump_forward_tokens(self) -> list[int]:
        """The text the grammar forces from here, in xgrammar's tokenization of it (one of those the mask allows)."""
        return [int(t) for t in self.matcher.find_jump_forward_tokens()]

    def jump_forward_string(self) -> str:
        """The text the grammar forces from here."""
        return self.matcher.find_jump_forward_string()


class OutlinesCoreState:
    """A row's state as an ``outlines_core.Guide`` over ``index`` (``max_rollback`` accepted tokens can be undone;
    the default covers any generation). ``vocab_size``: the length of the mask (default: one past the largest id
    the index knows). outlines-core's guide never consumes the end of sequence: its mask allows it where the regex
    may end (``Guide.is_finished``) and the guide has no transition for it, and accepting it here terminates the
    state, as outlines' own processor leaves its guide at the end."""

    def __init__(self, index, vocab_size: int | None = None, max_rollback: int = 1 << 20):
        import outlines_core

        self.guide = outlines_core.Guide(index, max_rollback=max_rollback)
        self.vocab_size = int(vocab_size) if vocab_size is not None else outlines_core_vocab_size(index)
        self._ended = False

    def allowed(self) -> torch.Tensor:
        words = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        self.guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        return unpack_bitmask(words, self.vocab_size)

    def advance(self, token: int) -> bool:
        token = int(token)
        if self._ended or not 0 <= token < self.vocab_size:
            return False
        if self.guide.accepts_tokens([token]):
            self.guide.advance(token, return_tokens=False)
            return True
        # the end of sequence: allowed by the mask where the regex may end, with no transition in the guide
        self._ended = bool(self.guide.is_finished()) and bool(self.allowed()[token])
        return self._ended

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended, num_tokens = False, num_tokens - 1
        if num_tokens:
            self.guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        return self._ended


def outlines_core_vocab_size(index) -> int:
    """One past the largest token id in an ``outlines_core.Index``'s transitions (its end-of-sequence id included):
    a mask that long allows every token the index may allow."""
    return 1 + max(token for moves in index.get_transitions().values() for token in moves)


class LLGuidanceState:
    """A row's state as an ``llguidance.LLMatcher`` for ``grammar`` (an llguidance grammar, e.g.
    ``LLMatcher.grammar_from_json_schema(...)``) over ``tokenizer`` (an ``llguidance.LLTokenizer``, e.g.
    ``llguidance.hf.from_tokenizer(hf_tokenizer)``). Tokens are validated before they are consumed (a rejected
    token would put the matcher in its error state). The matcher stops by itself where the grammar cannot go on and
    then allows only the end of sequence; accepting that token here terminates the state."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise ValueError(f"llguidance rejected the grammar: {self.matcher.get_error()}")
        self.vocab_size = int(vocab_size)
        self.eos_token_id = int(tokenizer.eos_token)
        self._ended = False  # the end of sequence was accepted
        self._ended_outside = False  # ... after the matcher had stopped (so it is not in the matcher's history)

    def allowed(self) -> torch.Tensor:
        import llguidance.torch

        words = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, words, 0)
        return unpack_bitmask(words[0], self.vocab_size)

    def advance(self, token: int) -> bool:
        token = int(token)
        if self._ended:
            return False
        if self.matcher.is_stopped():
            self._ended = self._ended_outside = bool(self.allowed()[token])
            return self._ended
        if self.matcher.validate_tokens([token]) != 1 or not self.matcher.consume_token(token):
            return False
        self._ended = token == self.eos_token_id
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            if self._ended_outside:
                num_tokens -= 1
            self._ended = self._ended_outside = False
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._ended

    def jump_forward_tokens(self) -> list[int]:
        return [int(t) for t in self.matcher.compute_ff_tokens()]


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks the tokens a grammar forbids, one grammar state per row, as a pure function of the prefix.

    Args:
        states: one :class:`GrammarState` per row, or one factory (``() -> GrammarState``) called per row at the
            first call (the prompt, whose length marks where each row's generated tokens start).
        tokenizer: the target's tokenizer, optional: text the grammar forces is then drafted in the tokenizer's own
            encoding of it (the spelling the target learned, e.g. SmolLM2's ``'ĊĠ' 'Ġ"'`` for a newline, indent
            and quote, where xgrammar's longest-match spelling is ``'ĊĠĠ' '"'``), else in the backend's.

    The processor can be passed to plain ``generate`` and to speculative ``generate`` alike; like the processors it
    replaces it serves one ``generate`` call.
    """

    hf_specdec_stateless = True  # every call rolls back to the common prefix: its output depends on input_ids only

    def __init__(self, states: Sequence[GrammarState] | Callable[[], GrammarState], tokenizer=None):
        self.tokenizer = tokenizer
        self._factory = states if callable(states) else None
        self.states: list[GrammarState] = [] if callable(states) else list(states)
        self._accepted: list[list[int]] = []
        self._prompt_len: int | None = None

    def _start(self, input_ids: torch.LongTensor) -> None:
        bsz = input_ids.shape[0]
        if self._factory is not None:
            self.states = [self._factory() for _ in range(bsz)]
        if len(self.states) != bsz:
            raise ValueError(f"GrammarLogitsProcessor has {len(self.states)} grammar states for a batch of {bsz} rows.")
        self._accepted = [[] for _ in range(bsz)]
        self._prompt_len = input_ids.shape[1]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prompt_len is None:
            self._start(input_ids)
        generated = input_ids[:, self._prompt_len :].tolist()
        out = scores.clone()
        for b, tokens in enumerate(generated):
            allowed = self._allowed_after(b, tokens)
            if allowed is not None:
                width = min(allowed.numel(), out.shape[-1])
                row = out[b]
                row[:width].masked_fill_(~allowed[:width].to(row.device), float("-inf"))
                row[width:] = float("-inf")  # ids past the grammar's vocabulary (padding rows of the LM head)
        return out

    def _allowed_after(self, b: int, tokens: list[int]) -> torch.Tensor | None:
        """Row ``b``'s mask after ``tokens``; ``None`` when the grammar rejects them (a prefix that is never
        committed: its scores stay as they are)."""
        if not self._sync(b, tokens):
            return None
        state, accepted = self.states[b], self._accepted[b]
        if accepted and state.is_terminated():
            # as the processors it replaces: after the stop token the mask stays the one before it
            last = accepted[-1]
            state.rollback(1)
            allowed = state.allowed()
            state.advance(last)
            return allowed
        return state.allowed()

    def _sync(self, b: int, tokens: list[int]) -> bool:
        """Brings row ``b``'s state to ``tokens``: rolls back to the common prefix with what it has accepted, then
        advances along the rest; ``False`` when the grammar rejects one of them."""
        state, accepted = self.states[b], self._accepted[b]
        common = 0
        for x, y in zip(accepted, tokens):
            if x != y:
                break
            common += 1
        state.rollback(len(accepted) - common)
        del accepted[common:]
        for token in tokens[common:]:
            if state.is_terminated() or not state.advance(token):  # nothing follows the stop token
                return False
            accepted.append(token)
        return True

    def forced_continuations(self, seq: torch.LongTensor, lengths: torch.LongTensor, limit: int) -> list[list[int]]:
        """Per row, at most ``limit`` tokens the grammar forces after ``seq[b, :lengths[b]]`` (the row's prompt and
        committed tokens): as long as its mask allows exactly one token, that token (always accepted: the target
        gives every other token probability zero); then, where the backend has it, the rest of the text the grammar
        forces in its own tokenization (xgrammar's jump-forward tokens: a BPE vocabulary can spell a forced key in
        several ways, and the target usually picks that one). Drafts that need no drafter. Empty for a row before
        the first call, a terminated row, or one where the grammar leaves a choice."""
        if self._prompt_len is None or limit <= 0:
            return [[] for _ in range(seq.shape[0])]
        return [
            self._forced(b, seq[b, self._prompt_len : end].tolist(), limit) for b, end in enumerate(lengths.tolist())
        ]

    def valid_prefix_lengths(self, seq: torch.LongTensor, lengths: torch.LongTensor, proposal: torch.LongTensor,
                             counts: torch.LongTensor) -> torch.LongTensor:  # fmt: skip
        """Per row, how many leading tokens of ``proposal[b, :counts[b]]`` the grammar accepts after
        ``seq[b, :lengths[b]]``: a draft cut there loses nothing (the target gives the first rejected token
        probability zero) and its pass verifies fewer tokens."""
        out = torch.zeros_like(counts)
        if self._prompt_len is None:
            return counts.clone()
        for b, (end, n) in enumerate(zip(lengths.tolist(), counts.tolist())):
            if n == 0 or not self._sync(b, seq[b, self._prompt_len : end].tolist()):
                continue
            state, valid = self.states[b], 0
            for token in proposal[b, :n].tolist():
                if state.is_terminated() or not state.advance(token):
                    break
                valid += 1
            state.rollback(valid)
            out[b] = valid
        return out

    def _forced(self, b: int, tokens: list[int], limit: int) -> list[int]:
        if not self._sync(b, tokens):
            return []
        state, forced = self.states[b], []
        while len(forced) < limit and not state.is_terminated():
            allowed = state.allowed().nonzero()
            if allowed.numel() != 1 or not state.advance(int(allowed[0])):
                break
            forced.append(int(allowed[0]))
        if len(forced) < limit and not state.is_terminated():
            for token in self._jump_forward(state)[: limit - len(forced)]:
                if not state.advance(token):
                    break
                forced.append(token)
        state.rollback(len(forced))
        return forced

    def _jump_forward(self, state) -> list[int]:
        """The text ``state``'s grammar forces next, as tokens: the tokenizer's encoding of it when the processor
        has a tokenizer and the backend gives the text, else the backend's own tokens (none without either)."""
        text = getattr(state, "jump_forward_string", None)
        if self.tokenizer is not None and text is not None:
            return self.tokenizer.encode(text(), add_special_tokens=False)
        tokens = getattr(state, "jump_forward_tokens", None)
        return tokens() if tokens is not None else []

    @classmethod
    def from_json_schema(cls, schema, tokenizer, vocab_size: int | None = None, **options) -> GrammarLogitsProcessor:
        """Output that is a JSON value of ``schema`` (a dict or its JSON text), through xgrammar; ``vocab_size``:
        the model's (its LM head may have more rows than the tokenizer has tokens); ``options``: xgrammar's
        ``compile_json_schema`` options (``any_whitespace=False, indent=2`` fixes the layout, whose newlines,
        indentation and keys are then forced tokens: free drafts)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        compiled = xgrammar_compiler(tokenizer, vocab_size).compile_json_schema(text, **options)
        return cls.from_xgrammar(compiled, tokenizer)

    @classmethod
    def from_regex(cls, pattern: str, tokenizer, vocab_size: int | None = None) -> GrammarLogitsProcessor:
        """Output that matches the regular expression ``pattern``, through xgrammar."""
        return cls.from_xgrammar(xgrammar_compiler(tokenizer, vocab_size).compile_regex(pattern), tokenizer)

    @classmethod
    def from_ebnf(cls, grammar: str, tokenizer, vocab_size: int | None = None) -> GrammarLogitsProcessor:
        """Output of the EBNF ``grammar`` (xgrammar's GBNF dialect, rule ``root``), through xgrammar."""
        return cls.from_xgrammar(xgrammar_compiler(tokenizer, vocab_size).compile_grammar(grammar), tokenizer)

    @classmethod
    def from_xgrammar(cls, compiled_grammars, tokenizer=None) -> GrammarLogitsProcessor:
        """One xgrammar matcher per row over ``compiled_grammars`` (one ``xgrammar.CompiledGrammar`` for every row,
        or a list with one per row); ``tokenizer``: the target's, for the spelling of forced text (see the class)."""
        grammars = compiled_grammars if isinstance(compiled_grammars, (list, tuple)) else [compiled_grammars]
        if len(grammars) == 1:
            return cls(lambda: XGrammarState(grammars[0]), tokenizer)
        return cls([XGrammarState(g) for g in grammars], tokenizer)


def xgrammar_compiler(tokenizer, vocab_size: int | None):
    """An ``xgrammar.GrammarCompiler`` for ``tokenizer`` (``vocab_size``: the model's, when its LM head has more
    rows than the tokenizer has tokens)."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError("Grammars need xgrammar: pip install 'hf_specdec[grammar]'.") from e
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info)


def _xgrammar_hf_processor(proc) -> GrammarLogitsProcessor | None:
    """``xgrammar.contrib.hf.LogitsProcessor``: its compiled grammar(s), one per row or one for all."""
    if proc.matchers:
        raise ValueError(
            "This xgrammar.contrib.hf.LogitsProcessor was already used by an earlier generate call (its matchers have "
            "advanced); xgrammar's processor serves one call: create a new one for each generate call."
        )
    return GrammarLogitsProcessor.from_xgrammar(proc.compiled_grammars)


def _outlines_processor(proc) -> GrammarLogitsProcessor:
    """outlines' processors (``outlines.backends``: xgrammar, outlines-core and llguidance): the grammar it holds,
    driven by states of the same backend."""
    if not proc.is_first_token:
        raise ValueError(
            f"This outlines {type(proc).__name__} was already used by an earlier generate call (its matchers have "
            "advanced): call its reset() or create a new one for each generate call."
        )
    if hasattr(proc, "compiled_grammar"):  # XGrammarLogitsProcessor
        return GrammarLogitsProcessor.from_xgrammar(proc.compiled_grammar)
    if hasattr(proc, "index"):  # OutlinesCoreLogitsProcessor
        vocab_size = outlines_core_vocab_size(proc.index)
        return GrammarLogitsProcessor(lambda: OutlinesCoreState(proc.index, vocab_size))
    lltok = proc.llg_tokenizer  # LLGuidanceLogitsProcessor
    return GrammarLogitsProcessor(lambda: LLGuidanceState(lltok, proc.grammar, lltok.vocab_size))


# the grammar processors the loop can drive, by (module prefix, class name)
_DRIVERS: dict[tuple[str, str], Callable[[object], LogitsProcessor]] = {
    ("xgrammar.", "LogitsProcessor"): _xgrammar_hf_processor,
    ("outlines.backends.", "XGrammarLogitsProcessor"): _outlines_processor,
    ("outlines.backends.", "OutlinesCoreLogitsProcessor"): _outlines_processor,
    ("outlines.backends.", "LLGuidanceLogitsProcessor"): _outlines_processor,
}


def speculation_safe_processor(proc) -> LogitsProcessor:
    """``proc`` itself, or, for a grammar processor whose state the loop can drive (``xgrammar.contrib.hf.
    LogitsProcessor``, outlines' ``XGrammarLogitsProcessor``, ``OutlinesCoreLogitsProcessor`` and
    ``LLGuidanceLogitsProcessor``), a :class:`GrammarLogitsProcessor` over the same grammar(s) with fresh states
    (``proc`` is not touched)."""
    cls = type(proc)
    for (module, name), driver in _DRIVERS.items():
        if cls.__name__ == name and cls.__module__.startswith(module):
            return driver(proc)
    return proc
