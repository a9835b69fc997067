"""Published EAGLE checkpoints with quirks (docs/formats.md, "Published checkpoints with quirks").

Each checkpoint is built here in its project's layout from a tiny drafter, loaded with a bare
``AutoModelForDrafting.from_pretrained(folder)``, checked against an independent statement of its project's forward
and for greedy identity with plain ``target.generate`` (fp32), or refused with an error naming the field:

* EAGLE-3.1 as SpecForge writes it (``fc_norm``: one RMSNorm per fused target state; SpecForge's ``norm_output``);
* EAGLE-3.1 as vLLM / speculators read it (``norm_output``: the normed state is fed back to the next draft step);
* NVIDIA ModelOpt exports (``eagle_config`` layer-norm and parallel-draft options);
* TensorRT-LLM's ``num_eagle_features``;
* metadata keys of transformers configs (token ids, generation defaults, names): inert;
* EAGLE-1 for Qwen2-style targets (``qkv_bias``: biases on q/k/v, none on o_proj).
"""

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import make_target, ragged_batch, rms
from safetensors.torch import load_file, save_file

from hf_specdec import AutoModelForDrafting, Eagle1Config, Eagle3Config
from hf_specdec.convert import detect_layout, export_drafter, import_drafter
from hf_specdec.layers import RMSNorm

LAYERS = 6  # default EAGLE-3 feature layers of a 6-layer target: output_hidden_states[2, 3, 3]


def _target(arch: str = "llama"):
    return make_target(arch, seed=7, layers=LAYERS)


def _randomize_norms(model) -> None:
    """Norm weights away from one, so that a norm applied in the wrong place changes the output."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=g))


def _eagle3(target, **overrides):
    torch.manual_seed(3)
    config = Eagle3Config.for_target(target.config, intermediate_size=48, **overrides)
    drafter = AutoModelForDrafting.from_config(config).eval()
    _randomize_norms(drafter)
    return drafter


def _write(folder, config: dict, tensors: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    return str(folder)


def _read_config(folder) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _llama_style_config(drafter) -> dict:
    """The Llama-style config.json keys of an EAGLE-3 checkpoint, with the metadata SpecForge's configs carry
    (SpecForge's configs/qwen3-30B-A3B-eagle3.1.json)."""
    cfg = drafter.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 5,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": 48,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": cfg.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.53.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
    }


def _specforge_folder(folder, drafter, target, **config) -> str:
    """SpecForge's layout: midlayer.*, fc_norm.{i} (EAGLE-3.1), d2t, t2d and the target's embeddings."""
    tensors = dict(drafter.state_dict(), **{"embed_tokens.weight": target.get_input_embeddings().weight})
    return _write(folder, {**_llama_style_config(drafter), **config}, tensors)


def _vllm_folder(folder, drafter, **config) -> str:
    """What vLLM's llama_eagle3.py loads: layers.0.*, fc_norm.{i}, d2t (no t2d), flags at the top level."""
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state_dict().items() if k != "t2d"}
    return _write(folder, {**_llama_style_config(drafter), **config}, tensors)


def _features(target, ids, drafter):
    out = target(input_ids=ids, output_hidden_states=True)
    return [out.hidden_states[i] for i in drafter.config.target_layer_ids]


def _assert_same_weights(want, got) -> None:
    a, b = want.state_dict(), got.state_dict()
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_greedy_identity(target, drafter) -> None:
    ids, mask = ragged_batch(2, length=10, seed=5)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, target.generate(ids, **kw))


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3.1: SpecForge's fc_norm and norm_output
# ---------------------------------------------------------------------------------------------------------------
def test_specforge_eagle31_fc_norm_normalises_each_target_state_before_fc(tmp_path):
    target = _target()
    source = _eagle3(target, fc_norm=True)
    folder = _specforge_folder(tmp_path / "specforge", source, target, fc_norm=True, norm_output=True)
    assert detect_layout(folder) == "eagle3"
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()  # bare: the target is bound at generate
    assert drafter.config.fc_norm and drafter.config.norm_output and not drafter.config.norm_feedback
    _assert_greedy_identity(target, drafter)
    _assert_same_weights(source, drafter)
    # SpecForge's project_hidden_states: the concatenated states, chunked per state, each through its own RMSNorm.
    ids, _ = ragged_batch(1, length=10, seed=2)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    with torch.no_grad():
        feats = _features(target, ids, drafter)
        normed = [rms(f, tensors[f"fc_norm.{i}.weight"], drafter.config.rms_norm_eps) for i, f in enumerate(feats)]
        want = torch.cat(normed, -1) @ tensors["fc.weight"].T
        torch.testing.assert_close(drafter.fuse_target_features(feats), want, rtol=1e-5, atol=1e-5)
        # the same weights without the norms draft differently: the norms are applied, not just loaded
        without = torch.cat(feats, -1) @ tensors["fc.weight"].T
        assert not torch.allclose(drafter.fuse_target_features(feats), without, atol=1e-3)


