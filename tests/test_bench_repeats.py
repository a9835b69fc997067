"""Speedups that survive a noisy machine: per-repeat ratios, their interval, the verdict and the load record.

No test here asserts a timing: the runs are synthetic, or only the report's shape is checked."""

import math
import statistics

import pytest
import torch
from helpers import char_tokenizer, make_target

from hf_specdec.bench.prompts import PromptItem
from hf_specdec.bench.report import _load_line, format_console_table, markdown_table
from hf_specdec.bench.runner import (
    _T975,
    _aggregate,
    _Run,
    _speedup_interval,
    _speedup_spread,
    _t975,
    _verdict,
    plain_method,
    prompt_lookup_method,
    run_benchmark,
)


def _runs(seconds_by_repeat, tokens_by_repeat):
    """``{batch: [run of repeat 0, run of repeat 1, ...]}`` from per-repeat lists of per-batch seconds / tokens."""
    out = {}
    for seconds, tokens in zip(seconds_by_repeat, tokens_by_repeat):
        for b, (s, t) in enumerate(zip(seconds, tokens)):
            out.setdefault(b, []).append(_Run(seconds=s, new_tokens=t, target_forwards=t))
    return out


T = 0.7  # sampling: no greedy identity check, so the synthetic runs need no sequences


def _results(**methods):
    return {(name, T, 1, b): runs for name, by_batch in methods.items() for b, runs in by_batch.items()}


# Two prompt batches, three repeats; the machine runs three times slower during repeat 1.
PLAIN = _runs([[1.0, 1.0], [3.0, 3.0], [1.0, 1.0]], [[10, 10], [10, 10], [10, 10]])  # 10, 10/3, 10 tokens/s
METHOD = _runs([[0.5, 1.5], [1.0, 2.0], [0.5, 0.5]], [[10, 10], [10, 20], [10, 10]])  # 10, 10, 20 tokens/s


def test_per_repeat_speedups_from_synthetic_runs():
    results = _results(plain=PLAIN, m=METHOD)
    plain = _aggregate(results, "plain", T, 1, [0, 1], None, "plain", plain_row=True)
    assert plain["tokens_per_s_by_repeat"] == pytest.approx([10.0, 10 / 3, 10.0], rel=1e-4)
    assert plain["speedup_by_repeat"] == [] and plain["verdict"] is None  # the baseline has no ratio of its own
    rec = _aggregate(results, "m", T, 1, [0, 1], plain, "plain")
    # Repeat r: the method's tokens over its seconds, both summed over the batches of that repeat, over plain's.
    assert rec["speedup_by_repeat"] == pytest.approx([1.0, 3.0, 2.0], rel=1e-4)
    assert (rec["speedup_median"], rec["speedup_min"], rec["speedup_max"]) == pytest.approx((2.0, 1.0, 3.0), rel=1e-4)
    # The pooled ratio of totals (70 tokens in 6 s against 60 in 10 s) is kept, and differs from the median.
    assert rec["speedup"] == pytest.approx((70 / 6) / (60 / 10), rel=1e-3)
    logs = [0.0, math.log(3.0), math.log(2.0)]
    half = 4.3027 * statistics.stdev(logs) / math.sqrt(3)
    expected = [math.exp(statistics.fmean(logs) - half), math.exp(statistics.fmean(logs) + half)]
    assert rec["speedup_ci95"] == pytest.approx(expected, rel=1e-4)
    assert rec["verdict"] == "within noise"
    # Only the first category's batch: ratios over that batch alone.
    rec = _aggregate(results, "m", T, 1, [0], _aggregate(results, "plain", T, 1, [0], None, "plain"), "plain")
    assert rec["speedup_by_repeat"] == pytest.approx([2.0, 3.0, 2.0], rel=1e-4)


def test_spread_of_tight_ratios_gives_a_verdict():
    plain = [10.0, 5.0, 20.0]  # the machine's speed varies fourfold between repeats
    faster = _speedup_spread([15.0, 7.6, 29.6], plain)
    assert faster["speedup_median"] == pytest.approx(1.5) and faster["verdict"] == "faster"
    assert faster["speedup_ci95"][0] > 1.0
    slower = _speedup_spread([9.0, 4.6, 17.6], plain)
    assert slower["verdict"] == "slower than plain" and slower["speedup_ci95"][1] < 1.0
    two = _speedup_spread([30.0, 15.0], plain[:2])
    assert two["verdict"] == "too few repeats" and two["speedup_ci95"] == pytest.approx([3.0, 3.0])
    one = _speedup_spread([30.0], plain[:1])
    assert one["speedup_median"] == pytest.approx(3.0) and one["speedup_ci95"] is None
    assert one["verdict"] == "too few repeats"
    assert _speedup_spread([None, 5.0, 5.0], plain)["speedup_by_repeat"] == pytest.approx([1.0, 0.25])


