"""Hardening of training inputs and checkpoints: pickle-free resume, token ids in range, atomic re-save, fallback."""

import json
import os
import shutil

import pytest
import torch
from helpers import VOCAB, make_target

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.training.data import DrafterDataset, load_records
from hf_specdec.training.recipes import build_datasets
from hf_specdec.training.trainer import DrafterTrainer, DrafterTrainingArguments, find_latest_checkpoint


@pytest.fixture(scope="module")
def target():
    return make_target("llama", seed=2)


def data(n=8, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, VOCAB, (n, length), generator=g)
    return DrafterDataset([{"input_ids": row.tolist(), "loss_mask": [0] * 4 + [1] * (length - 4)} for row in ids])


def fresh(target):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=2))


def args(out, **kw):
    base = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=1,
        save_steps=2,
        eval_steps=100,
        disable_tqdm=True,
        report_to="none",
        seed=0,
    )
    base.update(kw)
    return DrafterTrainingArguments(**base)


# ---------------------------------------------------------------------------------------------- pickle-free resume
class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('payload ran')",)


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_resume_refuses_a_checkpoint_carrying_a_pickle_payload(tmp_path, target, name):
    train = data()
    DrafterTrainer(fresh(target), target, args(tmp_path / "out", max_steps=4, stop_after_steps=2), train).train()
    ckpt = find_latest_checkpoint(str(tmp_path / "out"))
    assert ckpt.endswith("checkpoint-2")
    marker = tmp_path / "marker"
    state = torch.load(os.path.join(ckpt, name), weights_only=False)  # the genuine state, with a payload added
    state["extra"] = Payload(marker)
    torch.save(state, os.path.join(ckpt, name))

    resumed = DrafterTrainer(fresh(target), target, args(tmp_path / "out", max_steps=4), train)
    with pytest.raises(ValueError, match=rf"Refusing to resume from .*checkpoint-2: {name} holds a Python object"):
        resumed.train(resume_from_checkpoint=True)
    assert not marker.exists(), "the pickle payload ran"
    assert resumed.step == 0


# ---------------------------------------------------------------------------------------------- token ids in range
def test_a_token_id_outside_the_targets_vocabulary_is_refused_naming_file_and_line(tmp_path, target):
    path = tmp_path / "train.jsonl"
    good = [{"input_ids": [7, 8, 9, 10, 11, 12], "loss_mask": [0, 1, 1, 1, 1, 1]} for _ in range(5)]
    bad = {"input_ids": [7, 8, VOCAB + 3, 10], "loss_mask": [0, 1, 1, 1]}
    lines = [json.dumps(good[0]), "", json.dumps(good[1]), json.dumps(bad)] + [json.dumps(g) for g in good[2:]]
    path.write_text("\n".join(lines) + "\n")  # the bad record is on line 4 (a blank line counts)

    train, held_out, _ = build_datasets(str(path), None, eval_fraction=0.2)
    with pytest.raises(ValueError) as err:
        DrafterTrainer(fresh(target), target, args(tmp_path / "out"), train, held_out)
    message = str(err.value)
    assert f"{path}:4:" in message and f"token id {VOCAB + 3}" in message, message
    assert f"vocabulary of {VOCAB} tokens" in message and "target's own tokenizer" in message, message

    # The same check at load time, for callers that know the vocabulary.
    with pytest.raises(ValueError, match=rf"train.jsonl:4: token id {VOCAB + 3} \(position 2"):
        load_records(path, vocab_size=VOCAB)
    assert len(load_records(path, vocab_size=VOCAB + 4)) == 6

    # In-memory examples (no file): the example is named by its position; the largest valid id is accepted.
    examples = [dict(good[0]) for _ in range(4)]
    examples[2] = {"input_ids": [7, VOCAB, 9], "loss_mask": [0, 1, 1]}
    with pytest.raises(ValueError, match=rf"training example 2: token id {VOCAB} "):
        DrafterTrainer(fresh(target), target, args(tmp_path / "out"), DrafterDataset(examples))
    examples[2] = {"input_ids": [7, VOCAB - 1, 9], "loss_mask": [0, 1, 1]}
    DrafterTrainer(fresh(target), target, args(tmp_path / "out"), DrafterDataset(examples))