def test_specforge_norm_output_false_drops_the_final_norm_and_true_is_plain_eagle3(tmp_path):
    """SpecForge's compute_logits: lm_head(norm(h)) when norm_output (its default), lm_head(h) otherwise; the state fed
    back is the layer output either way."""
    target = _target()
    source = _eagle3(target)
    logits = {}
    for flag in (True, False):
        folder = _specforge_folder(tmp_path / str(flag), source, target, norm_output=flag)
        drafter = AutoModelForDrafting.from_pretrained(folder).eval()
        assert drafter.config.norm_output is flag and not drafter.config.norm_feedback
        drafter.bind_target(target)
        ids, _ = ragged_batch(1, length=10, seed=2)
        with torch.no_grad():
            out = drafter(input_ids=ids, target_hidden_states=_features(target, ids, drafter))
            head_input = drafter.norm(out.hidden_states) if flag else out.hidden_states
            torch.testing.assert_close(out.logits, drafter.lm_head(head_input))
        logits[flag] = out.logits
        _assert_greedy_identity(target, drafter)
    assert not torch.allclose(logits[True], logits[False], atol=1e-3)


def test_specforge_eagle31_refusals_name_the_field(tmp_path):
    target = _target()
    plain = _eagle3(target)
    # fc_norm set but the checkpoint holds no fc_norm tensors (or the reverse): named, with what to do
    folder = _specforge_folder(tmp_path / "no-tensors", plain, target, fc_norm=True)
    with pytest.raises(ValueError, match=r"missing tensors \['fc_norm.0.weight'"):
        AutoModelForDrafting.from_pretrained(folder)
    folder = _specforge_folder(tmp_path / "no-flag", _eagle3(target, fc_norm=True), target)
    with pytest.raises(ValueError, match="fc_norm.0.weight.*does not set the flag"):
        AutoModelForDrafting.from_pretrained(folder)
    folder = _specforge_folder(tmp_path / "both", plain, target, fc_norm=True, norm_before_fc=True)
    with pytest.raises(ValueError, match="fc_norm=True .*norm_before_fc=True.*mutually exclusive"):
        AutoModelForDrafting.from_pretrained(folder)
    # SafeAILab's runtime (what the 'eagle3' export targets) has no fc_norm: refused, pointing to vLLM's layouts
    with pytest.raises(ValueError, match="fc_norm.*eagle3-vllm"):
        export_drafter(_eagle3(target, fc_norm=True).bind_target(target), str(tmp_path / "x"), "eagle3")


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3.1 as vLLM / speculators read it: norm_output = the normed state is fed back
# ---------------------------------------------------------------------------------------------------------------
def _without_feedback(drafter):
    """The same weights with norm_feedback off (plain EAGLE-3's raw-state feedback)."""
    config = copy.deepcopy(drafter.config)
    config.norm_feedback = False
    plain = type(drafter)(config).eval()
    plain.load_state_dict(drafter.state_dict())
    return plain


