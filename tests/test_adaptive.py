"""Adaptive draft length (``draft_length="adaptive"``, the default): the controller's choices, and that no choice
changes what is generated (greedy identity, lossless sampling)."""

from __future__ import annotations

import statistics

import pytest
import torch
from helpers import make_oracle, make_target, ragged_batch, repetitive_prompt

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.generation import adaptive
from hf_specdec.generation.adaptive import DraftLengthController, controller_for
from hf_specdec.generation.ngram import lookup_continuations


def _feed(ctrl, k, accepted_per_row, seconds, drafted=None):
    acc = torch.tensor(accepted_per_row)
    drafted = torch.full_like(acc, k) if drafted is None else torch.tensor(drafted)
    ctrl.update(k, drafted, acc + 1, torch.ones_like(acc, dtype=torch.bool), seconds)


def test_expected_tokens_follow_per_depth_acceptance():
    ctrl = DraftLengthController(3, decay=1.0)
    # 4 rows: 0, 1, 2 and 3 drafts accepted -> alpha_1 = 3/4, alpha_2 = 2/3, alpha_3 = 1/2 (plus a weak prior).
    _feed(ctrl, 3, [0, 1, 2, 3], 1.0)
    a = ctrl.alphas()
    assert a[0] == pytest.approx((3 + 0.5) / (4 + 1))
    assert a[1] == pytest.approx((2 + a[0]) / (3 + 1))
    assert a[2] == pytest.approx((1 + a[1]) / (2 + 1))
    assert ctrl.expected_tokens(2) == pytest.approx(1 + a[0] + a[0] * a[1])
    assert ctrl.expected_tokens(0) == 1.0


def test_rows_that_draft_fewer_tokens_do_not_count_deeper():
    ctrl = DraftLengthController(4, decay=1.0)
    _feed(ctrl, 4, [1, 1], 1.0, drafted=[1, 4])  # row 0 drafted 1 and had it accepted: depth 2 was never reached
    assert ctrl.reached[1:] == [2, 2 - 1, 0, 0]
    assert ctrl.accepted[1:] == [2, 0, 0, 0]


def test_chooses_plain_steps_when_drafting_does_not_pay():
    ctrl = DraftLengthController(5)
    assert ctrl.choose(100) == 5  # nothing measured: draft
    _feed(ctrl, 5, [0, 0, 0, 0], 0.20)
    assert ctrl.choose(100) == 0  # the second pass measures a plain step
    _feed(ctrl, 0, [0, 0, 0, 0], 0.10)
    choices = []
    for _ in range(40):
        k = ctrl.choose(100)
        choices.append(k)
        _feed(ctrl, k, [0, 0, 0, 0] if k else [0, 0, 0, 0], 0.10 + 0.02 * k)
    # Nothing is ever accepted: plain steps, apart from the periodic probes of a neighbouring length.
    assert choices.count(0) >= 36, choices
    assert set(choices) <= {0, 1}


def _losing_probes(ctrl: DraftLengthController, passes: int = 200) -> list[int]:
    """The passes at which ``ctrl`` probes a draft while drafts are never accepted (2 rows, K_max 2)."""
    _feed(ctrl, 2, [0, 0], 0.12)
    _feed(ctrl, 0, [0, 0], 0.10)
    probes = []
    for _ in range(passes):
        k = ctrl.choose(100)
        if k:
            probes.append(ctrl.passes)
        _feed(ctrl, k, [0, 0], 0.10 + 0.01 * k)  # drafts are never accepted: every probe loses
    return probes


def test_probes_of_a_losing_arm_back_off_and_resume_when_the_best_changes():
    ctrl = DraftLengthController(2, probe_every=4, max_probe_gap=32, probe_optimism=0.0)
    probes = _losing_probes(ctrl)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 32 and len(probes) < 14, probes  # 4, 8, 16, 32, 32, ...
    # The text turns predictable: the next probe finds drafts accepted, the best changes, probes come often again.
    changed_at, later_probes = None, []
    for _ in range(120):
        k = ctrl.choose(100)
        if changed_at is None and ctrl.best() >= 1:
            changed_at = ctrl.passes
        elif changed_at is not None and k != ctrl.best():
            later_probes.append(ctrl.passes)
        _feed(ctrl, k, [k, k], 0.10 + 0.01 * k)
    assert ctrl.best() >= 1 and changed_at is not None  # drafting again
    assert later_probes and later_probes[0] - changed_at <= 4  # and looking around soon after the change


def test_hopeful_probes_of_a_losing_arm_stop_once_the_evidence_is_in():
    """With the hopeful estimate (the default), the first probes of a drafter that never pays come at the short gap
    while its few rejections leave room for doubt; then the gaps double as without it."""
    hopeful = _losing_probes(DraftLengthController(2, probe_every=4, max_probe_gap=32))
    plain = _losing_probes(DraftLengthController(2, probe_every=4, max_probe_gap=32, probe_optimism=0.0))
    gaps = [b - a for a, b in zip(hopeful, hopeful[1:])]
    assert gaps[-4:] == [32] * 4 and len(plain) < len(hopeful) <= len(plain) + 3, (hopeful, plain)


@pytest.mark.parametrize("option", ["margin", "probe_optimism"])
def test_negative_margins_and_optimism_are_refused(option):
    with pytest.raises(ValueError, match=f"{option} must be >= 0"):
        DraftLengthController(3, **{option: -0.1})


