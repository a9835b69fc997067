"""Greedy mismatches in the benchmark: each output that differs from plain ``generate`` is classified at its first
divergent token as a numerical near-tie (within the rounding error of the target's dtype) or a real difference."""

import pytest
import torch
from helpers import EOS, PAD, char_tokenizer, make_target
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specdec.bench import runner
from hf_specdec.bench.prompts import PromptItem
from hf_specdec.bench.report import format_console_table, markdown_table
from hf_specdec.bench.runner import (
    NEAR_TIE_K,
    BenchMethod,
    _aggregate,
    _first_divergences,
    _Run,
    classify_divergence,
    near_tie_tolerance,
    plain_method,
    run_benchmark,
)

BF16_EPS, FP16_EPS, FP32_EPS = 2.0**-7, 2.0**-10, 2.0**-23
PROMPTS = [
    PromptItem(id="a", category="letters", text="hello world"),
    PromptItem(id="b", category="letters", text="abcabcabc"),
]


def test_tolerance_is_k_eps_of_the_top_logit():
    assert NEAR_TIE_K == 4.0
    assert near_tie_tolerance(10.0, torch.bfloat16) == pytest.approx(4 * BF16_EPS * 10)
    assert near_tie_tolerance(-10.0, torch.float16) == pytest.approx(4 * FP16_EPS * 10)
    assert near_tie_tolerance(10.0, torch.float32) == pytest.approx(4 * FP32_EPS * 10)
    assert near_tie_tolerance(0.01, torch.bfloat16) == pytest.approx(4 * BF16_EPS)  # floor at |logit| = 1
    assert near_tie_tolerance(10.0, torch.bfloat16, k=1) == pytest.approx(BF16_EPS * 10)


def test_classifier_on_crafted_logits():
    logits = torch.full((16,), -5.0)
    logits[3], logits[7], logits[9] = 10.0, 10.0 - 0.1, 2.0  # plain picks 3; 7 is 0.1 behind, 9 far behind
    # bf16: tol = 4 * 2^-7 * 10 = 0.3125, so a 0.1 gap is a rounding-level tie; fp32: tol = 4.8e-6, a real gap.
    assert classify_divergence(logits, 3, 7, torch.bfloat16)["kind"] == "near_tie"
    fp32 = classify_divergence(logits, 3, 7, torch.float32)
    assert fp32["kind"] == "real" and fp32["margin"] == pytest.approx(0.1, abs=1e-6)
    assert fp32["tolerance"] == pytest.approx(4 * FP32_EPS * 10)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # a large margin is real in every precision
        assert classify_divergence(logits, 3, 9, dtype)["kind"] == "real"
    # An exact tie is a near-tie even in fp32 (the report still does not excuse it there: see the policy test).
    logits[7] = 10.0
    assert classify_divergence(logits, 3, 7, torch.float32) == {"kind": "near_tie", "margin": 0.0,
                                                                "tolerance": pytest.approx(4 * FP32_EPS * 10)}  # fmt: skip
    # A tie between plain's top two does not excuse a method that took a token far below them.
    assert classify_divergence(logits, 3, 9, torch.bfloat16)["kind"] == "real"
    # The boundary: a margin of exactly tol is a near-tie, just above it real; no token from the method is real.
    tol = near_tie_tolerance(10.0, torch.bfloat16)
    logits[7] = 10.0 - tol
    assert classify_divergence(logits, 3, 7, torch.bfloat16)["kind"] == "near_tie"
    logits[7] = 10.0 - 1.01 * tol
    assert classify_divergence(logits, 3, 7, torch.bfloat16)["kind"] == "real"
    assert classify_divergence(logits, 3, None, torch.bfloat16) == {"kind": "real", "margin": None, "tolerance": tol}


def test_fp16_tolerance_between_bf16_and_fp32():
    logits = torch.tensor([10.0, 10.0 - 0.1, 10.0 - 0.02, 0.0])
    # fp16: tol = 4 * 2^-10 * 10 = 0.039: 0.02 behind is a tie, 0.1 behind is not (it is in bf16).
    assert classify_divergence(logits, 0, 2, torch.float16)["kind"] == "near_tie"
    assert classify_divergence(logits, 0, 1, torch.float16)["kind"] == "real"
    assert classify_divergence(logits, 0, 1, torch.bfloat16)["kind"] == "near_tie"
    assert classify_divergence(logits, 0, 2, torch.float32)["kind"] == "real"


def _run(rows, width=2):
    return _Run(seconds=1.0, new_tokens=0, target_forwards=0, sequences=torch.tensor(rows), prompt_width=width)