def test_vllm_eagle31_norm_output_feeds_the_normed_state_back(tmp_path):
    """vLLM's llama_eagle3.py (and speculators, SGLang, TensorRT-LLM): hidden_states, hidden_prenorm = norm(h, residual);
    logits from the normed state, and with norm_output the normed state (not h) is what the next draft step reads."""
    target = _target()
    source = _eagle3(target, fc_norm=True, norm_feedback=True)
    folder = _vllm_folder(tmp_path / "vllm", source, fc_norm=True, norm_output=True)
    assert detect_layout(folder) == "eagle3-vllm"
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    assert drafter.config.norm_feedback and drafter.config.norm_output and drafter.config.fc_norm
    _assert_greedy_identity(target, drafter)
    _assert_same_weights(source, drafter)
    plain = _without_feedback(drafter).bind_target(target)
    ids, _ = ragged_batch(1, length=10, seed=2)
    with torch.no_grad():
        feats = _features(target, ids, drafter)
        fed, raw = drafter(input_ids=ids, target_hidden_states=feats), plain(input_ids=ids, target_hidden_states=feats)
        torch.testing.assert_close(fed.logits, raw.logits)  # the LM head reads norm(h) in both
        torch.testing.assert_close(fed.hidden_states, plain.norm(raw.hidden_states))  # what is fed back
        # so the second draft step (training-time test and decoding alike) differs
        ttt_fed, ttt_raw = drafter.ttt_forward(ids, feats, steps=2), plain.ttt_forward(ids, feats, steps=2)
        torch.testing.assert_close(ttt_fed[0][0], ttt_raw[0][0])
        torch.testing.assert_close(ttt_fed[0][1], plain.norm(ttt_raw[0][1]))
        assert not torch.allclose(ttt_fed[1][0], ttt_raw[1][0], atol=1e-3)
    # The same config in SpecForge's layout means plain EAGLE-3 (its norm_output=true is its default).
    specforge = _specforge_folder(tmp_path / "specforge", source, target, fc_norm=True, norm_output=True)
    assert not AutoModelForDrafting.from_pretrained(specforge).config.norm_feedback


def test_eagle31_exports_write_vllms_and_speculators_flags(tmp_path):
    target = _target()
    drafter = _eagle3(target, fc_norm=True, norm_feedback=True).bind_target(target)
    vllm = export_drafter(drafter, str(tmp_path / "vllm"), "eagle3-vllm")
    config = _read_config(vllm)
    assert config["fc_norm"] is True and config["norm_output"] is True and "norm_before_fc" not in config
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(os.path.join(vllm, "model.safetensors")))
    spec = export_drafter(drafter, str(tmp_path / "spec"), "eagle3-speculators")
    config = _read_config(spec)
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, False)
    for folder in (vllm, spec):
        back = AutoModelForDrafting.from_pretrained(folder).eval()
        assert back.config.fc_norm and back.config.norm_feedback
        _assert_same_weights(drafter, back)
        _assert_greedy_identity(target, back)
    # speculators' norm_before_fc (one norm over the concatenation, input_norm.weight) travels too
    single = _eagle3(target, norm_before_fc=True).bind_target(target)
    spec = export_drafter(single, str(tmp_path / "single"), "eagle3-speculators")
    assert _read_config(spec)["norm_before_fc"] is True
    assert "input_norm.weight" in load_file(os.path.join(spec, "model.safetensors"))
    back = AutoModelForDrafting.from_pretrained(spec).eval()
    _assert_same_weights(single, back)
    ids, _ = ragged_batch(1, length=10, seed=2)
    with torch.no_grad():
        feats = _features(target, ids, single)
        cat = torch.cat(feats, -1)
        want = rms(cat, back.input_norm.weight, back.config.rms_norm_eps) @ back.fc.weight.T
        torch.testing.assert_close(back.fuse_target_features(feats), want, rtol=1e-5, atol=1e-5)
    # SpecForge's norm_output=False has no vLLM form: both vLLM layouts refuse it by name
    no_norm = _eagle3(target, norm_output=False).bind_target(target)
    for layout in ("eagle3-vllm", "eagle3-speculators"):
        with pytest.raises(ValueError, match="norm_output=False"):
            export_drafter(no_norm, str(tmp_path / f"no-{layout}"), layout)


# ---------------------------------------------------------------------------------------------------------------
# NVIDIA ModelOpt exports and TensorRT-LLM's num_eagle_features
# ---------------------------------------------------------------------------------------------------------------
_MODELOPT_EAGLE_CONFIG = {
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
    "use_aux_hidden_state": True,
    "next_layer_regular": True,
    "parallel_draft_step": 1,
    "parallel_draft_heads_num_layers": 1,
}


def _modelopt_folder(folder, drafter, eagle_config=None, **config) -> str:
    """ModelOpt's export (modelopt/torch/export): layers.0.*, input_embeds_norm, hidden_norm, eagle_lm_head, no t2d;
    feature layers in eagle_config (output-of-layer numbering), with the architecture flags of its EAGLE module."""
    renames = (
        ("midlayer.input_layernorm.", "input_embeds_norm."),
        ("midlayer.hidden_norm.", "hidden_norm."),
        ("midlayer.", "layers.0."),
        ("lm_head.", "eagle_lm_head."),
    )
    tensors = {}
    for key, value in drafter.state_dict().items():
        if key == "t2d":
            continue
        for old, new in renames:
            if key.startswith(old):
                key = new + key[len(old) :]
                break
        tensors[key] = value
    ids = [int(i) - 1 for i in drafter.config.target_layer_ids]
    nested = {"eagle_aux_hidden_state_layer_ids": ids, **_MODELOPT_EAGLE_CONFIG, **(eagle_config or {})}
    return _write(folder, {**_llama_style_config(drafter), "eagle_config": nested, **config}, tensors)


