"""Published DFlash / MTP checkpoints as their projects write them, and pickles that would run code.

* DFlash: a drafter saved by transformers' own ``MuseGlimmerAssistantModel.save_pretrained`` has no ``vocab_size``;
  it loads with the vocabulary unresolved and ``generate`` binds it to the target (that the layout computes what
  transformers' model does is tests/models/dflash/test_dflash.py's check).
* MTP: XiaomiMiMo's ``model.mtp_layers.*`` import from the MiMo target's checkpoint (only the shard holding them is
  downloaded, its ``auto_map`` never run) and compute what MiMo's layer structure does (built here from transformers'
  Qwen2 parts); Qwen3-Next's ``mtp.*`` are refused by name from ``config.json`` and the tensor names alone.
* Pickles: other projects' ``.bin`` / ``.pt`` files (index-less and memory-mapped, legacy non-zip, sharded with an
  index, Medusa's ``medusa_lm_head.pt``) holding an object whose ``__reduce__`` would write a marker file are refused
  with what to do, from a folder and by repo id, and the marker never appears.
"""

import hashlib
import json
import os

import pytest
import torch
from helpers import make_target, ragged_batch
from huggingface_hub import HfApi
from safetensors.torch import load_file, save_file
from torch import nn

from hf_specdec import AutoModelForDrafting, DFlashConfig, MtpConfig
from hf_specdec.convert import detect_layout, export_drafter, import_drafter

# huggingface_hub's single-part LFS upload passes the file as `data=`, which httpx2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


def _upload(hub, folder, repo_id: str) -> None:
    api = HfApi(endpoint=hub.endpoint, token="t")
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id)


def _greedy(target, drafter=None, batch: int = 2):
    ids, mask = ragged_batch(batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    if drafter is not None:
        kwargs["assistant_model"] = drafter
    return target.generate(ids, **kwargs)


def _same_weights(a, b) -> None:
    want, got = a.state_dict(), b.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _perturb(model: nn.Module, seed: int) -> None:
    """Moves every parameter off its initial value (norms start at one), so equivalence checks see every weight."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))


# -- DFlash: transformers' MuseGlimmerAssistantModel ---------------------------------------------------------------
MASK_ID = 95  # a target token id of the tiny test vocabulary (96)


def _muse_model(mask_token_id: int = MASK_ID):
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=512, sliding_window=16, target_layer_ids=[0, 2],
        mask_token_id=mask_token_id, block_size=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = MuseGlimmerAssistantModel(config).eval()
    _perturb(model, seed=1)
    return model


def _muse_folder(tmp_path, mask_token_id: int = MASK_ID):
    model = _muse_model(mask_token_id)
    folder = tmp_path / f"muse-{mask_token_id}"
    model.save_pretrained(folder)
    return model, folder


def test_a_muse_glimmer_drafter_saved_by_transformers_loads_and_decodes_losslessly(tmp_path, hub):
    target = make_target("llama", seed=7)
    _, folder = _muse_folder(tmp_path)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["model_type"] == "muse_glimmer_assistant" and "vocab_size" not in saved  # the case at hand
    _upload(hub, folder, "org/muse")
    for source in (folder, "org/muse"):
        drafter = AutoModelForDrafting.from_pretrained(source).eval()
        assert isinstance(drafter.config, DFlashConfig) and drafter.config.target_vocab_size is None
        assert _greedy(target, drafter).equal(_greedy(target))
        # generate bound it: the vocabulary is the target's, drafted over in full
        assert drafter.config.target_vocab_size == drafter.config.draft_vocab_size == 96
        assert drafter.t2d.shape == (96,) and bool(drafter.t2d.all()) and not drafter.reduced_vocabulary
    # With the target's config at import, the vocabulary is resolved (and checked) right away.
    resolved = import_drafter(folder, target_config=target.config)
    assert resolved.config.target_vocab_size == 96 and resolved.config.target_num_hidden_layers == 4


def test_an_unresolved_drafter_saves_reloads_and_is_bound_before_export(tmp_path):
    target = make_target("llama", seed=7)
    _, folder = _muse_folder(tmp_path)
    drafter = AutoModelForDrafting.from_pretrained(folder)
    drafter.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForDrafting.from_pretrained(tmp_path / "saved").eval()
    assert reloaded.config.target_vocab_size is None
    _same_weights(drafter, reloaded)
    with pytest.raises(ValueError, match="target vocabulary is unresolved.*bind_target"):
        export_drafter(reloaded, str(tmp_path / "out"), "muse-glimmer")
    assert _greedy(target, reloaded, batch=1).equal(_greedy(target, batch=1))
    export_drafter(reloaded, str(tmp_path / "out"), "muse-glimmer")  # bound now: its vocabulary is known
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 96


def test_a_mask_token_outside_the_targets_vocabulary_is_refused_when_bound(tmp_path):
    """transformers' default mask_token_id (201818) fits Muse Glimmer's vocabulary, not the tiny target's."""
    target = make_target("llama", seed=7)
    _, folder = _muse_folder(tmp_path, mask_token_id=201818)
    drafter = AutoModelForDrafting.from_pretrained(folder)  # the vocabulary is not known yet: nothing to check
    with pytest.raises(ValueError, match=r"cannot be bound .*vocabulary 96.*mask_token_id must be a target token id"):
        _greedy(target, drafter, batch=1)
    assert drafter.config.target_vocab_size is None and drafter.t2d.numel() == 0  # left as it was
    with pytest.raises(ValueError, match="mask_token_id"):
        import_drafter(folder, target_config=target.config)


# -- MTP: XiaomiMiMo ----------------------------------------------------------------------------------------------
class MimoMtpLayer(nn.Module):
    """The layer structure of XiaomiMiMo's ``MiMoMTPLayers`` (modeling_mimo.py), from transformers' Qwen2 parts:
    ``final_layernorm(Qwen2DecoderLayer(input_proj([hidden_layernorm(h); token_layernorm(e)])))``."""

    def __init__(self, config):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm, self.hidden_layernorm = Qwen2RMSNorm(h, eps), Qwen2RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Qwen2DecoderLayer(config, layer_idx=0)  # input_layernorm, self_attn, post_attention_layernorm, mlp
        self.final_layernorm = Qwen2RMSNorm(h, eps)

    def mimo_state_dict(self, k: int = 0) -> dict:
        """The tensors as MiMo's checkpoint names them (the decoder layer's without a wrapper)."""
        prefix = f"model.mtp_layers.{k}."
        return {prefix + name.removeprefix("block."): t.detach().clone() for name, t in self.state_dict().items()}

    def forward(self, embeds, hidden, position_embeddings, mask):
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))
        return self.final_layernorm(self.block(x, attention_mask=mask, position_embeddings=position_embeddings))


