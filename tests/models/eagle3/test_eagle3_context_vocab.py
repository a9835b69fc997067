"""EAGLE-3 with a context vocabulary (``context_vocabulary``): the sequence's own tokens outside the reduced draft
vocabulary are drafted too. Candidates follow the sequence, training scores what inference drafts, generation stays
identical to plain greedy decoding and lossless when sampling, and the drafter saves, loads, grows from a trained
one and refuses what it cannot do."""

import types

import pytest
import torch
from drafter_tester import observe_slots, prefill_inputs
from helpers import VOCAB, make_target, ragged_batch
from sampling_check import check_sampling_matches_target

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.context_vocab import context_soft_labels, training_candidates, widen_step_logits
from hf_specdec.convert import LAYOUTS, export_drafter
from hf_specdec.features import TargetFeatures

DRAFT_IDS = torch.arange(6, VOCAB, 2)[:40]  # even ids from 6: every odd id lies outside the draft vocabulary


def context_drafter(target, seed=2, bias=2.0, **overrides):
    """An untrained EAGLE-3 drafter over ``DRAFT_IDS`` with a context vocabulary whose copy prior is raised, so that
    it drafts candidates often."""
    torch.manual_seed(seed)
    config = Eagle3Config.for_target(
        target.config, draft_vocab_size=len(DRAFT_IDS), intermediate_size=64, context_vocabulary=True, **overrides
    )
    drafter = AutoModelForDrafting.from_config(config).eval().bind_target(target)
    counts = torch.zeros(VOCAB)
    counts[DRAFT_IDS] = 1.0
    drafter.init_from_data(counts)
    with torch.no_grad():
        drafter.context_vocab.bias.fill_(bias)
    return drafter


def outside(ids):
    return ~torch.isin(ids, DRAFT_IDS)


class UnionSelector:
    """Greedy selector that records what it saw, expanded to the target vocabulary (``-inf`` outside the union)."""

    do_sample = False

    def __init__(self, forced=None):
        self.forced, self.seen = forced, []

    def __call__(self, logits, depth, vocab_ids=None):
        full = logits.new_full((logits.shape[0], VOCAB), float("-inf"))
        full = full.scatter_reduce(1, vocab_ids, logits.float(), reduce="amax")
        self.seen.append(full)
        return (full.argmax(-1) if self.forced is None else self.forced[:, depth]), None


def recording_proposals(drafter):
    """Wraps ``drafter.propose`` to keep every proposal's tokens."""
    proposed = []
    original = drafter.propose

    def propose(state, num_tokens, select):
        proposal = original(state, num_tokens, select)
        proposed.append(proposal.tokens.clone())
        return proposal

    drafter.propose = propose
    return proposed


def test_candidates_are_the_sequences_tokens_outside_the_vocabulary_in_order():
    target = make_target("llama", seed=1)
    drafter = context_drafter(target)
    ids, mask = ragged_batch(3, length=14, seed=8)
    full = prefill_inputs(target, ids, mask, torch.full((3,), 7))  # token 7 (odd) follows the prompt
    state = drafter.init_draft_state(3, 64)
    drafter.observe(state, full)
    for row in range(3):
        seen = [t for t, ok in zip(full.next_token_ids[row].tolist(), mask[row].tolist()) if ok and t not in DRAFT_IDS]
        want = list(dict.fromkeys(seen))
        got = state.context.ids[row][state.context.ids[row] >= 0].tolist()
        assert got == want and 7 in got
    union = drafter.selector_vocab_ids(state)
    assert union.shape == (3, len(DRAFT_IDS) + state.context.ids.shape[1])
    assert torch.equal(union[:, : len(DRAFT_IDS)], DRAFT_IDS.expand(3, -1))
    # The training view collects the same candidates (positions >= 1, no padding).
    nxt = torch.cat([ids, torch.full((3, 1), 7)], dim=1)
    train_ids, first = training_candidates(nxt, torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1).bool(),
                                           outside(nxt))  # fmt: skip
    assert torch.equal(train_ids, state.context.ids)
    assert bool((nxt.gather(1, first.clamp(max=nxt.shape[1] - 1)) == train_ids)[train_ids >= 0].all())