def test_modelopt_export_with_its_standard_eagle_config_loads(tmp_path):
    target = _target()
    source = _eagle3(target)
    # parallel_draft_heads_num_layers sizes parallel draft heads, which parallel_draft_step 1 builds none of
    folder = _modelopt_folder(tmp_path / "mo", source, {"parallel_draft_heads_num_layers": 2}, mlp_bias=False)
    assert detect_layout(folder) == "eagle3-modelopt"
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    assert drafter.config.target_layer_ids == source.config.target_layer_ids
    _assert_same_weights(source, drafter)
    _assert_greedy_identity(target, drafter)


@pytest.mark.parametrize(
    "key, value",
    [
        ("use_input_layernorm_in_first_layer", False),
        ("use_last_layernorm", False),
        ("use_mtp_layernorm", True),
        ("next_layer_regular", False),
        ("parallel_draft_step", 3),
        ("use_aux_hidden_state", False),
    ],
)
def test_modelopt_options_away_from_eagle3_are_refused_by_name(tmp_path, key, value):
    folder = _modelopt_folder(tmp_path / "mo", _eagle3(_target()), {key: value})
    with pytest.raises(ValueError, match=f"eagle_config.{key}={value!r}.*remove it"):
        AutoModelForDrafting.from_pretrained(folder)


def test_tensorrt_llm_num_eagle_features_must_match_the_feature_layers(tmp_path):
    target = _target()
    source = _eagle3(target)
    drafter = AutoModelForDrafting.from_pretrained(_modelopt_folder(tmp_path / "ok", source, num_eagle_features=3))
    _assert_same_weights(source, drafter)
    _assert_greedy_identity(target, drafter.eval())
    for folder in (_modelopt_folder(tmp_path / "bad", source, num_eagle_features=1),
                   _specforge_folder(tmp_path / "bad-sf", source, target, num_eagle_features=2)):  # fmt: skip
        with pytest.raises(ValueError, match=r"num_eagle_features=\d.*fuses 3 target states.*fix num_eagle_features"):
            AutoModelForDrafting.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# Metadata keys are inert; flags that change the forward stay refused
# ---------------------------------------------------------------------------------------------------------------
_METADATA = {
    "decoder_start_token_id": 0,
    "unk_token_id": None,
    "sep_token_id": None,
    "forced_eos_token_id": None,
    "temperature": 0.6,
    "top_p": 0.9,
    "do_sample": True,
    "max_length": 20,
    "name_or_path": "org/some-drafter",
    "tokenizer_class": "Qwen2Tokenizer",
    "id2label": {"0": "LABEL_0"},
    "use_bfloat16": False,
    "output_hidden_states": False,
}


def test_metadata_keys_are_inert(tmp_path):
    target = _target()
    source = _eagle3(target)
    folder = _specforge_folder(tmp_path / "specforge", source, target, **_METADATA)
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    _assert_same_weights(source, drafter)
    _assert_greedy_identity(target, drafter)
    # the same in the speculators layout, whose own keys sit at the top level too
    spec = export_drafter(source.bind_target(target), str(tmp_path / "spec"), "eagle3-speculators")
    _write(spec, {**_read_config(spec), **_METADATA}, load_file(os.path.join(spec, "model.safetensors")))
    _assert_same_weights(source, AutoModelForDrafting.from_pretrained(spec))


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"logit_scale": 2.0}, "logit_scale=2.0"),
        ({"use_sliding_window": True}, "use_sliding_window=True"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.*unknown"),
        ({"qkv_bias": True}, "qkv_bias=True"),
    ],
)
def test_flags_that_change_the_forward_stay_refused(tmp_path, extra, match):
    target = _target()
    folder = _specforge_folder(tmp_path / "sf", _eagle3(target), target, **_METADATA, **extra)
    with pytest.raises(ValueError, match=match):
        AutoModelForDrafting.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-1 for Qwen2-style targets: biases on q/k/v, none on o_proj
