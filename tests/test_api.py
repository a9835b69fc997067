"""Public API: registry, Auto classes, config construction from targets, the CLI."""

import pytest
import torch
from helpers import make_target, ragged_batch
from transformers import AutoConfig, AutoModel

import hf_specdec
from hf_specdec import AutoModelForDrafting, DrafterConfig, Eagle3Config, get_drafter_spec, register_drafter
from hf_specdec.commands import main as cli_main
from hf_specdec.testing import OracleDrafter, OracleDrafterConfig


def test_registry_knows_eagle3():
    spec = get_drafter_spec("eagle3")
    assert spec.model_type == "eagle3_drafter" and spec is get_drafter_spec("eagle3_drafter")
    assert isinstance(AutoConfig.for_model("eagle3_drafter"), Eagle3Config)
    with pytest.raises(ValueError, match="Unknown drafter family"):
        get_drafter_spec("nope")


def test_third_party_family_registers_with_the_auto_class():
    register_drafter("oracle", OracleDrafterConfig, OracleDrafter, "replay drafter for tests")
    target = make_target("llama")
    model = AutoModelForDrafting.from_config(OracleDrafterConfig.for_target(target.config))
    assert isinstance(model, OracleDrafter)
    assert "oracle" in hf_specdec.DRAFTERS


def test_register_rejects_colliding_model_types():
    class BadConfig(DrafterConfig):
        model_type = "llama"

    class Bad(OracleDrafter):
        config_class = BadConfig

    with pytest.raises(ValueError, match="_drafter"):
        register_drafter("bad", BadConfig, Bad)


def test_plain_auto_model_does_not_build_a_drafter(tmp_path):
    target = make_target("llama")
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(tmp_path)
    with pytest.raises(ValueError):
        AutoModel.from_pretrained(tmp_path)


def test_for_target_records_the_target(tmp_path):
    make_target("qwen3").save_pretrained(tmp_path / "t")
    config = AutoConfig.from_pretrained(tmp_path / "t")
    drafter_config = Eagle3Config.for_target(config, num_draft_tokens=7)
    assert drafter_config.target_model_name_or_path == str(tmp_path / "t")
    assert drafter_config.target_model_type == "qwen3"
    assert drafter_config.head_dim == config.head_dim == 8
    assert drafter_config.num_draft_tokens == 7


def test_template_config_is_allowed_but_models_need_target_facts():
    config = Eagle3Config()
    with pytest.raises(ValueError, match="target_hidden_size"):
        AutoModelForDrafting.from_config(config)


def test_drafter_default_num_draft_tokens_is_used():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3))
    ids, _ = ragged_batch(1)
    out = target.generate(ids, assistant_model=drafter, max_new_tokens=6, return_dict_in_generate=True)
    assert out.num_draft_tokens == 3
    out = target.generate(
        ids, assistant_model=drafter, max_new_tokens=6, num_assistant_tokens=5, return_dict_in_generate=True
    )
    assert out.num_draft_tokens == 5
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=6))


def test_cli_lists_families_and_selfcheck_passes(capsys):
    assert cli_main(["families"]) == 0
    assert "eagle3_drafter" in capsys.readouterr().out
    assert cli_main(["selfcheck", "--arch", "qwen2", "--batch", "2", "--max-new-tokens", "16"]) == 0
    assert "ALL IDENTICAL" in capsys.readouterr().out