def _unlucky_start(ctrl: DraftLengthController, passes: int = 200) -> list[int]:
    """A drafter whose first token is accepted half the time, in runs of three drafts (a draft of k costs 1 + 0.1 k
    plain steps, so one-token drafts pay: 1.5 tokens for 1.1 steps), after a first pass and two probes that were
    rejected; returns the draft lengths chosen next."""
    _feed(ctrl, 5, [0], 1.5)  # the first pass drafts K_max and is rejected
    _feed(ctrl, 0, [0], 1.0)
    for _ in range(2):  # two rejected probes of one token
        _feed(ctrl, 1, [0], 1.1)
    choices, drafts = [], 0
    for _ in range(passes):
        k = ctrl.choose(100)
        choices.append(k)
        drafts += k > 0
        _feed(ctrl, k, [min(k, (drafts - 1) // 3 % 2)], 1.0 + 0.1 * k)  # three rejected drafts, three accepted, ...
    return choices


def test_an_unlucky_start_does_not_keep_a_paying_drafter_on_plain_steps():
    """Three rejections put alpha_1 at 0.125 where it is 0.5: the plain estimate says plain steps win, and plain
    steps add no evidence. Hopeful probes come again after ``probe_every`` passes and the loop drafts within about
    40 passes; the control without them (probes of the neighbouring length at doubling gaps) is still on plain
    steps 200 passes later."""
    choices = _unlucky_start(DraftLengthController(5))
    assert choices[0] == 0 and choices[60:].count(0) <= 14, choices
    control = _unlucky_start(DraftLengthController(5, probe_optimism=0.0))
    assert control[60:].count(0) > 70, control


def test_chooses_long_drafts_when_they_are_accepted_and_cheap():
    ctrl = DraftLengthController(5)
    for _ in range(30):
        k = ctrl.choose(100)
        _feed(ctrl, k, [k] * 4, 0.10 + 0.01 * k)  # every draft accepted; a draft token costs 10 % of a step
    assert ctrl.best() == 5
    # The same acceptance with an expensive drafter: shorter drafts win.
    expensive = DraftLengthController(5)
    for k in range(6):
        _feed(expensive, k, [k] * 4, 0.10 + 0.08 * k)
    for _ in range(30):
        k = expensive.choose(100)
        _feed(expensive, k, [min(k, 1)] * 4, 0.10 + 0.08 * k)  # only the first draft is ever accepted
    assert expensive.best() == 1


def test_choice_respects_the_length_limit():
    ctrl = DraftLengthController(5)
    assert ctrl.choose(2) == 2
    assert ctrl.choose(0) == 0


def test_costs_are_measured_relative_to_plain_steps_and_survive_load_changes():
    ctrl = DraftLengthController(4, probe_every=1000)
    _feed(ctrl, 3, [3], 0.30)  # before any plain step: kept, relative once one is measured
    assert ctrl.relative_cost(3) is None and ctrl.relative_cost(2) is None
    _feed(ctrl, 0, [0], 0.20)
    assert ctrl.relative_cost(0) == 1.0 and ctrl.relative_cost(3) == pytest.approx(1.5)
    assert ctrl.relative_cost(2) is None  # never run: no cost is assumed
    assert ctrl.cost_bound(2) == pytest.approx(1.5) and ctrl.cost_bound(4) is None  # only bounded by a longer one
    for _ in range(7):
        _feed(ctrl, 3, [3], 0.30)
    _feed(ctrl, 3, [3], 9.0)  # one pass hit by a stall
    assert ctrl.relative_cost(3) == pytest.approx(1.5)  # the median ignores it
    for _ in range(8):
        _feed(ctrl, 3, [3], 0.90)  # the machine slows down 3x while drafting 3: drafts look dear ...
    assert ctrl.relative_cost(3) == pytest.approx(4.5) and ctrl.best() == 0
    for _ in range(5):
        _feed(ctrl, 0, [0], 0.60)  # ... so plain steps follow, and they re-measure the anchor: the ratio is back
    assert ctrl.step_time == pytest.approx(0.60) and ctrl.relative_cost(3) == pytest.approx(1.5)


def _step_seconds(context: int) -> float:
    """A plain step on a machine where attending over one more slot costs 10 microseconds."""
    return 0.030 + 1e-5 * context


def _plain_call(ctrl: DraftLengthController, prompt: int, passes: int = 40) -> None:
    ctrl.begin_call(prompt)
    for i in range(passes):
        ctrl.choose(100, 0, prompt + i)
        _feed(ctrl, 0, [0], _step_seconds(prompt + i))


def test_costs_are_read_at_the_context_each_pass_attended_over():
    """On SmolLM2 at T = 0.7, plain steps measured on a 700-token prompt made a weak drafter's one-token drafts on the
    short prompt after it look like 1.0 plain steps (they cost 1.35): it drafted whole calls at alpha 0.15-0.25, where
    plain steps win. A pass's cost is now its time over a plain step's at its own context."""
    ctrl = DraftLengthController(1, probe_every=1000)
    for prompt in (60, 700, 60, 700):  # prompts of both lengths teach how a step's time grows with its context
        _plain_call(ctrl, prompt)
    assert ctrl.step_slope.slope == pytest.approx(1e-5, rel=0.05)
    ctrl.begin_call(60)
    for i in range(8):  # a short prompt's one-token drafts: 1.35 plain steps each, one in five accepted
        ctrl.choose(100, 0, 60 + i)
        _feed(ctrl, 1, [0, 0, 0, 0, 1], 1.35 * _step_seconds(60 + i))
    _plain_call(ctrl, 700, passes=8)  # then a long prompt's plain steps: the recent anchor is a long context's
    ctrl.begin_call(60)  # and a short prompt again
    assert ctrl.step_time == pytest.approx(_step_seconds(60), rel=0.01)
    assert ctrl.step_time_at(700) == pytest.approx(_step_seconds(704), rel=0.01)
    assert ctrl.relative_cost(1) == pytest.approx(1.35, rel=0.01)  # not 1.35 * 0.031 / 0.037 = 1.12
    assert ctrl.best(100) == 0  # 1.2 tokens for 1.35 steps: plain steps


def test_one_prompt_length_leaves_the_anchor_a_median():
    """Plain steps that all attend over about as many slots do not tell a slope from the noise: the anchor is their
    median, a stall ignored."""
    ctrl = DraftLengthController(1)
    _plain_call(ctrl, 60, passes=64)
    _feed(ctrl, 0, [0], 9.0)
    assert ctrl.step_slope.slope == 0.0
    recent = [_step_seconds(60 + i) for i in range(57, 64)] + [9.0]
    assert ctrl.step_time == pytest.approx(statistics.median(recent))


def test_draft_passes_never_move_the_plain_step_anchor():
    """Batch 4 on SmolLM2 drafted on 99 % of passes and ran at 0.81x of plain: draft passes had pulled the plain-step
    time up (the old load rule), so drafts that cost three plain steps were read as cheaper than one. Plain steps
    alone set the anchor, and while drafting wins, every other probe re-measures it."""
    ctrl = DraftLengthController(2, probe_every=4, max_probe_gap=8)
    _feed(ctrl, 0, [0], 0.10)
    for _ in range(3):
        _feed(ctrl, 2, [2], 0.12)  # drafting pays: 3 tokens for 1.2 steps
    assert ctrl.best() == 2
    plain_probes = 0
    for _ in range(60):  # drafts now cost 3 steps and commit 2 tokens; the plain step is unchanged
        k = ctrl.choose(100)
        plain_probes += k == 0
        _feed(ctrl, k, [1] if k else [0], 0.30 if k else 0.10)
    assert ctrl.step_time == pytest.approx(0.10) and ctrl.relative_cost(2) == pytest.approx(3.0)
    assert ctrl.best() == 0 and plain_probes > 40
    drafting = DraftLengthController(2, probe_every=4, max_probe_gap=8)
    _feed(drafting, 0, [0], 0.10)
    choices = []
    for _ in range(80):  # drafting keeps paying: plain steps are only the probes that re-measure the anchor
        k = drafting.choose(100)
        choices.append(k)
        _feed(drafting, k, [k], 0.10 + 0.01 * k)
    assert choices[40:].count(0) >= 2 and choices[-20:].count(2) >= 17, choices


def test_a_draft_must_beat_plain_steps_by_the_margin():
    ctrl = DraftLengthController(1, probe_every=1000)
    _feed(ctrl, 0, [0], 1.0)
    for _ in range(50):
        _feed(ctrl, 1, [0, 1, 1, 1, 1], 1.55)  # alpha ~ 0.8: 1.8 tokens for 1.55 steps, 16 % more per second
    assert ctrl.best() == 1
    tight = DraftLengthController(1, probe_every=1000)
    _feed(tight, 0, [0], 1.0)
    for _ in range(50):
        _feed(tight, 1, [0, 1, 1, 1, 1], 1.75)  # 1.8 tokens for 1.75 steps: 3 % more, within the noise
    assert tight.best() == 0


def test_catch_up_is_measured_apart_and_counted_against_the_next_draft():
    ctrl = DraftLengthController(2, probe_every=1000)
    _feed(ctrl, 0, [0], 1.0)
    acc = torch.tensor([2, 2])
    for slots in (10, 10, 10, 100, 100):  # catching up costs 0.05 s per slot; a pass's own cost is 1.2 s
        ctrl.update(2, torch.tensor([2, 2]), acc + 1, torch.tensor([True, True]), 1.2 + 0.05 * slots, False,
                    0.05 * slots, slots)  # fmt: skip
    assert ctrl.relative_cost(2) == pytest.approx(1.2, rel=1e-3)
    assert ctrl.catchup_cost(10) == pytest.approx(0.5, rel=1e-3)
    assert ctrl.catchup_cost(400) == pytest.approx(20.0, rel=1e-3)  # beyond the largest: at its rate per slot
    assert ctrl.best(pending_slots=0) == 2
    assert ctrl.best(pending_slots=100) == 0  # 5 steps of catch-up eat the gain of the next draft


def test_a_batch_pass_counts_every_rows_acceptance():
    ctrl = DraftLengthController(3, decay=1.0, rows=4)
    committed = torch.tensor([4, 1, 1, 1])  # rows tied at 10; one accepts its three drafts, the others none
    ctrl.update(3, torch.full((4,), 3), committed, torch.ones(4, dtype=torch.bool), 1.0, ends=10 + committed)
    assert (ctrl.reached[1], ctrl.accepted[1]) == (4, 1)
    assert ctrl.accepted[1:] == [1, 1, 1]


def _simulated_call_progress(alphas: list[float], rows: int, tokens: int, calls: int = 400) -> float:
    """Tokens per pass by which a batched call moves on when every row drafts a chain with these per-depth
    acceptances each pass until its last row has ``tokens`` tokens (rows accept independently)."""
    gen = torch.Generator().manual_seed(0)
    passes = []
    for _ in range(calls):
        done, n = torch.zeros(rows), 0
        while done.min() < tokens:
            accepted = torch.rand(rows, len(alphas), generator=gen) < torch.tensor(alphas)
            done += 1 + accepted.long().cumprod(dim=1).sum(dim=1)
            n += 1
        passes.append(n)
    return tokens / statistics.fmean(passes)


def _controller_with_acceptance(alphas: list[float], rows: int) -> DraftLengthController:
    """A controller whose per-depth acceptance counts are exactly ``alphas`` over 10,000 rows (no prior to speak of)."""
    ctrl = DraftLengthController(len(alphas), decay=1.0, rows=rows)
    reached = 10_000.0
    for d, a in enumerate(alphas, start=1):
        ctrl.reached[d], ctrl.accepted[d] = reached, reached * a
        reached *= a
    return ctrl


@pytest.mark.parametrize("tokens", [32, 128])
def test_a_batch_drafts_expected_progress_is_what_its_last_row_makes_over_the_call(tokens):
    alphas = [0.6, 0.5]
    simulated = _simulated_call_progress(alphas, rows=4, tokens=tokens)
    batch = _controller_with_acceptance(alphas, rows=4).expected_tokens(2, steps_left=tokens)
    row = _controller_with_acceptance(alphas, rows=1).expected_tokens(2, steps_left=tokens)
    assert row == pytest.approx(1 + 0.6 + 0.6 * 0.5, rel=1e-3)  # one row: its own expected tokens
    assert batch == pytest.approx(simulated, rel=0.04)  # the last row trails the rows' mean
    assert batch < row - 0.05
    # Counting every pass from level rows as its least row's progress says about 1.14 tokens: far too few.
    assert simulated > 1.6


def test_drafts_that_pay_for_a_row_but_not_for_a_short_batched_call_lose():
    def best(rows: int, steps_left: int) -> int:
        ctrl = _controller_with_acceptance([0.6, 0.5], rows=rows)
        _feed(ctrl, 0, [0], 1.0)
        ctrl.update(2, torch.tensor([2]), torch.tensor([1]), torch.tensor([True]), 1.65)  # a chain of 2: 1.65 steps
        return ctrl.best(steps_left=steps_left)

    assert best(rows=1, steps_left=8) == 2  # 1.9 tokens for 1.65 steps
    assert best(rows=4, steps_left=128) == 2  # the last row trails by about 0.1 token a pass over a long call
    assert best(rows=4, steps_left=8) == 0  # over four passes by about 0.4: drafting no longer pays


def _losing_drafter_with_a_dear_catch_up() -> DraftLengthController:
    """A controller past its first probe point where drafts are never accepted (plain steps win) and the drafter's
    catch-up costs 0.05 plain steps per slot."""
    ctrl = DraftLengthController(2, probe_every=4)
    _feed(ctrl, 0, [0], 1.0)
    for _ in range(5):
        _feed(ctrl, 2, [0], 1.2)
    ctrl.update(2, torch.tensor([2]), torch.tensor([1]), torch.tensor([True]), 6.2, False, 5.0, 100)
    ctrl.passes = ctrl._next_probe = 10
    return ctrl


def test_a_probe_waits_while_the_catch_up_would_cost_more_than_its_share_of_the_call():
    ctrl = _losing_drafter_with_a_dear_catch_up()
    assert ctrl.best(pending_slots=0) == 0 and ctrl.catchup_cost(100) == pytest.approx(5.0)
    waited = []
    for _ in range(30):  # 100 steps left: a probe may spend 2 on catching up, and 100 pending slots cost 5
        waited.append(ctrl.choose(100, pending_slots=100))
        _feed(ctrl, 0, [0], 1.0)
    assert waited == [0] * 30
    assert ctrl.choose(100, pending_slots=10) > 0  # 0.5 steps of catch-up: the waiting probe runs
    # A long call affords the same catch-up (5 of the 20 steps a probe may spend).
    assert _losing_drafter_with_a_dear_catch_up().choose(1000, pending_slots=100) > 0


def _winning_drafter_with_small_catch_ups(ctrl: DraftLengthController) -> DraftLengthController:
    """Drafts of 2 that are always accepted (about 2.7 tokens for 1.2 plain steps), and catch-ups measured only
    after single plain steps: 0.2 plain steps per slot."""
    _feed(ctrl, 0, [0], 1.0)
    for _ in range(3):
        ctrl.update(2, torch.tensor([2]), torch.tensor([3]), torch.tensor([True]), 1.4, False, 0.2, 1)
    return ctrl


def test_a_waiting_prompt_is_paid_for_by_the_drafts_of_the_whole_call():
    ctrl = _winning_drafter_with_small_catch_ups(DraftLengthController(2, probe_every=1000))
    assert ctrl.catchup_cost(40) == pytest.approx(8.0)
    assert ctrl.best(pending_slots=40) == 0  # charged to one pass, the catch-up eats that pass's gain
    assert ctrl.best(pending_slots=40, steps_left=80) == 2  # spread over the call: 80 / (8 + 80 / 2.26) = 1.84
    assert ctrl.best(pending_slots=40, steps_left=10) == 0  # a short call does not win it back
    assert ctrl.choose(80, pending_slots=40) == 2


def test_a_call_where_drafting_wins_drafts_from_its_first_pass_whatever_its_prompt(monkeypatch):
    """Earlier calls measured drafts that win and only small, dear-per-slot catch-ups; a call with a 40-token prompt
    still drafts at once (the drafter observes the prompt before the first pass), and its output is plain
    generate's. Charged to the first pass alone, the prompt's catch-up (8 plain steps) left the prompt waiting and
    the whole call on plain steps (the code demo fell from 1.80x to 1.32x)."""
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2)).eval()
    ctrl = _winning_drafter_with_small_catch_ups(
        controller_for(drafter, target, 2, None, 1, False, torch.device("cpu"))
    )
    ctrl._next_probe = 10**9  # no probe at the first pass
    seen, observe = [], drafter.observe
    monkeypatch.setattr(drafter, "observe", lambda state, inputs: seen.append(inputs.next_token_ids.shape[1])
                        or observe(state, inputs))  # fmt: skip
    ids = torch.randint(3, target.config.vocab_size, (1, 40))
    ref = target.generate(ids, max_new_tokens=80, do_sample=False, eos_token_id=None)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=80, do_sample=False, eos_token_id=None,
                          lookup_tokens=0, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert seen[0] == 40 and max(out.draft_lengths[0]) > 0
    # The drafter's pass over the prompt was timed as a catch-up over its 40 slots: every call's prompt tells what a
    # catch-up costs per slot (a wide one, which the small catch-ups after single plain steps do not).
    assert ctrl.widest_catchup[0] == 40 and any(slots == 40 for slots, _ in ctrl.catchup)


def _catch_up(ctrl: DraftLengthController, slots: int, seconds: float) -> None:
    """Records a draft pass of 2 (both accepted, 1.2 plain steps) after a catch-up of ``slots`` taking ``seconds``."""
    ctrl.update(2, torch.tensor([2]), torch.tensor([3]), torch.tensor([True]), 1.2 + seconds, False, seconds, slots)


def test_a_catch_up_costs_a_fixed_part_and_a_part_per_slot():
    ctrl = DraftLengthController(2)
    _feed(ctrl, 0, [0], 1.0)
    for slots, seconds in ((8, 1.0), (64, 2.0)):  # a fixed cost and a little per slot
        _catch_up(ctrl, slots, seconds)
    assert ctrl.catchup_cost(32) == pytest.approx(1.0 + 24 / 56)  # on the line through the two
    # A thousand-token prompt waiting for the drafter: the slope, not the small catch-up's rate per slot (125).
    assert ctrl.catchup_cost(1000) == pytest.approx(1.0 + 992 / 56)
    one_size = DraftLengthController(2)
    _feed(one_size, 0, [0], 1.0)
    _catch_up(one_size, 8, 1.0)
    assert one_size.catchup_cost(1000) == pytest.approx(125.0)  # one size: its rate per slot bounds the slope


def test_the_widest_catch_up_anchors_the_slope_after_the_window_forgets_it():
    ctrl = DraftLengthController(2, window=4)
    _feed(ctrl, 0, [0], 1.0)
    _catch_up(ctrl, 700, 1.2)  # a prompt: 0.001 s per slot over a 0.5 s fixed cost
    for slots in (1, 2, 3, 4, 1, 2):  # then small ones only, one of them slow (a size the kernels had not seen)
        _catch_up(ctrl, slots, 0.5 + 0.001 * slots + (0.4 if slots == 3 else 0.0))
    assert ctrl.widest_catchup == (700, 1.2) and (700, 1.2) not in ctrl.catchup
    assert 1.0 < ctrl.catchup_cost(769) < 1.5  # 1.27 s on the prompt's line; the small ones alone say 32


def test_a_long_waiting_prompt_does_not_keep_a_winning_drafter_on_plain_steps():
    """Catch-ups measured after a few plain steps each, at a fixed cost of a quarter step; a 769-token prompt waits:
    the controller drafts in a 96-token call. Priced at the small catch-ups' rate per slot (0.25 steps), the prompt
    cost 190 steps and a trace of the SmolLM2 demo decoded its summarization and RAG prompts plainly."""
    ctrl = DraftLengthController(2, probe_every=1000)
    _feed(ctrl, 0, [0], 1.0)
    for slots in (1, 2, 4, 8, 12, 3):  # each after a draft of 2, both accepted: 3 tokens for 1.2 steps
        _catch_up(ctrl, slots, 0.25 + 0.001 * slots)
    assert ctrl.catchup_cost(769) == pytest.approx(0.25 + 0.769)
    assert ctrl.choose(96, pending_slots=769) == 2


def test_tree_controller_chooses_between_tree_and_plain():
    ctrl = DraftLengthController(16, tree=True)
    assert ctrl.arms() == [0, 16]
    assert ctrl.choose(3) == 16  # the loop caps a tree pass itself; the arm stays the tree
    ctrl.update(16, torch.tensor([16, 16]), torch.tensor([1, 1]), torch.tensor([True, True]), 0.3)
    ctrl.update(0, torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([True, True]), 0.1)
    assert ctrl.best() == 0  # a tree that commits one token per pass is slower than a plain step
    good = DraftLengthController(16, tree=True)
    good.update(16, torch.tensor([16]), torch.tensor([5]), torch.tensor([True]), 0.3)
    good.update(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([True]), 0.1)
    assert good.best() == 16


def _tree_after_unlucky_first_pass(ctrl: DraftLengthController, passes: int = 200) -> list[int]:
    """A 16-node tree that commits 3 tokens a pass at 1.6 plain steps (it pays: 1.9 tokens a step), after a first
    pass that committed 1; returns the arms chosen next."""
    ctrl.update(16, torch.tensor([16]), torch.tensor([1]), torch.tensor([True]), 1.6)
    ctrl.update(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([True]), 1.0)
    choices = []
    for _ in range(passes):
        k = ctrl.choose(1000)
        choices.append(k)
        ctrl.update(k, torch.tensor([k]), torch.tensor([3 if k else 1]), torch.tensor([True]), 1.6 if k else 1.0)
    return choices


def test_one_unlucky_tree_pass_does_not_keep_a_paying_tree_on_plain_steps():
    """The tree's tokens per pass are a mean over its passes with a prior pass: the first pass's one token weighs
    as one pass (a moving average started there kept the estimate near 1 for hundreds of passes), and the hopeful
    estimate's standard error sends probes to the tree until the evidence settles it."""
    choices = _tree_after_unlucky_first_pass(DraftLengthController(16, tree=True))
    assert choices[40:].count(0) <= 16, choices
    ctrl = DraftLengthController(16, tree=True)
    ctrl.update(16, torch.tensor([16]), torch.tensor([1]), torch.tensor([True]), 1.6)
    prior = 2.0 - 0.5**16  # a chain of 16 tokens, each accepted half the time
    assert ctrl.tree_tokens() == pytest.approx((1.0 + prior) / 2)  # one pass of 1 token and the prior pass
    assert ctrl.tree_tokens(optimism=1.0) == pytest.approx((1.0 + prior) / 2 + ((prior - 1.0) ** 2 / 8) ** 0.5)


def test_a_tree_that_does_not_pay_stays_on_plain_steps():
    ctrl = DraftLengthController(16, tree=True)
    ctrl.update(16, torch.tensor([16]), torch.tensor([2]), torch.tensor([True]), 1.6)
    ctrl.update(0, torch.tensor([0]), torch.tensor([1]), torch.tensor([True]), 1.0)
    choices = []
    for _ in range(300):
        k = ctrl.choose(1000)
        choices.append(k)
        ctrl.update(k, torch.tensor([k]), torch.tensor([1]), torch.tensor([True]), 1.6 if k else 1.0)
    assert choices[100:].count(16) <= 3, choices


SIZES = (1, 2, 4, 8, 16)


def _prior_gain(below: int, size: int) -> float:
    """What the prior takes the tree of ``size`` nodes to add over the one of ``below`` (each node half as likely
    as the one before)."""
    return sum(0.5**j for j in range(below + 1, size + 1))


def test_a_tree_pass_tells_what_each_smaller_size_commits():
    """A tree listed best first: the accepted path's nodes among the first n are what the tree of n accepts, and a
    size's estimate is what it adds over the size below it."""
    ctrl = DraftLengthController(16, tree=True, budgets=SIZES)
    assert ctrl.arms() == [0, *SIZES]
    one = torch.tensor([True])
    # The path is nodes 0, 1 and 9: sizes 1, 2, 4, 8 and 16 commit 2, 3, 3, 3 and 4 tokens.
    ctrl.update(16, torch.tensor([16]), torch.tensor([4]), one, 2.0, accepted_nodes=torch.tensor([[0, 1, 9, -1]]))
    gains = dict(zip(SIZES, (1, 1, 0, 0, 1)))
    expected, below = 1.0, 0
    for size in SIZES:  # one pass and one prior pass per size
        expected += (gains[size] + _prior_gain(below, size)) / 2
        below = size
        assert ctrl.tree_tokens(size) == pytest.approx(expected)
    # A pass of size 2 tells sizes 1 and 2 only; what 4, 8 and 16 add on top of them stays.
    added = ctrl.tree_tokens(16) - ctrl.tree_tokens(2)
    ctrl.update(2, torch.tensor([2]), torch.tensor([3]), one, 1.0, accepted_nodes=torch.tensor([[0, 1, -1]]))
    assert ctrl.tree_tokens(16) - ctrl.tree_tokens(2) == pytest.approx(added, rel=0.02)
    assert ctrl.tree_tokens(2) > ctrl.tree_tokens(1) > 1.0
    with pytest.raises(ValueError, match="accepted paths"):
        ctrl.update(16, torch.tensor([16]), torch.tensor([4]), one, 2.0)
    # A chain-shaped size with a prompt-lookup copy merged in commits past its nodes: the size drafted is credited
    # with what it committed (7 tokens: 5 over size 1's 2), the sizes below with their nodes of the path.
    merged = DraftLengthController(16, tree=True, budgets=SIZES)
    merged.update(2, torch.tensor([8]), torch.tensor([7]), one, 1.0, accepted_nodes=torch.arange(6)[None])
    assert merged.tree_tokens(1) == pytest.approx(1.0 + (1 + _prior_gain(0, 1)) / 2)
    assert merged.tree_tokens(2) - merged.tree_tokens(1) == pytest.approx((5 + _prior_gain(1, 2)) / 2)
    # A batch of two counts the call's progress for each size: the row behind moves it. Before the pass both rows
    # ended at 10; row 0 accepted nodes 0-3 (5 tokens), row 1 node 5 (2 tokens): only size 8 takes row 1 on.
    batch = DraftLengthController(16, tree=True, budgets=SIZES)
    paths = torch.tensor([[0, 1, 2, 3], [5, -1, -1, -1]])
    batch.update(16, torch.tensor([16, 16]), torch.tensor([5, 2]), torch.tensor([True, True]), 2.0,
                 ends=torch.tensor([15, 12]), accepted_nodes=paths)  # fmt: skip
    assert batch.tree_tokens(4) == pytest.approx(1.0 + _prior_gain(0, 4) / 2)
    assert batch.tree_tokens(8) - batch.tree_tokens(4) == pytest.approx((1 + _prior_gain(4, 8)) / 2)
    with pytest.raises(ValueError, match="include 16"):
        DraftLengthController(16, tree=True, budgets=(1, 2, 8))


def _tree_sizes_chosen(cost_per_node: float, passes: int = 300) -> list[int]:
    """Tree passes whose cost grows by ``cost_per_node`` plain steps a node (SmolLM2 on this CPU: about 0.06)
    and whose accepted path is nodes 0, 1 and 9 of the tree: sizes 1, 2, 4, 8 and 16 commit 2, 3, 3, 3 and 4
    tokens. Returns the sizes chosen after the first two passes."""
    ctrl = DraftLengthController(16, tree=True, budgets=SIZES)
    path = torch.tensor([[0, 1, 9]])
    choices = []
    for _ in range(passes):
        k = ctrl.choose(1000)
        choices.append(k)
        committed = 1 + int((path[0] < k).sum())
        ctrl.update(k, torch.tensor([k]), torch.tensor([committed]), torch.tensor([True]),
                    1.0 + 0.05 * (k > 0) + cost_per_node * k, accepted_nodes=path if k else None)  # fmt: skip
    return choices[2:]


def test_the_tree_size_the_hardware_pays_for_is_chosen():
    """On a CPU (a node costs 0.06 plain steps) two nodes pay best: 3 tokens for 1.17 steps against 4 for 2.01 with
    the whole tree; the sizes next to the whole tree (8: 3 tokens for 1.53) pay no better than it, so probing
    neighbours alone would never reach it. Where nodes cost next to nothing (a memory-bound accelerator), the whole
    tree pays best."""
    cpu = _tree_sizes_chosen(0.06)
    assert cpu[100:].count(2) >= 180, cpu
    gpu = _tree_sizes_chosen(0.001)
    assert gpu[100:].count(16) >= 180, gpu


def test_invalid_mode_is_refused():
    target = make_target("llama")
    ids, mask = ragged_batch(1)
    drafter = make_oracle(target, torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_length must be one of"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=4, draft_length="auto")


class _ScriptedController(DraftLengthController):
    """Replays a fixed sequence of draft lengths (whatever the measurements say)."""

    script = [4, 0, 2, 1, 4, 3, 0, 0, 4]

    def choose(self, limit, pending_slots=0, context=None):
        k = self.script[self.passes % len(self.script)]
        self.passes_chosen = getattr(self, "passes_chosen", []) + [min(k, limit)]
        return max(min(k, limit), 0)


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(adaptive, "DraftLengthController", _ScriptedController)
    return _ScriptedController


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_under_every_draft_length(scripted, arch, batch):
    target = make_target(arch)
    ids, mask = ragged_batch(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=4)).eval()
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=30, do_sample=False, lookup_tokens=0,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.timings["plain_steps"] > 0  # the script's K = 0 passes ran as plain steps
    assert max(max(row) for row in out.draft_lengths) == 4


def test_controller_is_kept_per_setting_across_calls():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    ids, mask = ragged_batch(2)
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    a = controller_for(drafter, target, 3, None, 2, False, torch.device("cpu"))
    assert a.passes > 0  # the call above used (and trained) this controller
    target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False)
    assert controller_for(drafter, target, 3, None, 2, False, torch.device("cpu")) is a
    assert controller_for(drafter, target, 3, None, 1, False, torch.device("cpu")) is not a  # another batch size
    fixed_passes = a.passes
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=12, do_sample=False, draft_length="fixed",
        return_dict_in_generate=True,
    )  # fmt: skip
    assert a.passes == fixed_passes  # a fixed length neither asks nor trains the controller
    assert all(row[0] == 3 for row in out.draft_lengths)  # only the length limit shortens a fixed draft


