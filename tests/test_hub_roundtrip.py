"""Publishing end to end against a local Hub-compatible HTTP endpoint: the real huggingface_hub client uploads the
drafter and its generated card, and AutoModelForDrafting.from_pretrained downloads it and generates (no network).
The weights take the path real uploads take: preupload says "lfs", then LFS batch, PUT to storage, verify, and a commit
that carries only the LFS pointer; the download follows the Hub's redirect to the storage."""

import hashlib
import json
import os

import pytest
import torch
from helpers import make_target, ragged_batch
from huggingface_hub import ModelCard, constants, hf_hub_download
from local_hub import LocalHub
from safetensors.torch import load

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.cards import drafter_card, push_drafter


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with LocalHub() as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        # The local hub speaks the LFS batch protocol, not Xet: without this, an installed hf_xet would ask for a
        # Xet token (an endpoint the local hub does not implement, so the test would fail below).
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        yield server
        assert server.unknown == [], f"the client called endpoints the local hub does not implement: {server.unknown}"


def _bench_report():
    return {
        "hardware": {"device": "cpu", "device_name": "test CPU", "torch": torch.__version__},
        "config": {"target": "tiny"},
        "records": [
            {"method": "plain", "kind": "plain", "category": "all", "temperature": 0.0, "batch_size": 1,
             "mean_accepted_length": 1.0, "speedup": 1.0, "identical": True},
            {"method": "eagle3 K=4", "kind": "drafter", "category": "all", "temperature": 0.0, "batch_size": 1,
             "mean_accepted_length": 3.21, "speedup": 1.87, "identical": True},
        ],
    }  # fmt: skip


def test_push_to_a_local_hub_and_load_back(tmp_path, hub):
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).eval()
    drafter.bind_target(target)
    info = drafter.push_to_hub("org/eagle3-tiny", private=True, commit_message="upload drafter", token="t",
                               bench=_bench_report(), base_model="org/tiny-llama")  # fmt: skip
    assert "org/eagle3-tiny" in info.commit_url
    repo = hub.repos["org/eagle3-tiny"]
    files = repo["revisions"]["main"]
    assert repo["private"] is True and hub.commits[-1]["summary"] == "upload drafter"
    assert {"config.json", "model.safetensors", "README.md"} <= set(files)
    # The weights went through LFS (preupload -> batch -> PUT to storage -> verify -> pointer in the commit); the small
    # text files went inline as regular blobs.
    weights = files["model.safetensors"]
    oid = hashlib.sha256(weights).hexdigest()
    assert hub.preuploads["model.safetensors"] == "lfs"
    assert hub.preuploads["config.json"] == hub.preuploads["README.md"] == "regular"
    assert hub.commits[-1]["lfs"] == ["model.safetensors"]
    assert {"config.json", "README.md"} <= set(hub.commits[-1]["regular"])
    assert hub.lfs_uploads == [{"oid": oid, "size": len(weights)}] and hub.lfs_verified == [oid]
    assert hub.lfs_paths("org/eagle3-tiny") == {"model.safetensors": oid}
    assert not any("embed" in k for k in load(files["model.safetensors"]))  # the target's weights are never pushed
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == "org/tiny-llama" and card.data.library_name == "hf_specdec"
    assert {"speculative-decoding", "eagle3"} <= set(card.data.tags)
    assert "| eagle3 K=4 | 0.0 | 1 | 3.21 | 1.87× | yes |" in card.text
    assert "token-identical" in card.text
    # Download through the real client and generate.
    loaded = AutoModelForDrafting.from_pretrained("org/eagle3-tiny").eval()
    assert hub.lfs_downloads == [oid]  # the weights came from the LFS storage the resolve endpoint redirected to
    local = tmp_path / "local"
    drafter.save_pretrained(local)
    downloaded = hf_hub_download("org/eagle3-tiny", "model.safetensors")
    with open(downloaded, "rb") as f:
        got = f.read()
    assert got == weights == (local / "model.safetensors").read_bytes()  # byte-identical end to end
    # The client cached it as an LFS file: the blob is named by its sha256 (X-Linked-Etag), a regular file by its git oid.
    assert os.path.basename(os.path.realpath(downloaded)) == oid
    config = os.path.realpath(hf_hub_download("org/eagle3-tiny", "config.json"))
    with open(config, "rb") as f:
        assert os.path.basename(config) == hashlib.sha1(b"blob %d\0" % len(data := f.read()) + data).hexdigest()
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    a = target.generate(ids, assistant_model=drafter, **kw)
    b = target.generate(ids, assistant_model=loaded, **kw)
    assert torch.equal(a, b) and torch.equal(b, target.generate(ids, **kw))


def test_push_command_revisions_and_card_checks(tmp_path, hub):
    from hf_specdec.cli import main

    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(_bench_report()))
    rc = main(["push", str(folder), "org/d", "--revision", "v1", "--commit-message", "v1 weights", "--bench",
               str(bench), "--base-model", "org/tiny-llama", "--endpoint", hub.endpoint, "--token", "t"])  # fmt: skip
    assert rc == 0
    assert "README.md" in hub.repos["org/d"]["revisions"]["v1"] and hub.commits[-1]["revision"] == "v1"
    # A card in the folder that names another target is refused.
    (folder / "README.md").write_text("---\nbase_model: org/other-model\n---\n# card\n")
    with pytest.raises(ValueError, match="org/other-model"):
        push_drafter(str(folder), "org/d", endpoint=hub.endpoint, token="t", base_model="org/tiny-llama")
    # The card alone, validated by huggingface_hub's ModelCard parser.
    out = tmp_path / "README.md"
    assert main(["push", str(folder), "org/d", "--card-only", str(out), "--base-model", "org/tiny-llama"]) == 0
    assert ModelCard.load(out).data.pipeline_tag == "text-generation"
    with pytest.raises(ValueError, match="bench report"):
        bad = tmp_path / "bad.json"
        bad.write_text("[]")
        drafter_card(str(folder), bench=str(bad), base_model="org/tiny-llama")
