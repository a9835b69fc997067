"""DFlash: the shared drafter tester plus family checks (block attention, loss, layouts)."""

import json

import pytest
import torch
from drafter_tester import DrafterTesterMixin
from helpers import make_target, ragged_batch
from safetensors.torch import load_file, save_file

from hf_specdec import AutoModelForDrafting, DFlashConfig, DFlashForDrafting
from hf_specdec.convert import detect_layout, export_drafter, import_drafter


class TestDFlash(DrafterTesterMixin):
    config_class = DFlashConfig
    model_class = DFlashForDrafting
    config_overrides = {"intermediate_size": 64, "block_size": 7}

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        feats = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(input_ids, feats, attention_mask, steps)


class TestDFlashSlidingWindow(TestDFlash):
    """A sliding-window layer (MuseGlimmer's layer type): the context slots' positions travel with the cache."""

    config_overrides = {
        "intermediate_size": 64,
        "block_size": 7,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
    }
    layouts_refusing = {"dflash-speculators": "sliding-window layers"}  # speculators windows from the anchor


def test_bad_configs_fail_early():
    target = make_target("llama")
    for bad, word in (({"block_size": 1}, "block_size"), ({"block_size": 4, "num_draft_tokens": 4}, "num_draft_tokens"),
                      ({"mask_token_id": 10_000}, "mask_token_id"), ({"loss_labels": "x"}, "loss_labels"),
                      ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
                      ({"layer_types": ["full_attention"]}, "layer_types")):  # fmt: skip
        with pytest.raises(ValueError, match=word):
            DFlashConfig.for_target(target.config, **bad)


def _muse_glimmer(target, tmp_path, sliding_window=6, seed=0):
    """A tiny transformers MuseGlimmerAssistantModel for ``target`` (reads target layers 0 and 2), saved."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    tc = target.config
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=tc.hidden_size, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=tc.hidden_size // 4, target_layer_ids=[0, 2], block_size=5, mask_token_id=3,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(cfg).eval()
    with torch.no_grad():  # norms away from 1 so that a missed norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "mg")
    return model, tmp_path / "mg"


def _reference_block(model, target, ids, layer_ids, block_size, mask_id):
    """transformers' own DFlash candidate generator (its cache and masks) for the block anchored at the last token of
    ``ids`` after a prefill over the tokens before it: the draft logits of slots 1..block_size - 1."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    gen = DFlashTokenCandidateGenerator(
        model, target.get_input_embeddings(), target.get_output_embeddings(), GenerationConfig(max_length=64)
    )
    s = ids.shape[1] - 1
    with torch.no_grad():
        outputs = target(ids[:, :s], output_hidden_states=True)
        kwargs = {"position_ids": torch.arange(s + 1)[None], "attention_mask": torch.ones(1, s + 1, dtype=torch.long)}
        _, logits = gen.get_candidates(ids, kwargs, outputs, is_first_iteration=False, n_last_matches=0)
    return logits


def test_muse_glimmer_layout_matches_transformers_forward_and_runs_in_its_dflash_path(tmp_path):
    target = make_target("llama")
    model, folder = _muse_glimmer(target, tmp_path)
    assert detect_layout(str(folder)) == "muse-glimmer"
    drafter = import_drafter(str(folder), target_config=target.config).eval().bind_target(target)
    assert drafter.config.target_layer_ids == [1, 3] and drafter.config.layer_types[0] == "sliding_attention"
    ids = torch.randint(6, 90, (1, 12), generator=torch.Generator().manual_seed(1))  # context longer than the window
    want = _reference_block(model, target, ids, [0, 2], 5, 3)
    with torch.no_grad():
        feats = drafter.select_target_features(target(ids, output_hidden_states=True).hidden_states)
        got = drafter.block_logits(ids, feats, None, torch.tensor([[11]]))[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ids2, mask = ragged_batch(3)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids2, assistant_model=drafter, **kw), target.generate(ids2, **kw))
    # exported back, transformers loads it and drafts with it in its own DFlash path (batch 1)
    out = export_drafter(drafter, str(tmp_path / "exported"), "muse-glimmer")
    from transformers import MuseGlimmerAssistantModel

    again = MuseGlimmerAssistantModel.from_pretrained(out).eval()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)
    one = ids2[2:, (mask[2] == 1).nonzero()[0, 0] :]
    ref = target.generate(one, max_new_tokens=12, do_sample=False)
    assert torch.equal(
        target.generate(one, assistant_model=again, speculation_type="dflash", max_new_tokens=12, do_sample=False), ref
    )


def test_zlab_layout_round_trip_and_independent_forward(tmp_path):
    target = make_target("llama")
    model, folder = _muse_glimmer(target, tmp_path, sliding_window=256)
    # the same weights under z-lab's names and config: fc / hidden_norm at the top, dflash_config
    state = {k.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm."): v
             for k, v in load_file(str(folder / "model.safetensors")).items()}  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "target_layer_ids", "mask_token_id", "layer_types")}
    cfg.update(architectures=["DFlashDraftModel"], dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 2]},
               num_target_layers=target.config.num_hidden_layers, vocab_size=target.config.vocab_size)  # fmt: skip
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    save_file(state, str(zlab / "model.safetensors"))
    (zlab / "config.json").write_text(json.dumps(cfg))
    assert detect_layout(str(zlab)) == "dflash-zlab"
    drafter = import_drafter(str(zlab), target_config=target.config).eval().bind_target(target)
    ids = torch.randint(6, 90, (1, 9), generator=torch.Generator().manual_seed(2))
    want = _reference_block(model, target, ids, [0, 2], 5, 3)
    with torch.no_grad():
        feats = drafter.select_target_features(target(ids, output_hidden_states=True).hidden_states)
        got = drafter.block_logits(ids, feats, None, torch.tensor([[8]]))[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    out = export_drafter(drafter, str(tmp_path / "out"), "dflash-zlab")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2]}
    again = import_drafter(out, target_config=target.config)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)


def test_loss_weights_decay_with_the_block_slot_and_evaluation_scores_every_anchor():
    from hf_specdec.features import TargetFeatures

    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(
        DFlashConfig.for_target(target.config, intermediate_size=64, block_size=4, num_anchors=3)
    ).bind_target(target)
    ids, mask = ragged_batch(2, length=10)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    hs = [out.hidden_states[i] for i in drafter.config.target_layer_ids]
    feats = TargetFeatures(hidden_states=hs, last_hidden=out.hidden_states[-1])
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    drafter.eval()
    with torch.no_grad():
        got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
        steps = drafter.teacher_forced_logits(ids, hs, mask)
    p = torch.softmax(out.logits.float(), -1)
    want = 0.0
    for j, logits in enumerate(steps):  # anchor t predicts t + 2 + j from the distribution at t + 1 + j
        ce = [-(p[b, t + 1 + j] * torch.log_softmax(logits[b, t].float(), -1)).sum()
              for b in range(2) for t in range(10 - 2 - j) if mask[b, t + 2 + j] and mask[b, t + 2]]  # fmt: skip
        want = want + torch.exp(torch.tensor(-j / 2.0)) * torch.stack(ce).mean()  # gamma = block_size / 2
    torch.testing.assert_close(got.loss, want, rtol=1e-4, atol=1e-5)
    drafter.train()
    sampled = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    assert int(sampled.accepted.ne(0).sum()) <= 2 * 3 and sampled.metrics["valid"][0] <= 2 * 3  # 3 anchors per row
