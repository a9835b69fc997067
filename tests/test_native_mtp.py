"""Targets with their own MTP layers (configs with ``num_mtp_layers``: DeepSeek-V3, GLM-4.5-MoE): the layer loads from
the target's checkpoint as ``NativeMtpForDrafting`` (transformers' ``MtpLayer`` around the target's MLA / MoE decoder
layer), reading the MTP tensors alone, drafts what transformers' ``MTPCandidateGenerator`` drafts, and runs through
hf_specdec's loop at batch > 1, with trees and with ASD. Targets whose MTP layers hf_specdec cannot run are refused
from ``config.json`` before any tensor is read."""

import json

import pytest
import torch
from helpers import ragged_batch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config
from transformers.generation.candidate_generator import MTPCandidateGenerator
from transformers.modeling_layers import MtpModel

from hf_specdec import AutoModelForDrafting
from hf_specdec.convert import detect_layout
from hf_specdec.models.mtp import NativeMtpForDrafting
from hf_specdec.testing import VOCAB

DEPTH = 2  # the target's layers; its MTP layer is model.layers.2


def tiny_deepseek_config(**overrides) -> DeepseekV3Config:
    """DeepSeek-V3 in miniature: MLA attention (q / kv LoRA ranks), a dense first layer, then 4 routed experts (2 per
    token) plus a shared one; the MTP layer is a MoE layer."""
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=DEPTH,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_mtp_layers=1, max_position_embeddings=256, pad_token_id=0,
        eos_token_id=5, bos_token_id=1,
    )  # fmt: skip
    return DeepseekV3Config(**{**fields, **overrides})


def checkpoint_names(mtp: MtpModel, depth: int) -> dict:
    """``MtpModel``'s layers under DeepSeek-V3's checkpoint names (``model.layers.{depth + k}.*``, one tensor per
    expert, ``shared_head.norm``); transformers' own loader reads them back (checked below)."""
    out = {}
    for name, tensor in mtp.layers.state_dict().items():
        k, rest = name.split(".", 1)
        prefix = f"model.layers.{depth + int(k)}."
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if rest == "mlp.experts.gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif rest == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[prefix + rest] = tensor.clone()
    return out


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """A tiny DeepSeek-V3 target saved as transformers saves it, its MTP layer in a second shard (as the published
    checkpoints shard it). Returns ``(target, folder, mtp_model)``: ``mtp_model`` is transformers' own
    ``MtpModel.from_pretrained`` of the folder."""
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_deepseek_config()).eval()
    mtp = MtpModel(target, 1)
    with torch.no_grad():
        for p in mtp.layers.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("deepseek-with-mtp")
    target.save_pretrained(folder)
    shards = {"model-00001-of-00002.safetensors": load_file(str(folder / "model.safetensors")),
              "model-00002-of-00002.safetensors": checkpoint_names(mtp, DEPTH)}  # fmt: skip
    (folder / "model.safetensors").unlink()
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    # DeepSeek-V3's class names its real MTP layer (model.layers.61); this one follows 2 layers
    target._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{DEPTH}\..*"]
    reference = MtpModel.from_pretrained(target).eval()
    for (name, mine), theirs in zip(mtp.layers.state_dict().items(), reference.layers.state_dict().values()):
        assert torch.equal(mine, theirs), name  # the checkpoint names are the ones transformers reads
    return target, folder, reference


def record_proposals(monkeypatch, drafter) -> list:
    seen = []
    propose = drafter.propose

    def recording(state, num_tokens, select):
        proposal = propose(state, num_tokens, select)
        seen.append((proposal.tokens.clone(), state.last_logits.clone()))
        return proposal

    monkeypatch.setattr(drafter, "propose", recording)
    return seen


