"""Import / export of other projects' EAGLE-3 layouts, checked against an independent forward of the source layout."""

import json
import os

import pytest
import torch
from helpers import make_target, ragged_batch
from safetensors.torch import load_file, save_file

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.convert import LAYOUTS, detect_layout, export_drafter, import_drafter

DRAFT_VOCAB = 64


def _source_checkpoint(target, seed=0):
    """Tensors and config of an EAGLE-3 drafter as SafeAILab EAGLE / SpecForge write them (random weights)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, heads, kv, hd = 32, 48, 4, 2, 8
    t = {
        "fc.weight": torch.randn(h, 3 * h, generator=g) * 0.2,
        "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.self_attn.q_proj.weight": torch.randn(heads * hd, 2 * h, generator=g) * 0.2,
        "midlayer.self_attn.k_proj.weight": torch.randn(kv * hd, 2 * h, generator=g) * 0.2,
        "midlayer.self_attn.v_proj.weight": torch.randn(kv * hd, 2 * h, generator=g) * 0.2,
        "midlayer.self_attn.o_proj.weight": torch.randn(h, heads * hd, generator=g) * 0.2,
        "midlayer.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "midlayer.mlp.gate_proj.weight": torch.randn(inter, h, generator=g) * 0.2,
        "midlayer.mlp.up_proj.weight": torch.randn(inter, h, generator=g) * 0.2,
        "midlayer.mlp.down_proj.weight": torch.randn(h, inter, generator=g) * 0.2,
        "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        "lm_head.weight": torch.randn(DRAFT_VOCAB, h, generator=g),
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
    }
    vocab = target.config.vocab_size
    draft_ids = torch.sort(torch.randperm(vocab, generator=g)[:DRAFT_VOCAB]).values
    t["d2t"] = draft_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    t["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": h,
    }
    return t, config


def _write(folder, tensors, config, bin_file=False):
    os.makedirs(folder, exist_ok=True)
    if bin_file:
        torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(config, fh)
    return str(folder)


def _reference_draft_tokens(t, config, embeds, feats):
    """An independent implementation of the source layout's teacher-forced forward -> draft tokens (target ids)."""
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # x: (b, n, T, hd), positions 0..T-1
        inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        scaling = config.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type")) == "linear":
            inv = inv / scaling["factor"]
        ang = torch.arange(x.shape[2]).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    b, n_tok, _ = embeds.shape
    fused = feats @ t["fc.weight"].T
    normed = rms(fused, t["midlayer.hidden_norm.weight"])
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), normed], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(b, n_tok, heads, hd).transpose(1, 2)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(b, n_tok, kv, hd).transpose(1, 2)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(b, n_tok, kv, hd).transpose(1, 2)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n_tok, n_tok, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n_tok, heads * hd)
    residual = normed if config.get("norm_before_residual") else fused  # vLLM's flag
    hid = residual + attn @ t["midlayer.self_attn.o_proj.weight"].T
    z = rms(hid, t["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(z @ t["midlayer.mlp.gate_proj.weight"].T) * (z @ t["midlayer.mlp.up_proj.weight"].T)
    hid = hid + mlp @ t["midlayer.mlp.down_proj.weight"].T
    out = rms(hid, t["norm.weight"]) if config.get("norm_output", True) else hid  # SpecForge's flag
    logits = out @ t["lm_head.weight"].T
    best = logits.argmax(-1)
    return best + t["d2t"][best]


def _features(target, ids, layer_ids):
    out = target(input_ids=ids, output_hidden_states=True)
    return [out.hidden_states[i] for i in layer_ids]


@pytest.mark.parametrize("bin_file", [False, True])
def test_import_matches_an_independent_forward_of_the_source_layout(tmp_path, bin_file):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target)
    src = _write(tmp_path / "src", tensors, config, bin_file=bin_file)
    assert detect_layout(src) == "eagle3"
    drafter = AutoModelForDrafting.from_pretrained(src, target_config=target.config)
    assert drafter.config.target_layer_ids == [2, 3, 3]  # the reference default for a 6-layer target
    drafter.bind_target(target)
    ids, _ = ragged_batch(2, length=12, seed=1)
    ids = ids.clamp_min(6)
    with torch.no_grad():
        feats = _features(target, ids, drafter.config.target_layer_ids)
        embeds = target.get_input_embeddings()(ids)
        ref = _reference_draft_tokens(tensors, config, embeds, torch.cat(feats, -1))
        logits = drafter(input_ids=ids, target_hidden_states=feats).logits
    ours = drafter.draft_token_ids[logits.argmax(-1)]
    assert torch.equal(ours, ref)
    # And the imported drafter decodes losslessly with its target.
    kw = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))


