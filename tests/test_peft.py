"""PEFT: LoRA-adapted targets work for generation and drafter training; `--lora` adapts a drafter with an adapter
saved and loaded the PEFT way."""

import pytest
import torch
from helpers import FIXED_K, make_target, ragged_batch
from peft import LoraConfig, PeftModel, get_peft_model
from test_training_trainer import args, fresh, self_distilled

from hf_specdec import AutoModelForDrafting
from hf_specdec.training.recipes import add_lora
from hf_specdec.training.trainer import DrafterTrainer


def lora_target(seed=2):
    base = make_target("llama", seed=seed, sharpen=20.0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():  # non-zero B so the adapter really changes the target
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model.eval()


def test_generation_with_a_lora_target_is_identical_to_its_own_generate():
    target = lora_target()
    drafter = AutoModelForDrafting.from_config(
        __import__("hf_specdec").Eagle3Config.for_target(target.get_base_model().config)
    )
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    ref = target.generate(input_ids=ids, **kw)
    out = target.generate(input_ids=ids, assistant_model=drafter, **kw)
    assert torch.equal(out, ref)
    with target.disable_adapter():
        plain = target.generate(input_ids=ids, **kw)
    assert not torch.equal(plain, ref)  # the adapter is active in both runs above


def test_drafter_training_on_a_lora_target(tmp_path):
    target = lora_target()
    data = self_distilled(target.get_base_model(), 8)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = DrafterTrainer(fresh(target.get_base_model()), target, args(tmp_path, max_steps=3), data)
    trainer.train()
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_lora_adaptation_of_a_drafter_trains_only_the_adapter(tmp_path):
    target = make_target("llama", seed=2, sharpen=20.0)
    data = self_distilled(target, 8)
    base = DrafterTrainer(fresh(target), target, args(tmp_path / "base", max_steps=4), data)
    base.train()
    base_dir = tmp_path / "base" / "out"
    drafter = AutoModelForDrafting.from_pretrained(base_dir)
    frozen = {k: v.clone() for k, v in drafter.state_dict().items()}
    adapted = add_lora(drafter, r=4, lora_alpha=8)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer = DrafterTrainer(adapted, target, args(tmp_path / "lora", max_steps=6, save_steps=3), data)
    trainer.train()
    out_dir = tmp_path / "lora" / "out"
    assert (out_dir / "adapter_config.json").exists() and (out_dir / "adapter_model.safetensors").exists()
    for k, v in adapted.get_base_model().state_dict().items():
        if "lora_" not in k and "base_layer" not in k:
            assert torch.equal(v, frozen[k]), k
    # Load the PEFT way and generate: identical to plain greedy, and the same drafts as the in-memory adapter.
    reloaded = PeftModel.from_pretrained(AutoModelForDrafting.from_pretrained(base_dir), out_dir).eval()
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    a = target.generate(ids, assistant_model=reloaded, **kw, **FIXED_K)  # fixed K: same passes, comparable
    b = target.generate(ids, assistant_model=adapted.eval(), **kw, **FIXED_K)
    assert torch.equal(a.sequences, target.generate(ids, **kw).sequences)
    assert a.accepted_lengths == b.accepted_lengths
    # Resuming a LoRA run restores the adapter from its checkpoint.
    again = DrafterTrainer(
        add_lora(AutoModelForDrafting.from_pretrained(base_dir), r=4, lora_alpha=8),
        target,
        args(tmp_path / "lora", max_steps=8, save_steps=3),
        data,
    )
    again.train(resume_from_checkpoint=True)
    assert again.step == 8


def test_lora_needs_target_modules():
    from hf_specdec.testing import make_oracle_drafter

    target = make_target("llama")
    with pytest.raises(ValueError, match="lora_target_modules"):
        add_lora(make_oracle_drafter(target, torch.zeros(1, 4, dtype=torch.long)))
