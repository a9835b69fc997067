"""Strict drafter loading: unexpected weights are refused (with an explicit opt-out), mis-shaped ones too."""

import warnings

import pytest
import torch
from helpers import make_target
from safetensors.torch import load_file, save_file

from hf_specdec import AutoModelForDrafting, Eagle3Config, Eagle3ForDrafting


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    path = tmp_path_factory.mktemp("drafter")
    drafter.save_pretrained(path)
    return drafter, path


def rewrite(src, dst, edit):
    import shutil

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_unexpected_weights_are_refused_then_loaded_with_the_opt_out_and_a_warning(saved, tmp_path):
    drafter, path = saved
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a matching checkpoint loads strictly, without a warning
        AutoModelForDrafting.from_pretrained(path)
    foreign = rewrite(
        path,
        tmp_path / "foreign",
        lambda w: w.update({"midlayer.extra_norm.weight": torch.ones(4), "lm_head_2.weight": torch.zeros(2, 2)}),
    )
    with pytest.raises(ValueError) as err:
        AutoModelForDrafting.from_pretrained(foreign)
    message = str(err.value)
    assert "unexpected weights ['lm_head_2.weight', 'midlayer.extra_norm.weight']" in message, message
    assert "allow_unexpected_weights=True" in message and "missing weights" not in message, message
    # allow_missing_weights does not cover unexpected weights.
    with pytest.raises(ValueError, match="unexpected weights"):
        AutoModelForDrafting.from_pretrained(foreign, allow_missing_weights=True)

    with pytest.warns(UserWarning, match=r"dropped the unexpected weights \['lm_head_2.weight', 'midlayer.extra"):
        loaded = AutoModelForDrafting.from_pretrained(foreign, allow_unexpected_weights=True)
    assert isinstance(loaded, Eagle3ForDrafting)
    expected = drafter.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_mis_shaped_weights_are_refused_with_their_shapes(saved, tmp_path):
    drafter, path = saved
    shape = tuple(drafter.fc.weight.shape)
    bad = rewrite(path, tmp_path / "misshaped", lambda w: w.update({"fc.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError) as err:
        AutoModelForDrafting.from_pretrained(bad)
    message = str(err.value)
    assert f"mis-shaped weights ['fc.weight (checkpoint (3, 3), model {shape})']" in message, message
    assert "allow_missing_weights=True" in message, message
    # The opt-out initialises the mis-shaped weight afresh, at the drafter's shape; the rest loads as saved.
    loaded = AutoModelForDrafting.from_pretrained(bad, allow_missing_weights=True)
    assert tuple(loaded.fc.weight.shape) == shape
    expected = drafter.state_dict()
    for k, v in loaded.state_dict().items():
        if k != "fc.weight":
            assert torch.equal(v, expected[k]), k


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"model_type": "eagle3_drafter", oops}', r"config\.json is not valid JSON \(line 1, column 34"),
        ('[{"model_type": "eagle3_drafter"}]', r"config\.json holds a JSON list, not an object"),
        (b"\xff\xfe{}", r"config\.json is not UTF-8 text"),
    ],
    ids=["not-json", "a-list", "not-utf8"],
)
def test_a_broken_config_json_is_named_in_the_error(saved, tmp_path, text, match):
    import shutil

    from hf_specdec.commands import main

    folder = tmp_path / "broken"
    shutil.copytree(saved[1], folder)
    config = folder / "config.json"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=match):
        AutoModelForDrafting.from_pretrained(folder)
    # the CLI says the same in one line (exit 2), for convert too
    assert main(["convert", str(folder), str(tmp_path / "out"), "--to", "eagle3-vllm"]) == 2
    assert not (tmp_path / "out").exists()


def test_nan_weights_are_refused_naming_the_tensor_in_our_layout_and_a_foreign_one(saved, tmp_path):
    from safetensors.torch import safe_open

    from hf_specdec.convert import export_drafter

    drafter, path = saved
    name = next(n for n, p in drafter.named_parameters() if p.dim() == 2)

    def poison(weights, key):
        weights[key] = weights[key].clone()
        weights[key].view(-1)[3] = float("nan")

    ours = rewrite(path, tmp_path / "ours", lambda w: poison(w, name))
    with pytest.raises(ValueError, match=rf"NaN or infinite values in {name}\b.*download it again, or retrain"):
        AutoModelForDrafting.from_pretrained(ours)
    target = make_target("llama")
    export_drafter(drafter.bind_target(target), str(tmp_path / "vllm"), "eagle3-vllm", target=target)
    with safe_open(str(tmp_path / "vllm" / "model.safetensors"), "pt") as f:
        foreign_key = next(k for k in f.keys() if f.get_slice(k).get_shape().__len__() == 2)
    foreign = rewrite(tmp_path / "vllm", tmp_path / "foreign", lambda w: poison(w, foreign_key))
    with pytest.raises(ValueError, match=r"holds NaN or infinite values in "):
        AutoModelForDrafting.from_pretrained(foreign, target_config=target.config)
    assert AutoModelForDrafting.from_pretrained(tmp_path / "vllm", target_config=target.config) is not None