def test_modelopt_and_vllm_layouts_import_to_the_same_drafter(tmp_path):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target, seed=3)
    base = import_drafter(_write(tmp_path / "src", tensors, config), target_config=target.config)
    # ModelOpt: layers.0.*, input_embeds_norm, top-level hidden_norm, eagle_lm_head, no t2d; explicit feature layers.
    mo = {}
    for key, value in tensors.items():
        if key == "t2d":
            continue
        key = key.replace("midlayer.input_layernorm.", "input_embeds_norm.").replace(
            "midlayer.hidden_norm.", "hidden_norm."
        )
        key = key.replace("midlayer.", "layers.0.").replace("lm_head.", "eagle_lm_head.")
        mo[key] = value
    mo_config = dict(config, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2], "use_aux_hidden_state": True})
    mo_dir = _write(tmp_path / "modelopt", mo, mo_config)
    assert detect_layout(mo_dir) == "eagle3-modelopt"
    imported = import_drafter(mo_dir, target_config=target.config)
    assert imported.config.target_layer_ids == [2, 3, 3]  # output-of-layer ids + 1
    for key, value in base.state_dict().items():
        assert torch.equal(imported.state_dict()[key], value), key
    # vLLM export round trip, and the SpecForge/SGLang layout.
    for layout in ("eagle3-vllm", "eagle3"):
        out = export_drafter(base, str(tmp_path / layout), layout, target=target)
        names = set(load_file(os.path.join(out, "model.safetensors")))
        assert ("t2d" in names) == (layout == "eagle3") == ("embed_tokens.weight" in names)
        assert any(n.startswith("layers.0." if layout == "eagle3-vllm" else "midlayer.") for n in names)
        assert detect_layout(out) == layout
        back = import_drafter(out, target_num_hidden_layers=6)
        for key, value in base.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), (layout, key)
        assert back.config.target_layer_ids == base.config.target_layer_ids


def test_older_eagle_config_and_checkpoint_without_embeddings(tmp_path):
    """Older EAGLE releases write architectures ["LlamaForCausalLM"]; embed_tokens may be absent."""
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target, seed=5)
    del tensors["embed_tokens.weight"]
    src = _write(tmp_path / "old", tensors, dict(config, architectures=["LlamaForCausalLM"]))
    assert detect_layout(src) == "eagle3"
    drafter = import_drafter(src, target_config=target.config)
    assert torch.equal(drafter.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(drafter.d2t, tensors["d2t"]) and torch.equal(drafter.t2d, tensors["t2d"])


def test_bad_checkpoints_fail_early(tmp_path):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target)
    src = _write(tmp_path / "src", tensors, config)
    # Without the target, the depth stays unresolved until bind_target; a target that differs fails there.
    bare = import_drafter(src)
    assert bare.config.target_num_hidden_layers is None and bare.config.target_layer_ids is None
    with pytest.raises(ValueError, match="hidden size"):
        bare.bind_target(make_target("llama", layers=6, hidden_size=64, num_attention_heads=4))
    assert bare.config.target_num_hidden_layers is None
    with pytest.raises(ValueError, match="Unknown layout"):
        import_drafter(src, layout="medusa-v9", target_config=target.config)
    broken = dict(tensors)
    del broken["midlayer.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="up_proj"):
        import_drafter(_write(tmp_path / "missing", broken, config), target_config=target.config)
    wide = make_target("llama", layers=6, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="another target"):
        import_drafter(src, target_config=wide.config)
    bad = tmp_path / "corrupt"
    _write(bad, tensors, config)
    with open(bad / "model.safetensors", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(ValueError, match="corrupt"):
        import_drafter(str(bad), target_config=target.config)
    with pytest.raises(ValueError, match="import-only"):
        export_drafter(import_drafter(src, target_config=target.config), str(tmp_path / "x"), "eagle3-modelopt")
    with pytest.raises(ValueError, match="only apply"):
        own = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
        own.save_pretrained(tmp_path / "own")
        AutoModelForDrafting.from_pretrained(tmp_path / "own", target_config=target.config)
    assert {"eagle3", "eagle3-vllm", "eagle3-modelopt"} <= set(LAYOUTS)


def test_convert_command(tmp_path, capsys):
    from hf_specdec.commands import main

    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target)
    src = _write(tmp_path / "src", tensors, config)
    assert main(["convert", "--list"]) == 0
    assert "eagle3-vllm" in capsys.readouterr().out
    assert main(["convert", src, str(tmp_path / "ours"), "--target-num-layers", "6"]) == 0
    drafter = AutoModelForDrafting.from_pretrained(tmp_path / "ours")
    assert drafter.config.draft_vocab_size == DRAFT_VOCAB
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "vllm"), "--to", "eagle3-vllm"]) == 0
    exported = json.load(open(tmp_path / "vllm" / "config.json"))
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["draft_vocab_size"] == DRAFT_VOCAB