# ---------------------------------------------------------------------------------------------- atomic re-save
def test_a_crash_while_saving_a_step_again_keeps_a_complete_copy_of_it(tmp_path, target, monkeypatch):
    train = data()
    out = tmp_path / "out"
    trainer = DrafterTrainer(fresh(target), target, args(out), train)
    trainer.train()
    assert find_latest_checkpoint(str(out)).endswith("checkpoint-4")
    weights = {k: v.clone() for k, v in trainer.unwrapped_drafter.state_dict().items()}

    real_replace = os.replace

    def crash_on_swap(src, dst, *a, **k):  # the process dies once the new folder is about to replace the old one
        if ".checkpoint-4.tmp" in str(src):
            raise KeyboardInterrupt("killed while saving checkpoint-4 again")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", crash_on_swap)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()  # saving step 4 again
    monkeypatch.setattr(os, "replace", real_replace)
    assert (out / "latest_checkpoint").read_text() == "checkpoint-4"

    # The previous copy of step 4 survived the crash: resume uses it (and says so), and ends where the run ended.
    with pytest.warns(
        UserWarning, match=r"names 'checkpoint-4', which does not exist; resuming from '\.checkpoint-4\.old"
    ):
        latest = find_latest_checkpoint(str(out))
    resumed = DrafterTrainer(fresh(target), target, args(out), train)
    with pytest.warns(UserWarning, match="resuming from"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.step == 4 and os.path.basename(latest).startswith(".checkpoint-4.old-")
    for k, v in resumed.unwrapped_drafter.state_dict().items():
        assert torch.equal(v, weights[k]), k
    # The final save of step 4 put a complete checkpoint-4 back and removed the aside copy.
    assert find_latest_checkpoint(str(out)).endswith("checkpoint-4")
    assert not [n for n in os.listdir(out) if ".old-" in n]


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path, target):
    train = data()
    out = tmp_path / "out"
    DrafterTrainer(fresh(target), target, args(out, max_steps=6, save_total_limit=3), train).train()
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    os.remove(out / "checkpoint-6" / "optimizer.pt")  # the pointer names an incomplete checkpoint
    steps = []
    resumed = DrafterTrainer(
        fresh(target), target, args(out, max_steps=6, save_total_limit=3), train, on_step=lambda s, r: steps.append(s)
    )
    with pytest.warns(
        UserWarning,
        match=r"'checkpoint-6', which is incomplete \(missing \['optimizer.pt'\]\); resuming from 'checkpoint-4'",
    ):
        resumed.train(resume_from_checkpoint=True)
    assert steps == [5, 6]

    shutil.rmtree(out / "checkpoint-6")  # the pointer names a missing checkpoint
    with pytest.warns(UserWarning, match=r"'checkpoint-6', which does not exist; resuming from 'checkpoint-4'"):
        assert find_latest_checkpoint(str(out)).endswith("checkpoint-4")
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "checkpoint-2")
    with pytest.raises(ValueError, match="holds no other complete checkpoint"):
        find_latest_checkpoint(str(out))


