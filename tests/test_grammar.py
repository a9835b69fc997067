"""Grammar-constrained generation with speculation (``hf_specdec.generation.grammar``).

The user's own ``xgrammar.contrib.hf.LogitsProcessor`` with ``assistant_model=`` added returns exactly what plain
constrained ``generate`` returns (greedy, fp32, batch 1 and a ragged batch), every output is accepted by the grammar,
the user's processor object is left untouched, and sampling keeps the constrained target's law (with a control that
skips the rollback and must fail). Tokenizer infos are built from the test vocabularies: no download.
"""

from __future__ import annotations

import json
import string

import pytest
import torch
import xgrammar as xgr
from helpers import EOS, VOCAB, make_oracle, make_target, ragged_batch
from transformers.generation.logits_process import LogitsProcessorList

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.generation.grammar import (
    GrammarLogitsProcessor,
    LLGuidanceState,
    OutlinesCoreState,
    XGrammarState,
    unpack_bitmask,
)

# ids 0..5 are the tiny targets' specials (PAD 0, EOS 5); then JSON's characters, letters, digits and a few words
JSON_VOCAB = ["<pad>", "<s>", "<unk>", "<x>", "<y>", "<eos>"] + list('{}[]:,"') + [" ", "\n"]
JSON_VOCAB += list(string.digits) + list(string.ascii_lowercase)
JSON_VOCAB += ['"name"', '"n"', '": ', ", ", "true", "false", "null", "ab", "cd", '"}', '{"', "12"]
JSON_VOCAB += [f"w{i}" for i in range(VOCAB - len(JSON_VOCAB))]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def compiled_schema(vocab=JSON_VOCAB, stop=(EOS,)):
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=list(stop))
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)


def user_processor():
    """What a user passes today: xgrammar's own HF processor (a new one per generate call)."""
    return xgr.contrib.hf.LogitsProcessor(compiled_schema())