def test_sampling_stays_lossless_with_changing_draft_lengths(scripted):
    """The shared distribution check with the draft length changing pass by pass (4, 0, 2, 1, ...): the law of the
    output matches the target's, and the check still rejects a verifier that samples from p after a rejection."""
    from sampling_check import check_sampling_matches_target

    def make_drafter(target, seed=0, **cfg):
        torch.manual_seed(seed)
        return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3, **cfg))

    _ScriptedController.script = [3, 0, 2, 1, 3]
    try:
        out, _ = check_sampling_matches_target(make_drafter, draft_length="adaptive")
    finally:
        _ScriptedController.script = [4, 0, 2, 1, 4, 3, 0, 0, 4]
    assert any(k == 0 for row in out.draft_lengths for k in row)


def _lookup_pass(ctrl, seconds):
    ctrl.update(0, torch.tensor([4]), torch.tensor([1]), torch.tensor([True]), seconds, lookup=True)


def test_lookup_is_taken_instead_of_plain_steps_only_while_it_pays():
    ctrl = DraftLengthController(3, probe_every=5, probe_share=1.0)  # a budget that never binds (see below)
    assert not ctrl.use_lookup()  # a plain step first: lookups are measured against it
    _feed(ctrl, 0, [0], 1.0)  # plain step: 1 token per second
    assert ctrl.use_lookup()  # lookup not measured yet: try it
    _lookup_pass(ctrl, 1.5)
    ctrl.record_copies([1])
    assert ctrl.step_time == 1.0 and list(ctrl.times) == [0]  # measured apart from plain steps and drafts
    assert ctrl.lookup_tokens == 1.0 and list(ctrl.lookup_times) == [(0, 1.5)]
    # 1 token in 1.5 s loses to plain steps: refused, except for probes of the cost at gaps that double (5, 10, 20).
    answers = [ctrl.use_lookup() for _ in range(40)]
    assert [i + 2 for i, a in enumerate(answers) if a] == [5, 15, 35], answers  # match numbers 5, 5+10, 15+20
    # Copies that were declined still count: once recent ones would have committed 4 tokens, lookups pay.
    ctrl.record_copies([4] * 32)
    assert ctrl.lookup_tokens == 4.0 and all(ctrl.use_lookup() for _ in range(10))
    ctrl.record_copies([1] * 32)  # the text moved on: recent copies fail, and lookups stop at once
    assert not any(ctrl.use_lookup() for _ in range(3))


