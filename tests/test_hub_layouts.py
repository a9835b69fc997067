"""Checkpoints in other projects' layouts, loaded by Hub repo id from a local Hub server (no network).

One layout per drafter family that has one: a tiny drafter is exported in it, uploaded, and
``AutoModelForDrafting.from_pretrained("org/name")`` must give the drafter the folder gives. Also: only the shards
holding the tensors a layout reads are downloaded, ``revision`` / ``subfolder`` / ``local_files_only`` work, and a
checkpoint in no known layout gets hf_specdec's own error (its ``auto_map`` is never run).
"""

import glob
import hashlib
import json
import os

import pytest
import torch
from helpers import make_target, ragged_batch
from huggingface_hub import HfApi, constants
from safetensors.torch import save_file

from hf_specdec import AutoModelForDrafting, MtpConfig
from hf_specdec.commands import main as cli
from hf_specdec.convert import LAYOUTS, detect_layout, export_drafter
from hf_specdec.registry import DRAFTERS

# huggingface_hub's single-part LFS upload passes the file as `data=`, which httpx2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")

DEAD_ENDPOINT = "http://127.0.0.1:9"  # nothing listens there: any request fails
# Config choices a family's default lacks for its layout to be able to hold it (the reference SpecBlock keeps all slots).
EXPORTABLE = {"specblock_drafter": {"context_slots": "all"}}


def _point_client_at(monkeypatch, endpoint: str) -> None:
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def _upload(hub, folder, repo_id: str, path_in_repo: str = "", revision: str | None = None) -> None:
    api = HfApi(endpoint=hub.endpoint, token="t")
    api.create_repo(repo_id, exist_ok=True)
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, path_in_repo=path_in_repo, revision=revision)


def _one_layout_per_family() -> list[str]:
    first: dict[str, str] = {}
    for layout in LAYOUTS.values():
        if layout.load and layout.save and layout.detect:
            first.setdefault(layout.family, layout.name)
    return sorted(first.values())


def _export(tmp_path, layout: str, seed: int = 3):
    """A tiny drafter of the layout's family, bound to a tiny target, written in the layout."""
    target = make_target("llama", seed=7)
    spec = next(s for s in DRAFTERS.values() if s.model_type == LAYOUTS[layout].family)
    torch.manual_seed(seed)
    config = spec.config_class.for_target(target.config, **EXPORTABLE.get(spec.model_type, {}))
    drafter = AutoModelForDrafting.from_config(config).eval()
    drafter.bind_target(target)
    folder = tmp_path / layout
    export_drafter(drafter, str(folder), layout, target=target)
    return target, folder


def _assert_same_drafter(a, b) -> None:
    assert type(a) is type(b)
    metadata = ("_name_or_path", "architectures", "dtype")  # save_pretrained fills these in
    strip = lambda d: {k: v for k, v in d.items() if k not in metadata}  # noqa: E731
    assert strip(a.config.to_dict()) == strip(b.config.to_dict())
    want, got = a.state_dict(), b.state_dict()
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key


def _cached_weight_files(tmp_path) -> list[str]:
    return sorted(glob.glob(str(tmp_path / "hub-cache" / "**" / "*.safetensors"), recursive=True))


def test_each_family_has_a_layout_to_test():
    # an empty parametrization below would pass silently
    assert len(_one_layout_per_family()) >= 7, _one_layout_per_family()