# ---------------------------------------------------------------------------------------------------------------
# Loading without the target; flags of foreign configs; what SafeAILab's runtime needs from an export
# ---------------------------------------------------------------------------------------------------------------
def test_bare_from_pretrained_resolves_the_target_at_generate(tmp_path, monkeypatch):
    target = make_target("llama", layers=8)
    tensors, config = _source_checkpoint(target, seed=7)
    src = _write(tmp_path / "safeailab", tensors, config)
    import safetensors.torch

    def no_full_load(*a, **k):
        raise AssertionError("layout detection must not load the weights")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "load_file", no_full_load)
        assert detect_layout(src) == "eagle3"
    drafter = AutoModelForDrafting.from_pretrained(src)  # no target_config
    assert drafter.config.target_num_hidden_layers is None and drafter.config.target_layer_ids is None
    kw = dict(max_new_tokens=20, do_sample=False)
    ids = torch.tensor([[7, 9, 11, 13, 8, 21, 30]])
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))
    # bind_target (run by generate) resolved the depth and the reference's default feature layers
    assert drafter.config.target_num_hidden_layers == 8 and drafter.config.target_layer_ids == [2, 4, 5]
    ids, mask = ragged_batch(3, length=10, seed=2)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw))
    # once resolved, the drafter is tied to that depth
    with pytest.raises(ValueError, match="number of layers"):
        drafter.unbind_target()
        drafter.bind_target(make_target("llama", layers=6))


def test_unresolved_feature_layers_are_checked_when_the_target_is_bound(tmp_path):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target)
    config = dict(config, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9, 10], "use_aux_hidden_state": True})
    drafter = AutoModelForDrafting.from_pretrained(_write(tmp_path / "mo", tensors, config))
    assert drafter.config.target_layer_ids == [2, 10, 11] and drafter.config.target_num_hidden_layers is None
    with pytest.raises(ValueError, match="feature layers"):
        drafter.bind_target(target)
    deep = make_target("llama", layers=12)
    drafter.bind_target(deep)
    assert drafter.config.target_num_hidden_layers == 12