def test_each_call_learns_what_copies_commit_from_its_own_text():
    """A passage one prompt quoted (copies committing 11 tokens) must not carry copies through the next prompt's
    text, where they fail: a call starts from the earlier calls' estimate, weighed as ``copy_prior`` matches, and
    its own matches take over."""
    ctrl = DraftLengthController(3, copy_prior=4.0)
    _feed(ctrl, 0, [0], 1.0)
    _lookup_pass(ctrl, 2.0)  # a lookup pass costs two plain steps
    ctrl.record_copies([1] * 24 + [11] * 8)  # the first call: failing copies, then a quoted passage
    assert ctrl.lookup_tokens == 3.5 and ctrl.use_lookup()
    ctrl.begin_call()
    assert ctrl.lookup_tokens == 3.5 and ctrl.use_lookup()  # nothing known of the new text yet
    ctrl.record_copies([1] * 4)  # its first four matches fail
    assert ctrl.lookup_tokens == pytest.approx(2.25)
    ctrl.record_copies([1] * 4)
    assert ctrl.lookup_tokens == pytest.approx(1.83, abs=0.01) and not ctrl.use_lookup()
    # The control: one window across calls still averages in the first call's passage, and keeps copying.
    control = DraftLengthController(3)
    _feed(control, 0, [0], 1.0)
    _lookup_pass(control, 2.0)
    control.record_copies([1] * 24 + [11] * 8 + [1] * 8)
    assert control.lookup_tokens == 3.5 and control.use_lookup()


