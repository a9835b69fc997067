"""The training contract: shared target-features code below the families, declared loss kwargs, metrics reduced
key by key."""

import ast
import pathlib

import pytest
import torch
from helpers import make_target
from test_training_trainer import args, fresh, self_distilled

import hf_specdec.features as core_features
import hf_specdec.training.features as training_features
from hf_specdec.features import TargetFeatures, soft_labels, target_logits_from_last_hidden
from hf_specdec.modeling_utils import DraftLossOutput
from hf_specdec.training.trainer import DrafterTrainer, TrainingMetrics

SRC = pathlib.Path(core_features.__file__).parent


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or "")
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_families_and_core_do_not_import_training():
    offenders = []
    for path in [*(SRC / "models").rglob("*.py"), SRC / "modeling_utils.py", SRC / "features.py"]:
        offenders += [f"{path.relative_to(SRC)}: {m}" for m in _imports(path) if "training" in m.split(".")]
    assert not offenders
    # training re-exports the shared objects rather than keeping copies
    for name in ("TargetFeatures", "target_logits_from_last_hidden", "soft_labels", "walk_passes"):
        assert getattr(training_features, name) is getattr(core_features, name)


def test_soft_labels_apply_the_softcap_once_and_restrict_to_a_vocab():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 12, bias=False)
    head.weight.data.mul_(20)
    hidden = torch.randn(2, 5, 8)
    raw = head(hidden).float()
    capped = torch.tanh(raw / 3.0) * 3.0
    feats = TargetFeatures(hidden_states=[], last_hidden=hidden, softcap=3.0)
    labels = feats.soft_labels(head)
    torch.testing.assert_close(labels.probs, torch.softmax(capped, -1))
    torch.testing.assert_close(feats.logits(head), capped)
    ids = torch.tensor([1, 4, 7])
    sub = soft_labels(head, hidden, ids, softcap=3.0)
    torch.testing.assert_close(sub.probs, torch.softmax(capped[..., ids], -1))
    assert torch.equal(sub.argmax, capped[..., ids].argmax(-1)) and torch.equal(sub.full_argmax, capped.argmax(-1))
    torch.testing.assert_close(target_logits_from_last_hidden(head, hidden), raw)


def _out(correct, valid, tokens, passes):
    metrics = {"correct": torch.tensor(correct), "valid": torch.tensor(valid)}
    metrics.update(walk_tokens=torch.tensor(tokens), walk_passes=torch.tensor(passes))
    return DraftLossOutput(loss=torch.tensor(1.0), metrics=metrics)


def test_metrics_sum_key_by_key_then_rates(monkeypatch, tmp_path):
    # Three heads (not K): rates are ratios of sums, not means of per-batch ratios.
    m = TrainingMetrics()
    m.add(_out([1.0, 0.0, 0.0], [1.0, 1.0, 1.0], 2.0, 1.0), tokens=4)
    m.add(_out([9.0, 5.0, 1.0], [9.0, 9.0, 9.0], 30.0, 10.0), tokens=4)
    assert m.accuracy == pytest.approx([1.0, 0.5, 0.1])
    assert m.simulated_tau == pytest.approx(32 / 11)
    assert m.as_dict()["acc_2"] == 0.1 and "acc_3" not in m.as_dict()
    with pytest.raises(ValueError, match="changed shape"):
        m.add(_out([1.0], [1.0], 1.0, 1.0), tokens=1)

    # Across processes: every process's sums are gathered and added key by key.
    target = make_target("llama", seed=2)
    trainer = DrafterTrainer(fresh(target), target, args(tmp_path), self_distilled(target, 4))
    other = TrainingMetrics()
    other.add(_out([0.0, 0.0, 0.0], [10.0, 0.0, 0.0], 10.0, 10.0), tokens=3)
    import accelerate.utils

    def fake_gather(obj):  # two processes: this one and `other`
        mine = obj[0]
        theirs = {"head": [other.loss_sum, other.batches, other.tokens], "rates": other.rates,
                  "sums": {k: v.tolist() for k, v in other.sums.items()}}  # fmt: skip
        return [mine, theirs]

    monkeypatch.setattr(accelerate.utils, "gather_object", fake_gather)
    both = trainer._all_reduce(m)
    assert both.batches == 3 and both.tokens == 11
    assert both.accuracy == pytest.approx([10 / 20, 5 / 10, 1 / 10])
    assert both.simulated_tau == pytest.approx(42 / 21)