@pytest.mark.parametrize("flags", [{"norm_before_residual": True}, {"norm_output": False}])
def test_norm_flags_change_the_forward_as_in_their_projects(tmp_path, flags):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target, seed=11)
    drafter = import_drafter(_write(tmp_path / "flags", tensors, dict(config, **flags)), target_config=target.config)
    plain = import_drafter(_write(tmp_path / "plain", tensors, config), target_config=target.config)
    for key, value in flags.items():
        assert getattr(drafter.config, key) == value
    drafter.bind_target(target)
    plain.bind_target(target)
    ids, _ = ragged_batch(2, length=12, seed=3)
    ids = ids.clamp_min(6)
    with torch.no_grad():
        feats = _features(target, ids, drafter.config.target_layer_ids)
        embeds = target.get_input_embeddings()(ids)
        ref = _reference_draft_tokens(tensors, dict(config, **flags), embeds, torch.cat(feats, -1))
        out = drafter(input_ids=ids, target_hidden_states=feats)
        assert torch.equal(drafter.draft_token_ids[out.logits.argmax(-1)], ref)
        assert not torch.allclose(out.logits, plain(input_ids=ids, target_hidden_states=feats).logits)
        # training-time test honours the flags too: its step 0 at anchor t reads token t + 1, as forward does when
        # given the next tokens
        ttt = drafter.ttt_forward(ids, feats, steps=2)
        nxt = drafter(input_ids=ids[:, 1:], target_hidden_states=[f[:, :-1] for f in feats]).logits
        torch.testing.assert_close(ttt[0][0][:, :-1], nxt, rtol=1e-5, atol=1e-5)
        nxt_plain = plain(input_ids=ids[:, 1:], target_hidden_states=[f[:, :-1] for f in feats]).logits
        assert not torch.allclose(plain.ttt_forward(ids, feats, steps=1)[0][0][:, :-1], nxt)
        torch.testing.assert_close(plain.ttt_forward(ids, feats, steps=1)[0][0][:, :-1], nxt_plain)
    # observe / propose: greedy decoding stays identical to plain generate
    kw = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))
    # the vLLM export keeps norm_before_residual; SpecForge's norm_output=False has no vLLM form (vLLM always applies
    # the final norm; its norm_output means post-norm feedback). SafeAILab's runtime has neither, so that export
    # refuses both.
    if flags.get("norm_output", True):
        vllm = export_drafter(drafter, str(tmp_path / "vllm"), "eagle3-vllm")
        back = import_drafter(vllm, target_config=target.config)
        assert all(getattr(back.config, k) == v for k, v in flags.items())
    else:
        with pytest.raises(ValueError, match="norm_output=False"):
            export_drafter(drafter, str(tmp_path / "vllm"), "eagle3-vllm")
    with pytest.raises(ValueError, match="SafeAILab"):
        export_drafter(drafter, str(tmp_path / "safeailab"), "eagle3", target=target)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"fc_norm": True}, "fc_norm"),
        ({"logit_scale": 2.0}, "logit_scale"),
        ({"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ({"num_hidden_layers": 2}, "num_hidden_layers=2; the tensors hold fewer draft layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
        ({"mystery_flag": 1}, "mystery_flag"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "not supported"),
    ],
)
def test_flags_that_would_change_the_forward_are_refused(tmp_path, extra, match):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target)
    src = _write(tmp_path / "src", tensors, dict(config, **extra))
    with pytest.raises(ValueError, match=match):
        AutoModelForDrafting.from_pretrained(src)


def test_inert_keys_and_rope_scaling_of_foreign_configs(tmp_path):
    target = make_target("llama", layers=6)
    tensors, config = _source_checkpoint(target, seed=2)
    inert = {"sliding_window": None, "use_sliding_window": False, "attention_dropout": 0.0, "fc_norm": False,
             "norm_output": True, "bos_token_id": 1, "torch_dtype": "bfloat16", "rope_scaling": {"type": "linear", "factor": 2.0}}  # fmt: skip
    config = dict(config, **inert)
    drafter = import_drafter(_write(tmp_path / "src", tensors, config), target_config=target.config)
    assert drafter.config.rope_scaling_parameters == {"rope_type": "linear", "factor": 2.0}
    drafter.bind_target(target)
    ids, _ = ragged_batch(1, length=12, seed=4)
    with torch.no_grad():
        feats = _features(target, ids, drafter.config.target_layer_ids)
        ref = _reference_draft_tokens(tensors, config, target.get_input_embeddings()(ids), torch.cat(feats, -1))
        ours = drafter.draft_token_ids[drafter(input_ids=ids, target_hidden_states=feats).logits.argmax(-1)]
    assert torch.equal(ours, ref)


# What SafeAILab EAGLE's runtime (eagle/model/ea_model.py + cnets.py) does with a drafter folder: it builds
# `Model(EConfig(config.json))` with embed_tokens (vocab_size × hidden_size), loads the target's embeddings from the
# target's *sharded* checkpoint only if the config has no `target_hidden_size`, and then
# `load_state_dict(drafter file, strict=False)`; EConfig accepts rope_scaling None or exactly {type: linear|dynamic,
# factor: float > 1}; its attention uses head_dim = hidden_size // heads, without biases; it reads decoder-layer
# inputs 2, L // 2 and L - 3.
def _safeailab_expected_shapes(config):
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = h // heads, config["intermediate_size"]
    shapes = {
        "embed_tokens.weight": (config["vocab_size"], h),
        "lm_head.weight": (config["draft_vocab_size"], h),
        "fc.weight": (h, 3 * config.get("target_hidden_size", h)),
        "norm.weight": (h,),
        "d2t": (config["draft_vocab_size"],),
        "t2d": (config["vocab_size"],),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
    }
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        shapes[f"midlayer.{norm}.weight"] = (h,)
    return shapes


