"""Published Medusa and Hydra checkpoints, as fixtures in their projects' own layouts (issue 25 §3).

* FasterDecoding/medusa-vicuna-7b-v1.3: ``config.json`` says ``medusa_num_heads: 2``, ``medusa_lm_head.pt`` holds 5
  heads (Medusa's loader forces 5): the weights decide, with a warning naming both numbers.
* FasterDecoding's full Medusa-2 models (``model.*`` / ``lm_head.*`` of the target next to ``medusa_head.*``): only
  the heads are read; the checkpoint itself loads as the target.
* zankner/Hydra (``ankner/hydra-vicuna-*``): ``hydra_lm_head.pt`` with ``hydra_mlp.*``, ``hydra_lm_head.*`` and, for
  ``prefix-mlp`` heads, a one-layer ``LlamaModel`` (``prefix_embeding_layer.*``). The reference forward below is
  written from Hydra's modules (``ResBlock``, ``HydraPrefixMLP.forward``), with transformers' own ``LlamaModel`` as
  the prefix layer.
"""

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from drafter_tester import RecordingSelector, prefill_inputs
from helpers import make_target, ragged_batch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaModel

from hf_specdec import AutoModelForDrafting, HydraConfig
from hf_specdec.convert import export_drafter, import_drafter

GREEDY = dict(max_new_tokens=12, do_sample=False)


def _randn(g, *shape, scale=0.1):
    return torch.randn(*shape, generator=g) * scale


def _assert_greedy_identity(target, drafter, batch=2):
    ids, mask = ragged_batch(batch)
    plain = target.generate(ids, attention_mask=mask, **GREEDY)
    assisted = target.generate(ids, attention_mask=mask, assistant_model=drafter, **GREEDY)
    assert torch.equal(assisted, plain)


# ------------------------------------------------------------------------------------------------------------ Medusa
def _medusa_heads(num_heads: int, target, dtype=torch.float32) -> dict:
    """FasterDecoding's head state dict (one residual block per head): ``{h}.0.linear.*``, ``{h}.1.weight``."""
    g = torch.Generator().manual_seed(1)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    lm_head = target.get_output_embeddings().weight.detach()
    state = {}
    for h in range(num_heads):
        state[f"{h}.0.linear.weight"] = _randn(g, hidden, hidden).to(dtype)
        state[f"{h}.0.linear.bias"] = _randn(g, hidden).to(dtype)
        state[f"{h}.1.weight"] = (lm_head + _randn(g, vocab, hidden)).to(dtype)
    return state


def _medusa_reference(state: dict, num_heads: int, hidden: torch.Tensor) -> torch.Tensor:
    """Medusa's head: ``x + SiLU(W x + b)``, then the head's own projection."""
    outs = []
    for h in range(num_heads):
        w, b = state[f"{h}.0.linear.weight"].float(), state[f"{h}.0.linear.bias"].float()
        proj = state[f"{h}.1.weight"].float()
        x = hidden + F.silu(hidden @ w.T + b)
        outs.append(x @ proj.T)
    return torch.stack(outs, dim=-2)


def test_medusa_vicuna_config_undercounts_its_heads(tmp_path):
    """medusa-vicuna-7b-v1.3: config says 2 heads, medusa_lm_head.pt (torch.save, fp16) holds 5; the 5 are used."""
    target = make_target("llama", seed=7)
    state = _medusa_heads(5, target, torch.float16)
    folder = tmp_path / "medusa-vicuna-7b-v1.3"
    folder.mkdir()
    torch.save(state, folder / "medusa_lm_head.pt")
    config = {"medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3"}
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": "4.31.0"}))

    with pytest.warns(UserWarning, match=r"medusa_num_heads=2, but the weights hold 5 heads") as seen:
        drafter = AutoModelForDrafting.from_pretrained(folder)
    assert len([w for w in seen if "medusa_num_heads" in str(w.message)]) == 1
    with pytest.warns(UserWarning, match=r"medusa_num_heads=2.*5 heads"):
        imported = import_drafter(str(folder), target_config=target.config)
    for loaded in (drafter, imported):
        assert loaded.num_heads == 5 and loaded.config.num_heads == 5 and loaded.config.num_draft_tokens == 5
    h = _randn(torch.Generator().manual_seed(2), 2, 4, target.config.hidden_size, scale=1.0)
    with torch.no_grad():
        torch.testing.assert_close(drafter(h), _medusa_reference(state, 5, h), rtol=1e-5, atol=1e-5)
    _assert_greedy_identity(target, drafter.eval())


