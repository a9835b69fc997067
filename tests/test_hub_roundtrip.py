"""push_to_hub writes the same files save_pretrained does (weights + config, no target weights), and what it uploads
loads back with AutoModelForDrafting. The Hub API is replaced by an in-process recorder (no network)."""

import os

import torch
import transformers.utils.hub as tf_hub
from helpers import make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, Eagle3Config


class RecordingApi:
    def __init__(self):
        self.repos, self.files = [], {}

    def create_repo(self, repo_id, private=None, token=None, exist_ok=False, **kwargs):
        self.repos.append((repo_id, private))
        return type("Repo", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, commit_message=None, **kwargs):
        for op in operations:
            src = op.path_or_fileobj
            if isinstance(src, (str, os.PathLike)):
                with open(src, "rb") as fh:
                    data = fh.read()
            elif isinstance(src, bytes):
                data = src
            else:
                data = src.read()
            self.files[op.path_in_repo] = data
        self.message = commit_message
        return "https://example.invalid/commit"

    def __getattr__(self, name):  # anything else would need the network
        raise AssertionError(f"unexpected Hub call {name}")


def test_push_to_hub_uploads_a_loadable_drafter(tmp_path, monkeypatch):
    api = RecordingApi()
    monkeypatch.setattr(tf_hub, "hf_api", lambda *a, **k: api)
    monkeypatch.setattr(tf_hub, "create_and_tag_model_card", lambda *a, **k: _EmptyCard())
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    drafter.bind_target(target)
    drafter.push_to_hub("org/eagle3-tiny", private=True, commit_message="upload drafter")
    assert api.repos == [("org/eagle3-tiny", True)]
    assert {"config.json", "model.safetensors"} <= set(api.files)
    assert api.message == "upload drafter"
    out_dir = tmp_path / "downloaded"
    out_dir.mkdir()
    for name, data in api.files.items():
        (out_dir / name).write_bytes(data)
    loaded = AutoModelForDrafting.from_pretrained(out_dir).eval()
    ids, mask = ragged_batch(2)
    a = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8, do_sample=False)
    b = target.generate(ids, attention_mask=mask, assistant_model=loaded, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b)
    from safetensors.torch import load

    assert not any("embed" in k for k in load(api.files["model.safetensors"]))


class _EmptyCard:
    def save(self, path):
        with open(path, "w") as fh:
            fh.write("---\nlibrary_name: hf_specdec\n---\n")
