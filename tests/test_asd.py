"""Approximate Speculative Decoding: the acceptance rule, the ledger, strictness at B = 0, options and errors."""

import pytest
import torch
from helpers import FIXED_K, make_oracle, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, Eagle3Config, Proposal
from hf_specdec.verification import ASDVerifier, asd_accept, get_verifier

V = 8


def _scores(rows):
    """(1, L + 1, V) scores where row i has its argmax at rows[i][0] and the draft token scored rows[i][1] below."""
    out = torch.zeros(1, len(rows), V)
    for i, (best, other, gap) in enumerate(rows):
        out[0, i, best] = 5.0
        if other is not None:
            out[0, i, other] = 5.0 - gap
    return out


def test_cheap_mismatch_unlocks_the_suffix():
    # Draft 1 2 3 4; the target prefers 7 at position 1 by 0.5 logits; positions 2, 3 match; bonus 6.
    draft = torch.tensor([[1, 2, 3, 4]])
    scores = _scores([(1, None, 0), (7, 2, 0.5), (3, None, 0), (4, None, 0), (6, None, 0)])
    n, tokens, stats = asd_accept(draft, scores, torch.tensor([8.0]), gate=0.25, block_cap=2)
    assert n.tolist() == [4] and tokens.tolist() == [[1, 2, 3, 4, 6]]
    assert stats["exceptions"].tolist() == [1] and stats["gained"].tolist() == [3]
    assert stats["regret"].tolist() == pytest.approx([0.5])
    # Strict greedy would stop at position 1 and commit the target's 7 instead.
    strict = get_verifier("greedy", False).verify(Proposal(tokens=draft), scores)
    assert strict.num_accepted.tolist() == [1] and strict.tokens[0, :2].tolist() == [1, 7]


def test_gate_cap_budget_and_margin():
    draft = torch.tensor([[1, 2, 3, 4]])
    scores = _scores([(1, None, 0), (7, 2, 0.5), (7, 3, 0.2), (4, None, 0), (6, None, 0)])
    # Gate: regret 0.5 over 3 remaining positions is 0.167 <= 0.25 but not <= 0.1.
    assert asd_accept(draft, scores, torch.tensor([8.0]), gate=0.1, block_cap=2)[0].tolist() == [1]
    # Two exceptions: the cap M = 1 stops before the second one.
    assert asd_accept(draft, scores, torch.tensor([8.0]), gate=0.25, block_cap=1)[0].tolist() == [2]
    assert asd_accept(draft, scores, torch.tensor([8.0]), gate=0.25, block_cap=2)[0].tolist() == [4]
    # Budget: 0.6 left covers the first exception (0.5) but not both (0.7).
    assert asd_accept(draft, scores, torch.tensor([0.6]), gate=0.25, block_cap=2)[0].tolist() == [2]
    # q normalised by K: the gate sees 0.5 / (3/4) = 0.67.
    assert asd_accept(draft, scores, torch.tensor([8.0]), 0.25, 2, normalize_remaining=True)[0].tolist() == [1]
    # DeepSeek margin: C_i - r_i < R must hold too; with R = 0.7 exactly, C_2 - r_2 = 0.5 < 0.7 passes...
    assert asd_accept(draft, scores, torch.tensor([0.7]), 0.25, 2, strict_margin=True)[0].tolist() == [4]
    # ...and with R = 0.5, C_1 - r_1 = 0 < 0.5 passes but C_1 = 0.5 <= 0.5 too; the second needs C_2 = 0.7 > 0.5.
    assert asd_accept(draft, scores, torch.tensor([0.5]), 0.25, 2, strict_margin=True)[0].tolist() == [2]


