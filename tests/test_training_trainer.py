"""DrafterTrainer: learning, frozen target, checkpoints (atomic, resumable, corrupt), training record."""

import json
import os

import pytest
import torch
from helpers import FIXED_K, make_target

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.training.data import DrafterDataset
from hf_specdec.training.trainer import DrafterTrainer, DrafterTrainingArguments, find_latest_checkpoint


def self_distilled(target, n, prompt_len=6, new=26, seed=0):
    """Prompts continued greedily by the target itself; the loss covers the continuation."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(6, target.config.vocab_size, (n, prompt_len), generator=g)
    out = target.generate(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None)
    examples = []
    for row in out:
        mask = [0] * prompt_len + [1] * new
        examples.append({"input_ids": row.tolist(), "loss_mask": mask})
    return DrafterDataset(examples)


def fresh(target, **kw):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=4, **kw))


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=1,
        save_steps=4,
        eval_steps=4,
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    base.update(kw)
    return DrafterTrainingArguments(**base)


@pytest.fixture(scope="module")
def target():
    return make_target("llama", seed=2, sharpen=20.0)


def test_training_lowers_the_loss_raises_tau_and_leaves_the_target_alone(tmp_path, target):
    # A random tiny target has no structure to generalise from, so the "held-out" split here is the training data:
    # what is checked is that the trainer fits its data and that the fit carries over to real drafting.
    train = self_distilled(target, 8)
    held_out = train
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = fresh(target)
    run_args = args(tmp_path, max_steps=40, eval_steps=20, save_steps=100, learning_rate=1e-2)
    trainer = DrafterTrainer(drafter, target, run_args, train, held_out)
    start = trainer.draft_metrics()
    record = trainer.train()
    end = trainer.draft_metrics()
    print("loss", start.loss, "->", end.loss, "tau", start.simulated_tau, "->", end.simulated_tau)
    assert end.loss < start.loss - 1.0
    assert end.simulated_tau > start.simulated_tau + 0.3
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k
    # The output folder is a loadable drafter plus a training record.
    loaded = AutoModelForDrafting.from_pretrained(tmp_path / "out").eval()
    assert record["steps"] == 40 and record["final_eval"]["simulated_tau"] == pytest.approx(end.simulated_tau, abs=1e-3)
    on_disk = json.loads((tmp_path / "out" / "training_record.json").read_text())
    assert on_disk["target"]["num_hidden_layers"] == 4 and on_disk["tokens_per_second"] > 0
    # Real speculative decoding agrees with the simulation: the trained drafter is accepted, output is unchanged.
    prompts = torch.stack([held_out[i]["input_ids"][:6] for i in range(len(held_out))])
    kw = dict(max_new_tokens=24, do_sample=False, eos_token_id=None)
    out = target.generate(prompts, assistant_model=loaded, return_dict_in_generate=True, **kw, **FIXED_K)
    untrained = target.generate(prompts, assistant_model=fresh(target), return_dict_in_generate=True, **kw, **FIXED_K)
    assert torch.equal(out.sequences, target.generate(prompts, **kw))
    print("real tau", untrained.mean_accepted_length, "->", out.mean_accepted_length)
    assert out.mean_accepted_length > untrained.mean_accepted_length + 0.3


def test_resume_continues_the_same_loss_curve(tmp_path, target):
    data = self_distilled(target, 16)
    full = DrafterTrainer(fresh(target), target, args(tmp_path / "a"), data)
    full.train()
    reference = [h["loss"] for h in full.history]

    class Crash(Exception):
        pass

    def crash_at_6(step, record):
        if step == 6:
            raise Crash

    interrupted = DrafterTrainer(fresh(target), target, args(tmp_path / "b"), data, on_step=crash_at_6)
    with pytest.raises(Crash):
        interrupted.train()
    assert find_latest_checkpoint(str(tmp_path / "b" / "out")).endswith("checkpoint-4")
    resumed = DrafterTrainer(fresh(target, draft_vocab_size=None), target, args(tmp_path / "b"), data)
    resumed.train(resume_from_checkpoint=True)
    assert [h["loss"] for h in resumed.history] == reference
    # Killed after a checkpoint and resumed from its files: the weights end bit for bit where the full run's end.
    end = full.unwrapped_drafter.state_dict()
    for k, v in resumed.unwrapped_drafter.state_dict().items():
        assert torch.equal(v, end[k]), k


def test_corrupt_or_incomplete_checkpoint_gives_a_clear_error(tmp_path, target):
    data = self_distilled(target, 8)
    trainer = DrafterTrainer(fresh(target), target, args(tmp_path, max_steps=4, save_steps=2), data)
    trainer.train()
    ckpt = find_latest_checkpoint(str(tmp_path / "out"))
    with open(os.path.join(ckpt, "optimizer.pt"), "wb") as fh:
        fh.write(b"not a checkpoint")
    again = DrafterTrainer(fresh(target), target, args(tmp_path, max_steps=6, save_steps=2), data)
    with pytest.raises(ValueError, match="is corrupt"):
        again.train(resume_from_checkpoint=True)
    os.remove(os.path.join(ckpt, "optimizer.pt"))
    with pytest.raises(ValueError, match="incomplete"):  # named explicitly: no fallback to another checkpoint
        again.train(resume_from_checkpoint=ckpt)
    with pytest.raises(ValueError, match="no checkpoint found"):
        DrafterTrainer(fresh(target), target, args(tmp_path / "empty"), data).train(resume_from_checkpoint=True)


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, target, monkeypatch):
    data = self_distilled(target, 8)
    trainer = DrafterTrainer(fresh(target), target, args(tmp_path, max_steps=4, save_steps=2), data)
    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if "checkpoint-4" in str(path):
            raise OSError("disk full")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError):
        trainer.train()
    latest = find_latest_checkpoint(str(tmp_path / "out"))
    assert latest.endswith("checkpoint-2")
    assert not os.path.exists(tmp_path / "out" / "checkpoint-4")
    monkeypatch.setattr(torch, "save", real_save)
    resumed = DrafterTrainer(fresh(target), target, args(tmp_path, max_steps=4, save_steps=2), data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.step == 4


def test_bad_arguments_fail_early(tmp_path):
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        DrafterTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=0)
    with pytest.raises(ValueError, match="learning_rate"):
        DrafterTrainingArguments(output_dir=str(tmp_path), learning_rate=0.0)


def test_bf16_mixed_precision_and_gradient_accumulation_run(tmp_path, target):
    data = self_distilled(target, 8)
    run = args(tmp_path, max_steps=2, bf16=True, gradient_accumulation_steps=2, save_steps=100)
    trainer = DrafterTrainer(fresh(target), target, run, data)
    record = trainer.train()
    assert record["steps"] == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history)
    assert next(trainer.unwrapped_drafter.parameters()).dtype == torch.float32  # master weights stay fp32


def test_metrics_are_logged_to_tensorboard(tmp_path, target):
    data = self_distilled(target, 8)
    run = args(tmp_path, max_steps=4, logging_steps=2, eval_steps=2, save_steps=100, report_to="tensorboard")
    DrafterTrainer(fresh(target), target, run, data, eval_dataset=data).train()
    events = list((tmp_path / "out").rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file written"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/simulated_tau", "eval/loss", "eval/acc_0"} <= tags


def test_fine_tuning_a_loaded_drafter_keeps_its_draft_vocabulary_and_weights(tmp_path, target):
    # A fresh drafter takes its reduced vocabulary from the data; a trained one, fine-tuned on data with other token
    # frequencies, must keep it: rebuilding it would point every trained output row at another token.
    first = self_distilled(target, 8, seed=0)
    drafter = fresh(target, draft_vocab_size=48)
    DrafterTrainer(drafter, target, args(tmp_path / "a"), first).train()
    drafter.save_pretrained(tmp_path / "trained")
    loaded = AutoModelForDrafting.from_pretrained(tmp_path / "trained")
    vocab = loaded.draft_token_ids.clone()
    before = DrafterTrainer(loaded, target, args(tmp_path / "b"), first).draft_metrics(first).loss
    other = self_distilled(target, 8, seed=5)
    DrafterTrainer(loaded, target, args(tmp_path / "c", max_steps=1, learning_rate=1e-6), other).train()
    assert torch.equal(loaded.draft_token_ids, vocab)
    after = DrafterTrainer(loaded, target, args(tmp_path / "d"), first).draft_metrics(first).loss
    # One tiny step: still the trained drafter, not a re-initialised one.
    assert after == pytest.approx(before, rel=0.02)
    fresh_other = fresh(target, draft_vocab_size=48)
    DrafterTrainer(fresh_other, target, args(tmp_path / "e", max_steps=1), other).train()
    assert not torch.equal(fresh_other.draft_token_ids, vocab)  # the control: other data gives another vocabulary


def test_plain_training_arguments_work_and_trainer_options_it_cannot_honour_are_refused(tmp_path, target):
    from transformers import Trainer, TrainingArguments

    data = self_distilled(target, 8)
    plain = TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=3, per_device_train_batch_size=4,
                              save_steps=2, report_to="none", disable_tqdm=True, use_cpu=True)  # fmt: skip
    trainer = DrafterTrainer(fresh(target), target, plain, data, eval_dataset=data)
    assert isinstance(trainer, Trainer)
    record = trainer.train()
    assert record["steps"] == 3 and len(trainer.history) == 3
    assert sorted(n for n in os.listdir(tmp_path / "plain") if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-3",
    ]
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(trainer.draft_metrics().loss) and "eval_acc_0" in metrics
    with pytest.raises(ValueError, match="load_best_model_at_end is not supported"):
        DrafterTrainer(fresh(target), target, args(tmp_path / "best", load_best_model_at_end=True), data, data)
    with pytest.raises(ValueError, match="push_to_hub is not supported .*hf-specdec push"):
        DrafterTrainer(fresh(target), target, args(tmp_path / "hub", push_to_hub=True), data)