def accepted_by_grammar(tokens: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(compiled_schema())
    return all(matcher.accept_token(t) for t in tokens if not matcher.is_terminated())


def generated(out, ids):
    """Each row's generated tokens, up to and with its EOS (the padding after it dropped)."""
    rows = out[:, ids.shape[1] :].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("drafter_kind", ["eagle3", "oracle"])
def test_xgrammar_processor_with_a_drafter_returns_plain_constrained_output(batch, drafter_kind):
    target = make_target("llama", seed=3, sharpen=4.0)
    ids, mask = ragged_batch(batch, length=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, logits_processor=[user_processor()], **kwargs)
    if drafter_kind == "oracle":  # drafts the constrained continuation, a third of it corrupted: accepts and rejects
        drafter = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3)
    else:  # an untrained EAGLE-3 head: it drafts from grammar-masked scores
        torch.manual_seed(0)
        drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    proc = user_processor()
    out = target.generate(ids, logits_processor=[proc], assistant_model=drafter, return_dict_in_generate=True,
                          **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert proc.matchers == []  # the user's processor was not consumed: the loop drove matchers of its own
    rows = generated(ref, ids)
    assert all(accepted_by_grammar(row) for row in rows)
    assert any(len(row) > 3 for row in rows)
    if drafter_kind == "oracle":
        assert max(max(r) for r in out.accepted_lengths) > 1  # some drafts were accepted under the grammar


def test_the_grammar_output_parses_when_the_target_finishes():
    """With a target nudged towards the schema's tokens, the greedy output ends with EOS and is valid JSON of the
    schema, with and without a drafter."""
    target = make_target("llama", seed=1, sharpen=2.0)
    with torch.no_grad():  # favour the tokens the schema needs, so the object closes within the budget
        bias = torch.zeros(VOCAB)
        for tok in ['{"', '"name"', '": ', "ab", '"', ", ", '"n"', "12", "}", "<eos>"]:
            bias[JSON_VOCAB.index(tok)] = 6.0
        target.lm_head.bias = torch.nn.Parameter(bias)
    ids = torch.tensor([[7, 9, 11]])
    ref = target.generate(ids, logits_processor=[user_processor()], max_new_tokens=40, do_sample=False)
    drafter = make_oracle(target, ref[:, 3:], corruption=0.2)
    out = target.generate(ids, logits_processor=[user_processor()], assistant_model=drafter, max_new_tokens=40,
                          do_sample=False)  # fmt: skip
    assert torch.equal(out, ref)
    tokens = out[0, 3:].tolist()
    assert tokens[-1] == EOS
    value = json.loads("".join(JSON_VOCAB[t] for t in tokens[:-1]))
    assert set(value) == {"name", "n"} and isinstance(value["n"], int) and len(value["name"]) <= 6


def test_a_used_xgrammar_processor_is_refused_with_what_to_do():
    target = make_target("llama", seed=3)
    proc = user_processor()
    ids = torch.tensor([[7, 9, 11]])
    target.generate(ids, logits_processor=[proc], max_new_tokens=3, do_sample=False)
    drafter = make_oracle(target, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="create a new one for each generate call"):
        target.generate(ids, logits_processor=[proc], assistant_model=drafter, max_new_tokens=3, do_sample=False)


def test_the_processor_is_a_pure_function_of_the_prefix():
    """Shown prefixes out of order (as the loop shows draft positions, then rejects some), every mask equals the
    mask of a fresh matcher advanced along that prefix."""
    grammar = compiled_schema()
    proc = GrammarLogitsProcessor.from_xgrammar(grammar)
    prompt = torch.tensor([[7, 9]])
    good = [JSON_VOCAB.index(t) for t in ['{"', "n", "a", "m", "e", '": ', '"', "ab"]]
    other = [
        JSON_VOCAB.index(t) for t in ['{"', "n", "a", "m", "e", '"', ":", " ", '"', "cd"]
    ]  # same text, other tokens
    shown = [good[:1], good[:3], good[:2], good, [], other, good[:6], other[:8], good, other[:3]]
    proc(prompt, torch.zeros(1, VOCAB))
    for prefix in shown:
        scores = proc(torch.cat([prompt, torch.tensor([prefix], dtype=torch.long)], 1), torch.zeros(1, VOCAB))
        fresh = XGrammarState(grammar)
        assert all(fresh.advance(t) for t in prefix)
        assert torch.equal(torch.isfinite(scores[0]), fresh.allowed()), prefix


def test_unpack_bitmask_reads_bit_i_of_word_i_over_32():
    words = torch.tensor([(1 << 0) | (1 << 31), 1 << 2], dtype=torch.int64).to(torch.int32)
    mask = unpack_bitmask(words, 40)
    assert mask.nonzero().squeeze(-1).tolist() == [0, 31, 34]


def test_outlines_core_state_follows_its_regex():
    import outlines_core

    vocab = outlines_core.Vocabulary(3, {"a": [0], "b": [1], "ab": [2]})
    index = outlines_core.Index("(ab)+", vocab)
    state = OutlinesCoreState(index)
    assert state.vocab_size == 4  # one past the largest id the index knows: the end of sequence, 3
    assert state.allowed().nonzero().squeeze(-1).tolist() == [0, 2]
    assert state.advance(0) and not state.advance(0)  # "a" then "a" breaks (ab)+
    assert state.allowed().nonzero().squeeze(-1).tolist() == [1]
    state.rollback(1)
    assert state.advance(2) and state.allowed()[3]  # after "ab" the EOS id may end it
    assert state.advance(3) and state.is_terminated() and not state.advance(0)
    state.rollback(2)  # the EOS and the "ab" before it
    assert state.allowed().nonzero().squeeze(-1).tolist() == [0, 2] and not state.is_terminated()


# ------------------------------------------------------------------------------------------- sampling stays lossless
SAMPLING_VOCAB = list("abcdefgh") + list("01234567")  # the sampling target's 16 ids
SAMPLING_GRAMMAR = 'root ::= ([a-d] [0-3] | "e" "f" [4-7])+'


def sampling_grammar():
    info = xgr.TokenizerInfo(SAMPLING_VOCAB, vocab_type=xgr.VocabType.RAW, stop_token_ids=[])
    return xgr.GrammarCompiler(info).compile_grammar(SAMPLING_GRAMMAR)


class _NoRollback(GrammarLogitsProcessor):
    """The control: forgets to roll its states back, so rejected draft tokens stay in the grammar state."""

    def _allowed_after(self, b, tokens):
        state, accepted = self.states[b], self._accepted[b]
        for token in tokens[len(accepted) :] if tokens[: len(accepted)] == accepted else tokens:
            if not state.advance(token):
                return None
            accepted.append(token)
        return state.allowed()


def constrained_laws(target, prompt, grammar):
    """The exact law of the sampling check's first tokens under the grammar (a fresh matcher per path)."""
    from sampling_check import exact_laws

    def mask(prefixes, scores):
        out = scores.clone()
        for i, row in enumerate(prefixes[:, len(prompt) :].tolist()):
            state = XGrammarState(grammar)
            assert all(state.advance(t) for t in row)
            out[i, ~state.allowed()] = float("-inf")
        return out

    return exact_laws(target, prompt, extra_processors=LogitsProcessorList([mask]))


def test_grammar_sampling_keeps_the_constrained_target_law_and_the_control_fails():
    from sampling_check import PROMPT, describe, fails_check, law_pvalues, sample, sampling_target

    target, grammar = sampling_target(), sampling_grammar()
    laws = constrained_laws(target, PROMPT, grammar)
    torch.manual_seed(6)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    out, gen = sample(target, drafter, prompt=PROMPT, logits_processor=[GrammarLogitsProcessor.from_xgrammar(grammar)])
    assert any(max(row) > 1 for row in out.accepted_lengths[:200])
    assert out.timings["forced_rows"] > 0  # after "e" the grammar forces "f": verified as a point mass
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), f"the output law differs from the constrained target's: {describe(pvalues)}"
    _, bad = sample(target, drafter, prompt=PROMPT, logits_processor=[_NoRollback.from_xgrammar(grammar)])
    assert fails_check(law_pvalues(bad, laws)), "the check cannot tell a processor without rollback apart"


