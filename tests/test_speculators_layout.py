"""The speculators format (vllm-project/speculators, what vLLM serves natively): export and import per family, the
fields written, speculators' own defaults when a key is absent, refusals by name, and publishing in the layout."""

import json
import shutil

import pytest
import torch
from helpers import make_target, ragged_batch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from hf_specdec import AutoModelForDrafting, DFlashConfig, DSparkConfig, Eagle3Config
from hf_specdec.commands import main as cli
from hf_specdec.convert import detect_layout, export_drafter, import_drafter

# huggingface_hub's single-part LFS upload passes the file as `data=`, which httpx2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

TARGET = "org/tiny-llama"
# layout -> (config class, config overrides, speculators_model_type, architecture)
CASES = {
    "eagle3-speculators": (Eagle3Config, {"num_draft_tokens": 4}, "eagle3", "Eagle3Speculator"),
    "dflash-speculators": (DFlashConfig, {"block_size": 4}, "dflash", "DFlashSpeculator"),
    "dspark-speculators": (DSparkConfig, {"block_size": 4, "markov_rank": 8}, "dspark", "DSparkSpeculator"),
}


def _target():
    target = make_target("llama", seed=7)
    target.config._name_or_path = TARGET
    target.config.architectures = ["LlamaForCausalLM"]
    return target


def _drafter(layout: str, target, bind: bool = True, **overrides):
    config_class, kwargs, _, _ = CASES[layout]
    torch.manual_seed(3)
    drafter = AutoModelForDrafting.from_config(config_class.for_target(target.config, **{**kwargs, **overrides}))
    drafter = drafter.eval()
    if bind:
        drafter.bind_target(target)
    if drafter.config.model_type == DSparkConfig.model_type:  # a fresh Markov correction is zero: make it matter
        with torch.no_grad():
            drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
    return drafter


def _config(folder) -> dict:
    with open(f"{folder}/config.json", encoding="utf-8") as fh:
        return json.load(fh)


def _edit(folder, dest, **changes) -> str:
    """A copy of the checkpoint ``folder`` whose config.json has ``changes`` (``None`` deletes a key)."""
    shutil.copytree(folder, dest)
    config = _config(dest)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(f"{dest}/config.json", "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    return str(dest)


def _assert_same_weights(a, b) -> None:
    want, got = a.state_dict(), b.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _assert_same_tokens(target, a, b) -> None:
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=a, **kw), target.generate(ids, assistant_model=b, **kw))


@pytest.mark.parametrize("layout", sorted(CASES))
def test_export_writes_the_format_and_imports_back_as_the_same_drafter(tmp_path, layout):
    target = _target()
    drafter = _drafter(layout, target)
    folder = export_drafter(drafter, str(tmp_path / layout), layout)  # the bound target gives the verifier
    config = _config(folder)
    _, _, kind, architecture = CASES[layout]
    assert config["speculators_model_type"] == kind and config["architectures"] == [architecture]
    assert (
        config["speculators_version"] and config["transformer_layer_config"]["vocab_size"] == target.config.vocab_size
    )
    spec = config["speculators_config"]
    assert spec["algorithm"] == kind and spec["default_proposal_method"] == "greedy"
    assert spec["verifier"] == {"name_or_path": TARGET, "architectures": ["LlamaForCausalLM"]}
    method = spec["proposal_methods"][0]
    assert method == {"proposal_type": "greedy", "speculative_tokens": drafter.config.num_draft_tokens,
                      "verifier_accept_k": 1, "accept_tolerance": 0.0}  # fmt: skip
    if kind == "eagle3":
        assert config["norm_before_residual"] is False  # written even at its default: vLLM reads absence as true
        assert method["speculative_tokens"] == 4 and config["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
        assert "layers.0.hidden_norm.weight" in load_file(f"{folder}/model.safetensors")
    else:
        assert config["sample_from_anchor"] is (kind == "dspark") and config["block_size"] == 4
        assert method["speculative_tokens"] == (4 if kind == "dspark" else 3)  # DSpark's anchor slot drafts too
        assert config["aux_hidden_state_layer_ids"] == list(drafter.config.target_layer_ids)
    tensors = load_file(f"{folder}/model.safetensors")
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)  # speculators' copy
    assert "d2t" not in tensors and "t2d" not in tensors  # a full vocabulary has no maps in speculators
    assert detect_layout(folder) == layout
    imported = AutoModelForDrafting.from_pretrained(folder).eval()
    assert type(imported) is type(drafter) and imported.config.num_draft_tokens == drafter.config.num_draft_tokens
    assert imported.config.target_layer_ids == drafter.config.target_layer_ids
    assert imported.config.target_model_name_or_path == TARGET
    _assert_same_weights(drafter, imported)
    _assert_same_tokens(target, drafter, imported)