def test_first_divergence_positions_compare_rows_up_to_eos():
    plain = _run([[1, 1, 10, 11, EOS, PAD], [1, 1, 10, 11, 12, 13], [1, 1, 10, 11, 12, 13]])
    other = _run([[1, 1, 10, 11, EOS, EOS], [1, 1, 10, 20, 12, 13], [1, 1, 10, 11, 12, 13]])
    # Row 0 only differs after EOS (padding): not a mismatch. Row 1 leaves plain at its second generated token.
    assert _first_divergences(plain, other, {EOS}) == [{"row": 1, "position": 1, "plain_token": 11, "token": 20}]
    # A row that ends (EOS) where plain goes on diverges at the EOS.
    other = _run([[1, 1, 10, EOS, PAD, PAD], [1, 1, 10, 11, 12, 13], [1, 1, 10, 11, 12, 13]])
    assert _first_divergences(plain, other, {EOS}) == [{"row": 0, "position": 1, "plain_token": 11, "token": EOS}]


def test_fp32_never_excuses_a_near_tie():
    tie = {"row": 0, "position": 3, "plain_token": 7, "token": 8, "kind": "near_tie", "margin": 0.0, "tolerance": 1e-6}
    plain, other = _run([[1, 1, 7]]), _run([[1, 1, 8]])
    plain.divergences, other.divergences = [], [tie]
    results = {("plain", 0.0, 1, 0): [plain], ("m", 0.0, 1, 0): [other]}
    for half in (False, True):
        rec = _aggregate(results, "m", 0.0, 1, [0], {"tokens_per_s": 1.0}, "plain", half=half)
        assert rec["identical"] is False and rec["divergence_rate"] == 1.0
        assert (rec["mismatches"], rec["near_tie_mismatches"], rec["real_mismatches"]) == (1, 1, 0)
        assert rec["identical_up_to_near_ties"] is half
        assert rec["mismatch_details"] == [tie]
    other.divergences = [dict(tie, kind="real")]
    rec = _aggregate(results, "m", 0.0, 1, [0], {"tokens_per_s": 1.0}, "plain", half=True)
    assert (rec["near_tie_mismatches"], rec["real_mismatches"], rec["identical_up_to_near_ties"]) == (0, 1, False)
    rec = _aggregate(results, "plain", 0.0, 1, [0], None, "plain", half=True)
    assert rec["identical"] is True and rec["mismatches"] == 0 and rec["identical_up_to_near_ties"] is True


class FlipAt(LogitsProcessor):
    """A deliberately wrong method: at generated position ``step`` it takes plain's runner-up (``"runner_up"``) or
    its least likely token (``"worst"``) instead of the argmax."""

    def __init__(self, step: int, how: str):
        self.step, self.how = step, how
        self.prompt_width = self.last = None

    def __call__(self, input_ids, scores):
        width = input_ids.shape[1]
        if self.last is None or width <= self.last:  # the first step of a new generate call
            self.prompt_width = width
        self.last = width
        if width - self.prompt_width == self.step:
            if self.how == "worst":
                pick = scores.argmin(-1)
            else:
                pick = scores.scatter(-1, scores.argmax(-1, keepdim=True), float("-inf")).argmax(-1)
            scores = torch.full_like(scores, float("-inf"))
            scores[torch.arange(scores.shape[0]), pick] = 0.0
        return scores


def flip_method(step: int, how: str) -> BenchMethod:
    processors = LogitsProcessorList([FlipAt(step, how)])
    return BenchMethod(name=f"flip-{how}", kind="custom", generate_kwargs={"logits_processor": processors})


def _bench(target, methods, prompts=PROMPTS, batch_sizes=(1,)):
    return run_benchmark(target, char_tokenizer(), [plain_method(), *methods], prompts, max_new_tokens=10,
                         batch_sizes=list(batch_sizes), warmup=0, progress=False)  # fmt: skip


def _record(report, method, bsz=1):
    (rec,) = [
        r
        for r in report["records"]
        if r["method"] == method and r["batch_size"] == bsz and r["category"] == "all" and r["mode"] == "greedy"
    ]
    return rec


def test_wrong_method_is_classified_real():
    target = make_target()
    report = _bench(target, [flip_method(3, "worst")], batch_sizes=(1, 2))
    for bsz in (1, 2):
        plain, flip = _record(report, "plain", bsz), _record(report, "flip-worst", bsz)
        assert plain["identical"] is True and plain["mismatches"] == 0
        assert plain["target_forwards"] == plain["new_tokens"] or bsz == 2  # the untimed replay is not counted
        assert flip["identical"] is False and flip["identical_up_to_near_ties"] is False
        assert (flip["mismatches"], flip["near_tie_mismatches"], flip["real_mismatches"]) == (2, 0, 2)
        assert flip["divergence_rate"] == 1.0
        details = flip["mismatch_details"]
        assert sorted(d["prompt"] for d in details) == ["a", "b"]
        for d in details:
            assert d["position"] == 3 and d["source"] == "replay" and d["kind"] == "real"
            assert d["margin"] > d["tolerance"] > 0 and d["token"] != d["plain_token"]
    assert report["config"]["near_tie_dtype"] == "float32" and report["config"]["near_tie_k"] == NEAR_TIE_K
    assert "no (0 near-ties, 2 real)" in format_console_table(report)
    assert "no (0 near-ties, 2 real)" in markdown_table(report)