def test_verdict_boundaries():
    assert _verdict((1.0, 1.3), 3) == "within noise"  # a lower bound of exactly 1 is not faster
    assert _verdict((math.nextafter(1.0, 2.0), 1.3), 3) == "faster"
    assert _verdict((0.7, 1.0), 3) == "within noise"  # an upper bound of exactly 1 is not slower
    assert _verdict((0.7, math.nextafter(1.0, 0.0)), 3) == "slower than plain"
    assert _verdict((0.9, 1.1), 5) == "within noise"
    assert _verdict((1.5, 2.0), 2) == "too few repeats"
    assert _verdict(None, 3) == "too few repeats"


def test_interval_is_the_t_interval_of_log_ratios():
    assert _speedup_interval([1.4]) is None
    assert _speedup_interval([1.2, 1.2, 1.2]) == pytest.approx((1.2, 1.2))
    low, high = _speedup_interval([0.5, 2.0])  # symmetric in log space around a geometric mean of 1
    assert low * high == pytest.approx(1.0) and high == pytest.approx(math.exp(12.7062 * math.log(4) / 2))
    assert _t975(2) == 4.3027 and len(_T975) == 30
    assert _t975(31) == pytest.approx(2.0395, abs=2e-4) and _t975(1000) == pytest.approx(1.9623, abs=2e-4)


def test_report_records_load_and_shows_verdicts():
    torch.manual_seed(0)
    item = PromptItem(id="a", category="letters", text="abcabcabc")
    methods = [plain_method(), prompt_lookup_method(num_tokens=3)]
    report = run_benchmark(
        make_target(), char_tokenizer(), methods, [item], max_new_tokens=6, warmup=0, repeats=3, progress=False
    )
    load = report["load"]
    assert set(load) == {"loadavg_start", "per_repeat", "loadavg_end", "cpu_count", "process_cpus", "torch_threads"}
    assert [p["repeat"] for p in load["per_repeat"]] == [0, 1, 2]
    assert all(len(p["loadavg"]) == 3 for p in load["per_repeat"]) and len(load["loadavg_start"]) == 3
    assert load["torch_threads"] == torch.get_num_threads() and load["process_cpus"] >= 1
    (plain,) = [r for r in report["records"] if r["kind"] == "plain"]
    assert plain["speedup"] == 1.0 and plain["speedup_by_repeat"] == [] and plain["verdict"] is None
    (rec,) = [r for r in report["records"] if r["kind"] == "prompt_lookup"]
    assert len(rec["speedup_by_repeat"]) == 3 and len(rec["tokens_per_s_by_repeat"]) == 3
    assert rec["speedup_min"] <= rec["speedup_median"] <= rec["speedup_max"]
    assert rec["verdict"] in {"faster", "within noise", "slower than plain"}
    assert rec["verdict"] in markdown_table(report) and rec["verdict"] in format_console_table(report)
    assert _load_line(load).startswith("**Machine load:** 1-minute load average")


def test_speedup_cell_and_load_line():
    rec = {"method": "m", "kind": "drafter", "mode": "greedy", "batch_size": 1, "category": "all", "speedup": 1.9}
    rec.update(speedup_median=1.62, speedup_ci95=[1.5, 1.75], verdict="faster")
    table = markdown_table({"records": [rec]})
    assert "| 1.62× [1.50–1.75] | faster |" in table
    busy = {"loadavg_start": [3.0, 2.0, 1.0], "per_repeat": [{"loadavg": [5.5, 3, 1]}, {"loadavg": [1.5, 2, 1]}]}
    busy.update(loadavg_end=[2.0, 2.0, 1.0], cpu_count=4, process_cpus=2, torch_threads=2)
    line = _load_line(busy)
    assert "3.00 at the start, 1.50–5.50 after each of 2 repeats, 2.00 at the end" in line
    assert "2 CPUs for this process, 2 torch threads" in line and "exceeded the CPU count" in line
    quiet = dict(busy, loadavg_start=None, per_repeat=[], loadavg_end=None)
    assert "no load average" in _load_line(quiet) and _load_line(None) is None