def test_rows_are_independent_and_ledger_persists():
    verifier = ASDVerifier(budget=1.0, gate=0.5, block_cap=2)
    verifier.start(2, torch.device("cpu"), False)
    draft = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    cheap = _scores([(1, None, 0), (7, 2, 0.6), (3, None, 0), (4, None, 0), (6, None, 0)])
    exact = _scores([(1, None, 0), (2, None, 0), (3, None, 0), (4, None, 0), (6, None, 0)])
    scores = torch.cat([cheap, exact])
    first = verifier.verify(Proposal(tokens=draft), scores)
    assert first.num_accepted.tolist() == [4, 4]
    assert verifier.ledger.tolist() == pytest.approx([0.6, 0.0])
    # The same 0.6 mismatch again: row 0 has 0.4 left and must stop; row 1 (nothing spent) accepts it.
    second = verifier.verify(Proposal(tokens=draft), torch.cat([cheap, cheap]))
    assert second.num_accepted.tolist() == [1, 4]
    assert second.token_stats["gained"].sum(1).tolist() == [0, 3]
    # A new request resets the ledger.
    verifier.start(2, torch.device("cpu"), False)
    assert verifier.ledger.tolist() == [0.0, 0.0]


def test_asd_in_generate_spends_within_budget_and_gains():
    target = make_target("llama", seed=1)
    ids, mask = ragged_batch(3, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kwargs)
    # A drafter that replays the target's output with 30% of its tokens corrupted, drafting every pass (the adaptive
    # length reads the clock: on a loaded machine it may run plain steps, where ASD has nothing to accept).
    oracle = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3, seed=1, num_draft_tokens=4)
    kwargs.update(FIXED_K)
    strict = target.generate(ids, assistant_model=oracle, return_dict_in_generate=True, **kwargs)
    approx = target.generate(ids, assistant_model=oracle, verifier="asd", asd_budget=3.0, asd_gate=10.0,
                             asd_block_cap=2, return_dict_in_generate=True, **kwargs)  # fmt: skip
    assert torch.equal(strict.sequences, ref) and strict.approximate is False
    assert approx.approximate is True and approx.verifier == "asd"
    stats = approx.verifier_stats
    assert set(stats) == {"regret", "exceptions", "gained"}
    assert (stats["regret"] <= 3.0 + 1e-5).all()  # the per-request budget bounds the regret spent
    assert int(stats["exceptions"].sum()) > 0 and int(stats["gained"].sum()) >= int(stats["exceptions"].sum())


def test_generation_config_holds_frozen_settings():
    target = make_target("llama", seed=1)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(2, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    ref = target.generate(ids, **kwargs)
    target.generation_config.verifier = "asd"
    target.generation_config.asd_budget = 0.0
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert out.verifier == "asd" and torch.equal(out.sequences, ref)
    target.generation_config.asd_budget = 50.0
    target.generation_config.asd_gate = 50.0
    # a fixed length: a random drafter does not pay, so the adaptive length would decode plainly, verifying nothing
    loose = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, draft_length="fixed", **kwargs)
    assert float(loose.verifier_stats["regret"].sum()) > 0  # the config's budget was used
    # An explicit call option wins over the config.
    again = target.generate(ids, assistant_model=drafter, asd_budget=0.0, verifier="asd", **kwargs)
    assert torch.equal(again, ref)


def test_bad_options_fail_early():
    for bad in ({"budget": -1.0}, {"gate": -0.1}, {"block_cap": -1}, {"block_cap": 1.5}, {"budget": float("nan")}):
        with pytest.raises(ValueError, match="ASD"):
            ASDVerifier(**bad)
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(1)
    with pytest.raises(ValueError, match="greedy-only"):
        target.generate(ids, assistant_model=drafter, verifier="asd", do_sample=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="verifier='asd'"):
        target.generate(ids, assistant_model=drafter, asd_budget=2.0, max_new_tokens=4)


