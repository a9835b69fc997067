"""A family that trains a target adapter (the Medusa-2 shape), with a small test-only family defined here.

The trainer puts the family's peft LoRA on the target, computes features with gradients through it, takes the
teacher under ``disable_adapter()``, uses the family's optimizer groups and loss ramp, saves and resumes the adapter
with the drafter, and refuses offline features.
"""

import copy
import os

import pytest
import torch
from helpers import make_target
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from test_training_trainer import args, self_distilled
from torch import nn

from hf_specdec import Proposal
from hf_specdec.configuration_utils import DrafterConfig
from hf_specdec.features import walk_metrics, walk_passes
from hf_specdec.modeling_utils import DrafterPreTrainedModel, DraftLossOutput
from hf_specdec.training.offline import OfflineFeatureDataset, dump_features
from hf_specdec.training.trainer import DrafterTrainer, find_latest_checkpoint


class ToyMedusaConfig(DrafterConfig):
    model_type = "toy_medusa_drafter"
    num_heads: int = 3
    lora_r: int = 4
    ramp_steps: int = 4
    lambda_max: float = 0.2


class ToyMedusa(DrafterPreTrainedModel):
    """Medusa-2 in miniature: heads on the adapted target's last hidden state; L = KL(teacher || adapted target)
    + λ · Σ_k 0.8^k CE(head k); λ ramped by the family; heads at the base learning rate, LoRA at a quarter of it."""

    config_class = ToyMedusaConfig
    trains_target_adapter = True
    loss_kwargs = ("medusa_weight",)

    def __init__(self, config):
        super().__init__(config)
        h, v = config.target_hidden_size, config.target_vocab_size
        self.heads = nn.ModuleList(nn.Linear(h, v) for _ in range(config.num_heads))
        self.seen_weights = []
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    # Decoding, as Medusa does: each head's choice from the target's last state at the last verified slot.
    def init_draft_state(self, batch_size, max_length):
        return {}

    def observe(self, state, inputs):
        last = inputs.hidden_states[-1]
        slot = torch.where(inputs.valid, torch.arange(inputs.valid.shape[1]), -1).max(dim=1).values
        state["hidden"] = last[torch.arange(last.shape[0]), slot]

    def propose(self, state, num_tokens, select):
        drafted = [select(head(state["hidden"]).float(), d)[0] for d, head in enumerate(self.heads[:num_tokens])]
        return Proposal(tokens=torch.stack(drafted, dim=1))

    def target_adapter_config(self):
        r = self.config.lora_r
        return LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])

    def loss_schedule(self, step, total_steps):
        return {"medusa_weight": self.config.lambda_max * min(1.0, step / self.config.ramp_steps)}

    def optimizer_param_groups(self, learning_rate, weight_decay, adapter_parameters=None):
        groups = [{"params": list(self.heads.parameters()), "lr": learning_rate, "weight_decay": weight_decay}]
        if adapter_parameters:
            groups.append({"params": adapter_parameters, "lr": learning_rate / 4, "weight_decay": 0.0})
        return groups

    def compute_loss(self, batch, features, target_head=None, medusa_weight=0.0):
        self.seen_weights.append(medusa_weight)
        ids = batch["input_ids"]
        mask = (batch["loss_mask"] * batch["attention_mask"]).bool()
        bsz, t = ids.shape
        teacher = features.soft_labels(target_head)
        student = torch.log_softmax(features.logits(target_head), dim=-1)
        kl = (teacher.probs * (teacher.probs.clamp_min(1e-12).log() - student)).sum(-1)[:, :-1]
        lm = (kl * mask[:, 1:]).sum() / mask[:, 1:].sum().clamp(min=1)
        medusa = torch.zeros(())
        correct, valid = [], []
        accepted = torch.zeros(bsz, t, dtype=torch.long)
        chain = None
        for k, head in enumerate(self.heads):
            width = t - 2 - k  # head k at position s predicts token s + 2 + k
            logits = head(features.last_hidden[:, :width]).float()
            labels = ids[:, 2 + k :]
            ok = mask[:, 2 + k :]
            ce = nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            medusa = medusa + 0.8**k * (ce * ok).sum() / ok.sum().clamp(min=1)
            hit = (logits.argmax(-1) == labels) & ok
            chain = hit if chain is None else chain[:, :width] & hit
            accepted[:, :width] += chain.long()
            correct.append(hit.sum().float())
            valid.append(ok.sum().float())
        metrics = {"correct": torch.stack(correct), "valid": torch.stack(valid)}
        metrics.update(walk_metrics(walk_passes(accepted, mask, self.config.num_draft_tokens)))
        return DraftLossOutput(loss=lm + medusa_weight * medusa, metrics=metrics, accepted=accepted)


def toy(target, seed=0, **kw):
    torch.manual_seed(seed)
    return ToyMedusa(ToyMedusaConfig.for_target(target.config, num_draft_tokens=2, **kw))


def fresh_target():
    return make_target("llama", seed=2, sharpen=20.0)


