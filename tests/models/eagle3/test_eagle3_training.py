"""EAGLE-3 training objective: train/inference consistency of the training-time test, and the loss itself."""

import pytest
import torch
from drafter_tester import prefill_inputs
from helpers import ARCHS, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, DraftInputs, Eagle3Config
from hf_specdec.layers import SlotKVCache, SlotKVCaches
from hf_specdec.training.features import capture_target_features, target_logits_from_last_hidden


def _drafter(target, **kw):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, **kw)).eval().bind_target(target)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("anchor", [3, 7])
def test_ttt_step_j_equals_inference_drafting_with_teacher_forcing(anchor, layers):
    """Step j of TTT at anchor t computes exactly what the j-th drafted slot computes at inference, with one draft
    layer or a stack of them (each attending to its own keys)."""
    target = make_target("llama", seed=2)
    drafter = _drafter(target, num_hidden_layers=layers)
    ids, mask = ragged_batch(1, length=14)
    feats = capture_target_features(target, ids, mask, drafter.config.target_layer_ids)
    outs = drafter.ttt_forward(ids, feats.hidden_states, mask, steps=4)

    # Inference: observe the verified context up to the anchor, then draft with the true next tokens.
    full = prefill_inputs(target, ids, mask, torch.tensor([0]))
    sl = slice(0, anchor + 1)
    state = drafter.init_draft_state(1, 64)
    drafter.observe(
        state,
        DraftInputs(
            next_token_ids=ids[:, sl.start + 1 : anchor + 2],
            position_ids=full.position_ids[:, sl],
            valid=full.valid[:, sl],
            hidden_states=tuple(h[:, sl] for h in full.hidden_states),
        ),
    )
    torch.testing.assert_close(state.last_logits, outs[0][0][:, anchor], rtol=1e-5, atol=1e-5)
    hidden = state.last_hidden
    for j in range(1, 4):
        emb = drafter.embed_target_tokens(ids[:, anchor + 1 + j : anchor + 2 + j])
        pos = torch.tensor([[anchor + j]])
        out, logits = drafter._step(emb, hidden[:, None], pos, torch.ones(1, 1, dtype=torch.bool), state.cache)
        hidden = out[:, 0]
        torch.testing.assert_close(logits[:, 0], outs[j][0][:, anchor], rtol=1e-5, atol=1e-5)
    assert isinstance(state.cache, SlotKVCache if layers == 1 else SlotKVCaches)
    assert [c.length for c in drafter.layer_caches(state.cache)] == [anchor + 4] * layers


@pytest.mark.parametrize("arch", ARCHS)
def test_last_hidden_reproduces_target_logits(arch):
    """Soft labels are recomputed from output_hidden_states[-1]: it must be the LM-head input for every arch."""
    target = make_target(arch, seed=1)
    ids, mask = ragged_batch(2)
    feats = capture_target_features(target, ids, mask, [1])
    logits = target(input_ids=ids, attention_mask=mask).logits.float()
    head = target.get_output_embeddings()
    softcap = getattr(target.config, "final_logit_softcapping", None)
    torch.testing.assert_close(target_logits_from_last_hidden(head, feats.last_hidden, softcap=softcap), logits)


def test_loss_masks_and_metrics():
    target = make_target("llama", seed=2)
    drafter = _drafter(target)
    ids, mask = ragged_batch(2, length=12)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 8:] = 1
    feats = capture_target_features(target, ids, mask, drafter.config.target_layer_ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    out = drafter.compute_loss(batch, feats, target.get_output_embeddings(), steps=3)
    assert out.loss.requires_grad and out.loss.item() > 0
    # Step j scores anchors t with t + 2 + j in [8, 12): 4 tokens per row at every step.
    m = out.metrics
    assert m["valid"].tolist() == [8.0, 8.0, 8.0]
    assert (m["correct"] <= m["valid"]).all()
    # The walk: each row's region 8..11 starts at anchor 7 and covers 3 drafted tokens in at least one pass.
    assert m["walk_passes_all"].item() >= 2 and m["walk_tokens_all"].item() == 2 * 3
    assert out.accepted.shape == ids.shape and int(out.accepted.max()) <= 3
    none = drafter.compute_loss({**batch, "loss_mask": torch.zeros_like(ids)}, feats, target.get_output_embeddings())
    assert none.loss.item() == 0.0 and none.metrics["valid"].sum().item() == 0
    assert none.metrics["walk_passes_all"].item() == 0


def test_ttt_knobs_live_in_the_config_or_declared_loss_kwargs():
    target = make_target("llama", seed=2)
    drafter = _drafter(target, num_draft_tokens=4, ttt_steps=2, ttt_decay=0.5)
    ids, mask = ragged_batch(2, length=12)
    feats = capture_target_features(target, ids, mask, drafter.config.target_layer_ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    head = target.get_output_embeddings()
    assert drafter.compute_loss(batch, feats, head).metrics["valid"].shape == (2,)  # config.ttt_steps
    assert drafter.compute_loss(batch, feats, head, steps=3).metrics["valid"].shape == (3,)  # loss kwarg
    a = drafter.compute_loss(batch, feats, head).loss
    b = drafter.compute_loss(batch, feats, head, decay=0.5).loss
    c = drafter.compute_loss(batch, feats, head, decay=0.9).loss
    assert a.item() == b.item() and c.item() > a.item()
    with pytest.raises(TypeError, match="unknown loss kwargs"):
        drafter.compute_loss(batch, feats, head, lambda0=0.2)
    # The knobs are saved with the drafter.
    assert Eagle3Config.from_dict(drafter.config.to_dict()).ttt_steps == 2


def test_a_few_steps_lower_the_loss_and_touch_only_drafter_parameters():
    target = make_target("llama", seed=2, sharpen=20.0)  # a peaked target: something to learn
    drafter = _drafter(target, draft_vocab_size=64)
    ids, mask = ragged_batch(4, length=16, seed=3)
    counts = torch.bincount(ids.flatten(), minlength=target.config.vocab_size)
    drafter.init_from_data(counts)
    drafter.check_draft_vocab()
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    feats = capture_target_features(target, ids, mask, drafter.config.target_layer_ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = drafter.compute_loss(batch, feats, target.get_output_embeddings())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.8 * losses[0]
    for k, v in target.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    assert all(p.grad is None or p.grad.abs().sum() > 0 for p in drafter.parameters())


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_init_from_target_starts_in_the_targets_output_space(arch):
    """After init_from_data (a reduced draft vocabulary) and init_from_target, the drafter's output side is the
    target's own: on the target's last-layer state, draft logits equal the target's logits of the draft vocabulary
    (Gemma's norm scales by 1 + w, which the copy must follow)."""
    target = make_target(arch, seed=3)
    drafter = _drafter(target, draft_vocab_size=40)
    counts = torch.arange(target.config.vocab_size, dtype=torch.float).flip(0) % 17  # an irregular vocabulary
    drafter.init_from_data(counts)
    ids = drafter.draft_token_ids
    assert not torch.equal(ids, torch.arange(40))
    ids_in, mask = ragged_batch(2, length=9)
    norm = target.get_decoder().norm
    seen = {}
    norm.register_forward_hook(lambda module, args, output: seen.update(last=args[0]))  # the final norm's input
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 1.5)  # a trained norm's scale, not the initial ones (or zeros for Gemma)
        out = target(ids_in, attention_mask=mask)
        last = seen["last"]
        before = drafter.draft_logits(last)
        drafter.init_from_target(target)
        after = drafter.draft_logits(last)
    torch.testing.assert_close(after, out.logits[..., ids], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, out.logits[..., ids], atol=1e-2)
