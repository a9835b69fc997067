"""End to end through the command line: regenerate -> train (online) -> resume -> dump-features -> train (offline),
and the offline/online equivalence of the loss."""

import json

import pytest
import torch
from helpers import chat_workspace

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.commands import main as cli
from hf_specdec.training.data import DataCollator, DrafterDataset, load_records
from hf_specdec.training.features import capture_target_features
from hf_specdec.training.offline import OfflineFeatureDataset, collate_offline, dump_features


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, tok, _ = chat_workspace(root)
    return root, target, tok


def test_cli_pipeline(workspace):
    root, target, tok = workspace
    t = str(root / "target")
    assert cli(["regenerate", "--target", t, "--data", str(root / "prompts.jsonl"), "--output", str(root / "regen.jsonl"),
                "--max-new-tokens", "16", "--batch-size", "4"]) == 0  # fmt: skip
    regen = load_records(root / "regen.jsonl")
    assert len(regen) == 12 and all(r["messages"][-1]["role"] == "assistant" for r in regen)

    common = ["--target", t, "--batch-size", "4", "--eval-fraction", "0.25", "--save-steps", "3", "--eval-steps", "3",
              "--report-to", "none", "--lr", "3e-3", "--num-draft-tokens", "3", "--max-length", "64"]  # fmt: skip
    out = root / "out"
    assert (
        cli(["train", "--data", str(root / "regen.jsonl"), "--output-dir", str(out), "--max-steps", "6", *common]) == 0
    )
    record = json.loads((out / "training_record.json").read_text())
    assert record["steps"] == 6 and record["data"]["examples"] == 12 and record["eval_examples"] == 3
    drafter = AutoModelForDrafting.from_pretrained(out)
    assert drafter.config.num_draft_tokens == 3
    # --resume continues from the last checkpoint of the finished run and trains further.
    assert cli(["train", "--data", str(root / "regen.jsonl"), "--output-dir", str(out), "--max-steps", "8",
                "--resume", *common]) == 0  # fmt: skip
    assert json.loads((out / "training_record.json").read_text())["steps"] == 8

    feats = root / "features"
    assert cli(["dump-features", "--target", t, "--data", str(root / "regen.jsonl"), "--output-dir", str(feats),
                "--feature-dtype", "float32", "--max-length", "64", "--batch-size", "4"]) == 0  # fmt: skip
    out2 = root / "out_offline"
    assert cli(["train", "--features", str(feats), "--output-dir", str(out2), "--max-steps", "4", *common]) == 0
    assert json.loads((out2 / "training_record.json").read_text())["data"]["offline_features"] is True
    assert AutoModelForDrafting.from_pretrained(out2) is not None
    # --draft-layers deepens the trained drafter before fine-tuning it.
    out3 = root / "out_deeper"
    assert cli(["train", "--features", str(feats), "--output-dir", str(out3), "--max-steps", "2", "--drafter", str(out2),
                "--draft-layers", "2", *common[:-4]]) == 0  # fmt: skip
    deeper = AutoModelForDrafting.from_pretrained(out3)
    assert deeper.config.num_hidden_layers == 2 and len(deeper.upper_layers) == 1


def test_offline_features_give_the_online_loss(workspace, tmp_path):
    root, target, tok = workspace
    records = [{"messages": [{"role": "user", "content": "ab cd"}, {"role": "assistant", "content": "efg hij kl"}]}]
    records += [{"messages": [{"role": "user", "content": "x" * i}, {"role": "assistant", "content": "ab" * i}]}
                for i in range(1, 6)]  # fmt: skip
    dataset = DrafterDataset.from_records(records, tok, max_length=64)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).bind_target(target)
    examples = [dataset[i] for i in range(len(dataset))]
    dump_features(target, examples, drafter.config.target_layer_ids, tmp_path / "f", dtype=torch.float32,
                  batch_size=2, progress=False, log=lambda *a: None)  # fmt: skip
    offline = OfflineFeatureDataset(tmp_path / "f")
    idx = [0, 3, 5]
    online_batch = DataCollator(pad_token_id=0)([dataset[i] for i in idx])
    offline_batch = collate_offline([offline[i] for i in idx], pad_token_id=0)
    assert torch.equal(online_batch["input_ids"], offline_batch["input_ids"])
    assert torch.equal(online_batch["loss_mask"], offline_batch["loss_mask"])
    online = capture_target_features(
        target, online_batch["input_ids"], online_batch["attention_mask"], drafter.config.target_layer_ids
    )
    from hf_specdec.training.features import TargetFeatures

    stored = TargetFeatures(offline_batch["target_hidden_states"], offline_batch["target_last_hidden"])
    head = target.get_output_embeddings()
    a = drafter.compute_loss(online_batch, online, head)
    b = drafter.compute_loss(offline_batch, stored, head)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    assert a.metrics.keys() == b.metrics.keys()
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in a.metrics)
    assert torch.equal(a.accepted, b.accepted) and a.metrics["valid"].sum() > 0