def test_divergence_tokens_and_margins_are_plain_steps():
    """The recorded plain token and margin are those of plain ``generate``'s own step (``output_logits``)."""
    target, tok = make_target(), char_tokenizer()
    step = 2
    report = _bench(target, [flip_method(step, "runner_up")], prompts=PROMPTS[:1])
    (detail,) = _record(report, "flip-runner_up")["mismatch_details"]
    ids = tok(PROMPTS[0].text, return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    logits = out.logits[step][0]
    top2 = logits.topk(2)
    assert detail["plain_token"] == int(out.sequences[0, ids.shape[1] + step]) == int(top2.indices[0])
    assert detail["token"] == int(top2.indices[1])
    assert detail["margin"] == pytest.approx(float(top2.values[0] - top2.values[1]), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_up_flip_is_a_near_tie_only_in_half_precision(dtype):
    """Plain's top-2 margin at step 2 of this prompt is small (a few thousandths): below bf16's rounding tolerance,
    far above fp32's. The same wrong-by-one-rank method is a near-tie on a bf16 target and real on an fp32 one."""
    target, tok = make_target().to(dtype), char_tokenizer()
    step = 2
    ids = tok(PROMPTS[0].text, return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    top2 = out.logits[step][0].topk(2).values
    margin = float(top2[0] - top2[1])
    # The premise of this test (checked, not assumed): the margin lies between the two tolerances.
    assert near_tie_tolerance(top2[0], torch.float32) < margin <= near_tie_tolerance(top2[0], torch.bfloat16)

    report = _bench(target, [flip_method(step, "runner_up")], prompts=PROMPTS[:1])
    flip = _record(report, "flip-runner_up")
    assert flip["identical"] is False and flip["mismatches"] == 1
    (detail,) = flip["mismatch_details"]
    assert detail["position"] == step and detail["margin"] == pytest.approx(margin, abs=1e-6)
    if dtype == torch.bfloat16:
        assert report["config"]["near_tie_dtype"] == "bfloat16"
        assert (flip["near_tie_mismatches"], flip["real_mismatches"]) == (1, 0)
        assert flip["identical_up_to_near_ties"] is True
        assert "no (1 near-tie, 0 real)" in format_console_table(report)
    else:
        assert (flip["near_tie_mismatches"], flip["real_mismatches"]) == (0, 1)
        assert flip["identical_up_to_near_ties"] is False


def test_teacher_forced_fallback_when_the_replay_does_not_reproduce_plain(monkeypatch):
    """Where the untimed replay of plain ``generate`` does not reproduce the timed run (non-deterministic kernels), one
    teacher-forced pass over plain's output gives the logits instead."""

    def record_nothing(self, input_ids, scores):
        return scores

    monkeypatch.setattr(runner._StepLogitsRecorder, "__call__", record_nothing)
    report = _bench(make_target(), [flip_method(3, "worst")])
    flip = _record(report, "flip-worst")
    assert (flip["mismatches"], flip["real_mismatches"]) == (2, 2)
    assert {d["source"] for d in flip["mismatch_details"]} == {"teacher_forced"}
    assert all(d["margin"] > d["tolerance"] for d in flip["mismatch_details"])


def test_sampling_records_have_no_mismatch_counts():
    report = run_benchmark(make_target(), char_tokenizer(), [plain_method()], PROMPTS[:1], max_new_tokens=4,
                           temperatures=[0.7], warmup=0, progress=False)  # fmt: skip
    (rec,) = report["records"]
    assert rec["identical"] is None and rec["mismatches"] is None and rec["identical_up_to_near_ties"] is None


def test_report_identical_cell():
    from hf_specdec.bench.report import _identical

    assert _identical({"identical": True, "mismatches": 0}) == "yes"
    assert _identical({"identical": None}) == "—"
    assert _identical({"identical": False}) == "no"  # a report written before the classification
    assert (
        _identical({"identical": False, "near_tie_mismatches": 3, "real_mismatches": 0}) == "no (3 near-ties, 0 real)"
    )
    assert _identical({"identical": False, "near_tie_mismatches": 1, "real_mismatches": 2}) == "no (1 near-tie, 2 real)"