def test_medusa_checkpoint_agreeing_with_its_config_loads_without_a_warning(tmp_path):
    target = make_target("llama", seed=7)
    folder = tmp_path / "medusa"
    folder.mkdir()
    torch.save(_medusa_heads(3, target), folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AutoModelForDrafting.from_pretrained(folder).num_heads == 3


def _full_medusa2_folder(tmp_path, target, num_heads: int):
    """A full Medusa-2 model as FasterDecoding ships it: the target's config + medusa_* keys, the target's weights
    in one shard and the heads (``medusa_head.*``) in another, with the weight index."""
    heads = {f"medusa_head.{k}": v for k, v in _medusa_heads(num_heads, target).items()}
    shards = {
        "model-00001-of-00002.safetensors": {k: v.detach().clone() for k, v in target.state_dict().items()},
        "model-00002-of-00002.safetensors": heads,
    }
    folder = tmp_path / "medusa-1.0-tiny"
    folder.mkdir()
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {**target.config.to_dict(), "architectures": ["MedusaModelLlama"]}
    config.update(medusa_num_heads=num_heads, medusa_num_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, {k[len("medusa_head.") :]: v for k, v in heads.items()}


def test_full_medusa2_model_imports_its_heads_without_reading_the_target_weights(tmp_path):
    target = make_target("llama", seed=7)
    folder, heads = _full_medusa2_folder(tmp_path, target, num_heads=3)
    own_target = AutoModelForCausalLM.from_pretrained(folder).eval()  # the checkpoint is the heads' target
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        torch.testing.assert_close(own_target(ids, attention_mask=mask).logits, target(ids, attention_mask=mask).logits)
    # The target's shard can no longer be read: importing the heads must not touch it. (A new file replaces it:
    # the loaded target may still map the old one.)
    (folder / "garbage").write_bytes(b"not a safetensors file")
    os.replace(folder / "garbage", folder / "model-00001-of-00002.safetensors")
    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    imported = import_drafter(str(folder))
    assert drafter.config.model_type == "medusa_drafter" and drafter.num_heads == 3
    cfg = drafter.config  # the target's facts come from the checkpoint's own (target) config
    assert (cfg.target_num_hidden_layers, cfg.target_layer_ids, cfg.target_vocab_size) == (4, [4], 96)
    h = _randn(torch.Generator().manual_seed(3), 2, 5, target.config.hidden_size, scale=1.0)
    with torch.no_grad():
        torch.testing.assert_close(drafter(h), _medusa_reference(heads, 3, h), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(imported(h), drafter(h))
    _assert_greedy_identity(own_target, drafter)


# ------------------------------------------------------------------------------------------------------------- Hydra
def _block_index(arch: str, block: int) -> int:
    return 2 * block + 1 if arch == "prefix-mlp" else block


def _lm_head_prefix(arch: str, h: int) -> str:
    return f"hydra_lm_head.{h}.1." if arch == "prefix-mlp" else f"hydra_lm_head.{h}."


def _prefix_model(target_config, seed: int = 5) -> LlamaModel:
    """Hydra's prefix layer: a one-layer LlamaModel shaped as the target (here transformers' own), randomised."""
    config = LlamaConfig(**{**target_config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(seed)
    model = LlamaModel(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(_randn(g, *p.shape, scale=0.2)) if "norm" in name else p.copy_(_randn(g, *p.shape, scale=0.2))
    return model


def _hydra_checkpoint(target, arch: str, num_heads: int, num_layers: int, seed: int = 4):
    """Hydra's head state dict as ``torch.save(hydra_head.state_dict())`` writes it; the blocks after the first are
    one module repeated in Hydra, so their entries are one tensor."""
    g = torch.Generator().manual_seed(seed)
    d, vocab = target.config.hidden_size, target.config.vocab_size
    state = {}
    for h in range(num_heads):
        first = f"hydra_mlp.{h}.{_block_index(arch, 0)}."
        state[first + "linear.weight"], state[first + "linear.bias"] = _randn(g, d, (h + 2) * d), _randn(g, d)
        state[first + "res_connection.weight"] = _randn(g, d, (h + 2) * d, scale=0.3)
        state[first + "res_connection.bias"] = _randn(g, d)
        shared_w, shared_b = _randn(g, d, d), _randn(g, d)
        for j in range(1, num_layers):
            block = f"hydra_mlp.{h}.{_block_index(arch, j)}."
            state[block + "linear.weight"], state[block + "linear.bias"] = shared_w, shared_b
        lm = _lm_head_prefix(arch, h)
        state[lm + "weight"], state[lm + "bias"] = _randn(g, vocab, d, scale=1.0), _randn(g, vocab)
    prefix = None
    if arch == "prefix-mlp":
        prefix = _prefix_model(target.config)
        state.update({f"prefix_embeding_layer.{k}": v.clone() for k, v in prefix.state_dict().items()})
        head_dim = target.config.head_dim  # Hydra's rotary embedding keeps its frequencies as a saved buffer
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        state["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq
    return state, prefix


def _hydra_folder(tmp_path, state: dict, **config) -> str:
    folder = tmp_path / "hydra"
    folder.mkdir(exist_ok=True)
    torch.save(state, folder / "hydra_lm_head.pt")
    defaults = {"hydra_head_arch": "mlp", "grounded_heads": True, "hidden_state_offset": 0}
    full = {**defaults, **config, "base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "transformers_version": "4.36.2"}
    (folder / "config.json").write_text(json.dumps(full))
    return folder


def _hydra_head_ref(state, arch, h, num_layers, x):
    """Hydra's head ``h`` on ``x = [base; E(path)]``: ``P x + SiLU(W x + b)``, the repeated ``ResBlock``, the
    biased projection."""
    first = f"hydra_mlp.{h}.{_block_index(arch, 0)}."
    y = x @ state[first + "res_connection.weight"].T + state[first + "res_connection.bias"]
    y = y + F.silu(x @ state[first + "linear.weight"].T + state[first + "linear.bias"])
    for j in range(1, num_layers):
        block = f"hydra_mlp.{h}.{_block_index(arch, j)}."
        y = y + F.silu(y @ state[block + "linear.weight"].T + state[block + "linear.bias"])
    lm = _lm_head_prefix(arch, h)
    return y @ state[lm + "weight"].T + state[lm + "bias"]


def _hydra_teacher_forced_ref(state, arch, num_heads, num_layers, prefix, hidden, embeds):
    """``HydraPrefixMLP.forward`` / ``HydraMLP.forward`` with grounded heads (inputs rolled left per head)."""
    base = prefix(inputs_embeds=hidden).last_hidden_state if prefix is not None else hidden
    inputs = [base] + [torch.roll(embeds, shifts=-(i + 1), dims=1) for i in range(num_heads)]
    return [_hydra_head_ref(state, arch, h, num_layers, torch.cat(inputs[: h + 2], -1)) for h in range(num_heads)]


def _check_teacher_forced(drafter, target, state, arch, num_heads, num_layers, prefix, layer: int):
    ids, _ = ragged_batch(1, length=10)  # one unpadded row, as Hydra runs
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states[layer]
        embeds = target.get_input_embeddings()(ids)
        want = _hydra_teacher_forced_ref(state, arch, num_heads, num_layers, prefix, hidden, embeds)
        got = drafter(hidden, ids)
    for h in range(num_heads):
        valid = ids.shape[1] - (h + 1)  # Hydra's roll wraps around past the end
        torch.testing.assert_close(got[h][:, :valid], want[h][:, :valid], rtol=1e-4, atol=1e-4)


def test_hydra_plus_plus_prefix_mlp_checkpoint(tmp_path):
    """ankner/hydra-vicuna-*: prefix-mlp, grounded, 4 blocks (3 of them one repeated module), biased heads."""
    target = make_target("llama", seed=6, rms_norm_eps=1e-5)
    num_heads, num_layers = 3, 4
    state, prefix = _hydra_checkpoint(target, "prefix-mlp", num_heads, num_layers)
    config = dict(hydra_num_heads=num_heads, hydra_num_layers=num_layers, hydra_head_arch="prefix-mlp")
    folder = _hydra_folder(tmp_path, state, **config)

    drafter = AutoModelForDrafting.from_pretrained(folder).eval()
    cfg = drafter.config
    assert cfg.model_type == "hydra_drafter" and (cfg.num_heads, cfg.num_layers) == (num_heads, num_layers)
    assert cfg.prefix_layer and cfg.prefix_norm and cfg.head_bias
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (4, 2, 8, 64)
    assert drafter.prefix.norm.eps == 1e-6  # the target's epsilon is not known before binding
    drafter.bind_target(target)
    assert drafter.prefix.norm.eps == drafter.prefix.input_layernorm.eps == cfg.rms_norm_eps == 1e-5
    _check_teacher_forced(drafter, target, state, "prefix-mlp", num_heads, num_layers, prefix, layer=4)

    # Given the target's config, the same drafter is resolved at import.
    imported = import_drafter(str(folder), target_config=target.config)
    assert imported.prefix.norm.eps == 1e-5 and imported.config.target_layer_ids == [4]
    assert all(torch.equal(v, imported.state_dict()[k]) for k, v in drafter.state_dict().items())

    # Decoding: after the prompt, head h reads [prefix state; E(next token); E(draft 1..h)] (Hydra's proposal).
    ids, mask = ragged_batch(1, length=10)
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        first = out.logits[:, -1].argmax(-1)
        state_d = drafter.init_draft_state(1, 64)
        drafter.observe(state_d, prefill_inputs(target, ids, mask, first))
        proposal = drafter.propose(state_d, num_heads, RecordingSelector())
        base = prefix(inputs_embeds=out.hidden_states[4]).last_hidden_state[:, -1]
        path = [target.get_input_embeddings()(first)]
        for h in range(num_heads):
            want = _hydra_head_ref(state, "prefix-mlp", h, num_layers, torch.cat([base, *path], -1)).argmax(-1)
            assert torch.equal(proposal.tokens[:, h], want), h
            path.append(target.get_input_embeddings()(want))
    _assert_greedy_identity(target, AutoModelForDrafting.from_pretrained(folder).eval())


def test_hydra_mlp_heads_with_a_hidden_state_offset(tmp_path):
    target = make_target("llama", seed=6)
    state, _ = _hydra_checkpoint(target, "mlp", 2, 2)
    folder = _hydra_folder(tmp_path, state, hydra_num_heads=2, hydra_num_layers=2, hidden_state_offset=1)
    with pytest.raises(ValueError, match="hidden_state_offset=1"):
        AutoModelForDrafting.from_pretrained(folder)
    drafter = AutoModelForDrafting.from_pretrained(folder, target_config=target.config).eval()
    assert drafter.config.target_layer_ids == [3] and drafter.prefix is None and drafter.config.head_bias
    drafter.bind_target(target)
    _check_teacher_forced(drafter, target, state, "mlp", 2, 2, None, layer=3)
    _assert_greedy_identity(target, drafter)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hydra_head_arch": "cross-attn"}, "hydra_head_arch='cross-attn'"),
        ({"hydra_head_arch": "eagle-attn"}, "hydra_head_arch='eagle-attn'"),
        ({"grounded_heads": False}, "grounded_heads=false"),
        ({"hydra_num_heads": 3}, "hydra_num_heads=3"),
        ({"hydra_num_layers": 3}, "hydra_num_layers=3"),
    ],
)
def test_hydra_settings_hf_specdec_cannot_run_are_refused_by_name(tmp_path, change, field):
    target = make_target("llama", seed=6)
    state, _ = _hydra_checkpoint(target, "mlp", 2, 2)
    if "hydra_head_arch" in change:  # Hydra's attention heads have other tensors: found through the config alone
        state = {"hydra_head.cross_attn.q_proj.weight": torch.zeros(2, 2)}
    folder = _hydra_folder(tmp_path, state, **{"hydra_num_heads": 2, "hydra_num_layers": 2, **change})
    with pytest.raises(ValueError) as err:
        AutoModelForDrafting.from_pretrained(folder)
    assert field in str(err.value)


def _hf_specdec_hydra(target, **overrides):
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(HydraConfig.for_target(target.config, num_heads=3, **overrides)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(_randn(g, *p.shape, scale=0.2))
        for head in drafter.heads:  # Hydra repeats one block after the first
            for block in head.blocks[1:]:
                block.load_state_dict(head.blocks[0].state_dict())
    return drafter.bind_target(target)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prefix_layer=True, prefix_norm=True, head_bias=True, num_layers=2),
        dict(num_layers=4),
    ],
    ids=["prefix-mlp", "mlp"],
)
def test_hydra_export_and_import_round_trip(tmp_path, overrides):
    target = make_target("llama", seed=4)
    drafter = _hf_specdec_hydra(target, **overrides)
    out = tmp_path / "exported"
    export_drafter(drafter, str(out), "hydra-zankner")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "hydra_lm_head.pt"]
    config = json.loads((out / "config.json").read_text())
    arch = "prefix-mlp" if overrides.get("prefix_layer") else "mlp"
    assert config["hydra_head_arch"] == arch and config["grounded_heads"] is True
    assert (config["hydra_num_heads"], config["hydra_num_layers"]) == (3, overrides["num_layers"])
    saved = torch.load(out / "hydra_lm_head.pt", weights_only=True)
    assert f"hydra_mlp.2.{_block_index(arch, 0)}.res_connection.weight" in saved
    assert f"{_lm_head_prefix(arch, 2)}bias" in saved

    back = AutoModelForDrafting.from_pretrained(out).eval()
    want, got = drafter.state_dict(), back.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    back.bind_target(target)
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        hidden = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        for a, b in zip(drafter(hidden, ids, attention_mask=mask), back(hidden, ids, attention_mask=mask)):
            assert torch.equal(a, b)
        first = torch.tensor([7, 8])
        chains = []
        for model in (drafter, back):  # the decoding path too (the prefix layer's cache)
            state = model.init_draft_state(2, 64)
            model.observe(state, prefill_inputs(target, ids, mask, first))
            chains.append(model.propose(state, 3, RecordingSelector()).tokens)
        assert torch.equal(chains[0], chains[1])
    original = target.generate(ids, attention_mask=mask, assistant_model=drafter, **GREEDY)
    assert torch.equal(original, target.generate(ids, attention_mask=mask, assistant_model=back, **GREEDY))
    assert torch.equal(original, target.generate(ids, attention_mask=mask, **GREEDY))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_layers=3), "num_layers=3"),
        (dict(prefix_layer=True, intermediate_size=48), "prefix_norm=False"),
        (dict(draft_vocab_size=40), "draft_vocab_size"),
        (dict(prefix_layer=True, prefix_norm=True, intermediate_size=48), "intermediate_size 48"),
    ],
)
def test_hydra_export_refuses_what_hydra_cannot_hold(tmp_path, overrides, field):
    target = make_target("llama", seed=4)
    drafter = _hf_specdec_hydra(target, **overrides)
    if overrides.get("num_layers") == 3:
        with torch.no_grad():
            drafter.heads[0].blocks[1].weight.add_(1.0)  # distinct blocks
    with pytest.raises(ValueError, match=field):
        export_drafter(drafter, str(tmp_path / "x"), "hydra-zankner")