@pytest.mark.parametrize("layout", _one_layout_per_family())
def test_a_foreign_layout_loads_by_repo_id_as_from_its_folder(tmp_path, hub, layout):
    target, folder = _export(tmp_path, layout)
    repo_id = f"org/{layout}"
    _upload(hub, folder, repo_id)
    assert detect_layout(repo_id) == layout
    assert _cached_weight_files(tmp_path) == []  # detection read the safetensors header remotely, cached no weights
    from_folder = AutoModelForDrafting.from_pretrained(folder).eval()
    from_hub = AutoModelForDrafting.from_pretrained(repo_id).eval()
    _assert_same_drafter(from_folder, from_hub)
    ids, mask = ragged_batch(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    a = target.generate(ids, assistant_model=from_folder, **kwargs)
    assert torch.equal(a, target.generate(ids, assistant_model=from_hub, **kwargs))
    # `hf-specdec convert <repo id> OUT` imports it into hf_specdec's own format.
    assert cli(["convert", repo_id, str(tmp_path / "converted")]) == 0
    converted = AutoModelForDrafting.from_pretrained(tmp_path / "converted")
    _assert_same_drafter(AutoModelForDrafting.from_pretrained(folder), converted)  # unbound, as converted


def test_a_pickle_under_its_projects_own_file_name(tmp_path, hub):
    """FasterDecoding's Medusa loader reads ``medusa_lm_head.pt``: found through the repo's file listing."""
    from safetensors.torch import load_file

    _, folder = _export(tmp_path, "medusa-fasterdecoding")
    torch.save(load_file(str(folder / "medusa_lm_head.safetensors")), folder / "medusa_lm_head.pt")
    (folder / "medusa_lm_head.safetensors").unlink()
    _upload(hub, folder, "org/medusa")
    _assert_same_drafter(
        AutoModelForDrafting.from_pretrained(folder), AutoModelForDrafting.from_pretrained("org/medusa")
    )


def test_only_the_shards_holding_the_mtp_layers_are_downloaded(tmp_path, hub):
    """A target checkpoint sharded as transformers shards it: the target's own layers in one shard, its MTP layers
    in another. Importing the MTP layers by repo id reads the index and downloads the MTP shard alone."""
    target = make_target("llama", seed=7)
    drafter = AutoModelForDrafting.from_config(MtpConfig.for_target(target.config)).eval()
    exported = tmp_path / "exported"
    export_drafter(drafter, str(exported), "mtp-layers")
    from safetensors.torch import load_file

    shards = {
        "model-00001-of-00002.safetensors": {k: v.clone() for k, v in target.state_dict().items()},
        "model-00002-of-00002.safetensors": load_file(str(exported / "model.safetensors")),
    }
    repo = tmp_path / "target-with-mtp"
    repo.mkdir()
    for name, tensors in shards.items():
        save_file(tensors, str(repo / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    (repo / "config.json").write_text((exported / "config.json").read_text())
    _upload(hub, repo, "org/target-with-mtp")

    loaded = AutoModelForDrafting.from_pretrained("org/target-with-mtp")
    _assert_same_drafter(AutoModelForDrafting.from_pretrained(repo), loaded)
    sha = {name: hashlib.sha256((repo / name).read_bytes()).hexdigest() for name in shards}
    assert hub.lfs_downloads == [sha["model-00002-of-00002.safetensors"]]  # not even the target shard's header


def test_revision_subfolder_and_local_files_only(tmp_path, hub, monkeypatch):
    _, folder = _export(tmp_path, "eagle3")
    _upload(hub, folder, "org/drafters", path_in_repo="eagle3", revision="v1")
    from_folder = AutoModelForDrafting.from_pretrained(folder)
    options = dict(revision="v1", subfolder="eagle3")
    _assert_same_drafter(from_folder, AutoModelForDrafting.from_pretrained("org/drafters", **options))
    with pytest.raises(ValueError, match="org/drafters/eagle3 has no config.json"):
        AutoModelForDrafting.from_pretrained("org/drafters", subfolder="eagle3")  # main does not have it
    # A local folder with a subfolder, likewise.
    _assert_same_drafter(from_folder, AutoModelForDrafting.from_pretrained(tmp_path, subfolder="eagle3"))

    # Offline: the Hub is unreachable, the first download is in the cache.
    _point_client_at(monkeypatch, DEAD_ENDPOINT)
    offline = AutoModelForDrafting.from_pretrained("org/drafters", local_files_only=True, **options)
    _assert_same_drafter(from_folder, offline)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _assert_same_drafter(from_folder, AutoModelForDrafting.from_pretrained("org/drafters", **options))
    with pytest.raises(OSError, match="not in the local Hugging Face cache") as err:
        AutoModelForDrafting.from_pretrained("org/never-downloaded", local_files_only=True)
    assert "local_files_only=True" in str(err.value)


def test_local_files_only_says_the_cache_lacks_the_weights(tmp_path, hub, monkeypatch):
    """Detection alone caches config.json only; loading offline then says which file is missing, and why."""
    _, folder = _export(tmp_path, "eagle1")
    _upload(hub, folder, "org/eagle1")
    assert detect_layout("org/eagle1") == "eagle1"
    _point_client_at(monkeypatch, DEAD_ENDPOINT)
    with pytest.raises(ValueError, match="holds no weights .* in the local cache, and downloads are off"):
        AutoModelForDrafting.from_pretrained("org/eagle1", local_files_only=True)


def _foreign_folder(path, config: dict, files: dict[str, str] | None = None):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({"foo.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def test_a_checkpoint_in_no_known_layout_gets_hf_specdecs_error(tmp_path, hub):
    cases = {
        "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8},
        "no-model-type": {"architectures": ["SomethingForCausalLM"], "hidden_size": 8},
    }
    for name, config in cases.items():
        folder = _foreign_folder(tmp_path / name, config)
        _upload(hub, folder, f"org/{name}")
        for source in (folder, f"org/{name}"):
            with pytest.raises(ValueError) as err:
                AutoModelForDrafting.from_pretrained(source)
            message = str(err.value)
            assert "hf-specdec convert --list" in message and "eagle3" in message and "--from LAYOUT" in message
            assert "model_type key" not in message and "Unrecognized configuration" not in message
    folder = _foreign_folder(tmp_path / "unregistered", {"model_type": "foo_drafter"})
    _upload(hub, folder, "org/unregistered")
    with pytest.raises(ValueError, match="'foo_drafter' drafter, a family no installed package registers"):
        AutoModelForDrafting.from_pretrained("org/unregistered")


def test_auto_map_in_a_foreign_config_is_never_run(tmp_path, hub):
    marker = tmp_path / "remote-code-ran"
    code = f"open({str(marker)!r}, 'w').close()\nclass Evil:\n    pass\n"
    auto_map = {"AutoConfig": "evil.Evil", "AutoModel": "evil.Evil", "AutoModelForDrafting": "evil.Evil"}
    unknown = _foreign_folder(tmp_path / "unknown", {"model_type": "evil", "auto_map": auto_map}, {"evil.py": code})
    _upload(hub, unknown, "org/evil")
    for kwargs in ({}, {"trust_remote_code": True}):
        with pytest.raises(ValueError, match="hf-specdec convert --list"):
            AutoModelForDrafting.from_pretrained("org/evil", **kwargs)
    # SpecForge's DSpark configs carry an auto_map to their remote code: the checkpoint imports as its layout, and
    # the code it points at (here: one that would leave the marker) is neither downloaded nor run.
    _, folder = _export(tmp_path, "dspark-specforge")
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" in config
    auto_map = {"AutoConfig": "dspark.Evil", "AutoModel": "dspark.Evil", "AutoModelForDrafting": "dspark.Evil"}
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    (folder / "dspark.py").write_text(code)
    _upload(hub, folder, "org/dspark-with-auto-map")
    loaded = AutoModelForDrafting.from_pretrained("org/dspark-with-auto-map", trust_remote_code=True)
    _assert_same_drafter(AutoModelForDrafting.from_pretrained(folder), loaded)
    assert not marker.exists() and not os.path.exists(tmp_path / "modules")
    assert not glob.glob(str(tmp_path / "hub-cache" / "**" / "*.py"), recursive=True)