def test_training_unroll_scores_the_candidates_propose_drafts_from():
    """At every anchor and depth, the training unroll's logits over the draft vocabulary and the candidates equal the
    logits ``observe`` + ``propose`` give (teacher forced); a candidate is hidden from training exactly until it has
    appeared in the sequence."""
    steps = 3
    target = make_target("llama", seed=1)
    drafter = context_drafter(target, bias=0.5)
    ids, mask = ragged_batch(3, length=14, seed=8)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        feats = drafter.select_target_features(out.hidden_states)
        unroll = drafter.ttt_forward(ids, feats, mask, steps)
        cand, first = training_candidates(ids, mask.bool(), outside(ids))
        labels = types.SimpleNamespace(context_ids=cand, context_first=first)
        widened = widen_step_logits([lg for lg, _ in unroll], [drafter.output_features(h) for _, h in unroll], labels,
                                    drafter.context_vocab, target.get_output_embeddings().weight)  # fmt: skip
    full = prefill_inputs(target, ids, mask, torch.zeros(3, dtype=torch.long))
    state = drafter.init_draft_state(3, 64)
    compared = 0
    for anchor in range(ids.shape[1] - steps):
        observe_slots(drafter, state, full, slice(anchor, anchor + 1))
        forced = torch.cat([ids[:, anchor + 2 : anchor + 1 + steps], ids[:, -1:]], dim=1)
        sel = UnionSelector(forced)
        drafter.propose(state, steps, sel)
        for row in range(3):
            if not mask[row, anchor]:
                continue
            for depth in range(steps):
                seen = first[row] <= anchor + 1 + depth
                want = widened[depth][row, anchor]
                got = sel.seen[depth][row]
                torch.testing.assert_close(got[DRAFT_IDS], want[: len(DRAFT_IDS)], rtol=1e-4, atol=1e-4)
                now = seen & (first[row] <= anchor + 1)  # candidates propose had: seen by the anchor
                torch.testing.assert_close(got[cand[row][now]], want[len(DRAFT_IDS) :][now], rtol=1e-4, atol=1e-4)
                assert bool((want[len(DRAFT_IDS) :][~seen] < -1e8).all())
                assert bool(torch.isinf(got[cand[row][(cand[row] >= 0) & ~seen]]).all())
            compared += 1
    assert compared == int(mask[:, : ids.shape[1] - steps].sum())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_identity_with_candidates_drafted(arch, batch):
    """Chains of every length and EAGLE-2 trees stay identical to plain greedy decoding while the drafter proposes
    tokens outside its draft vocabulary, each of them a token of that row's sequence."""
    target = make_target(arch, seed=1, sharpen=4.0)
    drafter = context_drafter(target)
    ids, mask = ragged_batch(batch, seed=3)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kwargs)
    for options in ({"num_assistant_tokens": 1}, {"num_assistant_tokens": 4}, {"draft_length": "fixed"},
                    {"tree": "eagle2", "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8}):  # fmt: skip
        proposed = recording_proposals(drafter)
        out = target.generate(ids, assistant_model=drafter, **kwargs, **options)
        del drafter.propose
        assert torch.equal(out, ref), options
        if "tree" in options:
            continue
        drafted = torch.cat([p.reshape(batch, -1) for p in proposed], dim=1)
        assert bool(outside(drafted).any()), f"no candidate drafted with {options}"
        for row in range(batch):
            copies = set(drafted[row][outside(drafted[row])].tolist())
            assert copies <= set(ref[row].tolist()), "a candidate that is not a token of the sequence"


def test_sampling_is_lossless_with_candidates_drafted():
    """The shared lossless-sampling check (its subtle-bug control must fail) with a drafter whose vocabulary leaves
    out two of the target's likeliest tokens, drafting them from the context."""
    drafters, drafted = [], []

    def make(target, seed=0, **cfg):
        torch.manual_seed(seed)
        config = Eagle3Config.for_target(target.config, intermediate_size=64, num_draft_tokens=3,
                                         context_vocabulary=True, **cfg)  # fmt: skip
        drafter = AutoModelForDrafting.from_config(config).eval()
        with torch.no_grad():
            drafter.context_vocab.bias.fill_(1.0)
        drafters.append(drafter)
        drafted.append(recording_proposals(drafter))
        return drafter

    check_sampling_matches_target(make, reduced_vocab=True)
    tokens = torch.cat([p.flatten() for p in drafted[0]])
    from_context = ~drafters[0].t2d[tokens]
    assert 0.01 < float(from_context.float().mean()) < 0.99, "draw tokens from both the vocabulary and the context"


def test_save_load_and_a_trained_drafter_grown_to_a_context_vocabulary(tmp_path):
    target = make_target("llama", seed=1)
    torch.manual_seed(0)
    plain_config = Eagle3Config.for_target(target.config, draft_vocab_size=len(DRAFT_IDS), intermediate_size=64)
    plain = AutoModelForDrafting.from_config(plain_config).eval()
    counts = torch.zeros(VOCAB)
    counts[DRAFT_IDS] = 1.0
    plain.init_from_data(counts)
    plain.bind_target(target).init_from_target(target)
    grown = plain.with_context_vocabulary(target).eval().bind_target(target)
    assert grown.config.context_vocabulary and not plain.config.context_vocabulary
    for key, value in plain.state_dict().items():
        assert torch.equal(grown.state_dict()[key], value), key
    # lm_head holds the target's rows, so the fitted map is the identity on them: candidates score like own rows.
    head = target.get_output_embeddings().weight
    torch.testing.assert_close(grown.context_vocab.rows(head, DRAFT_IDS[None])[0], grown.lm_head.weight, atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    grown.save_pretrained(tmp_path)
    loaded = AutoModelForDrafting.from_pretrained(tmp_path).eval().bind_target(target)
    assert loaded.config.context_vocabulary
    for key, value in grown.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids, mask = ragged_batch(2, seed=5)
    # a fixed chain: the adaptive length reads the clock, so its accepted lengths differ from run to run
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                  draft_length="fixed")  # fmt: skip
    a = target.generate(ids, assistant_model=grown, **kwargs)
    b = target.generate(ids, assistant_model=loaded, **kwargs)
    assert torch.equal(a.sequences, b.sequences) and a.accepted_lengths == b.accepted_lengths


def test_labels_cover_the_candidates_seen_before_each_position():
    """The teacher's greedy token counts as a candidate at a position exactly when it is in the draft vocabulary or
    appeared in the sequence at or before that position; the soft labels put no mass on unseen candidates."""
    target = make_target("llama", seed=1, sharpen=6.0)
    drafter = context_drafter(target)
    prompt, mask = ragged_batch(2, length=8, seed=2)
    ids = target.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False)  # greedy loops repeat
    valid = torch.cat([mask, torch.ones(2, 24, dtype=mask.dtype)], dim=1).bool()
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True)
    feats = TargetFeatures(hidden_states=[], last_hidden=out.hidden_states[-1])
    head = target.get_output_embeddings()
    labels, in_vocab = context_soft_labels(feats, head, drafter.draft_token_ids, drafter.t2d, ids, valid)
    greedy = labels.full_argmax
    cases = {True: 0, False: 0}
    for row in range(2):
        for s in range(ids.shape[1]):
            tok = int(greedy[row, s])
            earlier = [int(ids[row, p]) for p in range(1, s + 1) if valid[row, p] and valid[row, p - 1]]
            want = tok in DRAFT_IDS.tolist() or tok in earlier
            assert bool(in_vocab[row, s]) == want, (row, s, tok)
            if tok not in DRAFT_IDS.tolist():
                cases[want] += 1
        unseen = ~(labels.context_first[row][None, :] <= torch.arange(ids.shape[1])[:, None])
        assert float(labels.probs[row][:, len(DRAFT_IDS) :][unseen].sum()) == 0.0
    assert cases[True] and cases[False], cases  # both kinds of out-of-vocabulary greedy tokens occur