def test_a_reduced_draft_vocabulary_travels_as_d2t_and_t2d(tmp_path):
    target = _target()
    drafter = _drafter("eagle3-speculators", target, draft_vocab_size=48)
    drafter.set_draft_vocab(torch.arange(0, 96, 2))
    folder = export_drafter(drafter, str(tmp_path / "e3"), "eagle3-speculators")
    tensors = load_file(f"{folder}/model.safetensors")
    assert tensors["lm_head.weight"].shape[0] == 48 and tensors["t2d"].sum() == 48
    imported = import_drafter(folder, target_config=target.config).eval()
    _assert_same_weights(drafter, imported)
    _assert_same_tokens(target, drafter, imported)


def test_a_hand_written_config_reads_with_speculators_defaults(tmp_path):
    """Absent keys take speculators' defaults: the layer config's class defaults (a diff dict, as speculators saves
    it), norm_before_residual false (not vLLM's true), draft_vocab_size 32000."""
    target = _target()
    drafter = _drafter("eagle3-speculators", target, norm_before_residual=True)
    exported = export_drafter(drafter, str(tmp_path / "exported"), "eagle3-speculators")
    layer = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 512, "vocab_size": 96}  # fmt: skip
    by_hand = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.7.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": 96,
        "eagle_aux_hidden_state_layer_ids": [2, 2, 1],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": TARGET, "architectures": ["LlamaForCausalLM"]},
        },
    }
    folder = tmp_path / "by-hand"
    folder.mkdir()
    shutil.copy(f"{exported}/model.safetensors", folder)
    (folder / "config.json").write_text(json.dumps(by_hand))
    imported = AutoModelForDrafting.from_pretrained(folder)
    assert imported.config.norm_before_residual is False  # speculators' default, though the weights were trained True
    assert imported.config.num_draft_tokens == 3 and imported.config.rms_norm_eps == 1e-6  # LlamaConfig's default
    assert imported.config.target_model_name_or_path == TARGET
    _assert_same_weights(drafter, imported)
    # The same file with norm_before_residual written reads as the drafter it came from.
    by_hand["norm_before_residual"] = True
    (folder / "config.json").write_text(json.dumps(by_hand))
    _assert_same_tokens(target, drafter, AutoModelForDrafting.from_pretrained(folder).eval())
    # Without draft_vocab_size, speculators reads 32000: a 96-token head with no id maps is refused by name.
    del by_hand["draft_vocab_size"]
    (folder / "config.json").write_text(json.dumps(by_hand))
    with pytest.raises(ValueError, match="draft_vocab_size=32000"):
        AutoModelForDrafting.from_pretrained(folder)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    target = _target()
    root = tmp_path_factory.mktemp("speculators")
    return {layout: export_drafter(_drafter(layout, target), str(root / layout), layout) for layout in CASES}


