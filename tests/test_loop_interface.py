"""The drafter/loop contract: which target features are captured, target logits at prefill, options routed through
``generate`` to whoever declares them, and logits processors that are unsafe to re-run."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from helpers import make_target, ragged_batch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_specdec import AutoModelForDrafting, DrafterPreTrainedModel, Eagle3Config, Proposal
from hf_specdec.configuration_utils import DrafterConfig
from hf_specdec.generation import register_stateless_logits_processor


def _record_target_calls(target):
    calls = []
    original = target.forward

    def forward(*args, **kwargs):
        calls.append(kwargs.get("output_hidden_states"))
        return original(*args, **kwargs)

    target.forward = forward
    return calls


def test_only_the_layers_the_drafter_reads_are_captured():
    target = make_target("llama", layers=6)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    calls = _record_target_calls(target)
    ids, mask = ragged_batch(2)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=10, do_sample=False)
    assert calls and all(c == drafter.config.target_layer_ids for c in calls)
    del target.forward
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False))


class LogitsConfig(DrafterConfig):
    model_type = "logits_reader_test_drafter"


class LogitsReader(DrafterPreTrainedModel):
    """Reads only the target's logits (no hidden states) and declares one drafting option of its own."""

    config_class = LogitsConfig
    requires_target_hidden_states = False
    requires_target_logits = True
    draft_options: ClassVar[dict] = {"echo_width": 1}

    def __init__(self, config):
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))
        self.seen = []
        self.options = None
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size, max_length, echo_width=1):
        self.options = {"echo_width": echo_width}
        return {}

    def observe(self, state, inputs):
        self.seen.append((inputs.logits.shape, inputs.hidden_states))
        last = torch.where(inputs.valid, torch.arange(inputs.valid.shape[1]), -1).max(1).values
        state["next"] = inputs.logits[torch.arange(inputs.valid.shape[0]), last].argmax(-1)

    def propose(self, state, num_tokens, select):
        width = min(num_tokens, self.options["echo_width"])
        return Proposal(tokens=state["next"][:, None].expand(-1, width).clone())


def test_target_logits_reach_the_drafter_at_prefill_and_family_options_are_routed():
    target = make_target("qwen3")
    calls = _record_target_calls(target)
    drafter = LogitsReader(LogitsConfig.for_target(target.config)).eval()
    ids, mask = ragged_batch(2)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8, echo_width=2)
    assert drafter.options == {"echo_width": 2}
    prefill_shape, hidden = drafter.seen[0]
    assert prefill_shape[:2] == ids.shape and hidden is None  # every prompt position, no hidden states
    assert all(c is None for c in calls)  # no hidden states asked of the target
    del target.forward
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))
    with pytest.raises(ValueError, match="Unknown drafting option"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8, draft_options={"x": 1})
    # Another family's options are not taken: the keyword then reaches transformers, which refuses it.
    eagle = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    with pytest.raises(ValueError):
        target.generate(ids, attention_mask=mask, assistant_model=eagle, max_new_tokens=8, echo_width=2)


def test_verifier_options_are_routed_to_the_verifier_that_declares_them():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(1)
    out = target.generate(
        ids, assistant_model=drafter, verifier="typical", typical_posterior_threshold=0.5, max_new_tokens=6,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.verifier == "typical" and out.approximate
    with pytest.raises(ValueError, match="verifier='typical'"):
        target.generate(ids, assistant_model=drafter, typical_posterior_alpha=0.1, max_new_tokens=6)
    with pytest.raises(ValueError, match="verifier='typical'"):
        target.generate(ids, assistant_model=drafter, verifier="asd", typical_posterior_alpha=0.1, max_new_tokens=6)
    with pytest.raises(ValueError, match="posterior_threshold"):
        target.generate(
            ids, assistant_model=drafter, verifier="typical", typical_posterior_threshold=-1.0, max_new_tokens=6
        )


class CountingProcessor(LogitsProcessor):
    """A stateful processor: it counts its calls (a watermark or a schedule would behave alike)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def test_stateful_processors_are_refused_and_stateless_ones_can_be_declared():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    ids, mask = ragged_batch(1)
    proc = CountingProcessor()
    with pytest.raises(ValueError, match="register_stateless_logits_processor"):
        target.generate(ids, assistant_model=drafter, logits_processor=LogitsProcessorList([proc]), max_new_tokens=6)
    assert proc.calls == 0  # refused before anything ran

    @register_stateless_logits_processor
    class BanToken(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, 9] = -float("inf")
            return scores

    kwargs = dict(logits_processor=LogitsProcessorList([BanToken()]), max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, tree="fork-10", **kwargs)
    assert torch.equal(out, target.generate(ids, **kwargs))
    assert not bool((out[:, ids.shape[1] :] == 9).any())