def test_the_mtp_layer_loads_from_the_target_folder_as_transformers_builds_it(native):
    target, folder, reference = native
    assert detect_layout(folder) == "native-mtp"
    drafter = AutoModelForDrafting.from_pretrained(folder)
    assert isinstance(drafter, NativeMtpForDrafting)
    assert type(drafter.layers[0].mtp_block) is type(target.model.layers[-1])  # MLA + MoE: the target's own class
    theirs = reference.layers.state_dict()
    assert set(drafter.layers.state_dict()) == set(theirs)
    for name, tensor in drafter.layers.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_drafts_equal_transformers_mtp_candidate_generator(native, monkeypatch):
    target, folder, _ = native
    ids, _ = ragged_batch(1, length=7, seed=3)
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=None)
    theirs = []
    get_candidates = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kw):
        candidates, logits = get_candidates(self, input_ids, *args, **kw)
        if logits is not None:
            theirs.append((candidates[:, input_ids.shape[1] :].clone(), logits.clone()))
        return candidates, logits

    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    ref = target.generate(ids, use_mtp=True, **kwargs)
    drafter = AutoModelForDrafting.from_pretrained(folder)
    ours = record_proposals(monkeypatch, drafter)
    out = target.generate(ids, assistant_model=drafter, draft_length="fixed", **kwargs)
    assert torch.equal(out, ref)
    assert min(len(theirs), len(ours)) >= 5  # (transformers also drafts at the last step, which plans no draft here)
    for (their_token, their_logits), (token, logits) in zip(theirs, ours):
        assert torch.equal(token, their_token)
        torch.testing.assert_close(logits, their_logits[:, 0], rtol=1e-5, atol=1e-5)


def test_greedy_identity_at_batch_1_and_ragged_batch_2_with_longer_chains(native, monkeypatch):
    target, folder, _ = native
    drafter = AutoModelForDrafting.from_pretrained(folder)
    ids, mask = ragged_batch(2, length=9, seed=5)
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, attention_mask=mask, **kwargs)
    kwargs["draft_length"] = "fixed"
    batched = record_proposals(monkeypatch, drafter)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, num_assistant_tokens=3, **kwargs)
    assert torch.equal(out, ref)
    for row in range(2):  # each row of the ragged batch drafts what it drafts alone: padding and rollback are masked
        keep = mask[row].bool()
        monkeypatch.undo()
        alone = record_proposals(monkeypatch, drafter)
        single = target.generate(ids[row : row + 1, keep], assistant_model=drafter, num_assistant_tokens=3, **kwargs)
        assert torch.equal(single[0, -10:], ref[row, -10:])
        steps = min(len(alone), len(batched))
        assert steps >= 3
        for step in range(steps):
            assert torch.equal(alone[step][0][0], batched[step][0][row]), (row, step)


@pytest.mark.parametrize("tree", [{"tree": "eagle2", "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6}])
def test_trees_and_asd_are_greedy_identical(native, tree, monkeypatch):
    target, folder, _ = native
    drafter = AutoModelForDrafting.from_pretrained(folder)
    ids, mask = ragged_batch(2, length=9, seed=7)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    expanded = []
    tree_expand = drafter.tree_expand
    monkeypatch.setattr(drafter, "tree_expand", lambda state, e: expanded.append(e.depth) or tree_expand(state, e))
    assert torch.equal(target.generate(ids, assistant_model=drafter, draft_length="fixed", **tree, **kwargs), ref)
    assert max(expanded) >= 2  # the tree grew past the MTP layer's own token: the layer reran on its tree nodes
    strict = target.generate(ids, assistant_model=drafter, verifier="asd", asd_budget=0.0, **tree, **kwargs)
    assert torch.equal(strict, ref)
    spent = target.generate(
        ids, assistant_model=drafter, verifier="asd", asd_budget=2.0, num_assistant_tokens=3,
        return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    assert spent.approximate is True and spent.verifier == "asd"
    assert spent.sequences.shape == ref.shape


def test_only_the_mtp_tensors_are_read(native, tmp_path):
    """The target's own shard corrupted: loading reads the config, the index and the MTP shard alone."""
    _, folder, reference = native
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(folder, copy)
    (copy / "model-00001-of-00002.safetensors").write_bytes(b"not a safetensors file")
    drafter = AutoModelForDrafting.from_pretrained(copy)
    theirs = reference.layers.state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in drafter.layers.state_dict().items())
    (copy / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*corrupt"):  # the MTP shard is read
        AutoModelForDrafting.from_pretrained(copy)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"num_mtp_layers": 2}, "has 2 MTP layers"), ({"quantization_config": {"quant_method": "fp8"}}, "quantized")],
)
def test_unsupported_mtp_targets_are_refused_before_any_tensor_is_read(native, tmp_path, overrides, match):
    _, folder, _ = native
    copy = tmp_path / "refused"
    copy.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config.update(overrides)
    if "num_mtp_layers" in overrides:
        config["num_nextn_predict_layers"] = config.pop("num_mtp_layers")
    (copy / "config.json").write_text(json.dumps(config))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in set(index["weight_map"].values()):  # no weight file can be read
        (copy / name).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=match):
        AutoModelForDrafting.from_pretrained(copy)
