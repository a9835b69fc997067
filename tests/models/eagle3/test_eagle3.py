"""EAGLE-3: the shared drafter tester plus family-specific checks."""

import pytest
import torch
from drafter_tester import DrafterTesterMixin, RecordingSelector, prefill_inputs
from helpers import make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, Eagle3Config, Eagle3ForDrafting


class TestEagle3(DrafterTesterMixin):
    config_class = Eagle3Config
    model_class = Eagle3ForDrafting
    config_overrides = {"intermediate_size": 64}

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        # Training-time test: step j at anchor t reads the teacher-forced token t + 1 + j.
        feats = drafter.select_target_features(hidden_states)
        return [logits for logits, _ in drafter.ttt_forward(input_ids, feats, attention_mask, steps)]


class TestEagle3TwoLayers(TestEagle3):
    """The whole shared tester on a drafter with two draft layers (``midlayer`` and ``upper_layers.0``)."""

    config_overrides = {"intermediate_size": 64, "num_hidden_layers": 2}
    layouts_refusing = {"eagle3": "draft layers"}  # SafeAILab's runtime has one draft layer; vLLM's has layers.{i}

    def make_drafter(self, target, seed=0, **overrides):
        # The tiny targets are built under seed 0 too: a plain upper layer initialised from the same random stream
        # would come out equal to a target layer, which test_no_target_weights_saved reads as a copied weight.
        return super().make_drafter(target, seed=seed + 1000, **overrides)


def test_default_layer_ids_follow_reference():
    # hidden_states[2], [L // 2], [L - 3] (inputs of decoder layers 2, L//2, L-3), e.g. [2, 16, 29] for 32 layers.
    assert Eagle3Config.default_target_layer_ids(32) == [2, 16, 29]
    assert Eagle3Config.default_target_layer_ids(36) == [2, 18, 33]
    target = make_target("llama", layers=8)
    assert Eagle3Config.for_target(target.config).target_layer_ids == [2, 4, 5]


def test_hidden_size_must_match_target():
    target = make_target("llama")
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3Config.for_target(target.config, hidden_size=64)


def test_reduced_draft_vocab_round_trip_and_mapping(tmp_path):
    target = make_target("llama")
    config = Eagle3Config.for_target(target.config, draft_vocab_size=40, intermediate_size=64)
    drafter = AutoModelForDrafting.from_config(config).eval()
    used = torch.arange(6, 96, 2)[:40]  # even ids 6..84
    drafter.set_draft_vocab(used)
    assert torch.equal(drafter.draft_token_ids, used)
    assert int(drafter.t2d.sum()) == 40 and bool(drafter.t2d[used].all())
    drafter.check_draft_vocab()
    drafter.save_pretrained(tmp_path)
    loaded = AutoModelForDrafting.from_pretrained(tmp_path)
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    # Draft tokens only come from the draft vocabulary; generation stays identical to plain greedy.
    drafter.bind_target(target)
    ids, mask = ragged_batch(2)
    state = drafter.init_draft_state(2, 64)
    drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([7, 8])))
    prop = drafter.propose(state, 5, RecordingSelector())
    assert bool(torch.isin(prop.tokens, used).all())
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)


def test_corrupt_vocab_mapping_is_detected():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, draft_vocab_size=40))
    drafter.t2d[0] = False
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        drafter.check_draft_vocab()
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocab(torch.zeros(40, dtype=torch.long))


def test_forward_matches_incremental_observe():
    """`forward` over a sequence (the training path) equals the loop's incremental path."""
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval().bind_target(target)
    ids, mask = ragged_batch(1, length=10)
    inputs = prefill_inputs(target, ids, mask, torch.tensor([9]))
    feats = [inputs.hidden_states[i] for i in drafter.config.target_layer_ids]
    out = drafter(input_ids=inputs.next_token_ids, target_hidden_states=feats, position_ids=inputs.position_ids)
    state = drafter.init_draft_state(1, 64)
    drafter.observe(state, inputs)
    torch.testing.assert_close(state.last_logits, out.logits[:, -1])
    torch.testing.assert_close(state.last_hidden, out.hidden_states[:, -1])


def test_incomplete_or_corrupt_checkpoints_fail_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    drafter.save_pretrained(tmp_path / "missing")
    weights = load_file(str(tmp_path / "missing" / "model.safetensors"))
    weights.pop("fc.weight")
    save_file(weights, str(tmp_path / "missing" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights \['fc.weight'\]"):
        AutoModelForDrafting.from_pretrained(tmp_path / "missing")
    loaded = AutoModelForDrafting.from_pretrained(tmp_path / "missing", allow_missing_weights=True)
    assert isinstance(loaded, Eagle3ForDrafting)

    drafter.save_pretrained(tmp_path / "truncated")
    path = tmp_path / "truncated" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        AutoModelForDrafting.from_pretrained(tmp_path / "truncated")

    reduced = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, draft_vocab_size=40))
    reduced.t2d[3] = False
    reduced.t2d[90] = True  # t2d no longer matches d2t
    reduced.save_pretrained(tmp_path / "badvocab")
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        AutoModelForDrafting.from_pretrained(tmp_path / "badvocab")


def test_with_draft_layers_starts_where_the_shallower_drafter_is():
    """A drafter deepened with ``with_draft_layers`` keeps every weight, drafts the same logits and the same tokens
    (its added layers start as identities), has one cache per layer, and its added layers train."""
    target = make_target("llama", seed=3)
    torch.manual_seed(0)
    shallow = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, intermediate_size=64)).eval()
    deeper = shallow.with_draft_layers(3).eval()
    assert deeper.config.num_hidden_layers == 3 and shallow.config.num_hidden_layers == 1
    assert len(deeper.upper_layers) == 2 and not hasattr(shallow, "upper_layers")
    for key, value in shallow.state_dict().items():
        assert torch.equal(deeper.state_dict()[key], value), key
    ids, mask = ragged_batch(2, length=10, seed=5)
    feats = [h for h in target(ids, attention_mask=mask, output_hidden_states=True).hidden_states]
    feats = [feats[i] for i in shallow.config.target_layer_ids]
    shallow.bind_target(target), deeper.bind_target(target)
    torch.testing.assert_close(
        deeper(ids, target_hidden_states=feats, attention_mask=mask).logits,
        shallow(ids, target_hidden_states=feats, attention_mask=mask).logits,
    )
    # a fixed chain: the adaptive length reads the clock, so its accepted lengths differ from run to run
    kw = dict(
        attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, draft_length="fixed"
    )
    a = target.generate(ids, assistant_model=shallow, **kw)
    b = target.generate(ids, assistant_model=deeper, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert a.accepted_lengths == b.accepted_lengths
    # The zero output projections still pass gradients: one step moves the added layers.
    deeper.train()
    loss = deeper(ids, target_hidden_states=feats, attention_mask=mask).logits.float().logsumexp(-1).mean()
    loss.backward()
    assert deeper.upper_layers[0].self_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="adds layers"):
        deeper.with_draft_layers(2)