def test_loss_trains_the_map_and_the_copy_prior():
    target = make_target("llama", seed=1)
    drafter = context_drafter(target).train()
    ids, mask = ragged_batch(2, length=16, seed=4)
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    feats = TargetFeatures(hidden_states=drafter.select_target_features(out.hidden_states),
                           last_hidden=out.hidden_states[-1])  # fmt: skip
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    loss = drafter.compute_loss(batch, feats, target_head=target.get_output_embeddings())
    assert torch.isfinite(loss.loss)
    loss.loss.backward()
    assert drafter.context_vocab.proj.weight.grad.abs().sum() > 0 and drafter.context_vocab.bias.grad.abs() > 0
    with pytest.raises(ValueError, match="soft labels only"):
        drafter.loss_targets(batch, feats, target.get_output_embeddings(), {}, labels="hard")


def test_refuses_what_it_cannot_do(tmp_path):
    target = make_target("llama", seed=1)
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        Eagle3Config.for_target(target.config, context_vocabulary=True)
    with pytest.raises(ValueError, match="flag"):
        Eagle3Config.for_target(target.config, draft_vocab_size=40, context_vocabulary="yes")
    drafter = context_drafter(target)
    layouts = [name for name, layout in LAYOUTS.items() if layout.save and layout.family == "eagle3_drafter"]
    assert layouts
    for layout in layouts:
        with pytest.raises(ValueError, match="context vocabulary"):
            export_drafter(drafter, str(tmp_path / layout), layout)