def run_args(tmp_path, **kw):
    base = dict(max_steps=6, save_steps=3, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0)
    base.update(kw)
    return args(tmp_path, **base)


@pytest.fixture(scope="module")
def data():
    return self_distilled(fresh_target(), 8)


def lora_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_adapter_trains_through_the_features_against_the_frozen_target(tmp_path, data):
    target = fresh_target()
    original = copy.deepcopy(target)
    drafter = toy(target)
    trainer = DrafterTrainer(drafter, target, run_args(tmp_path, eval_steps=100), data, eval_dataset=data)
    assert isinstance(trainer.target, PeftModel)
    before = lora_weights(trainer.target)
    assert before and all(p.abs().sum() == 0 for n, p in before.items() if "lora_B" in n)  # starts as the target

    batch = trainer.data_collator([data[i] for i in range(4)])
    feats = trainer._features(batch)
    assert feats.last_hidden.requires_grad and not feats.teacher_last_hidden.requires_grad
    record = trainer.train()

    # The adapter trained (B left zero), the target's own weights did not move.
    after = lora_weights(trainer.target)
    assert all(not torch.equal(before[n], after[n]) for n in after if "lora_B" in n)
    base = {
        k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in trainer.target.state_dict().items()
    }
    for k, v in original.state_dict().items():
        assert torch.equal(base[k], v), k
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        ref = original(input_ids=ids, attention_mask=mask).logits
        adapted = trainer.target(input_ids=ids, attention_mask=mask).logits
        with trainer.target.disable_adapter():
            disabled = trainer.target(input_ids=ids, attention_mask=mask).logits
        feats = trainer._features(batch)
    assert torch.equal(disabled, ref) and (adapted - ref).abs().max() > 1e-3
    # Teacher = the target without its adapter; student logits = the adapted target.
    torch.testing.assert_close(feats.soft_labels(trainer.target_head).probs, torch.softmax(ref.float(), -1))
    torch.testing.assert_close(feats.logits(trainer.target_head), adapted.float(), rtol=1e-5, atol=1e-5)

    # The family's optimizer groups (heads at lr, LoRA at lr / 4) and its λ ramp reached compute_loss.
    lrs = sorted({g["lr"] for g in trainer.optimizer.param_groups})
    assert lrs == pytest.approx([1e-2 / 4, 1e-2])
    assert trainer.history[-1]["group_lrs"] == pytest.approx([1e-2, 1e-2 / 4])
    ramp = [h["loss_kwargs"]["medusa_weight"] for h in trainer.history]
    assert ramp == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.2])
    assert drafter.seen_weights == pytest.approx(ramp + [0.2, 0.2])  # training steps, then 2 final eval batches
    # Metrics with as many entries as the family has heads (3), not K (2); the walk is reported too.
    assert len(record["final_eval"]) and "acc_2" in record["final_eval"] and "simulated_tau" in record["final_eval"]


def test_adapter_is_saved_and_resumed_with_the_drafter(tmp_path, data):
    full = DrafterTrainer(toy(fresh_target()), fresh_target(), run_args(tmp_path / "a"), data)
    full.train()
    out = tmp_path / "a" / "out"
    assert (out / "target_adapter" / "adapter_model.safetensors").exists()
    assert (out / "checkpoint-3" / "target_adapter" / "adapter_model.safetensors").exists()
    # The final folder: the drafter loads with its class, the adapter with peft onto a plain target.
    loaded = ToyMedusa.from_pretrained(out)
    for k, v in full.unwrapped_drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    restored = PeftModel.from_pretrained(fresh_target(), out / "target_adapter").eval()
    ids = torch.stack([data[i]["input_ids"] for i in range(2)])
    with torch.no_grad():
        assert torch.equal(restored(input_ids=ids).logits, full.target(input_ids=ids).logits)

    # Stopped after the step-3 checkpoint, then resumed from its files with fresh objects: bit for bit the same end.
    stopped = DrafterTrainer(toy(fresh_target()), fresh_target(), run_args(tmp_path / "b", stop_after_steps=3), data)
    assert stopped.train().get("stopped_early") is True
    assert find_latest_checkpoint(str(tmp_path / "b" / "out")).endswith("checkpoint-3")
    assert not os.path.exists(tmp_path / "b" / "out" / "model.safetensors")
    resumed = DrafterTrainer(toy(fresh_target(), seed=9), fresh_target(), run_args(tmp_path / "b"), data)
    resumed.train(resume_from_checkpoint=True)
    for k, v in full.unwrapped_drafter.state_dict().items():
        assert torch.equal(resumed.unwrapped_drafter.state_dict()[k], v), k
    a = load_file(out / "target_adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "out" / "target_adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]