# ---------------------------------------------------------------------------------------------------------------
def _qwen2_eagle1_folder(folder, target, seed=0) -> tuple[str, dict, dict]:
    """SafeAILab cnets1.py's layer for a Qwen2 target: config ``qkv_bias: true`` (+ ``bias`` for fc), q/k/v biases,
    o_proj without; no input_layernorm; no embeddings or LM head (the target's)."""
    torch.manual_seed(seed)
    base = AutoModelForDrafting.from_config(Eagle1Config.for_target(target.config, intermediate_size=48))
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v.clone() for k, v in base.state_dict().items() if k not in ("d2t", "t2d")}
    for proj in ("q_proj", "k_proj", "v_proj"):
        weight = tensors[f"layers.0.self_attn.{proj}.weight"]
        tensors[f"layers.0.self_attn.{proj}.bias"] = 0.5 * torch.randn(weight.shape[0], generator=g)
    tensors["fc.bias"] = 0.1 * torch.randn(tensors["fc.bias"].shape, generator=g)
    tensors["layers.0.post_attention_layernorm.weight"] += 0.3 * torch.randn(target.config.hidden_size, generator=g)
    cfg = base.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": 28,
        "sliding_window": None,
        "use_sliding_window": False,
        "vocab_size": cfg.target_vocab_size,
        "num_hidden_layers": 1,
        "bias": True,
        "qkv_bias": True,
        "torch_dtype": "float32",
    }
    return _write(folder, config, tensors), config, tensors


def _qwen2_layer_reference(config: dict, tensors: dict, x: torch.Tensor) -> torch.Tensor:
    """transformers' own Qwen2 decoder layer (q/k/v biases, o_proj without) as EAGLE-1's layer 0: no input norm."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_theta", "max_position_embeddings", "hidden_act")  # fmt: skip
    qwen = Qwen2Config(**{k: config[k] for k in keys}, num_hidden_layers=1)
    qwen._attn_implementation = "eager"
    layer = Qwen2DecoderLayer(qwen, 0).eval()
    own = {k[len("layers.0.") :]: v for k, v in tensors.items() if k.startswith("layers.0.")}
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict(own, strict=True)
    positions = torch.arange(x.shape[1])[None]
    cos_sin = Qwen2RotaryEmbedding(qwen)(x, positions)
    causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    return layer(x, attention_mask=causal, position_ids=positions, position_embeddings=cos_sin)


def test_eagle1_qwen2_style_qkv_bias(tmp_path):
    target = _target("qwen2")
    folder, config, tensors = _qwen2_eagle1_folder(tmp_path / "eagle1-qwen2", target)
    assert detect_layout(folder) == "eagle1"
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    attn = drafter.layers[0].self_attn
    assert drafter.config.qkv_bias and not drafter.config.attention_bias and attn.o_proj.bias is None
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, proj).bias, tensors[f"layers.0.self_attn.{proj}.bias"])
    _assert_greedy_identity(target, drafter)
    # The first draft step against transformers' Qwen2 layer over FC([embedding; feature]).
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 90, (1, 9), generator=g)
    feat = torch.randn(1, 9, target.config.hidden_size, generator=g)
    with torch.no_grad():
        ((_, ours),) = drafter.unroll(ids, feat, steps=1)
        emb = target.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], 1))
        x = F.linear(torch.cat([emb, feat], -1), tensors["fc.weight"], tensors["fc.bias"])
        torch.testing.assert_close(ours, _qwen2_layer_reference(config, tensors, x), rtol=1e-4, atol=1e-4)
    # Exported back in the layout: qkv_bias in config.json, biases on q/k/v only.
    out = export_drafter(drafter, str(tmp_path / "back"), "eagle1")
    assert _read_config(out)["qkv_bias"] is True
    names = set(load_file(os.path.join(out, "model.safetensors")))
    assert "layers.0.self_attn.q_proj.bias" in names and "layers.0.self_attn.o_proj.bias" not in names
    _assert_same_weights(drafter, import_drafter(out, target_config=target.config))


def test_eagle1_qkv_biases_without_the_flag_are_refused(tmp_path):
    target = _target("qwen2")
    folder, config, tensors = _qwen2_eagle1_folder(tmp_path / "src", target)
    _write(folder, {k: v for k, v in config.items() if k != "qkv_bias"}, tensors)
    with pytest.raises(ValueError, match="unexpected.*q_proj.bias"):
        AutoModelForDrafting.from_pretrained(folder)
