"""Reproducible `hf-specdec train`: same seed, data and settings give identical weights on CPU, and a run stopped
after a checkpoint and resumed from its files ends bit for bit where the uninterrupted run ends."""

import json
import random

import pytest
import torch
from helpers import chat_tokenizer
from safetensors.torch import load_file

from hf_specdec.commands import main as cli
from hf_specdec.testing import tiny_target


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    tok = chat_tokenizer()
    target = tiny_target("llama", seed=0, vocab=len(tok), sharpen=20.0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as fh:
        for _ in range(16):
            q = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(2))
            a = " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(4))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            fh.write("\n")
    return root


def train(root, out, *extra, seed=0):
    argv = ["train", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--output-dir", str(out),
            "--max-steps", "6", "--batch-size", "4", "--eval-fraction", "0.25", "--save-steps", "3",
            "--eval-steps", "2", "--report-to", "none", "--lr", "3e-3", "--num-draft-tokens", "3",
            "--max-length", "64", "--seed", str(seed), *extra]  # fmt: skip
    assert cli(argv) == 0


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_same_seed_same_weights_and_another_seed_differs(workspace):
    train(workspace, workspace / "a")
    torch.manual_seed(999)  # whatever the caller's RNG state: the run seeds everything it draws from
    random.seed(999)
    train(workspace, workspace / "b")
    a, b = weights(workspace / "a"), weights(workspace / "b")
    assert_identical(a, b)
    ra = json.loads((workspace / "a" / "training_record.json").read_text())
    rb = json.loads((workspace / "b" / "training_record.json").read_text())
    assert ra["final_eval"] == rb["final_eval"] and ra["eval_history"] == rb["eval_history"]
    train(workspace, workspace / "c", seed=1)
    c = weights(workspace / "c")
    assert max((a[k].float() - c[k].float()).abs().max().item() for k in a) > 1e-3


def test_stopped_and_resumed_run_ends_bit_for_bit_where_the_full_run_ends(workspace):
    full = workspace / "a"
    if not (full / "model.safetensors").exists():
        train(workspace, full)
    out = workspace / "stopped"
    train(workspace, out, "--stop-after-steps", "4")  # checkpoints at 3 and (on stopping) 4
    assert (out / "checkpoint-4").is_dir() and not (out / "model.safetensors").exists()
    train(workspace, out, "--resume")
    assert_identical(weights(full), weights(out))
    record = json.loads((out / "training_record.json").read_text())
    assert (
        record["steps"] == 6
        and record["final_eval"] == json.loads((full / "training_record.json").read_text())["final_eval"]
    )
