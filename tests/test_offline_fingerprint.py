"""Offline features know their target: the dump's index records a fingerprint of the target (config hash, tokenizer
hash, weight checksums), and training with another target -- even one of the same shape -- is refused."""

import json
import random

import pytest
import torch
from helpers import chat_tokenizer

from hf_specdec.commands import main as cli
from hf_specdec.testing import tiny_target
from hf_specdec.training.offline import (
    INDEX_NAME,
    OfflineFeatureDataset,
    dump_features,
    record_target_fingerprint,
    target_fingerprint,
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fingerprint")
    tok = chat_tokenizer()
    for name, seed in (("target_a", 0), ("target_b", 1)):  # same shape, different weights
        tiny_target("llama", seed=seed, vocab=len(tok), sharpen=20.0).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as fh:
        for _ in range(8):
            q = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(2))
            a = " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(3))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            fh.write("\n")
    feats = root / "features_a"
    assert cli(["dump-features", "--target", str(root / "target_a"), "--data", str(root / "data.jsonl"),
                "--output-dir", str(feats), "--feature-dtype", "float32", "--max-length", "64",
                "--batch-size", "4"]) == 0  # fmt: skip
    return root


def train(root, target, out, features="features_a"):
    return cli(["train", "--target", str(root / target), "--features", str(root / features),
                "--output-dir", str(out), "--max-steps", "2", "--batch-size", "4", "--eval-fraction", "0.25",
                "--save-steps", "2", "--eval-steps", "2", "--report-to", "none", "--num-draft-tokens", "2",
                "--max-length", "64"])  # fmt: skip


def test_index_records_the_target_fingerprint(workspace):
    index = json.loads((workspace / "features_a" / INDEX_NAME).read_text())
    fp = index["target_fingerprint"]
    assert fp["name_or_path"] == str(workspace / "target_a")
    assert len(fp["config_sha256"]) == 64 and len(fp["tokenizer_sha256"]) == 64
    assert set(fp["weights_sha256"]) == {"embed_tokens", "lm_head", "layer"}
    assert all(len(v) == 64 for v in fp["weights_sha256"].values())


def test_features_of_another_target_of_the_same_shape_are_refused(workspace, tmp_path, capsys):
    capsys.readouterr()
    try:  # the CLI either raises or reports the error and returns non-zero
        rc, message = train(workspace, "target_b", tmp_path / "b"), ""
    except (ValueError, SystemExit) as e:
        rc, message = 2, str(e)
    captured = capsys.readouterr()
    message += captured.out + captured.err
    assert rc != 0
    assert str(workspace / "target_a") in message and str(workspace / "target_b") in message
    assert "weights" in message and "Dump the features again" in message
    assert not (tmp_path / "b" / "model.safetensors").exists()
    # With the target they were dumped from, training runs.
    assert train(workspace, "target_a", tmp_path / "a") == 0
    assert (tmp_path / "a" / "model.safetensors").exists()


def test_fingerprint_ignores_paths_and_precision_but_not_config_or_tokenizer(workspace):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = AutoModelForCausalLM.from_pretrained(workspace / "target_a")
    a16 = AutoModelForCausalLM.from_pretrained(workspace / "target_a", dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(workspace / "target_a")
    fa, f16 = target_fingerprint(a, tok), target_fingerprint(a16, tok)
    assert fa["name_or_path"] == f16["name_or_path"]
    assert {k: v for k, v in fa.items() if k != "dtype"} == {k: v for k, v in f16.items() if k != "dtype"}
    a.config._name_or_path = "/elsewhere/copy"
    assert target_fingerprint(a, tok)["config_sha256"] == fa["config_sha256"]
    a.config.rms_norm_eps = 1e-5
    assert target_fingerprint(a, tok)["config_sha256"] != fa["config_sha256"]
    other_tok = chat_tokenizer()
    other_tok.add_tokens(["<extra>"])
    assert target_fingerprint(a16, other_tok)["tokenizer_sha256"] != fa["tokenizer_sha256"]


def _dump(target, path, **kw):
    examples = [{"input_ids": [1, 6, 7, 8, 9], "loss_mask": [0, 1, 1, 1, 1]}, {"input_ids": [1, 10, 11, 12]}]
    return dump_features(target, examples, [1, 2], path, dtype=torch.float32, shard_tokens=1, progress=False,
                         log=None, **kw)  # fmt: skip


def test_old_index_without_fingerprint_is_refused_until_stamped(tmp_path):
    a, b = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    _dump(a, tmp_path / "f")
    index_path = tmp_path / "f" / INDEX_NAME
    index = json.loads(index_path.read_text())
    del index["target_fingerprint"]
    index_path.write_text(json.dumps(index))
    dataset = OfflineFeatureDataset(tmp_path / "f")
    with pytest.raises(ValueError, match="no target fingerprint"):
        dataset.check_target(a)
    record_target_fingerprint(tmp_path / "f", a)  # the user vouches: these come from `a`
    dataset = OfflineFeatureDataset(tmp_path / "f")
    dataset.check_target(a)
    with pytest.raises(ValueError, match="differ in weights"):
        dataset.check_target(b)
    with pytest.raises(ValueError, match="not overwriting"):
        record_target_fingerprint(tmp_path / "f", b)


def test_resuming_a_dump_with_another_target_is_refused(tmp_path):
    a, b = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    _dump(a, tmp_path / "f")
    with pytest.raises(ValueError, match="Cannot resume.*differ in"):
        _dump(b, tmp_path / "f")
    _dump(a, tmp_path / "f")  # the same target resumes (nothing left to do)
    _dump(b, tmp_path / "f", resume=False)  # starting over is allowed
    OfflineFeatureDataset(tmp_path / "f").check_target(b)