def test_safeailab_export_runs_in_safeailab_runtime(tmp_path):
    target = make_target("llama", layers=8)
    tensors, config = _source_checkpoint(target, seed=9)
    drafter = AutoModelForDrafting.from_pretrained(_write(tmp_path / "src", tensors, config))
    with pytest.raises(ValueError, match="embeddings"):  # not bound, no target given: refuse, never ship random ones
        export_drafter(drafter, str(tmp_path / "nothing"), "eagle3")
    drafter.bind_target(target)
    out = export_drafter(drafter, str(tmp_path / "out"), "eagle3")
    exported = json.load(open(os.path.join(out, "config.json")))
    weights = load_file(os.path.join(out, "model.safetensors"))
    # The runtime skips fetching the target's embeddings when target_hidden_size is set, so the file must hold them.
    assert "target_hidden_size" in exported
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    # strict=False loading: every tensor the runtime's Model has must be there with its shape (else it stays random)
    shapes = _safeailab_expected_shapes(exported)
    assert {k: tuple(v.shape) for k, v in weights.items()} == shapes
    rope = exported.get("rope_scaling")
    assert rope is None or (set(rope) == {"type", "factor"} and rope["type"] in ("linear", "dynamic"))
    assert exported["head_dim"] * exported["num_attention_heads"] == exported["hidden_size"]
    assert not exported.get("attention_bias")
    layers = exported["hf_specdec"]["target_num_hidden_layers"]
    ids = [i + 1 for i in exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert ids == [2, layers // 2, layers - 3]
    # and it comes back as the same drafter
    back = import_drafter(out)
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    # A drafter SafeAILab would rotate differently (llama3 RoPE) is refused for that layout, kept for vLLM.
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}  # fmt: skip
    scaled = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, rope_scaling_parameters=llama3))
    with pytest.raises(ValueError, match="RoPE"):
        export_drafter(scaled, str(tmp_path / "llama3"), "eagle3", target=target)
    vllm = json.load(open(os.path.join(export_drafter(scaled, str(tmp_path / "v"), "eagle3-vllm"), "config.json")))
    assert vllm["rope_scaling"]["rope_type"] == "llama3"
    assert import_drafter(str(tmp_path / "v")).config.rope_scaling_parameters == scaled.config.rope_scaling_parameters


def test_vllm_layout_with_several_draft_layers(tmp_path):
    """vLLM's EAGLE-3 model stacks ``num_hidden_layers`` layers (``layers.0`` reads ``[embedding; feature]``, the
    others are plain) and builds a ``hidden_norm`` in each that only the first reads: such a checkpoint imports, the
    unused norms dropped, and drafts as the exported drafter does; one whose tensors hold more layers than its
    config.json says is refused by name."""
    target = make_target("llama", layers=6)
    torch.manual_seed(3)
    config = Eagle3Config.for_target(target.config, num_hidden_layers=3, intermediate_size=64)
    drafter = AutoModelForDrafting.from_config(config).eval().bind_target(target)
    export_drafter(drafter, str(tmp_path / "vllm"), "eagle3-vllm")
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert {k.split(".")[1] for k in tensors if k.startswith("layers.")} == {"0", "1", "2"}
    tensors.update({f"layers.{i}.hidden_norm.weight": torch.full((config.hidden_size,), 7.0) for i in (1, 2)})
    with open(tmp_path / "vllm" / "config.json", encoding="utf-8") as fh:
        exported = json.load(fh)
    assert exported["num_hidden_layers"] == 3
    back = AutoModelForDrafting.from_pretrained(_write(tmp_path / "as-vllm", tensors, exported))
    assert back.config.num_hidden_layers == 3
    for key, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    ids, mask = ragged_batch(2, length=9, seed=4)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=back, **kw), target.generate(ids, **kw))
    with pytest.raises(ValueError, match="num_hidden_layers=2; the tensors hold more draft layers"):
        AutoModelForDrafting.from_pretrained(_write(tmp_path / "short", tensors, dict(exported, num_hidden_layers=2)))