def test_offline_features_and_prewrapped_targets_are_refused(tmp_path, data):
    target = fresh_target()
    examples = [data[i] for i in range(len(data))]
    dump_features(target, examples, [4], tmp_path / "f", dtype=torch.float32, progress=False, log=None)
    offline = OfflineFeatureDataset(tmp_path / "f")
    with pytest.raises(ValueError, match="offline features"):
        DrafterTrainer(toy(target), target, run_args(tmp_path), offline)
    wrapped = get_peft_model(fresh_target(), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="plain target"):
        DrafterTrainer(toy(fresh_target()), wrapped, run_args(tmp_path), data)


def test_loss_kwargs_and_optimizer_groups_are_checked(tmp_path, data):
    target = fresh_target()
    with pytest.raises(ValueError, match=r"does not take the loss kwargs \['steps'\]"):
        DrafterTrainer(toy(target), target, run_args(tmp_path, loss_kwargs={"steps": 3}), data)

    class Forgetful(ToyMedusa):  # leaves the adapter out of its groups
        def optimizer_param_groups(self, learning_rate, weight_decay, adapter_parameters=None):
            return [{"params": list(self.heads.parameters())}]

    torch.manual_seed(0)
    forgetful = Forgetful(ToyMedusaConfig.for_target(target.config))
    with pytest.raises(ValueError, match="exactly once"):
        DrafterTrainer(forgetful, fresh_target(), run_args(tmp_path), data)
    # A fixed loss kwarg overrides the family's ramp.
    trainer = DrafterTrainer(toy(target), fresh_target(), run_args(tmp_path, loss_kwargs={"medusa_weight": 1.0}), data)
    assert trainer.loss_kwargs_at(0) == {"medusa_weight": 1.0}


def test_the_trained_adapter_is_declared_and_required_at_generation(tmp_path, data):
    trainer = DrafterTrainer(toy(fresh_target()), fresh_target(), run_args(tmp_path, max_steps=3), data)
    trainer.train()
    out = tmp_path / "out"
    loaded = ToyMedusa.from_pretrained(out)
    declared = loaded.config.target_adapter
    assert declared["subfolder"] == "target_adapter" and len(declared["fingerprint"]) == 64
    # The plain target is refused, with the way out in the message.
    with pytest.raises(ValueError, match=r"drafter.adapt_target\(target\)"):
        loaded.bind_target(fresh_target())
    # The drafter's own adapter binds; a different adapter (another training step's) is refused.
    adapted = loaded.adapt_target(fresh_target())
    loaded.bind_target(adapted)
    other = PeftModel.from_pretrained(fresh_target(), str(out / "target_adapter")).eval()
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if "lora_B" in n).add_(1e-3)  # another adapter's weights
    fresh = ToyMedusa.from_pretrained(out)
    with pytest.raises(ValueError, match="not the one"):
        fresh.bind_target(other)
    # A drafter without a declared adapter has nothing to adapt.
    with pytest.raises(ValueError, match="declares no target adapter"):
        toy(fresh_target()).adapt_target(fresh_target())


def test_adapt_target_merges_the_adapter_and_the_merge_is_still_checked(tmp_path, data):
    """By default the adapter is merged into the target's weights (a plain model again, as fast as the target and
    packable like it); the merge computes what the peft model computes, it is recognised by its fingerprint (also
    after save and load), and a merged target with another adapter, or with a second adapter on top, is refused."""
    DrafterTrainer(toy(fresh_target()), fresh_target(), run_args(tmp_path, max_steps=3), data).train()
    out = tmp_path / "out"
    loaded = ToyMedusa.from_pretrained(out)
    unmerged = loaded.adapt_target(fresh_target(), merge=False)
    merged = loaded.adapt_target(fresh_target())
    assert isinstance(unmerged, PeftModel) and not isinstance(merged, PeftModel)
    assert not any("lora" in name for name, _ in merged.named_modules())
    ids = torch.randint(0, merged.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, unmerged(ids).logits, atol=1e-5)
        assert (merged(ids).logits - fresh_target()(ids).logits).abs().max() > 1e-4  # the adapter does something
    loaded.bind_target(merged)
    kw = dict(max_new_tokens=8, do_sample=False)
    for model in (merged, unmerged):  # greedy speculative decoding on either is that model's own greedy decoding
        assert torch.equal(model.generate(ids, assistant_model=ToyMedusa.from_pretrained(out), **kw),
                           model.generate(ids, **kw))  # fmt: skip
    merged.save_pretrained(tmp_path / "merged")
    reloaded = type(merged).from_pretrained(tmp_path / "merged")
    ToyMedusa.from_pretrained(out).bind_target(reloaded)  # the fingerprint travels in config.json
    reloaded.config.hf_specdec_merged_adapter = "0" * 64  # another adapter's merge
    with pytest.raises(ValueError, match="not the one"):
        ToyMedusa.from_pretrained(out).bind_target(reloaded)
    twice = PeftModel.from_pretrained(type(merged).from_pretrained(tmp_path / "merged"), str(out / "target_adapter"))
    with pytest.raises(ValueError, match="not the one"):  # the adapter merged in and applied once more
        ToyMedusa.from_pretrained(out).bind_target(twice)
