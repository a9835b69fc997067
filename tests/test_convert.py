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
        ang = torch.arange(x.shape[2]).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    b, n_tok, _ = embeds.shape
    fused = feats @ t["fc.weight"].T
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), rms(fused, t["midlayer.hidden_norm.weight"])], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(b, n_tok, heads, hd).transpose(1, 2)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(b, n_tok, kv, hd).transpose(1, 2)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(b, n_tok, kv, hd).transpose(1, 2)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n_tok, n_tok, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n_tok, heads * hd)
    hid = fused + attn @ t["midlayer.self_attn.o_proj.weight"].T
    z = rms(hid, t["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(z @ t["midlayer.mlp.gate_proj.weight"].T) * (z @ t["midlayer.mlp.up_proj.weight"].T)
    hid = hid + mlp @ t["midlayer.mlp.down_proj.weight"].T
    logits = rms(hid, t["norm.weight"]) @ t["lm_head.weight"].T
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
        out = export_drafter(base, str(tmp_path / layout), layout)
        names = set(load_file(os.path.join(out, "model.safetensors")))
        assert ("t2d" in names) == (layout == "eagle3")
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
    with pytest.raises(ValueError, match="target_config"):
        import_drafter(src)
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
    from hf_specdec.cli import main

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