def _mimo_checkpoint(tmp_path, marker):
    """A MiMo target checkpoint as XiaomiMiMo ships it: the Qwen2 target's weights in one shard, its MTP layer in
    another, ``model_type`` ``mimo`` with an ``auto_map`` to remote code (here: code that would leave ``marker``)."""
    target = make_target("qwen2", seed=7)
    torch.manual_seed(5)
    layer = MimoMtpLayer(target.config).eval()
    _perturb(layer, seed=6)
    folder = tmp_path / "mimo"
    folder.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {k: v.clone() for k, v in target.state_dict().items()},
        "model-00002-of-00002.safetensors": layer.mimo_state_dict(),
    }
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    auto_map = {"AutoConfig": "modeling_mimo.MiMoConfig", "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"}
    config = {**target.config.to_dict(), "model_type": "mimo", "architectures": ["MiMoForCausalLM"],
              "num_nextn_predict_layers": 1, "auto_map": auto_map}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    code = f"open({str(marker)!r}, 'w').close()\nclass MiMoConfig:\n    pass\nclass MiMoForCausalLM:\n    pass\n"
    (folder / "modeling_mimo.py").write_text(code)
    return target, layer, folder


def _mimo_reference_logits(target, layer, ids):
    """Teacher-forced logits of MiMo's MTP layer: position ``t`` reads the target's final (normed) state at ``t`` and
    the embedding of token ``t + 1`` (the last repeated), causally, through the target's LM head."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    layer.block.self_attn.config._attn_implementation = "eager"  # the explicit mask below is all it sees
    t = ids.shape[1]
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]
    embeds = target.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], dim=1))
    positions = torch.arange(t)[None]
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = layer(embeds, hidden, Qwen2RotaryEmbedding(target.config)(hidden, positions), causal)
    return target.get_output_embeddings()(out), hidden


def test_mimo_mtp_layers_import_as_the_drafter_mimo_runs(tmp_path):
    marker = tmp_path / "remote-code-ran"
    target, layer, folder = _mimo_checkpoint(tmp_path, marker)
    assert detect_layout(folder) == "mimo-mtp"
    drafter = AutoModelForDrafting.from_pretrained(folder, trust_remote_code=True).eval()
    cfg = drafter.config
    assert isinstance(cfg, MtpConfig) and cfg.hidden_states_first and cfg.num_mtp_modules == 1
    assert cfg.qkv_bias and not cfg.attention_bias  # Qwen2's attention: biases on q/k/v, none on o_proj
    assert cfg.target_num_hidden_layers == 4 and cfg.target_layer_ids == [4]  # the final, normed state
    drafter.bind_target(target)
    ids = torch.randint(6, 90, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, hidden = _mimo_reference_logits(target, layer, ids)
        got = drafter.unroll(ids, hidden, steps=1)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert _greedy(target, drafter).equal(_greedy(target))
    assert not marker.exists() and not os.path.exists(tmp_path / "modules")


def test_mimo_by_repo_id_downloads_only_its_mtp_shard_and_never_its_code(tmp_path, hub):
    marker = tmp_path / "remote-code-ran"
    _, _, folder = _mimo_checkpoint(tmp_path, marker)
    _upload(hub, folder, "org/mimo")
    loaded = AutoModelForDrafting.from_pretrained("org/mimo", trust_remote_code=True)
    _same_weights(AutoModelForDrafting.from_pretrained(folder), loaded)
    mtp_shard = hashlib.sha256((folder / "model-00002-of-00002.safetensors").read_bytes()).hexdigest()
    assert hub.lfs_downloads == [mtp_shard]
    assert not marker.exists() and not os.path.exists(tmp_path / "modules")
    assert not list((tmp_path / "hub-cache").rglob("*.py"))


def test_a_sliding_window_mimo_config_is_refused(tmp_path):
    _, _, folder = _mimo_checkpoint(tmp_path, tmp_path / "marker")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window: true; hf_specdec's MTP layer attends to the whole"):
        AutoModelForDrafting.from_pretrained(folder)


# -- MTP: Qwen3-Next ----------------------------------------------------------------------------------------------
def _qwen3_next_folder(path):
    """A Qwen3-Next checkpoint's config and a few of its tensors: the target's, and its ``mtp.*`` layer."""
    config = {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 96, "num_experts": 4, "num_experts_per_tok": 2, "num_nextn_predict_layers": 1,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "partial_rotary_factor": 0.25,
    }  # fmt: skip
    h = 32
    tensors = {
        "model.embed_tokens.weight": torch.zeros(96, h),
        "model.layers.3.self_attn.q_proj.weight": torch.zeros(2 * 32, h),
        "mtp.fc.weight": torch.zeros(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(h),
        "mtp.layers.0.self_attn.q_proj.weight": torch.zeros(2 * 32, h),  # queries and their output gate
        "mtp.layers.0.mlp.gate.weight": torch.zeros(4, h),
        "mtp.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 128, h),
        "mtp.norm.weight": torch.zeros(h),
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _assert_names_qwen3_next(err) -> None:
    message = str(err.value)
    assert "Qwen3-Next's MTP layer (tensors mtp.*" in message and "is not supported" in message
    assert "gated attention" in message and "hf_specdec's MTP module" in message
    assert "vLLM or SGLang" in message and "hf-specdec train --drafter mtp" in message
    assert "Unrecognized configuration" not in message and "trust_remote_code" not in message


def test_qwen3_next_mtp_layers_are_refused_by_name_without_reading_weights(tmp_path, hub, monkeypatch):
    folder = _qwen3_next_folder(tmp_path / "qwen3-next")
    _upload(hub, folder, "org/qwen3-next")
    from hf_specdec import checkpoint_files

    def no_weight_reads(*args, **kwargs):
        raise AssertionError("the refusal read weights")

    monkeypatch.setattr(checkpoint_files, "_read_tensors", no_weight_reads)
    for load in (AutoModelForDrafting.from_pretrained, import_drafter):
        for source in (folder, "org/qwen3-next"):
            with pytest.raises(ValueError) as err:
                load(source)
            _assert_names_qwen3_next(err)
    # The safetensors header was read remotely (range requests); no weight file was downloaded.
    assert not list((tmp_path / "hub-cache").rglob("*.safetensors"))
    assert detect_layout(folder) is None


# -- pickles from other projects ----------------------------------------------------------------------------------
class WritesMarker:
    """Unpickling this runs ``exec``, which writes ``path``: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _save_armed(state: dict, path, marker, legacy: bool = False) -> None:
    """Saves ``state`` plus the payload to ``path`` and checks the payload is live (an unsafe load writes
    ``marker``), so that the tests below would fail if hf_specdec unpickled it."""
    torch.save({**state, "payload": WritesMarker(marker)}, path, _use_new_zipfile_serialization=not legacy)
    torch.load(path, weights_only=False)
    assert marker.exists(), "the payload did not run under an unsafe load"
    marker.unlink()


