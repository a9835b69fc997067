"""One drafter used from several threads: it stays bound to its target for the whole of a ``generate`` call.

A call with another target while one runs is refused (it would re-bind the drafter under the running call: still
lossless, but drafting with the other target's embeddings and head); calls with the same target share it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import make_target, ragged_batch
from transformers import StoppingCriteria

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.generation.adaptive import controller_for


class _PauseOnce(StoppingCriteria):
    """Stops nothing; on its first call it signals ``started`` and waits for ``release`` (a call caught midway)."""

    def __init__(self):
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(60), "the test never released the paused generate call"
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _drafter(target):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()


def _generate(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kw)


def _start_paused_call(target, drafter, ids, mask):
    pause, result = _PauseOnce(), {}

    def run():
        result["out"] = _generate(target, ids, mask, assistant_model=drafter, stopping_criteria=[pause])

    thread = threading.Thread(target=run)
    thread.start()
    assert pause.started.wait(60), "the generate call never reached its first stopping check"
    return thread, pause, result


def test_another_target_is_refused_while_a_call_runs_and_welcome_after():
    first, second = make_target("llama", seed=0), make_target("llama", seed=1)
    drafter = _drafter(first)
    ids, mask = ragged_batch(1)
    thread, pause, result = _start_paused_call(first, drafter, ids, mask)
    try:
        with pytest.raises(RuntimeError, match="generating for another target.*from_pretrained"):
            _generate(second, ids, mask, assistant_model=drafter)
        with pytest.raises(RuntimeError, match="generating for another target"):
            drafter.bind_target(second)
        assert drafter.bound_target is first
    finally:
        pause.release.set()
        thread.join(60)
    assert torch.equal(result["out"], _generate(first, ids, mask))  # the paused call finished, still lossless
    out = _generate(second, ids, mask, assistant_model=drafter)  # no call runs now: it re-binds
    assert drafter.bound_target is second
    assert torch.equal(out, _generate(second, ids, mask))


def test_calls_with_the_same_target_share_the_drafter():
    target = make_target("llama")
    drafter = _drafter(target)
    ids, mask = ragged_batch(1)
    thread, pause, result = _start_paused_call(target, drafter, ids, mask)
    try:
        other = _generate(target, ids, mask, assistant_model=drafter)  # runs to the end beside the paused call
    finally:
        pause.release.set()
        thread.join(60)
    plain = _generate(target, ids, mask)
    assert torch.equal(other, plain) and torch.equal(result["out"], plain)


def test_a_failed_call_releases_the_drafter():
    first, second = make_target("llama", seed=0), make_target("llama", seed=1)
    drafter = _drafter(first)
    ids, mask = ragged_batch(1)
    with pytest.raises(ValueError, match="num_beams"):
        _generate(first, ids, mask, assistant_model=drafter, num_beams=2)
    assert torch.equal(_generate(second, ids, mask, assistant_model=drafter), _generate(second, ids, mask))


def test_adaptive_memory_is_kept_per_target():
    first, second = make_target("llama", seed=0), make_target("llama", seed=1)
    drafter = _drafter(first)
    ids, mask = ragged_batch(1)
    _generate(first, ids, mask, assistant_model=drafter)
    cpu = torch.device("cpu")
    learned = controller_for(drafter, first, 3, None, 1, False, cpu)
    assert learned.passes > 0
    fresh = controller_for(drafter, second, 3, None, 1, False, cpu)
    assert fresh is not learned and fresh.passes == 0  # the second target does not inherit the first's costs


def test_the_adaptive_memory_lives_outside_the_drafter_resets_and_goes_with_it():
    import gc
    import weakref

    from hf_specdec.generation.adaptive import _MEMORIES, draft_length_memory

    target = make_target("llama", seed=0)
    drafter = _drafter(target)
    ids, mask = ragged_batch(1)
    before = dict(vars(drafter))
    _generate(target, ids, mask, assistant_model=drafter)
    # nothing of the adaptive length is stashed on the drafter (only the count of calls it is bound in)
    assert set(vars(drafter)) - set(before) <= {"_generations"}
    cpu = torch.device("cpu")
    learned = controller_for(drafter, target, 3, None, 1, False, cpu)
    assert learned.passes > 0
    draft_length_memory(drafter).reset()
    assert controller_for(drafter, target, 3, None, 1, False, cpu).passes == 0  # starts cold again
    gone, memory = weakref.ref(drafter), weakref.ref(draft_length_memory(drafter))
    assert drafter in _MEMORIES
    del drafter, learned
    gc.collect()
    assert gone() is None and memory() is None  # the memory went with its drafter