def test_tune_asd_freezes_the_best_setting_under_the_constraint():
    from helpers import char_tokenizer

    from hf_specdec.bench.asd_tune import split_prompts, tune_asd
    from hf_specdec.bench.prompts import PromptItem

    target, tok = make_target(seed=1), char_tokenizer()
    item = PromptItem(id="x", category="default", text="abcdefgh")
    ids = tok(item.text, return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    oracle = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.3, seed=1, num_draft_tokens=4)
    grid = dict(budgets=(0.0, 50.0), gates=(50.0,), block_caps=(2,), max_new_tokens=20, progress=False)
    loose = tune_asd(target, tok, oracle, [item], max_logprob_drop=10.0, **grid)
    by_name = {row["name"]: row for row in loose["candidates"]}
    strict_row, loose_row = by_name["asd B=0.0 g=50.0 M=2"], by_name["asd B=50.0 g=50.0 M=2"]
    assert strict_row["divergence_rate"] == 0.0 and strict_row["logprob_drop"] == 0.0
    assert loose_row["mean_accepted_length"] > strict_row["mean_accepted_length"]
    assert loose["recommended"] == {"asd_budget": 50.0, "asd_gate": 50.0, "asd_block_cap": 2}
    # A constraint the loose setting violates (it changes the output and lowers the likelihood) freezes B = 0.
    assert loose_row["logprob_drop"] > 0
    tight = tune_asd(target, tok, oracle, [item], max_logprob_drop=0.0, **grid)
    assert tight["recommended"]["asd_budget"] == 0.0
    with pytest.raises(ValueError, match="max_logprob_drop"):
        tune_asd(target, tok, oracle, [item], max_logprob_drop=-1.0, **grid)

    prompts = [PromptItem(id=str(i), category="c", text="ab") for i in range(20)]
    dev, test = split_prompts(prompts)
    assert dev and test and len(dev) + len(test) == 20
    assert split_prompts(prompts) == (dev, test)  # deterministic
    with pytest.raises(ValueError, match="dev_fraction"):
        split_prompts(prompts, 1.5)