def test_every_generate_call_begins_a_call_of_its_controller():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2)).eval()
    ids = torch.randint(3, target.config.vocab_size, (1, 6))
    ctrl = controller_for(drafter, target, 2, None, 1, False, drafter.device)
    calls = []
    ctrl.begin_call = lambda context=0: calls.append(context)
    contexts, choose = [], ctrl.choose
    ctrl.choose = lambda limit, pending_slots=0, context=None: (
        contexts.append(context) or choose(limit, pending_slots, context)
    )
    for _ in range(2):
        target.generate(ids, assistant_model=drafter, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert calls == [6, 6]  # each call begins at its prompt's width
    # Each pass is planned at the slots it attends over: the prompt, the tokens committed, and the one it feeds.
    per_call = contexts[: len(contexts) // 2]
    assert per_call[0] == 7 and per_call == sorted(per_call) and contexts == per_call * 2, contexts


class _PlainThenLookup(DraftLengthController):
    """Always asks for a plain step and always takes a lookup copy when there is one."""

    def choose(self, limit, pending_slots=0, context=None):
        return 0

    def use_lookup(self, chosen_rate=1.0):
        return True


class _DraftOrCopy(DraftLengthController):
    """Always asks for a 3-token draft and always lets copies go first."""

    def choose(self, limit, pending_slots=0, context=None):
        return min(self.k_max, limit)

    def use_lookup(self, chosen_rate=1.0):
        return True


@pytest.mark.parametrize("batch", [1, 3])
def test_copies_go_first_and_keep_greedy_identity(monkeypatch, batch):
    """Copies before the drafter's chain: at batch 1 a pass with a match verifies the copy alone (nothing drafted),
    one without drafts; at batch 3 rows with a copy take it whatever the chain drafted, rows without draft."""
    monkeypatch.setattr(adaptive, "DraftLengthController", _DraftOrCopy)
    target = make_target("llama", sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False, lookup_tokens=6,
        eos_token_id=None, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert max(max(row) for row in out.accepted_lengths) > 1  # some copies were accepted
    if batch == 1:
        assert out.timings["lookup_passes"] > 0 and out.timings["draft_steps"] > 0
        assert out.timings["plain_steps"] == 0  # every pass drafted or copied
    else:
        assert out.timings["lookup_rows"] > 0  # rows took their copies in drafting passes


def test_the_lookup_must_beat_the_chosen_length_not_only_a_plain_step():
    ctrl = DraftLengthController(3, probe_every=50)
    _feed(ctrl, 0, [0], 1.0)  # plain step: 1 token per second
    assert ctrl.use_lookup(2.0)  # not measured yet: try it
    _lookup_pass(ctrl, 1.25)
    ctrl.record_copies([2])
    assert ctrl.lookup_rate() == pytest.approx(1.6)
    assert ctrl.use_lookup(1.0)  # beats a plain step
    assert not ctrl.use_lookup(2.0)  # loses to a draft expected at 2 tokens per plain-step time


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 3])
def test_lookup_passes_in_place_of_plain_steps_keep_greedy_identity(monkeypatch, arch, batch):
    monkeypatch.setattr(adaptive, "DraftLengthController", _PlainThenLookup)
    target = make_target(arch, sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False, lookup_tokens=6, eos_token_id=None,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.timings["lookup_passes"] > 0 and out.timings["draft_steps"] == 0  # copies only, nothing drafted
    assert max(max(row) for row in out.accepted_lengths) > 1  # some copies were accepted
    assert out.timings["plain_steps"] + out.timings["lookup_passes"] == out.timings["passes"]


class _TreeOrCopy(DraftLengthController):
    """Always asks for the whole tree and always takes a lookup copy when every row has one."""

    def choose(self, limit, pending_slots=0, context=None):
        return self.k_max

    def use_lookup(self, chosen_rate=1.0):
        return True


@pytest.mark.parametrize("batch", [1, 3])
def test_a_tree_pass_gives_way_to_copies_every_row_has_and_keeps_greedy_identity(monkeypatch, batch):
    """A tree cannot carry a copy beside it, so copies are verified alone, in place of the tree pass, where every
    row still generating has one; the other passes draft the tree."""
    monkeypatch.setattr(adaptive, "DraftLengthController", _TreeOrCopy)
    target = make_target("llama", sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    # Copies of up to 10 tokens (the default), wider than the tree's 6 nodes.
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False, eos_token_id=None,
        tree="eagle2", tree_depth=3, tree_top_k=2, tree_total_tokens=6, return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.timings["lookup_passes"] > 0 and out.timings["draft_steps"] > 0  # copies alone, trees otherwise
    assert out.timings["plain_steps"] == 0
    assert max(max(row) for row in out.accepted_lengths) > 1


class _Recording:
    """Keeps the copies' outcomes the loop records."""

    def record_copies(self, outcomes):
        type(self).outcomes.extend(outcomes)
        super().record_copies(outcomes)


class _RecordingLookups(_Recording, _PlainThenLookup):
    outcomes = []


class _RecordingDeclines(_Recording, DraftLengthController):
    """Plain steps only: every copy is declined."""

    outcomes = []

    def choose(self, limit, pending_slots=0, context=None):
        return 0

    def use_lookup(self, chosen_rate=1.0):
        return False


def _generate_with(monkeypatch, controller, batch=1):
    monkeypatch.setattr(adaptive, "DraftLengthController", controller)
    controller.outcomes = []
    target = make_target("llama", sharpen=3.0)
    ids, mask = repetitive_prompt(batch)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          lookup_tokens=6, eos_token_id=None, return_dict_in_generate=True)  # fmt: skip
    return ids, out


@pytest.mark.parametrize("batch", [1, 3])
def test_copy_outcomes_are_what_lookup_passes_commit(monkeypatch, batch):
    """Greedy: the outcome recorded for each lookup pass is exactly how far it moved the call on (in a batch, from
    the row furthest behind before the pass to the one furthest behind after it; rows without a copy commit their
    one token)."""
    _, out = _generate_with(monkeypatch, _RecordingLookups, batch)
    lookup_committed = []
    for i in range(max(len(row) for row in out.accepted_lengths)):
        active = [b for b, row in enumerate(out.accepted_lengths) if len(row) > i]  # rows still generating
        if any(out.draft_lengths[b][i] > 0 for b in active):  # a plain step verifies nothing
            starts = [sum(int(c) for c in out.accepted_lengths[b][:i]) for b in active]
            ends = [s + int(out.accepted_lengths[b][i]) for s, b in zip(starts, active)]
            lookup_committed.append(min(ends) - min(starts))
    assert out.timings["lookup_passes"] == len(lookup_committed) > 3 and max(lookup_committed) > 1
    assert _RecordingLookups.outcomes == pytest.approx(lookup_committed)


def test_declined_copies_are_scored_against_the_text_that_followed(monkeypatch):
    """Plain steps only: no copy is verified, and the positions with a match still yield their outcomes, the tokens
    lookup passes verifying every copy would have committed (replayed here on the finished text)."""
    ids, out = _generate_with(monkeypatch, _RecordingDeclines)
    assert out.timings["lookup_passes"] == 0
    text = out.sequences[0]
    expected, next_stop = [], 0
    for end in range(ids.shape[1] + 1, text.numel()):  # each plain step's text (the first token came with the prompt)
        budget = min(6, text.numel() - 1 - end)  # a copy never runs past the length limit
        copy, n = lookup_continuations(text[None, :end], torch.zeros(1, dtype=torch.long), torch.tensor([end]), 6)
        copy = copy[0, : min(int(n), budget)].tolist()
        if copy and end >= next_stop:  # not inside what the last scored copy would have committed
            follows = text[end : end + len(copy)].tolist()
            same = next((i for i, (x, y) in enumerate(zip(copy, follows)) if x != y), len(copy))
            expected.append(min(same + 1, text.numel() - end))
            next_stop = end + expected[-1]
    assert len(expected) > 5 and max(expected) > 1
    assert _RecordingDeclines.outcomes == expected


def _copies_alone(out) -> bool:
    copied = sum(1 for row in out.draft_lengths if row[0] >= 2)  # rows that verified a copy in their first pass
    return copied > 1000 and out.timings["draft_steps"] == 0


def _copies_beside_chains(out) -> bool:
    return out.timings["lookup_rows"] > 1000 and out.timings["draft_steps"] > 0


@pytest.mark.parametrize(
    "controller, exercised",
    [(_PlainThenLookup, _copies_alone), (_DraftOrCopy, _copies_beside_chains)],
    ids=["lookup-passes", "copies-first-in-drafting-passes"],
)
def test_copies_keep_sampling_lossless(monkeypatch, controller, exercised):
    """The shared law check with unigram lookup, so nearly every row has a copy: verified alone in lookup-only passes
    (nothing drafted), or first in drafting passes (rows without a copy verify their drafted chain, in the same
    pass). The copies are point masses, the output law stays the target's, and a wrong residual is rejected."""
    from sampling_check import (
        PROMPT,
        ResidualIsTargetVerifier,
        describe,
        exact_laws,
        fails_check,
        law_pvalues,
        sample,
        sampling_target,
    )

    from hf_specdec.generation import ngram

    monkeypatch.setattr(adaptive, "DraftLengthController", controller)
    monkeypatch.setattr(ngram, "NGRAM_SIZES", (1,))
    prompt = tuple(range(4, 16)) + PROMPT
    target = sampling_target()
    laws = exact_laws(target, prompt)
    torch.manual_seed(6)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2))
    opts = {"num_assistant_tokens": 2, "lookup_tokens": 3, "draft_length": "adaptive"}
    out, gen = sample(target, drafter, prompt=prompt, **opts)
    assert exercised(out), f"the copies were not exercised: {out.timings}"
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), f"the output law differs from the target's: {describe(pvalues)}"
    _, bad = sample(target, drafter, verifier=ResidualIsTargetVerifier(), prompt=prompt, **opts)
    assert fails_check(law_pvalues(bad, laws)), "the check cannot tell a wrong residual apart"