def test_declared_loss_kwargs_reach_compute_loss_and_others_are_refused(tmp_path):
    target = make_target("llama", seed=2)
    data = self_distilled(target, 4)
    with pytest.raises(
        ValueError, match=r"does not take the loss kwargs \['lambda0'\]; it declares \['steps', 'decay'\]"
    ):
        DrafterTrainer(fresh(target), target, args(tmp_path, loss_kwargs={"lambda0": 0.2}), data)
    trainer = DrafterTrainer(fresh(target), target, args(tmp_path, loss_kwargs={"steps": 2}), data, data)
    assert len(trainer.draft_metrics().accuracy) == 2  # K is 4: the loss kwarg set the TTT steps


def test_cli_loss_kwargs_and_stop_flags_parse():
    from hf_specdec.commands import build_parser
    from hf_specdec.commands.train import _loss_kwargs

    argv = ["train", "--target", "t", "--output-dir", "o", "--loss-kwarg", "decay=0.5", "--loss-kwarg", "mode=x",
            "--ttt-steps", "3", "--stop-after-steps", "7"]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert _loss_kwargs(parsed) == {"decay": 0.5, "mode": "x", "steps": 3} and parsed.stop_after_steps == 7
    assert _loss_kwargs(build_parser().parse_args(argv[:5])) is None
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _loss_kwargs(build_parser().parse_args([*argv[:5], "--loss-kwarg", "novalue"]))


def test_init_from_target_runs_on_fresh_drafters_only(tmp_path):
    """A family's target-dependent initialisation (e.g. heads copied from the target's LM head) runs once, on a
    drafter that starts from scratch, before training; a resumed run does not run it again."""
    target = make_target("llama", seed=2)
    data = self_distilled(target, 4)
    calls = []

    class CopiesHead(type(fresh(target))):
        def init_from_target(self, tgt):
            calls.append(tgt)
            with torch.no_grad():
                self.lm_head.weight.copy_(tgt.get_output_embeddings().weight[: self.lm_head.weight.shape[0]])
            calls.append(self.lm_head.weight.detach().clone())

    drafter = CopiesHead(fresh(target).config)
    head = target.get_output_embeddings().weight[: drafter.lm_head.weight.shape[0]].detach().clone()
    trainer = DrafterTrainer(drafter, target, args(tmp_path, max_steps=2, save_steps=2, eval_steps=2), data)
    trainer.train()
    assert len(calls) == 2 and calls[0] is target and torch.equal(calls[1], head)  # ran once, before any step
    assert not torch.equal(trainer.unwrapped_drafter.lm_head.weight, head)  # then trained from there
    resumed = CopiesHead(fresh(target).config)
    again = DrafterTrainer(resumed, target, args(tmp_path, max_steps=3, save_steps=2, eval_steps=2), data)
    again.train(resume_from_checkpoint=True)
    assert len(calls) == 2  # not called again on resume


def test_online_features_capture_only_the_layers_read():
    from hf_specdec.training.features import capture_target_features

    target = make_target("llama", seed=1, layers=6)
    seen = []
    original = target.forward

    def forward(*a, **kw):
        seen.append(kw.get("output_hidden_states"))
        return original(*a, **kw)

    target.forward = forward
    ids = torch.randint(6, 90, (2, 10))
    feats = capture_target_features(target, ids, torch.ones_like(ids), [2, 4, 5])
    assert seen == [[-1, 2, 4, 5]]
    del target.forward
    full = target(ids, output_hidden_states=True).hidden_states
    for got, i in zip(feats.hidden_states, [2, 4, 5]):
        torch.testing.assert_close(got, full[i])
    torch.testing.assert_close(feats.last_hidden, full[-1])