@pytest.mark.parametrize(
    "layout, changes, message",
    [
        ("eagle3-speculators", {"fc_norm": True, "norm_before_fc": True}, "fc_norm=True .*norm_before_fc=True"),
        ("eagle3-speculators", {"fc_norm": True}, r"missing tensors \['fc_norm.0.weight'"),
        ("eagle3-speculators", {"mystery_flag": 1}, "mystery_flag=1"),
        ("dflash-speculators", {"sample_from_anchor": True}, "sample_from_anchor=True"),
        ("dflash-speculators", {"mask_token_id": None}, "mask_token_id=None"),
        ("dspark-speculators", {"markov_head_type": "gated"}, "markov_head_type='gated'"),
        ("dspark-speculators", {"sample_from_anchor": False}, "sample_from_anchor=False"),
        ("eagle3-speculators", {"speculators_model_type": "peagle"}, "speculators_model_type='peagle'.*P-EAGLE"),
        ("dflash-speculators", {"speculators_model_type": "mtp"}, "speculators_model_type='mtp'.*MTP"),
    ],
)
def test_what_hf_specdec_cannot_honour_is_refused_by_name(tmp_path, exports, layout, changes, message):
    folder = _edit(exports[layout], tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=message):
        AutoModelForDrafting.from_pretrained(folder)


def test_refusals_inside_nested_configs(tmp_path, exports):
    config = _config(exports["eagle3-speculators"])
    layer = dict(config["transformer_layer_config"], model_type="qwen3")
    folder = _edit(exports["eagle3-speculators"], tmp_path / "qwen3", transformer_layer_config=layer)
    with pytest.raises(ValueError, match="transformer_layer_config.model_type='qwen3'"):
        AutoModelForDrafting.from_pretrained(folder)
    spec = config["speculators_config"]
    spec["proposal_methods"][0]["verifier_accept_k"] = 3
    folder = _edit(exports["eagle3-speculators"], tmp_path / "topk", speculators_config=spec)
    with pytest.raises(ValueError, match="verifier_accept_k=3"):
        AutoModelForDrafting.from_pretrained(folder)


def test_export_without_a_target_and_export_refusals(tmp_path):
    target = _target()
    drafter = _drafter("eagle3-speculators", target, bind=False)  # its config still names the target
    folder = export_drafter(drafter, str(tmp_path / "unbound"), "eagle3-speculators")
    assert _config(folder)["speculators_config"]["verifier"] == {"name_or_path": TARGET, "architectures": []}
    assert "embed_tokens.weight" not in load_file(f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match="norm_output=False"):
        export_drafter(_drafter("eagle3-speculators", target, norm_output=False), str(tmp_path / "x"),
                       "eagle3-speculators")  # fmt: skip
    reduced = _drafter("dflash-speculators", target, bind=False, draft_vocab_size=48)
    with pytest.raises(ValueError, match="pass the target"):
        export_drafter(reduced, str(tmp_path / "y"), "dflash-speculators")


def test_push_in_the_speculators_layout_and_load_back_by_repo_id(tmp_path, hub):
    target = _target()
    drafter = _drafter("dspark-speculators", target)
    saved = tmp_path / "drafter"
    drafter.save_pretrained(saved)  # hf_specdec's own format
    rc = cli(["push", str(saved), "org/dspark-spec", "--layout", "dspark-speculators", "--base-model", TARGET,
              "--endpoint", hub.endpoint, "--token", "t"])  # fmt: skip
    assert rc == 0
    files = hub.repos["org/dspark-spec"]["revisions"]["main"]
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    assert json.loads(files["config.json"])["speculators_model_type"] == "dspark"
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == TARGET and "`dspark-speculators`" in card.text
    assert detect_layout("org/dspark-spec") == "dspark-speculators"
    loaded = AutoModelForDrafting.from_pretrained("org/dspark-spec").eval()
    _assert_same_weights(drafter, loaded)
    _assert_same_tokens(target, drafter, loaded)
    # An unknown layout name is refused before anything is uploaded.
    from hf_specdec.cards import push_drafter

    with pytest.raises(ValueError, match="Unknown layout 'speculatorz'"):
        push_drafter(str(saved), "org/typo", layout="speculatorz", endpoint=hub.endpoint, token="t")
    assert "org/typo" not in hub.repos