class _DraftEveryFifthPass(DraftLengthController):
    """Plain steps, with a 2-token draft every fifth pass."""

    passes = 0

    def choose(self, limit, pending_slots=0, context=None):
        type(self).passes += 1
        return min(2, limit) if self.passes % 5 == 0 else 0


def test_the_draft_cost_counts_drafting_passes_not_the_prompt_or_catch_ups(monkeypatch):
    """The drafter's pass over the prompt is slow here (0.3 s); drafting is not. The cost per draft token
    (``drafting_s`` over ``draft_steps``, what the benchmark's c divides) leaves the prompt pass out; ``draft_s``,
    all the drafter's time, keeps it."""
    import time

    monkeypatch.setattr(adaptive, "DraftLengthController", _DraftEveryFifthPass)
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2)).eval()
    observe = drafter.observe

    def slow_on_the_prompt(state, inputs):
        if inputs.next_token_ids.shape[1] >= 8:
            time.sleep(0.3)
        return observe(state, inputs)

    monkeypatch.setattr(drafter, "observe", slow_on_the_prompt)
    ids = torch.randint(3, target.config.vocab_size, (1, 12))
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False, eos_token_id=None,
                          lookup_tokens=0, return_dict_in_generate=True)  # fmt: skip
    timings = out.timings
    assert timings["draft_steps"] >= 6 and timings["plain_steps"] >= 15
    # all the drafter's time holds the 0.3 s prompt pass; the drafting passes' time (what c divides) does not
    assert timings["draft_s"] - timings["drafting_s"] >= 0.3, timings
    assert timings["drafting_s"] > 0