def test_hf_specdecs_own_regex_grammar_from_a_tokenizer():
    """``GrammarLogitsProcessor.from_regex(pattern, tokenizer)``: the same output with and without a drafter, and it
    matches the pattern."""
    import re

    from helpers import char_tokenizer

    from hf_specdec import GrammarLogitsProcessor as Exported

    tok = char_tokenizer()
    target = make_target("llama", seed=2, sharpen=3.0)
    pattern = "[a-c]{3}-[0-9]{2}(x|yz)"

    def proc():
        return Exported.from_regex(pattern, tok, vocab_size=VOCAB)

    ids = torch.tensor([[7, 9, 11, 13]])
    ref = target.generate(ids, logits_processor=[proc()], max_new_tokens=12, do_sample=False)
    drafter = make_oracle(target, ref[:, 4:], corruption=0.3)
    out = target.generate(ids, logits_processor=[proc()], assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    text = tok.decode(ref[0, 4:], skip_special_tokens=True)
    assert re.fullmatch(pattern, text), text


def plain_and_drafted(batch: int, max_new_tokens: int, num_draft_tokens: int, **draft_kwargs):
    """Plain constrained greedy output of a ragged batch, and the same with an untrained EAGLE-3 drafter."""
    target = make_target("llama", seed=3, sharpen=4.0)
    ids, mask = ragged_batch(batch, length=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    ref = target.generate(ids, logits_processor=[user_processor()], **kwargs)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(
        Eagle3Config.for_target(target.config, num_draft_tokens=num_draft_tokens)
    )
    out = target.generate(ids, logits_processor=[user_processor()], assistant_model=drafter, **draft_kwargs, **kwargs)
    return ref, out


@pytest.mark.parametrize("batch", [1, 3])
def test_grammar_with_an_eagle2_tree_returns_plain_constrained_output(batch):
    """Tree nodes are scored with their own paths' prefixes: the grammar state rolls back between branches."""
    ref, out = plain_and_drafted(batch, 20, 4, tree="eagle2", tree_depth=3, tree_top_k=3, tree_total_tokens=8)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("draft_length", ["adaptive", "fixed"])
def test_forced_tokens_are_verified_without_the_drafter_and_keep_identity(batch, draft_length):
    """The schema forces its keys and punctuation ('{"', 'name', '": '...): those passes verify the forced tokens
    (``timings["forced_rows"]``), and the output stays plain constrained decoding's."""
    ref, out = plain_and_drafted(batch, 24, 3, draft_length=draft_length, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.timings["forced_rows"] > 0
    assert max(max(row) for row in out.accepted_lengths) > 1


def test_forced_continuations_are_the_tokens_the_mask_allows_alone_then_the_forced_text():
    """After '{"' the schema's first key must follow: 'n', 'a', 'm', 'e' are each the only token the mask allows;
    then the text '": ' is forced but can be spelt '"' ':' ' ' or '": ', and xgrammar's jump-forward tokens give one
    spelling. At the start '{' and '{"' both fit the mask: the forced text '{"name": ' comes as jump-forward tokens."""
    proc = GrammarLogitsProcessor.from_xgrammar(compiled_schema())
    prompt = torch.tensor([[7, 9]])
    proc(prompt, torch.zeros(1, VOCAB))
    start = proc.forced_continuations(prompt, torch.tensor([2]), 10)[0]
    assert "".join(JSON_VOCAB[t] for t in start) == '{"name": '
    seq = torch.tensor([[7, 9, JSON_VOCAB.index('{"')]])
    forced = proc.forced_continuations(seq, torch.tensor([3]), 10)[0]
    assert [JSON_VOCAB[t] for t in forced[:4]] == ["n", "a", "m", "e"]
    assert "".join(JSON_VOCAB[t] for t in forced) == 'name": '
    assert proc.forced_continuations(seq, torch.tensor([3]), 2)[0] == forced[:2]
    scores = proc(seq, torch.zeros(1, VOCAB))  # the state is back where it was: the mask after '{"'
    assert torch.isfinite(scores[0]).nonzero().squeeze(-1).tolist() == [JSON_VOCAB.index("n")]


def json_vocab_tokenizer():
    """A fast tokenizer over JSON_VOCAB with no merges: it spells any text one character per token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(JSON_VOCAB)}, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_forced_text_is_spelt_by_the_tokenizer_when_the_processor_has_one():
    """xgrammar spells the forced '{"name": "' with its longest tokens ('{"', '"name"'...); given the target's
    tokenizer, the processor drafts the tokenizer's own encoding of the text (here one character per token), each
    token checked by the grammar."""
    prompt = torch.tensor([[7, 9]])
    spelt = {}
    for name, tokenizer in [("xgrammar", None), ("tokenizer", json_vocab_tokenizer())]:
        proc = GrammarLogitsProcessor.from_xgrammar(compiled_schema(), tokenizer)
        proc(prompt, torch.zeros(1, VOCAB))
        spelt[name] = [JSON_VOCAB[t] for t in proc.forced_continuations(prompt, torch.tensor([2]), 12)[0]]
    assert "".join(spelt["xgrammar"]) == '{"name": '  # its tokens stop where the next one could be spelt two ways
    assert spelt["tokenizer"] == list('{"name": "')  # the whole forced text: the name is a string


def test_forced_tokens_can_be_turned_off():
    target = make_target("llama", seed=3, sharpen=4.0)
    ids = torch.tensor([[7, 9, 11]])
    ref = target.generate(ids, logits_processor=[user_processor()], max_new_tokens=16, do_sample=False)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    out = target.generate(ids, logits_processor=[user_processor()], assistant_model=drafter, max_new_tokens=16,
                          do_sample=False, grammar_forced_tokens=False, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref) and out.timings["forced_rows"] == 0


def byte_level_tokenizer():
    """A character-level fast tokenizer with a byte-level decoder over the test vocabulary (llguidance reads
    byte-level and SentencePiece tokenizers; ids 0..5 are the tiny target's specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<s>", "<unk>", "<x>", "<y>", "<eos>"] + list(string.ascii_letters + string.digits + "-.,:")
    vocab = {c: i for i, c in enumerate(chars[:VOCAB])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_llguidance_state_drives_the_loop_like_xgrammar():
    """The same regex through llguidance: its state follows the grammar, rolls back, and speculative decoding with it
    returns plain constrained decoding's output."""
    import re

    import llguidance
    import llguidance.hf

    tok = byte_level_tokenizer()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_regex("[a-c]{3}-[0-9]{2}")
    state = LLGuidanceState(lltok, grammar, VOCAB)
    a, dash, one = tok.convert_tokens_to_ids(["a", "-", "1"])
    assert state.allowed()[a] and not state.allowed()[dash]
    assert all(state.advance(a) for _ in range(3)) and not state.advance(a)  # a fourth letter breaks [a-c]{3}
    assert state.allowed().nonzero().squeeze(-1).tolist() == [dash]
    state.rollback(2)
    assert state.allowed()[a] and not state.allowed()[dash]
    nine = tok.convert_tokens_to_ids("9")
    assert all(state.advance(t) for t in (a, a, dash, one, nine)) and not state.is_terminated()
    assert state.allowed().nonzero().squeeze(-1).tolist() == [EOS]  # the regex is complete: only the end is left
    assert state.advance(EOS) and state.is_terminated() and not state.advance(a)
    state.rollback(3)  # the end, "9" and "1"
    assert state.allowed()[one] and not state.is_terminated()

    target = make_target("llama", seed=2, sharpen=3.0)
    ids = torch.tensor([[7, 9, 11, 13]])

    def proc():
        return GrammarLogitsProcessor(lambda: LLGuidanceState(lltok, grammar, VOCAB))

    ref = target.generate(ids, logits_processor=[proc()], max_new_tokens=12, do_sample=False)
    drafter = make_oracle(target, ref[:, 4:], corruption=0.3)
    out = target.generate(ids, logits_processor=[proc()], assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)
    assert ref[0, -1] == EOS and re.fullmatch("[a-c]{3}-[0-9]{2}", tok.decode(ref[0, 4:], skip_special_tokens=True))


# ------------------------------------------------------------------------------ outlines' own processors, unchanged
OUTLINES_REGEX = "[a-c]{3}-[0-9]{2}(,[a-c]{2}[0-9]){2,4}"


def outlines_processor(backend: str):
    """What an outlines user passes (``outlines.backends``' processors, built from the test vocabulary)."""
    tok = byte_level_tokenizer()
    if backend == "xgrammar":
        from outlines.backends.xgrammar import XGrammarLogitsProcessor

        vocab = [tok.convert_ids_to_tokens(i) if i < len(tok) else f"~{i}" for i in range(VOCAB)]
        info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])
        return XGrammarLogitsProcessor(xgr.GrammarCompiler(info).compile_regex(OUTLINES_REGEX), "torch")
    if backend == "outlines-core":
        import outlines_core
        from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

        chars = {tok.convert_ids_to_tokens(i): [i] for i in range(EOS + 1, len(tok))}
        return OutlinesCoreLogitsProcessor(outlines_core.Index(OUTLINES_REGEX, outlines_core.Vocabulary(EOS, chars)),
                                           "torch")  # fmt: skip
    import llguidance
    import llguidance.hf
    from outlines.backends.llguidance import LLGuidanceLogitsProcessor

    grammar = llguidance.LLMatcher.grammar_from_regex(OUTLINES_REGEX)
    return LLGuidanceLogitsProcessor(grammar, llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB), "torch")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("backend", ["xgrammar", "outlines-core", "llguidance"])
def test_outlines_processors_with_a_drafter_return_plain_constrained_output(backend, batch):
    """outlines' XGrammarLogitsProcessor, OutlinesCoreLogitsProcessor and LLGuidanceLogitsProcessor, passed as they
    are with ``assistant_model=`` added: the loop drives states of the same backend over their grammar, the output
    equals plain constrained ``generate``'s and follows the regex, and the user's processor is left unused."""
    import re

    target = make_target("llama", seed=2, sharpen=3.0)
    ids, mask = ragged_batch(batch, length=6, vocab=60)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    ref = target.generate(ids, logits_processor=[outlines_processor(backend)], **kwargs)
    drafter = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3)
    proc = outlines_processor(backend)
    out = target.generate(ids, logits_processor=[proc], assistant_model=drafter, return_dict_in_generate=True,
                          **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert proc.is_first_token  # not consumed
    assert max(max(r) for r in out.accepted_lengths) > 1
    tok, grammar = byte_level_tokenizer(), outlines_processor("xgrammar").compiled_grammar
    for row in generated(ref, ids):
        matcher = xgr.GrammarMatcher(grammar)
        assert all(matcher.accept_token(t) for t in row)  # a prefix of the regex's language, or all of a match
        assert row[-1] != EOS or re.fullmatch(OUTLINES_REGEX, tok.decode(row[:-1]))


def test_a_used_outlines_processor_is_refused_with_what_to_do():
    target = make_target("llama", seed=2)
    proc = outlines_processor("outlines-core")
    ids = torch.tensor([[7, 9, 11]])
    target.generate(ids, logits_processor=[proc], max_new_tokens=2, do_sample=False)
    drafter = make_oracle(target, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"OutlinesCoreLogitsProcessor was already used.*reset\(\)"):
        target.generate(ids, logits_processor=[proc], assistant_model=drafter, max_new_tokens=2, do_sample=False)


def test_a_stateful_grammar_processor_that_cannot_be_driven_is_refused_by_name():
    class OutlinesLikeProcessor:  # keeps a guide it advances on every call, like outlines' HF processors
        def __call__(self, input_ids, scores):
            return scores

    target = make_target("llama", seed=3)
    drafter = make_oracle(target, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="OutlinesLikeProcessor.*GrammarLogitsProcessor"):
        target.generate(torch.tensor([[7, 9]]), logits_processor=[OutlinesLikeProcessor()], assistant_model=drafter,
                        max_new_tokens=3, do_sample=False)  # fmt: skip


def test_copies_are_cut_where_the_grammar_rejects_them():
    """A draft (e.g. a prompt-lookup copy) is cut before its first token the grammar rejects: the target would give
    it probability zero, so the cut loses nothing and the pass verifies fewer tokens."""
    proc = GrammarLogitsProcessor.from_xgrammar(compiled_schema())
    prompt = torch.tensor([[7, 9], [7, 9]])
    proc(prompt, torch.zeros(2, VOCAB))
    ids = [JSON_VOCAB.index(t) for t in ['{"', "n", "a", "m", "e", '"', "}", "x"]]
    seq = torch.cat([prompt, torch.tensor([ids[:1], ids[:1]])], 1)
    proposal = torch.tensor([ids[1:], ids[1:]])
    counts = torch.tensor([7, 3])
    assert proc.valid_prefix_lengths(seq, torch.tensor([3, 3]), proposal, counts).tolist() == [5, 3]  # '}' breaks
    scores = proc(seq, torch.zeros(2, VOCAB))  # the states are back after '{"'
    assert torch.isfinite(scores).sum(-1).tolist() == [1, 1]


def test_copies_merged_into_chains_are_cut_where_the_grammar_rejects_them(monkeypatch):
    """With a fixed draft length (and no forced tokens, which would verify the structure first), prompt-lookup copies
    are merged into the drafter's chains: the loop hands
    ``merge_lookup`` each row's copy cut at its grammar-valid prefix. The prompt holds '{"name": "abcdefgh"}', so once
    the output reaches '{"name": ' the copy is '"abcdefgh"...', and the schema's six-character name cuts it after
    'abcdef'."""
    from hf_specdec.generation import loop
    from hf_specdec.generation.ngram import lookup_continuations

    calls = []

    def spy(proposal, seq, starts, lengths, num_tokens, agree=None, continuations=None, **kw):
        raw = lookup_continuations(seq, starts, lengths, num_tokens)
        calls.append((seq.clone(), lengths.clone(), raw, continuations))
        return merge_lookup(proposal, seq, starts, lengths, num_tokens, agree=agree, continuations=continuations, **kw)

    merge_lookup = loop.merge_lookup
    monkeypatch.setattr(loop, "merge_lookup", spy)
    text = [*'{"name": "abcdefgh"}']  # spelt as the target spells its own output: one character per token
    ids = torch.tensor([[7, 9] + [JSON_VOCAB.index(t) for t in text] + [11]])
    target = make_target("llama", seed=3, sharpen=4.0)
    ref = target.generate(ids, logits_processor=[user_processor()], max_new_tokens=20, do_sample=False)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    out = target.generate(ids, logits_processor=[user_processor()], assistant_model=drafter, max_new_tokens=20,
                          do_sample=False, draft_length="fixed", grammar_forced_tokens=False)  # fmt: skip
    assert torch.equal(out, ref)
    cut = 0
    for seq, lengths, (raw, raw_count), (tokens, count) in calls:
        prefix, copy = seq[0, ids.shape[1] : lengths[0]].tolist(), tokens[0, : count[0]].tolist()
        assert copy == raw[0, : count[0]].tolist() and count[0] <= raw_count[0]
        assert accepted_by_grammar(prefix + copy)
        if count[0] < raw_count[0]:
            assert not accepted_by_grammar(prefix + raw[0, : count[0] + 1].tolist())  # cut at the first rejection
            cut += 1
    assert cut > 0
