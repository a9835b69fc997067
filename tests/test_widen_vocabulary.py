"""Widening a trained drafter's draft vocabulary: its trained weights kept, the new tokens initialised from the
target, then fine-tuned (``train_drafter(..., drafter=path, drafter_overrides={"draft_vocab_size": N})``); and
deepening a trained EAGLE-3 drafter the same way (``{"num_hidden_layers": N}``, ``hf-specdec train --draft-layers``)."""

import types

import pytest
import torch
from helpers import make_target
from test_training_trainer import args, fresh, self_distilled

from hf_specdec import AutoModelForDrafting
from hf_specdec.testing import OracleDrafter, OracleDrafterConfig
from hf_specdec.training.data import loss_token_counts
from hf_specdec.training.recipes import train_drafter
from hf_specdec.training.trainer import DrafterTrainer


@pytest.fixture(scope="module")
def target():
    return make_target("llama", seed=2, sharpen=20.0)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    data = self_distilled(target, 8)
    drafter = fresh(target, draft_vocab_size=48)
    DrafterTrainer(drafter, target, args(folder / "run"), data).train()
    drafter.save_pretrained(folder / "drafter")
    return str(folder / "drafter"), data


def test_widening_keeps_every_trained_weight_and_maps_the_targets_rows_for_new_tokens(target, trained):
    path, data = trained
    old = AutoModelForDrafting.from_pretrained(path).eval()
    counts = loss_token_counts(data, target.config.vocab_size)
    wider = old.widened_draft_vocabulary(80, counts, target).eval()

    old_ids, new_ids = old.draft_token_ids, wider.draft_token_ids
    assert new_ids.numel() == 80 and set(old_ids.tolist()) <= set(new_ids.tolist())
    added = sorted(set(new_ids.tolist()) - set(old_ids.tolist()))
    outside = counts.clone()
    outside[old_ids] = -1
    assert added == sorted(torch.argsort(-outside.double(), stable=True)[:32].tolist())  # the most frequent others
    places = torch.searchsorted(new_ids, old_ids)
    assert torch.equal(wider.lm_head.weight[places], old.lm_head.weight)
    for name, value in old.state_dict().items():
        if name not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(wider.state_dict()[name], value), name
    # The same hidden state gives the same logits on the old tokens.
    hidden = torch.randn(3, old.config.hidden_size)
    assert torch.allclose(wider.draft_logits(hidden)[:, places], old.draft_logits(hidden), atol=1e-6)
    assert wider.config.name_or_path == old.config.name_or_path  # trained: the trainer does not re-initialise it


def test_new_rows_follow_the_map_the_trained_rows_have_from_the_targets_rows(target, trained):
    # Trained rows that are exactly an affine map of the target's rows: the new tokens' rows are that map of theirs.
    path, data = trained
    old = AutoModelForDrafting.from_pretrained(path).eval()
    head = target.get_output_embeddings().weight.detach()
    torch.manual_seed(3)
    mapping, shift = torch.randn(head.shape[1], old.config.hidden_size), torch.randn(old.config.hidden_size)
    with torch.no_grad():
        old.lm_head.weight.copy_(head[old.draft_token_ids] @ mapping + shift)
    wider = old.widened_draft_vocabulary(80, loss_token_counts(data, target.config.vocab_size), target)
    new = wider.draft_token_ids
    assert torch.allclose(wider.lm_head.weight, head[new] @ mapping + shift, atol=1e-4)
    assert not torch.allclose(wider.lm_head.weight, head[new], atol=1e-2)  # not the target's raw rows


def test_fine_tuning_with_a_wider_vocabulary_through_train_drafter(target, trained, tmp_path):
    path, data = trained
    old_ids = AutoModelForDrafting.from_pretrained(path).draft_token_ids
    run = args(tmp_path, max_steps=4, save_steps=2, eval_steps=100)
    drafter, record = train_drafter(target, None, list(data.examples), run, drafter=path,
                                    drafter_overrides={"draft_vocab_size": 80}, eval_fraction=0.0)  # fmt: skip
    assert record["steps"] == 4 and drafter.config.draft_vocab_size == 80
    assert set(old_ids.tolist()) <= set(drafter.draft_token_ids.tolist())
    saved = AutoModelForDrafting.from_pretrained(tmp_path / "out")
    assert torch.equal(saved.draft_token_ids, drafter.draft_token_ids)
    # Resuming rebuilds the same wider drafter (the same counts), so the checkpoint fits it.
    again = args(tmp_path / "again", max_steps=4, save_steps=2, eval_steps=100, stop_after_steps=2)
    train_drafter(target, None, list(data.examples), again, drafter=path,
                  drafter_overrides={"draft_vocab_size": 80}, eval_fraction=0.0)  # fmt: skip
    _, resumed = train_drafter(target, None, list(data.examples), args(tmp_path / "again", max_steps=4, save_steps=2,
                               eval_steps=100), drafter=path, drafter_overrides={"draft_vocab_size": 80},
                               eval_fraction=0.0, resume=True)  # fmt: skip
    assert resumed["steps"] == 4