def _plain_winning_setup(monkeypatch, probes: bool):
    """A target, a batch of two ragged prompts, an EAGLE-3 drafter whose observe calls are recorded (slots per call),
    and a controller remembered from earlier calls where a draft pass cost 1.2 plain steps and committed one token
    (plain steps win); with ``probes``, probes may lose the whole call's time (the test's real plain steps are far
    faster than those remembered), else it never drafts."""
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2)).eval()
    ctrl = controller_for(drafter, target, 2, None, 2, False, torch.device("cpu"))
    _feed(ctrl, 0, [0, 0], 0.01)
    for k in (1, 2):
        _feed(ctrl, k, [0, 0], 0.012)
    ctrl.probe_share = 1.0
    if not probes:
        monkeypatch.setattr(ctrl, "choose", lambda limit, pending_slots=0, context=None: 0)
    seen, observe = [], drafter.observe
    monkeypatch.setattr(drafter, "observe", lambda state, inputs: seen.append(inputs.next_token_ids.shape[1])
                        or observe(state, inputs))  # fmt: skip
    return target, drafter, ragged_batch(2), seen


def test_a_call_that_never_drafts_never_runs_the_drafter(monkeypatch):
    """Where earlier calls measured plain steps winning, the drafter's pass over the prompt waits for the first
    draft, and the plain steps' slots wait with it (past the usual catch-up every 64 slots): a call that never
    drafts costs the drafter nothing. The output is plain generate's."""
    target, drafter, (ids, mask), seen = _plain_winning_setup(monkeypatch, probes=False)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=80, do_sample=False, eos_token_id=None)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=80, do_sample=False,
                          eos_token_id=None, lookup_tokens=0, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert out.timings["plain_steps"] == 79 and seen == []