def test_multi_process_training_with_torchrun(workspace):
    """Two CPU processes (DDP over gloo): `torchrun` starts them, accelerate picks the distributed setup up from the
    environment exactly as under `accelerate launch` on GPUs (whose `--cpu` mode only starts one process)."""
    import os
    import subprocess
    import sys

    root, target, tok = workspace
    regen = root / "regen_ddp.jsonl"
    with open(regen, "w") as fh:
        for i in range(16):
            text = "abc def " * (i % 4 + 1)
            fh.write(
                json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": text}]})
            )
            fh.write("\n")
    out = root / "out_ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "hf_specdec", "train",
           "--target", str(root / "target"), "--data", str(regen), "--output-dir", str(out), "--max-steps", "4",
           "--batch-size", "2", "--eval-fraction", "0.25", "--save-steps", "2", "--eval-steps", "2",
           "--report-to", "none", "--max-length", "64"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "training_record.json").read_text())
    assert record["processes"] == 2 and record["steps"] == 4
    assert record["final_eval"]["loss"] > 0
    assert AutoModelForDrafting.from_pretrained(out) is not None


@pytest.mark.parametrize("fails", [False, True])
def test_train_command_ends_the_process_group_it_ran_in(tmp_path, monkeypatch, fails):
    """A launcher's process group is ended when `train` returns or raises: a rank that exits with it still up can
    abort in gloo's threads after a finished run and fail the whole launch (seen under `torchrun`)."""
    import torch.distributed as dist

    from hf_specdec.commands import train as train_command

    def run(args):
        assert dist.is_initialized()
        if fails:
            raise RuntimeError("training failed")
        return 0

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    monkeypatch.setattr(train_command, "_run_training", run)
    try:
        if fails:
            with pytest.raises(RuntimeError, match="training failed"):
                train_command._train(None)
        else:
            assert train_command._train(None) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_dump_features_refuses_token_ids_outside_the_target_vocabulary(workspace, tmp_path, capsys):
    root, target, tok = workspace
    bad = tmp_path / "bad.jsonl"
    rows = [{"input_ids": [3, 7, 9, 11], "loss_mask": [0, 1, 1, 1]}] * 3 + [
        {"input_ids": [3, len(tok) + 5, 9], "loss_mask": [0, 1, 1]}
    ]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = cli(
        ["dump-features", "--target", str(root / "target"), "--data", str(bad), "--output-dir", str(tmp_path / "f")]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"bad.jsonl:4: token id {len(tok) + 5}" in err, err
    assert not (tmp_path / "f" / "index.json").exists()


def test_a_demo_target_name_is_a_target(tmp_path):
    """`--target demo-code` loads the bundled demo target, as `bench` and `demo` do (no folder or Hub id needed)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    out = tmp_path / "regen.jsonl"
    assert cli(["regenerate", "--target", "demo-code", "--data", str(prompts), "--output", str(out),
                "--max-new-tokens", "4"]) == 0  # fmt: skip
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["regenerated"] is True and record["response"]


def test_config_overrides_of_a_fresh_drafter_are_parsed_and_checked():
    import argparse

    from helpers import make_target

    from hf_specdec.commands.common import drafter_overrides as _drafter_overrides
    from hf_specdec.registry import default_drafter_spec
    from hf_specdec.training.recipes import make_drafter

    args = argparse.Namespace(config=["num_draft_tokens=2", "target_layer_ids=[0, 1, 2]"], num_draft_tokens=None)
    overrides = _drafter_overrides(args)
    assert overrides == {"num_draft_tokens": 2, "target_layer_ids": [0, 1, 2]}
    target = make_target("llama")
    family = default_drafter_spec().name
    assert make_drafter(target, family, **overrides).config.num_draft_tokens == 2
    with pytest.raises(ValueError, match=r"no field\(s\) \['num_draft_tokenz'\]"):  # a typo is not kept silently
        make_drafter(target, family, num_draft_tokenz=2)
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        _drafter_overrides(argparse.Namespace(config=["oops"]))


def test_a_fixed_held_out_dump_and_a_training_prefix(workspace, tmp_path):
    """Data-scaling runs: every size is scored on the same held-out dump, and trains on a prefix of one dump."""
    from hf_specdec.training.recipes import train_drafter
    from hf_specdec.training.trainer import DrafterTrainingArguments

    root, target, tok = workspace
    records = [{"messages": [{"role": "user", "content": "q" * i}, {"role": "assistant", "content": "ab" * i}]}
               for i in range(1, 11)]  # fmt: skip
    dataset = DrafterDataset.from_records(records, tok, max_length=64)
    layers = Eagle3Config.for_target(target.config).target_layer_ids
    kwargs = dict(dtype=torch.float32, batch_size=4, progress=False, log=lambda *a: None)
    dump_features(target, [dataset[i] for i in range(7)], layers, tmp_path / "train", **kwargs)
    dump_features(target, [dataset[i] for i in range(7, 10)], layers, tmp_path / "eval", **kwargs)
    args = DrafterTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                                    report_to="none", disable_tqdm=True, eval_steps=1, save_steps=100)  # fmt: skip
    _, record = train_drafter(target, tok, None, args, features_dir=str(tmp_path / "train"),
                              eval_features_dir=str(tmp_path / "eval"), max_train_examples=4)  # fmt: skip
    assert record["train_examples"] == 4 and record["eval_examples"] == 3
    args = DrafterTrainingArguments(output_dir=str(tmp_path / "online"), max_steps=2, per_device_train_batch_size=2,
                                    report_to="none", disable_tqdm=True, eval_steps=1, save_steps=100)  # fmt: skip
    with pytest.raises(ValueError, match="pass eval_data"):  # a dump is not the held-out set of online training
        train_drafter(target, tok, records, args, eval_features_dir=str(tmp_path / "eval"))
    # Online training on the same split (how Medusa-2, which changes the target's features, meets the others).
    _, record = train_drafter(target, tok, records[:7], args, eval_data=records[7:], max_train_examples=4)
    assert record["train_examples"] == 4 and record["eval_examples"] == 3
    assert record["data"]["held_out"]["examples"] == 3 and record["data"]["max_train_examples"] == 4
    # The same through the command line (how the family script shares one dump and one held-out set).
    out = tmp_path / "cli-out"
    assert cli(["train", "--target", str(root / "target"), "--features", str(tmp_path / "train"), "--eval-features",
                str(tmp_path / "eval"), "--max-train-examples", "5", "--output-dir", str(out), "--max-steps", "1",
                "--batch-size", "2", "--report-to", "none"]) == 0  # fmt: skip
    record = json.loads((out / "training_record.json").read_text())
    assert record["train_examples"] == 5 and record["eval_examples"] == 3


def test_distill_command_builds_shards_from_the_users_prompts(workspace, tmp_path):
    from hf_specdec.training.distill import read_distill_dataset

    root, target, tok = workspace
    out = tmp_path / "data"
    args = ["distill", "--target", str(root / "target"), "--output-dir", str(out), "--num-shards", "2",
            "--shard-size", "6", "--data", str(root / "prompts.jsonl"), "--templated-share", "0",
            "--max-new-tokens", "8", "--batch-size", "4"]  # fmt: skip
    assert cli(args) == 0
    records = read_distill_dataset(out)
    assert len(records) == 12 and all(r["messages"][-1]["role"] == "assistant" for r in records)
    index = json.loads((out / "index.json").read_text())
    assert index["sources"] == {"user": 12} and index["settings"]["command"].startswith("hf-specdec distill --target")
    assert "| records | 12 in 2 shards of 6 prompts |" in (out / "README.md").read_text()
    assert load_records(out)[0]["messages"][0] == records[0]["messages"][0]  # training reads the folder
