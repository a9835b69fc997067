"""The decoding loop: acceptance bookkeeping, stopping, streaming, outputs, processors, the hook and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import FIXED_K, PAD, char_tokenizer, make_oracle, make_target, ragged_batch
from sampling_check import (
    ALPHA,
    MIN_BRANCH_SHARE,
    NUM_DRAFT_TOKENS,
    NUM_SAMPLES,
    PROMPT,
    chi_square_test,
    describe,
    exact_laws,
    fails_check,
    first_pass_outcomes,
    law_pvalues,
    sample,
    sampling_target,
)
from transformers import LlamaForCausalLM
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_specdec
from hf_specdec import (
    AutoModelForDrafting,
    DrafterPreTrainedModel,
    Eagle3Config,
    Proposal,
    SpeculativeDecoderOnlyOutput,
)


def greedy_continuation(target, ids, mask, n):
    out = target.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[:, ids.shape[1] :]


# ---------------------------------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [2, 4])
def test_oracle_reaches_full_acceptance(batch, k):
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(batch)
    n_new = 21
    cont = greedy_continuation(target, ids, mask, n_new + k + 2)
    drafter = make_oracle(target, cont, num_draft_tokens=k)
    kwargs = dict(attention_mask=mask, max_new_tokens=n_new, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    assert isinstance(out, SpeculativeDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref)
    # Prefill gives 1 token, then every pass commits K + 1 (the last one is cut by max_new_tokens).
    passes = math.ceil((n_new - 1) / (k + 1))
    for row in out.accepted_lengths:
        assert row[:-1] == [k + 1] * (passes - 1)
        assert sum(row) == n_new - 1
    assert out.num_target_forwards.tolist() == [1 + passes] * batch
    assert out.mean_accepted_length > k


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("k", [2, 5])
def test_noisy_oracle_ragged_acceptance_is_identical(arch, k):
    target = make_target(arch, seed=4)
    ids, mask = ragged_batch(3, seed=1)
    cont = greedy_continuation(target, ids, mask, 40 + k)
    drafter = make_oracle(target, cont, corruption=0.25, seed=k, num_draft_tokens=k)
    kwargs = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **FIXED_K)
    assert torch.equal(out.sequences, ref)
    # Rows really advanced at different speeds within the same passes.
    lengths = out.accepted_lengths
    assert any(len({row[i] for row in lengths if i < len(row)}) > 1 for i in range(min(map(len, lengths))))
    assert out.mean_accepted_length > 1 and out.mean_accepted_length < k + 1


def test_eos_inside_an_accepted_chunk_stops_that_row_only():
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(3, seed=2)
    cont = greedy_continuation(target, ids, mask, 40)
    eos = int(cont[1, 6])  # row 1 meets its EOS mid-way through a chunk of the perfect oracle
    drafter = make_oracle(target, cont, num_draft_tokens=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    row = out.sequences[1, ids.shape[1] :].tolist()
    first = row.index(eos)
    assert all(t == PAD for t in row[first + 1 :])
    assert sum(out.accepted_lengths[1]) + 1 == first + 1


def test_max_length_and_max_new_tokens_are_honoured():
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(2)
    cont = greedy_continuation(target, ids, mask, 30)
    drafter = make_oracle(target, cont, num_draft_tokens=4)
    for kwargs in ({"max_new_tokens": 7}, {"max_length": ids.shape[1] + 5}, {"max_new_tokens": 1}):
        ref = target.generate(ids, attention_mask=mask, do_sample=False, eos_token_id=None, **kwargs)
        out = target.generate(
            ids, attention_mask=mask, do_sample=False, eos_token_id=None, assistant_model=drafter, **kwargs
        )
        assert torch.equal(out, ref), kwargs


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_mid_chunk():
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(1)
    cont = greedy_continuation(target, ids, mask, 30)
    stop_token = int(cont[0, 9])
    drafter = make_oracle(target, cont, num_draft_tokens=4)
    crit = StoppingCriteriaList([StopOnToken(stop_token)])
    ref = target.generate(ids, max_new_tokens=25, do_sample=False, eos_token_id=None, stopping_criteria=crit)
    out = target.generate(
        ids, max_new_tokens=25, do_sample=False, eos_token_id=None, stopping_criteria=crit, assistant_model=drafter
    )
    assert torch.equal(out, ref)
    assert out[0, -1].item() == stop_token and out.shape[1] < ids.shape[1] + 25


@pytest.mark.parametrize("batch", [1, 2])
def test_stop_strings_inside_accepted_chunks(batch):
    tok = char_tokenizer()
    target = make_target("llama", seed=3)
    ids, mask = ragged_batch(batch)
    cont = greedy_continuation(target, ids, mask, 30)
    stop = tok.decode(cont[0, 7:9])
    drafter = make_oracle(target, cont, num_draft_tokens=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=25, do_sample=False, stop_strings=[stop], tokenizer=tok)
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    row0 = out[0, ids.shape[1] :].tolist()
    assert row0[9:] == [PAD] * (len(row0) - 9)  # row 0 stopped right after its stop string
    with pytest.raises(ValueError, match="tokenizer"):
        target.generate(ids, attention_mask=mask, max_new_tokens=5, stop_strings=["x"], assistant_model=drafter)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_committed_chunk():
    target = make_target("llama", seed=3)
    ids, _ = ragged_batch(1)
    cont = greedy_continuation(target, ids, None, 30)
    drafter = make_oracle(target, cont, corruption=0.3, num_draft_tokens=3)
    streamer = Collect()
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=drafter, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1] :].tolist()
    assert max(len(c) for c in streamer.chunks[1:]) > 1  # several tokens per pass reached the streamer
    batch, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(batch, attention_mask=mask, max_new_tokens=4, assistant_model=drafter, streamer=Collect())


@pytest.mark.parametrize("batch", [1, 2])
def test_scores_and_logits_match_plain_generate(batch):
    target = make_target("qwen2", seed=3)
    ids, mask = ragged_batch(batch)
    cont = greedy_continuation(target, ids, mask, 30)
    drafter = make_oracle(target, cont, corruption=0.3, num_draft_tokens=3)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.2,
    )
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 1.5},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 6, "eos_token_id": None},
        {"bad_words_ids": [[9], [10]]},
    ],
)
def test_prefix_dependent_processors_keep_greedy_identity(options):
    target = make_target("llama", seed=7)
    ids, mask = ragged_batch(3, seed=4)
    cont = greedy_continuation(target, ids, mask, 40)
    drafter = make_oracle(target, cont, corruption=0.2, num_draft_tokens=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, **options)
    if options.get("eos_token_id", 0) is None:
        # min_new_tokens needs an EOS to suppress: use the token the target likes at step 2 of row 0.
        kwargs["eos_token_id"] = int(cont[0, 2])
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)


def test_eagle3_greedy_identity_under_processors_and_long_generation():
    target = make_target("mistral", seed=8)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(3, seed=5, length=12)
    kwargs = dict(attention_mask=mask, max_new_tokens=60, do_sample=False, repetition_penalty=1.1)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), target.generate(ids, **kwargs))


# ---------------------------------------------------------------------------------------------------- sampling
class MixtureDrafter(DrafterPreTrainedModel):
    """A good-but-imperfect sampling drafter: q = 0.6 * p_target + 0.4 * uniform, computed with the target.

    It accepts often *and* rejects often, so both branches of speculative sampling are exercised.
    """

    config_class = hf_specdec.DrafterConfig
    requires_target_hidden_states = False

    def __init__(self, config):
        super().__init__(config)
        self.dummy = torch.nn.Linear(1, 1)
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size, max_length):
        return {"ids": self.prompt, "mask": torch.ones_like(self.prompt)}

    def observe(self, state, inputs):
        # Ragged rows: keep every slot and mask the invalid ones, as the loop does for the target.
        state["ids"] = torch.cat([state["ids"], inputs.next_token_ids], 1)
        state["mask"] = torch.cat([state["mask"], inputs.valid.long()], 1)

    def propose(self, state, num_tokens, select):
        ids, mask = state["ids"], state["mask"]
        toks, probs = [], []
        for depth in range(num_tokens):
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            p = torch.softmax(self.bound_target(ids, attention_mask=mask, position_ids=pos).logits[:, -1].float(), -1)
            q = 0.6 * p + 0.4 / p.shape[-1]
            tok, qp = select(q.log(), depth)
            toks.append(tok)
            probs.append(qp)
            ids = torch.cat([ids, tok[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(tok[:, None])], 1)
        return Proposal(tokens=torch.stack(toks, 1), draft_probs=torch.stack(probs, 1))


def test_sampling_is_lossless_with_a_frequently_accepted_drafter():
    """The shared distribution check with a drafter close to the target (q = 0.6 p + 0.4 u): most draft tokens are
    accepted, deep rejections and full acceptances are frequent. (The subtle-bug control is checked by the drafter
    tester, with an untrained drafter: with q this close to p, that bug moves the law too little for this sample.)"""
    target = sampling_target()
    laws = exact_laws(target, PROMPT)
    drafter = MixtureDrafter(hf_specdec.DrafterConfig.for_target(target.config, num_draft_tokens=NUM_DRAFT_TOKENS))
    n = NUM_SAMPLES // 2  # this drafter runs the target without a cache at every depth
    drafter.prompt = torch.tensor(PROMPT)[None, :1].repeat(n, 1)  # observe() sees PROMPT[1:] onwards
    out, gen = sample(target, drafter, num_samples=n, seed=1)
    assert 2.0 < out.mean_accepted_length < NUM_DRAFT_TOKENS + 1, out.mean_accepted_length
    assert all(row[0] == NUM_DRAFT_TOKENS for row in out.draft_lengths)
    assert bool((first_pass_outcomes(out) >= MIN_BRANCH_SHARE).all()), first_pass_outcomes(out)
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), describe(pvalues)


def test_sampling_check_rejects_subtle_bugs_and_accepts_the_exact_law():
    """The statistics of the shared check on their own: exact samples drawn from the enumerated joint law pass; a
    law moved by 0.03 in total variation on one pair of positions fails."""
    target = sampling_target()
    laws = exact_laws(target, PROMPT)
    assert laws.pruned_mass < 1e-4
    for law in laws.marginals:
        torch.testing.assert_close(law.sum(), torch.tensor(1.0, dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(laws.pairs[0].sum(1), laws.marginals[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(laws.pairs[0].sum(0), laws.marginals[1], atol=1e-5, rtol=0)
    g = torch.Generator().manual_seed(0)
    # Exact samples of (x1, x2): the test must pass them.
    pair = laws.pairs[0].flatten()
    draws = torch.multinomial(pair.float(), NUM_SAMPLES, replacement=True, generator=g)
    assert chi_square_test(torch.bincount(draws, minlength=pair.numel()), pair)[0] > 1e-3
    # Move 0.03 of mass from the most likely pair to the second: detected.
    moved = pair.clone()
    top = torch.argsort(pair, descending=True)[:2]
    moved[top[0]] -= 0.03
    moved[top[1]] += 0.03
    draws = torch.multinomial(moved.float(), NUM_SAMPLES, replacement=True, generator=g)
    assert chi_square_test(torch.bincount(draws, minlength=pair.numel()), pair)[0] < ALPHA / 9


def test_num_return_sequences_with_sampling():
    target = make_target("llama", seed=3)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    ids, mask = ragged_batch(2)
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, do_sample=True, num_return_sequences=3, max_new_tokens=6
    )
    assert out.shape == (6, ids.shape[1] + 6)


# ---------------------------------------------------------------------------------------------------- placement
def test_accelerate_dispatched_target(tmp_path):
    """A target loaded with device_map (accelerate hooks, disk offload of one layer) keeps greedy identity."""
    src = make_target("llama", seed=3)
    src.save_pretrained(tmp_path / "target")
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "cpu",
        "model.layers.3": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    target = LlamaForCausalLM.from_pretrained(
        tmp_path / "target", device_map=device_map, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert getattr(target, "hf_device_map", None)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), src.generate(ids, **kwargs))
    assert drafter.device == target.get_output_embeddings().weight.device


# ---------------------------------------------------------------------------------------------------- the hook
def test_other_assistant_models_keep_transformers_behaviour():
    target = make_target("llama", seed=3)
    assistant = make_target("llama", seed=9, layers=1)
    ids, _ = ragged_batch(1)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(
        ids, max_new_tokens=10, do_sample=False, assistant_model=assistant, return_dict_in_generate=True
    )
    assert not isinstance(out, SpeculativeDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref)
    lookup = target.generate(ids, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, ref)


def test_hook_can_be_uninstalled_and_reinstalled():
    target = make_target("llama", seed=3)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    ids, _ = ragged_batch(1)
    hf_specdec.uninstall_generate_hook()
    try:
        assert not hf_specdec.is_generate_hook_installed()
        with pytest.raises(Exception):  # noqa: B017 - transformers' own assisted generation cannot drive a drafter
            target.generate(ids, assistant_model=drafter, max_new_tokens=4)
    finally:
        hf_specdec.install_generate_hook()
    assert hf_specdec.is_generate_hook_installed()
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=4, do_sample=False))


# ---------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_beams": 2}, "beam search"),
        ({"num_assistant_tokens": 0}, "must be >= 1"),
        ({"output_attentions": True}, "output_attentions"),
        ({"use_cache": False}, "KV cache"),
        ({"verifier": "nope"}, "Unknown verifier"),
        ({"verifier": "sampling"}, "needs do_sample=True"),
        ({"do_sample": True, "verifier": "greedy"}, "does not support sampling"),
        ({"assistant_tokenizer": object()}, "assistant_tokenizer"),
    ],
)
def test_unsupported_options_fail_before_generating(kwargs, match):
    target = make_target("llama", seed=3)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    ids, _ = ragged_batch(1)
    with pytest.raises(ValueError, match=match):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, **kwargs)


def test_an_empty_prompt_is_refused_before_generating():
    target = make_target("llama", seed=3)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    empty = torch.zeros((1, 0), dtype=torch.long)  # (a batch of empty rows fails in transformers' generate first)
    with pytest.raises(ValueError, match=r"empty prompt \(input_ids of shape \(1, 0\)\): give at least one token"):
        target.generate(empty, assistant_model=drafter, max_new_tokens=4, do_sample=False)


def test_custom_generate_without_drafter_fails_clearly():
    target = make_target("llama", seed=3)
    ids, _ = ragged_batch(1)
    with pytest.raises(ValueError, match="needs `drafter="):
        target.generate(ids, custom_generate=hf_specdec.speculative_generate, max_new_tokens=4)


class NoHiddenStates(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.hidden_states = None
        return out


def test_target_without_hidden_states_fails_clearly():
    src = make_target("llama", seed=3)
    target = NoHiddenStates(src.config).eval()
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    ids, _ = ragged_batch(1)
    with pytest.raises(ValueError, match="did not return hidden states"):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4)


def test_sliding_window_target_batch_1_and_refusal_for_padded_batches():
    target = make_target("mistral", seed=6, sliding_window=12)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, _ = ragged_batch(1, length=9)
    cont = greedy_continuation(target, ids, None, 60)
    oracle = make_oracle(target, cont, corruption=0.3, num_draft_tokens=4)
    kwargs = dict(max_new_tokens=40, do_sample=False, eos_token_id=None)  # runs far past the 12-token window
    ref = target.generate(ids, **kwargs)
    assert torch.equal(target.generate(ids, assistant_model=oracle, **kwargs), ref)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), ref)
    batch, mask = ragged_batch(2)
    with pytest.raises(ValueError, match="sliding-window"):
        target.generate(batch, attention_mask=mask, assistant_model=drafter, **kwargs)