@pytest.mark.parametrize("batch", [1, 3])
def test_zero_budget_is_strict_with_a_frequently_wrong_drafter(batch):
    """B = 0 must reject every mismatch even when the drafter is wrong often (oracle with 40% corruption)."""
    target = make_target("qwen2", seed=2)
    ids, mask = ragged_batch(batch, seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
    ref = target.generate(ids, **kwargs)
    oracle = make_oracle(target, ref[:, ids.shape[1] :], corruption=0.4, seed=3, num_draft_tokens=5)
    kwargs.update(FIXED_K)  # draft every pass: the adaptive length reads the clock and may run plain steps
    out = target.generate(ids, assistant_model=oracle, verifier="asd", asd_budget=0.0, asd_gate=100.0,
                          asd_block_cap=5, return_dict_in_generate=True, **kwargs)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert int(out.verifier_stats["exceptions"].sum()) == 0
    loose = target.generate(ids, assistant_model=oracle, verifier="asd", asd_budget=100.0, asd_gate=100.0,
                            asd_block_cap=5, return_dict_in_generate=True, **kwargs)  # fmt: skip
    assert int(loose.verifier_stats["exceptions"].sum()) > 0  # the same drafter does trigger exceptions


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("batch", [1, 3])
def test_statistics_count_only_committed_tokens(arch, batch):
    """Re-scoring the output with one fresh target pass: the non-argmax tokens are exactly the recorded exceptions,
    their regrets sum to the recorded regret (at most B per row), also
    when EOS or the length limit cut an accepted chunk, with left padding, on three architectures."""
    target = make_target(arch, seed=11)
    ids, mask = ragged_batch(batch, seed=5)
    cont = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None)
    cont = cont[:, ids.shape[1] :]
    # EOS: a token the last row first writes after position 10 (so that it lands inside accepted chunks).
    late = [t for t in cont[-1, 10:40].tolist() if t not in cont[-1, :10].tolist()]
    eos = late[0] if late else (int(cont[-1, 0]) + 1) % target.config.vocab_size
    checked = 0
    for seed in range(6):
        drafter = make_oracle(target, cont, corruption=0.3, seed=seed, num_draft_tokens=5)
        out = target.generate(
            ids, attention_mask=mask, assistant_model=drafter, verifier="asd", asd_budget=1e4, asd_gate=1e4,
            asd_block_cap=3, max_new_tokens=23, do_sample=False, eos_token_id=eos, pad_token_id=0,
            return_dict_in_generate=True, **FIXED_K,
        )  # fmt: skip
        gen = out.sequences[:, ids.shape[1] :]
        full_mask = torch.cat([mask, torch.ones_like(gen)], dim=1)
        pos = (full_mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = target(out.sequences, attention_mask=full_mask, position_ids=pos).logits[:, ids.shape[1] - 1 : -1]
        stats = out.verifier_stats or {"regret": torch.zeros(batch), "exceptions": torch.zeros(batch)}  # no pass ran
        assert bool((stats["regret"] <= 1e4).all())
        for b in range(batch):
            row = gen[b].tolist()
            n = row.index(eos) + 1 if eos in row else len(row)
            z = logits[b, :n]
            toks = gen[b, :n]
            best = z.argmax(-1)
            off = toks != best
            regret = (z.gather(-1, best[:, None]) - z.gather(-1, toks[:, None])).squeeze(-1)[off].sum()
            assert int(off.sum()) == int(stats["exceptions"][b]), (seed, b)
            torch.testing.assert_close(regret, stats["regret"][b].float(), atol=1e-4, rtol=1e-4)
            checked += int(off.sum())
    assert checked >= 1  # exceptions did occur


def test_the_rule_itself_is_strict_at_an_exhausted_budget():
    """Without the verifier's strict shortcut: a zero-regret tie is an exception only while budget is left."""
    from hf_specdec.verification import asd_accept

    scores = torch.zeros(2, 4, 10)
    scores[:, :, 3] = 1.0
    scores[:, 0, 7] = 1.0  # position 0: token 7 ties the argmax 3 (argmax picks 3, the first maximum)
    draft = torch.tensor([[7, 3, 3], [7, 3, 3]])
    n, tokens, stats = asd_accept(draft, scores, torch.tensor([0.0, 1.0]), gate=1.0, block_cap=2)
    assert n.tolist() == [0, 3]  # exhausted budget: strict; some budget left: the free tie is accepted
    assert tokens[0, 0] == 3 and tokens[1, :3].tolist() == [7, 3, 3]
    assert stats["exceptions"].tolist() == [0, 1] and stats["regret"].tolist() == [0.0, 0.0]


def _scores_with(best: list[int], draft_scores: dict[tuple[int, int], float], vocab: int = 10) -> torch.Tensor:
    """(1, L + 1, vocab) scores: argmax ``best[i]`` scoring 5.0 at position i, plus the given (i, token) scores."""
    scores = torch.zeros(1, len(best), vocab)
    for i, t in enumerate(best):
        scores[0, i, t] = 5.0
    for (i, t), value in draft_scores.items():
        scores[0, i, t] = value
    return scores


def test_gate_divides_by_the_remaining_length():
    """An exception at position 0 of K = 3 with regret 1.5 passes the gate g = 0.5 only as 1.5 / 3 <= 0.5 (a
    denominator of K - i - 1 = 2 or i + 1 = 1 would refuse it); 1.75 / 3 > 0.5 is refused."""
    from hf_specdec.verification import asd_accept

    draft = torch.tensor([[7, 3, 3]])
    ok = _scores_with([3, 3, 3, 3], {(0, 7): 5.0 - 1.5})
    n, _, stats = asd_accept(draft, ok, torch.tensor([10.0]), gate=0.5, block_cap=2)
    assert n.tolist() == [3] and stats["exceptions"].tolist() == [1]
    too_much = _scores_with([3, 3, 3, 3], {(0, 7): 5.0 - 1.75})
    n, _, _ = asd_accept(draft, too_much, torch.tensor([10.0]), gate=0.5, block_cap=2)
    assert n.tolist() == [0]


def test_rejected_mismatches_cost_nothing_and_strict_margin_binds():
    verifier = ASDVerifier(budget=5.0, gate=0.1, block_cap=2)
    verifier.start(1, torch.device("cpu"), False)
    proposal = Proposal(tokens=torch.tensor([[7, 3, 3]]))
    result = verifier.verify(proposal, _scores_with([3, 3, 3, 3], {(0, 7): 2.0}))  # regret 3.0: gate refuses it
    assert result.num_accepted.tolist() == [0] and verifier.ledger.tolist() == [0.0]

    from hf_specdec.verification import asd_accept

    # Budget 1.0: the first exception spends all of it (regret 1.0), the second is a zero-regret tie (token 8 scores
    # 5.0 like the argmax 3). The reproduction's margin C - r < R refuses the tie; without it, the tie is accepted.
    draft = torch.tensor([[7, 8, 3]])
    scores = _scores_with([3, 3, 3, 3], {(0, 7): 4.0, (1, 8): 5.0})
    loose, _, _ = asd_accept(draft, scores, torch.tensor([1.0]), gate=1.0, block_cap=2, strict_margin=False)
    tight, _, _ = asd_accept(draft, scores, torch.tensor([1.0]), gate=1.0, block_cap=2, strict_margin=True)
    assert loose.tolist() == [3] and tight.tolist() == [1]


def test_a_minus_inf_scored_draft_token_is_infeasible_and_the_ledger_stays_finite():
    target = make_target("llama", seed=11)
    ids, mask = ragged_batch(2, seed=5)
    cont = target.generate(ids, attention_mask=mask, max_new_tokens=50, do_sample=False, eos_token_id=None)
    cont = cont[:, ids.shape[1] :].clone()
    banned = 4  # a token the target never needs; the drafter proposes it often
    noisy = cont.clone()
    noisy[:, 1::3] = banned
    drafter = make_oracle(target, noisy, corruption=0.2, num_draft_tokens=5)
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, verifier="asd", asd_budget=100.0, asd_gate=100.0,
        asd_block_cap=3, suppress_tokens=[banned], max_new_tokens=40, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, **FIXED_K,
    )  # fmt: skip
    regret = out.verifier_stats["regret"]
    assert bool(torch.isfinite(regret).all())
    assert not bool((out.sequences[:, ids.shape[1] :] == banned).any())  # never committed
    assert int(out.verifier_stats["exceptions"].sum()) > 0  # ASD kept working after the -inf tokens


def test_a_binding_budget_spends_less():
    """B = 3 binds (spends at most 3 per row and accepts fewer exceptions) where B = 1e9 does not."""
    target = make_target("llama", seed=11)
    ids, mask = ragged_batch(3, seed=5)
    cont = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None)
    drafter = make_oracle(target, cont[:, ids.shape[1] :], corruption=0.35, seed=1, num_draft_tokens=5)
    kwargs = dict(attention_mask=mask, assistant_model=drafter, verifier="asd", asd_gate=1e9, asd_block_cap=5,
                  max_new_tokens=50, do_sample=False, eos_token_id=None, return_dict_in_generate=True, **FIXED_K)  # fmt: skip
    tight = target.generate(ids, asd_budget=3.0, **kwargs)
    loose = target.generate(ids, asd_budget=1e9, **kwargs)
    assert bool((tight.verifier_stats["regret"] <= 3.0 + 1e-5).all())
    assert float(loose.verifier_stats["regret"].sum()) > float(tight.verifier_stats["regret"].sum()) + 1.0
    assert int(loose.verifier_stats["exceptions"].sum()) > int(tight.verifier_stats["exceptions"].sum())