def test_the_waiting_prompt_is_caught_up_with_the_plain_steps_at_the_first_draft(monkeypatch):
    """A probe drafts: the drafter then observes the prompt and every plain step before it in one call (the family
    contract's cache equivalence makes that the same as observing them one by one), and greedy output is unchanged.
    A fresh controller drafts from the start, so the prompt is observed at once, alone."""
    target, drafter, (ids, mask), seen = _plain_winning_setup(monkeypatch, probes=True)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                          eos_token_id=None, lookup_tokens=0, return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(out.sequences, ref)
    first_draft = next(i for i, row in enumerate(zip(*out.draft_lengths)) if max(row) > 0)
    assert first_draft > 0 and seen[0] == ids.shape[1] + first_draft  # the prompt and the plain steps before it
    adaptive.draft_length_memory(drafter).reset()
    seen.clear()
    fresh = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                            eos_token_id=None, lookup_tokens=0)  # fmt: skip
    assert torch.equal(fresh, ref) and seen[0] == ids.shape[1]


def _losing_run(probe_share: float, passes: int = 600) -> DraftLengthController:
    """Passes where drafting never pays (every draft rejected; a pass over k drafts costs 1.5 + 0.1 k plain steps of
    1 s), probed every few passes, and prompt-lookup copies that commit one token in 1.5 s at every pass."""
    ctrl = DraftLengthController(3, probe_every=2, max_probe_gap=4, probe_share=probe_share)
    for _ in range(passes):
        k = ctrl.choose(100)
        lookup = ctrl.use_lookup(ctrl.rate(k) or 1.0) if ctrl.step_time is not None else False
        if lookup:
            ctrl.record_copies([1.0])
            ctrl.update(0, torch.tensor([4]), torch.tensor([1]), torch.tensor([True]), 1.5, lookup=True)
        else:
            _feed(ctrl, k, [0], 1.0 if k == 0 else 1.5 + 0.1 * k)
    return ctrl


def test_probes_lose_at_most_their_share_of_the_time():
    ctrl = _losing_run(probe_share=0.02)
    plain_seconds = ctrl.passes * 1.0  # every pass committed one token, as a plain step does in 1 s
    first_pass = 0.8  # nothing is measured before the first pass, which drafts K_max: not a probe
    assert ctrl.measured_seconds - plain_seconds == pytest.approx(ctrl.probe_loss_seconds + first_pass)
    assert ctrl.probe_loss_seconds <= 0.02 * ctrl.measured_seconds + 0.8  # the share, plus the last probe's loss
    # Control: without the budget the same probes lose several times that share.
    free = _losing_run(probe_share=1.0)
    assert free.probe_loss_seconds > 0.05 * free.measured_seconds


def _dear_drafts_and_copies(ctrl: DraftLengthController) -> DraftLengthController:
    """Drafts of 3 and lookup passes that each cost 3 plain steps of 1 s and commit one token (a batch of 4 on a
    CPU), measured; the run-wide budget has saved up (only a call's share can bind)."""
    _feed(ctrl, 3, [0], 3.0)
    _feed(ctrl, 0, [0], 1.0)
    ctrl.record_copies([1.0])
    ctrl.update(0, torch.tensor([4]), torch.tensor([1]), torch.tensor([True]), 3.0, lookup=True)
    ctrl.measured_seconds = 1e6
    return ctrl


def _explorations_per_call(steps: int, calls: int = 3) -> tuple[list[int], list[float]]:
    """Calls of ``steps`` tokens with :func:`_dear_drafts_and_copies`' costs, copies matching at every pass: the
    draft and lookup passes of each call, and what each call's probes lost, in plain steps."""
    ctrl = _dear_drafts_and_copies(DraftLengthController(3, probe_every=4, max_probe_gap=8))
    explored, lost = [], []
    for _ in range(calls):
        ctrl.begin_call(0)
        before, n = ctrl.probe_loss_seconds, 0
        for left in range(steps, 0, -1):
            k = ctrl.choose(left)
            if ctrl.use_lookup(ctrl.rate(k) if k else 1.0):
                ctrl.record_copies([1.0])
                ctrl.update(0, torch.tensor([4]), torch.tensor([1]), torch.tensor([True]), 3.0, lookup=True)
                n += 1
                continue
            n += k > 0
            _feed(ctrl, k, [0], 3.0 if k else 1.0)
        explored.append(n)
        lost.append(ctrl.probe_loss_seconds - before)
    return explored, lost


def test_a_probe_runs_only_where_its_call_affords_what_it_is_expected_to_lose():
    """A probe that costs 3 plain steps and commits one token loses 2: more than 2 % of a 64-token call (1.28), so
    such calls take plain steps only, however much the run-wide budget has saved up; a 400-token call affords a few
    probes, and what they lose stays within its share (8 steps)."""
    short, short_lost = _explorations_per_call(64)
    assert short == [0, 0, 0] and short_lost == [0.0, 0.0, 0.0]
    long, long_lost = _explorations_per_call(400)
    assert all(n >= 2 for n in long) and all(0 < lost <= 0.02 * 400 for lost in long_lost), (long, long_lost)


def test_a_probe_that_pays_adds_to_the_budget():
    ctrl = DraftLengthController(3, probe_every=2, max_probe_gap=2, probe_share=0.02)
    _feed(ctrl, 0, [0], 1.0)
    ctrl.probe_loss_seconds = 0.5  # earlier probes lost more than 2 % of the 1 s measured: no probe now
    assert ctrl.choose(100) == 0 and not ctrl._probing
    ctrl._probing = True  # a draft probe that commits 4 tokens in 1.5 s gains 2.5 s over plain steps
    _feed(ctrl, 3, [3], 1.5)
    assert ctrl.probe_loss_seconds == pytest.approx(0.5 - 2.5)
    assert ctrl._within_probe_budget()