# ---------------------------------------------------------------------------------------- one run per output folder
def _run_files(out):
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def test_a_fresh_run_into_another_runs_folder_is_refused_and_overwrite_clears_it_first(tmp_path, target):
    out = tmp_path / "out"
    DrafterTrainer(fresh(target), target, args(out, max_steps=6, save_total_limit=None), data()).train()
    assert _run_files(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    first_record = json.loads((out / "training_record.json").read_text())

    with pytest.raises(ValueError, match=r"already holds a training run .*--resume.*--overwrite-output-dir"):
        DrafterTrainer(fresh(target), target, args(out, max_steps=4), data(seed=1)).train()
    assert _run_files(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # nothing of the old run was lost
    assert json.loads((out / "training_record.json").read_text()) == first_record

    # with overwrite, the old run's checkpoints go first: rotation keeps the new run's, the pointer names one of them
    DrafterTrainer(fresh(target), target, args(out, max_steps=4, overwrite_output_dir=True), data(seed=1)).train()
    assert _run_files(out) == ["checkpoint-2", "checkpoint-4"]
    assert find_latest_checkpoint(str(out)).endswith("checkpoint-4")
    assert json.loads((out / "training_record.json").read_text())["total_steps"] == 4


def test_resuming_a_finished_run_keeps_its_record(tmp_path, target):
    out = tmp_path / "out"
    record = DrafterTrainer(fresh(target), target, args(out), data()).train()
    assert record["wall_time_s"] > 0
    saved = (out / "training_record.json").read_text()
    with pytest.warns(UserWarning, match="had already finished"):
        again = DrafterTrainer(fresh(target), target, args(out), data()).train(resume_from_checkpoint=True)
    assert again == json.loads(saved)
    assert (out / "training_record.json").read_text() == saved


def test_a_resumed_runs_record_counts_the_time_and_tokens_of_the_steps_before_it(tmp_path, target):
    whole = DrafterTrainer(fresh(target), target, args(tmp_path / "whole"), data()).train()
    assert whole["resumed_at_step"] is None
    out = tmp_path / "out"
    DrafterTrainer(fresh(target), target, args(out, stop_after_steps=2), data()).train()
    history_file = out / "checkpoint-2" / "draft_history.json"
    history = json.loads(history_file.read_text())
    assert history["wall_time_s"] > 0 and history["tokens"] > 0
    history["wall_time_s"] = 1000.0  # as if the first process had trained for a long time
    history_file.write_text(json.dumps(history))
    record = DrafterTrainer(fresh(target), target, args(out), data()).train(resume_from_checkpoint=True)
    assert record["resumed_at_step"] == 2
    assert 1000.0 < record["wall_time_s"] < 1000.0 + 60
    assert record["tokens"] == whole["tokens"] > 0
    assert record["tokens_per_second"] == pytest.approx(record["tokens"] / record["wall_time_s"], abs=0.1)


# ---------------------------------------------------------------------------------------------- data that cannot train
def test_training_data_with_nothing_to_learn_is_refused_saying_what_carries_loss(tmp_path, target):
    from helpers import chat_tokenizer

    silent = DrafterDataset([{"input_ids": [7, 8, 9, 10], "loss_mask": [0, 0, 0, 0]} for _ in range(4)])
    with pytest.raises(ValueError, match=r"None of the 4 training examples has a token to train on.*assistant"):
        DrafterTrainer(fresh(target), target, args(tmp_path / "a"), silent)
    prompts_only = DrafterDataset.from_records([{"prompt": "hi there"}, {"prompt": "and you"}], chat_tokenizer())
    assert prompts_only.num_dropped == 2
    with pytest.raises(ValueError, match=r"holds no examples \(2 records were dropped.*'response'"):
        DrafterTrainer(fresh(target), target, args(tmp_path / "b"), prompts_only)


def test_a_line_that_is_not_utf8_is_named_in_every_kind_of_data_file(tmp_path):
    from hf_specdec.bench.prompts import load_prompts
    from hf_specdec.training.sources import load_prompt_source

    good = json.dumps({"prompt": "hello", "response": "hi"}).encode()
    bad = '{"prompt": "caf\xe9"}'.encode("latin-1")  # latin-1, not UTF-8
    for name in ("train.jsonl", "prompts.jsonl", "prompts.txt"):
        (tmp_path / name).write_bytes(good + b"\n" + good + b"\n" + bad + b"\n")
    match = r":3: not UTF-8 text \(byte b'\\xe9' at column 16\).*Save the file as UTF-8"
    with pytest.raises(ValueError, match=r"train\.jsonl" + match):
        load_records(tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match=r"prompts\.jsonl" + match):
        load_prompt_source(str(tmp_path / "prompts.jsonl"))
    with pytest.raises(ValueError, match=r"prompts\.jsonl" + match):
        load_prompts(str(tmp_path / "prompts.jsonl"))
    with pytest.raises(ValueError, match=r"prompts\.txt" + match):
        load_prompts(str(tmp_path / "prompts.txt"))
    (tmp_path / "fine.jsonl").write_bytes(
        good + "\n".join(["", json.dumps({"prompt": "café"}, ensure_ascii=False)]).encode() + b"\n"
    )
    assert [r["prompt"] for r in load_records(tmp_path / "fine.jsonl")] == ["hello", "café"]


# ---------------------------------------------------------------------------------------------- a full disk
def _leftovers(out):
    return sorted(n for n in os.listdir(out) if ".tmp-" in n)


def _checkpoint_bytes(ckpt):
    return {name: open(os.path.join(ckpt, name), "rb").read() for name in sorted(os.listdir(ckpt))}


def _failing_writer(form):
    """The three ways a full disk surfaces while a checkpoint is written, each from the writer that raises it."""
    from safetensors import SafetensorError

    errors = {
        "oserror": OSError(28, "No space left on device"),
        "torch": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 64; file write failed"),
        "safetensors": SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'),
    }  # fmt: skip

    def write(*_a, **_k):
        raise errors[form]

    return write


@pytest.mark.parametrize("form", ["oserror", "torch", "safetensors"])
def test_a_full_disk_while_checkpointing_says_so_keeps_the_previous_checkpoint_and_leaves_no_temporaries(
    tmp_path, target, monkeypatch, form
):
    out = tmp_path / "out"
    DrafterTrainer(fresh(target), target, args(out, stop_after_steps=2), data()).train()
    before = _checkpoint_bytes(out / "checkpoint-2")
    resumed = DrafterTrainer(fresh(target), target, args(out), data())
    if form == "safetensors":
        monkeypatch.setattr(resumed.unwrapped_drafter, "save_pretrained", _failing_writer(form))
    else:
        monkeypatch.setattr(torch, "save", _failing_writer(form))
    with pytest.raises(OSError, match=r"No space left on the device while saving checkpoint-4 in .*out.*the previous "
                                      r"checkpoint 'checkpoint-2' is intact.*rerun with --resume"):  # fmt: skip
        resumed.train(resume_from_checkpoint=True)
    assert _leftovers(out) == []
    assert (out / "latest_checkpoint").read_text() == "checkpoint-2"
    assert _checkpoint_bytes(out / "checkpoint-2") == before
    monkeypatch.undo()
    record = DrafterTrainer(fresh(target), target, args(out), data()).train(resume_from_checkpoint=True)  # space freed
    assert record["total_steps"] == 4 and find_latest_checkpoint(str(out)).endswith("checkpoint-4")


def test_another_error_while_checkpointing_is_raised_as_it_is_and_leaves_no_temporaries(tmp_path, target, monkeypatch):
    out = tmp_path / "out"
    trainer = DrafterTrainer(fresh(target), target, args(out, stop_after_steps=2), data())
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(TypeError("cannot pickle 'generator'")))
    with pytest.raises(TypeError, match="cannot pickle"):
        trainer.train()
    assert _leftovers(out) == [] and not (out / "latest_checkpoint").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs, where this machine lets the test mount one (root in a container that allows it)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the patched writers test the same")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_really_full_disk_while_checkpointing_keeps_the_previous_checkpoint(small_disk, target):
    out = small_disk / "out"
    DrafterTrainer(fresh(target), target, args(out, stop_after_steps=2), data()).train()
    before = _checkpoint_bytes(out / "checkpoint-2")
    free = shutil.disk_usage(small_disk).free
    with open(small_disk / "filler", "wb") as fh:  # leave a few KB: too little for another checkpoint
        fh.write(b"\0" * max(free - 8192, 0))
    with pytest.raises(
        OSError, match=r"No space left on the device while saving checkpoint-4.*'checkpoint-2' is intact"
    ):
        DrafterTrainer(fresh(target), target, args(out), data()).train(resume_from_checkpoint=True)
    assert _leftovers(out) == [] and (out / "latest_checkpoint").read_text() == "checkpoint-2"
    assert _checkpoint_bytes(out / "checkpoint-2") == before
    os.remove(small_disk / "filler")
    record = DrafterTrainer(fresh(target), target, args(out), data()).train(resume_from_checkpoint=True)
    assert record["total_steps"] == 4
