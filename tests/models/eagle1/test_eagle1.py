"""EAGLE-1: the shared drafter tester plus family-specific checks (layer layout, loss, import)."""

import json

import pytest
import torch
import torch.nn.functional as F
from drafter_tester import DrafterTesterMixin
from helpers import llama_layer_by_hand, make_target, ragged_batch
from safetensors.torch import save_file

from hf_specdec import AutoModelForDrafting, Eagle1Config, Eagle1ForDrafting
from hf_specdec.convert import detect_layout, import_drafter
from hf_specdec.features import TargetFeatures


class TestEagle1(DrafterTesterMixin):
    config_class = Eagle1Config
    model_class = Eagle1ForDrafting
    config_overrides = {"intermediate_size": 64}

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        (feats,) = drafter.select_target_features(hidden_states)
        return [logits for logits, _ in drafter.unroll(input_ids, feats, attention_mask, steps)]


def _drafter(target, **kw):
    torch.manual_seed(0)
    return (
        AutoModelForDrafting.from_config(Eagle1Config.for_target(target.config, intermediate_size=64, **kw))
        .eval()
        .bind_target(target)
    )


def _independent_forward(state, cfg, emb, feat, lm_head):
    """The SafeAILab layer by hand over one sequence (batch 1, positions 0..T-1, causal, no cache)."""
    x = F.linear(torch.cat([emb, feat], -1), state["fc.weight"], state.get("fc.bias"))
    return lm_head(llama_layer_by_hand(state, "layers.0.", cfg, x, cfg["rope_theta"], input_norm=False))


def test_import_matches_an_independent_forward_of_the_safeailab_layout(tmp_path):
    target = make_target("llama")
    hidden = target.config.hidden_size
    g = torch.Generator().manual_seed(0)
    shapes = {
        "fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
        "layers.0.self_attn.q_proj.weight": (hidden, hidden), "layers.0.self_attn.k_proj.weight": (hidden // 2, hidden),
        "layers.0.self_attn.v_proj.weight": (hidden // 2, hidden), "layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "layers.0.post_attention_layernorm.weight": (hidden,), "layers.0.mlp.gate_proj.weight": (48, hidden),
        "layers.0.mlp.up_proj.weight": (48, hidden), "layers.0.mlp.down_proj.weight": (hidden, 48),
        "embed_tokens.weight": (target.config.vocab_size, hidden),
    }  # fmt: skip
    state = {k: torch.randn(*s, generator=g) * 0.2 for k, s in shapes.items()}
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": 48,
           "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "vocab_size": target.config.vocab_size, "num_hidden_layers": 1, "bias": True}  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    assert detect_layout(str(src)) == "eagle1"
    drafter = import_drafter(str(src), target_config=target.config).bind_target(target)
    ids = torch.randint(6, 90, (1, 9), generator=g)
    feat = torch.randn(1, 9, hidden, generator=g)
    with torch.no_grad():
        ((logits, _),) = drafter.unroll(ids, feat, steps=1)
        emb = target.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], 1))
        want = _independent_forward(state, cfg, emb, feat, target.get_output_embeddings())
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    ids2, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids2, assistant_model=drafter, **kw), target.generate(ids2, **kw))


def test_loss_is_feature_regression_plus_a_tenth_of_cross_entropy():
    target = make_target("llama")
    drafter = _drafter(target, feature_noise=0.0)
    ids, mask = ragged_batch(2, length=10)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    top = out.hidden_states[-1]
    feats = TargetFeatures(hidden_states=[top], last_hidden=top)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    ((logits, pred),) = drafter.unroll(ids, top, mask, steps=1)
    p = torch.softmax(out.logits.float(), -1)
    ce, l1 = [], []
    for b in range(2):
        for t in range(8):
            if mask[b, t + 2]:
                ce.append(-(p[b, t + 1] * torch.log_softmax(logits[b, t].float(), -1)).sum())
        for t in range(9):
            if mask[b, t + 1]:
                l1.append(F.smooth_l1_loss(pred[b, t], top[b, t + 1]))
    want = torch.stack(l1).mean() + 0.1 * torch.stack(ce).mean()
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
    assert "feature_l1_sum" in got.metrics and got.rates["feature_l1"] == ("feature_l1_sum", "feature_count")


def test_training_noise_only_in_training_mode():
    target = make_target("llama")
    drafter = _drafter(target, feature_noise=0.5)
    ids, mask = ragged_batch(1, length=8)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    top = out.hidden_states[-1]
    feats = TargetFeatures(hidden_states=[top], last_hidden=top)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    head = target.get_output_embeddings()
    a, b = drafter.compute_loss(batch, feats, head).loss, drafter.compute_loss(batch, feats, head).loss
    assert torch.equal(a, b)  # eval: deterministic
    drafter.train()
    assert not torch.equal(drafter.compute_loss(batch, feats, head).loss, a)
    with pytest.raises(ValueError, match="feature_noise"):
        Eagle1Config.for_target(target.config, feature_noise=-1.0)