def test_widening_refuses_what_it_cannot_do(target, trained, tmp_path):
    path, data = trained
    old = AutoModelForDrafting.from_pretrained(path)
    counts = loss_token_counts(data, target.config.vocab_size)
    with pytest.raises(ValueError, match="can only grow: Eagle3ForDrafting has 48 tokens"):
        old.widened_draft_vocabulary(32, counts, target)
    with pytest.raises(ValueError, match="can only grow"):
        old.widened_draft_vocabulary(target.config.vocab_size + 1, counts, target)
    full = OracleDrafter(OracleDrafterConfig.for_target(target.config))
    with pytest.raises(ValueError, match="full vocabulary; there is no draft vocabulary to widen"):
        full.widened_draft_vocabulary(40, counts, target)
    with pytest.raises(ValueError, match="Architecture overrides only apply to a fresh drafter"):
        train_drafter(target, None, list(data.examples), args(tmp_path, max_steps=1), drafter=path,
                      drafter_overrides={"num_draft_tokens": 2})  # fmt: skip


def test_deepening_a_trained_drafter_through_train_drafter(target, trained, tmp_path):
    """``num_hidden_layers`` with a trained EAGLE-3 drafter deepens it (trained weights kept) and trains the added
    layer; the drafter starts where the trained one is (the same held-out accuracy before its first step)."""
    path, data = trained
    old = AutoModelForDrafting.from_pretrained(path)
    start = DrafterTrainer(old.with_draft_layers(2), target, args(tmp_path / "score"), data, data).draft_metrics()
    base = DrafterTrainer(old, target, args(tmp_path / "base"), data, data).draft_metrics()
    assert start.accuracy == base.accuracy
    run = args(tmp_path, max_steps=4, save_steps=2, eval_steps=100)
    drafter, record = train_drafter(target, None, list(data.examples), run, drafter=path,
                                    drafter_overrides={"num_hidden_layers": 2}, eval_fraction=0.0)  # fmt: skip
    assert record["steps"] == 4 and drafter.config.num_hidden_layers == 2
    assert drafter.upper_layers[0].mlp.down_proj.weight.abs().sum() > 0  # trained away from its zero start
    saved = AutoModelForDrafting.from_pretrained(tmp_path / "out")
    assert saved.config.num_hidden_layers == 2
    assert set(old.state_dict()) < set(saved.state_dict())
    with pytest.raises(ValueError, match="adds layers"):
        train_drafter(target, None, list(data.examples), args(tmp_path / "less"), drafter=str(tmp_path / "out"),
                      drafter_overrides={"num_hidden_layers": 1}, eval_fraction=0.0)  # fmt: skip
    flat = OracleDrafter(OracleDrafterConfig.for_target(target.config))
    with pytest.raises(ValueError, match="OracleDrafter cannot be deepened"):
        train_drafter(target, None, list(data.examples), args(tmp_path / "flat"), drafter=flat,
                      drafter_overrides={"num_hidden_layers": 2}, eval_fraction=0.0)  # fmt: skip


def test_a_context_vocabulary_added_to_a_trained_drafter_through_train_drafter(target, trained, tmp_path):
    """``{"context_vocabulary": True}`` (``hf-specdec train --context-vocabulary``) with a trained EAGLE-3 drafter
    adds the map (fitted to its LM head, every trained weight kept) and trains it with the drafter; a drafter family
    without one is refused by name, and a fresh drafter with one warns that it trails the same drafter without."""
    from hf_specdec.commands.common import drafter_overrides

    path, data = trained
    old = AutoModelForDrafting.from_pretrained(path)
    assert drafter_overrides(types.SimpleNamespace(context_vocabulary=True)) == {"context_vocabulary": True}
    run = args(tmp_path, max_steps=4, save_steps=2, eval_steps=100)
    drafter, record = train_drafter(target, None, list(data.examples), run, drafter=path,
                                    drafter_overrides={"context_vocabulary": True}, eval_fraction=0.0)  # fmt: skip
    assert record["steps"] == 4 and drafter.config.context_vocabulary
    saved = AutoModelForDrafting.from_pretrained(tmp_path / "out")
    assert saved.config.context_vocabulary and set(old.state_dict()) < set(saved.state_dict())
    grown = old.with_context_vocabulary(target)
    assert not torch.equal(saved.context_vocab.proj.weight, grown.context_vocab.proj.weight)  # trained from its fit
    flat = OracleDrafter(OracleDrafterConfig.for_target(target.config))
    with pytest.raises(ValueError, match="OracleDrafter has no context vocabulary"):
        train_drafter(target, None, list(data.examples), args(tmp_path / "flat"), drafter=flat,
                      drafter_overrides={"context_vocabulary": True}, eval_fraction=0.0)  # fmt: skip
    with pytest.warns(UserWarning, match="fine-tuning stage"):
        fresh(target, draft_vocab_size=48, context_vocabulary=True).bind_target(target).init_from_target(target)