def _assert_refused(load, marker) -> None:
    with pytest.raises(ValueError) as err:
        load()
    message = str(err.value)
    assert "is a pickle holding more than tensors (Unsupported global" in message
    assert "weights_only=True" in message and "convert the checkpoint to safetensors" in message
    assert not marker.exists()


def _drafter_export(tmp_path, config_class, layout: str):
    target = make_target("llama", seed=7)
    torch.manual_seed(3)
    drafter = AutoModelForDrafting.from_config(config_class.for_target(target.config)).eval()
    folder = tmp_path / layout
    export_drafter(drafter, str(folder), layout, target=target)
    return folder


def _refused_everywhere(hub, folder, repo_id: str, marker) -> None:
    _upload(hub, folder, repo_id)
    for load in (AutoModelForDrafting.from_pretrained, import_drafter):
        for source in (folder, repo_id):
            _assert_refused(lambda: load(source), marker)  # noqa: B023  (called at once)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip-memory-mapped", "legacy-non-zip"])
def test_an_index_less_pytorch_model_bin_with_a_payload_is_refused(tmp_path, hub, legacy):
    """Its tensor names need the file: the payload is met while detecting the layout (memory-mapped for the zip
    format, a plain load for the legacy one)."""
    marker = tmp_path / "payload-ran"
    folder = _drafter_export(tmp_path, DFlashConfig, "dflash-zlab")
    _save_armed(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin", marker, legacy)
    (folder / "model.safetensors").unlink()
    _refused_everywhere(hub, folder, "org/dflash-bin", marker)


def test_a_sharded_pytorch_model_bin_with_a_payload_in_the_shard_read_is_refused(tmp_path, hub):
    """The index names the tensors (detection reads no pickle); the payload sits in the shard holding the MTP layers,
    which import reads."""
    marker = tmp_path / "payload-ran"
    target = make_target("llama", seed=7)
    exported = _drafter_export(tmp_path, MtpConfig, "mtp-layers")
    repo = tmp_path / "target-with-mtp"
    repo.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {k: v.clone() for k, v in target.state_dict().items()},
        "pytorch_model-00002-of-00002.bin": load_file(str(exported / "model.safetensors")),
    }
    torch.save(shards["pytorch_model-00001-of-00002.bin"], repo / "pytorch_model-00001-of-00002.bin")
    _save_armed(shards["pytorch_model-00002-of-00002.bin"], repo / "pytorch_model-00002-of-00002.bin", marker)
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (repo / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (repo / "config.json").write_text((exported / "config.json").read_text())
    assert detect_layout(repo) == "mtp-layers"  # from the index alone
    _refused_everywhere(hub, repo, "org/target-with-mtp-bin", marker)


def test_a_medusa_lm_head_pt_with_a_payload_is_refused(tmp_path, hub):
    """FasterDecoding's Medusa loader reads medusa_lm_head.pt (found through the folder's or repo's file listing)."""
    from hf_specdec import MedusaConfig

    marker = tmp_path / "payload-ran"
    folder = _drafter_export(tmp_path, MedusaConfig, "medusa-fasterdecoding")
    _save_armed(load_file(str(folder / "medusa_lm_head.safetensors")), folder / "medusa_lm_head.pt", marker)
    (folder / "medusa_lm_head.safetensors").unlink()
    _refused_everywhere(hub, folder, "org/medusa-pt", marker)


@pytest.mark.parametrize("command", ["convert", "push"])
def test_the_cli_says_in_one_line_that_a_pickle_with_a_payload_was_not_loaded(tmp_path, command, capsys):
    """No traceback quoting torch's advice to retry with weights_only=False: one line naming the file, saying it
    was not read and that the way on is a safetensors copy."""
    from hf_specdec.commands import main

    marker = tmp_path / "payload-ran"
    folder = _drafter_export(tmp_path, DFlashConfig, "dflash-zlab")
    _save_armed(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin", marker)
    (folder / "model.safetensors").unlink()
    capsys.readouterr()
    if command == "convert":
        argv = ["convert", str(folder), str(tmp_path / "out")]
    else:
        argv = ["push", str(folder), "org/x", "--base-model", "org/t", "--endpoint", "http://127.0.0.1:9"]
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]
    assert code == 2 and len(err) == 1, err
    assert str(folder / "pytorch_model.bin") in err[0] and "does not read it" in err[0]
    assert "convert the checkpoint to safetensors" in err[0] and "Traceback" not in err[0]
    assert not marker.exists() and not (tmp_path / "out").exists()
