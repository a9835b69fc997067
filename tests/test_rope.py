"""RoPE scalings of the shared rotary embedding, checked against transformers' own ROPE_INIT_FUNCTIONS."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_specdec.layers import RotaryEmbedding, normalize_rope_scaling, rope_scaling_from_config

HEAD_DIM = 128  # Llama-3.1 shape: 64 rotary pairs
MAX_POS = 131072

SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 4096,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _target_config(scaling, theta=500000.0):
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters={**scaling, "rope_theta": theta},
    )


def _ours(config):
    theta, scaling = rope_scaling_from_config(config)
    return RotaryEmbedding(HEAD_DIM, theta, scaling, config.max_position_embeddings)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inv_freq_and_attention_scaling_match_transformers(name):
    config = _target_config(SCALINGS[name])
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None)
    rope = _ours(config)
    assert rope.rope_type == config.rope_parameters["rope_type"]
    torch.testing.assert_close(rope.inv_freq, ref_inv, rtol=1e-6, atol=0)
    assert rope.attention_scaling == pytest.approx(ref_scale, rel=1e-6)
    # cos / sin carry the attention scaling (yarn), as transformers' rotary embedding applies it.
    pos = torch.tensor([[0, 1, 511, 70000]])
    cos, sin = rope(pos, torch.float32)
    freqs = pos.float()[..., None] * ref_inv  # float32, as both implementations compute the angles
    torch.testing.assert_close(cos[..., : HEAD_DIM // 2], freqs.cos() * ref_scale, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[..., HEAD_DIM // 2 :], freqs.sin() * ref_scale, rtol=1e-5, atol=1e-5)


def test_scalings_really_differ_from_plain_rope():
    """The check above can fail: every scaling moves some frequencies away from plain RoPE."""
    plain = RotaryEmbedding(HEAD_DIM, 500000.0)
    for name, scaling in SCALINGS.items():
        rope = RotaryEmbedding(HEAD_DIM, 500000.0, scaling, MAX_POS)
        if name == "dynamic":  # only beyond max_position_embeddings
            assert torch.equal(rope.inv_freq, plain.inv_freq)
            continue
        assert not torch.allclose(rope.inv_freq, plain.inv_freq), name
    llama3 = RotaryEmbedding(HEAD_DIM, 500000.0, SCALINGS["llama3"], MAX_POS)
    changed = (llama3.inv_freq != plain.inv_freq).sum().item()
    assert changed >= 30  # the Llama-3.1 shape: about half the rotary pairs are rescaled


def test_dynamic_ntk_beyond_the_context_matches_transformers():
    config = _target_config(SCALINGS["dynamic"], theta=10000.0)
    config.max_position_embeddings = 2048
    rope = _ours(config)
    for seq_len in (1000, 2048, 5000):
        ref_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=seq_len)
        pos = torch.arange(seq_len)[None]
        cos, _ = rope(pos, torch.float32)
        want = (pos.float()[..., None] * ref_inv).cos()
        torch.testing.assert_close(cos[..., : HEAD_DIM // 2], want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=5000)[0], rope.inv_freq)


def test_legacy_and_transformers5_forms():
    # legacy {"type", "factor"} as in transformers-4 / SafeAILab configs, with a top-level rope_theta
    theta, scaling = rope_scaling_from_config({"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert theta == 1e6 and scaling == {"rope_type": "linear", "factor": 4.0}
    # transformers-5 rope_parameters carry rope_theta inside
    theta, scaling = rope_scaling_from_config(
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "max_position_embeddings": 8192}
    )
    assert theta == 5e5 and scaling is None
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings (as transformers)
    cfg = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4}}
    _, scaling = rope_scaling_from_config(dict(cfg, max_position_embeddings=4096))
    assert scaling["original_max_position_embeddings"] == 4096
    # a transformers LlamaConfig built from the legacy form
    legacy = LlamaConfig(max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=1e4)
    assert rope_scaling_from_config(legacy) == (1e4, {"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "not supported"),
        ({"type": "su", "factor": 2.0}, "not supported"),
        ({"rope_type": "linear", "factor": 2.0, "mystery": 1}, "mystery"),
        ({"rope_type": "llama3", "factor": 8.0}, "missing"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_scalings_are_refused(scaling, match):
    with pytest.raises(ValueError, match=match):
        normalize_rope_scaling(scaling, 4096)
    with pytest.raises(ValueError, match=match):
        RotaryEmbedding(64, 10000.0, scaling, 4096)


def test_two_disagreeing_rope_dicts_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        rope_scaling_from_config(
            {"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"type": "linear", "factor": 2.0}}
        )


def test_angle_error_that_plain_rope_would_make():
    """The issue's number: plain RoPE instead of llama3 is off by ~0.46 rad at distance 512 at Llama-3.1 shape."""
    plain = RotaryEmbedding(HEAD_DIM, 500000.0)
    llama3 = RotaryEmbedding(HEAD_DIM, 500000.0, SCALINGS["llama3"], MAX_POS)
    err = ((plain.inv_freq - llama3.inv_freq) * 512).abs().max().item()
    assert err == pytest.approx(0.46, abs=0.02) and err < math.pi


def test_for_target_records_the_targets_scaling_and_rotates_like_the_target():
    from helpers import make_target

    from hf_specdec import AutoModelForDrafting, Eagle3Config

    llama3 = dict(SCALINGS["llama3"], original_max_position_embeddings=64)
    target = make_target("llama", max_position_embeddings=512, rope_parameters={**llama3, "rope_theta": 5e5})
    config = Eagle3Config.for_target(target.config)
    assert config.rope_theta == 5e5 and config.rope_scaling_parameters == llama3
    drafter = AutoModelForDrafting.from_config(config)
    ref = target.model.rotary_emb
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, ref.inv_freq)
    pos = torch.arange(300)[None]
    x = torch.zeros(1, 300, 8)
    cos_t, sin_t = ref(x, pos)
    cos_d, sin_d = drafter.rotary_emb(pos, torch.float32)
    torch.testing.assert_close(cos_d, cos_t)
    torch.testing.assert_close(sin_d, sin_t)
    assert not torch.allclose(ref.inv_freq, RotaryEmbedding(8, 5e5).inv_freq)  # the scaling matters here
    # saved and reloaded, the scaling stays
    assert Eagle3Config.from_dict(config.to_dict()).rope_scaling_parameters == llama3
    # a target whose RoPE the drafter cannot reproduce is refused, not imported with plain RoPE
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "rope_theta": 1e4}
    odd = make_target("llama", max_position_embeddings=512, rope_parameters=longrope)
    with pytest.raises(ValueError, match="longrope.*rope_scaling_parameters="):
        Eagle3Config.for_target(odd.config)
    # ... unless the caller chooses the drafter's RoPE explicitly
    chosen = Eagle3Config.for_target(odd.config, rope_theta=1e4, rope_scaling_parameters=None)
    assert chosen.rope_scaling_parameters is None
    # per-layer-type RoPE (Gemma-3 style) that differs between layer types is refused the same way
    gemma3 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    gemma3["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ValueError, match="layer types"):
        rope_scaling_from_config({"rope_parameters": gemma3, "layer_types": list(gemma3)})
