"""Publishing end to end against a local Hub-compatible HTTP endpoint: the real huggingface_hub client uploads the
drafter and its generated card, and AutoModelForDrafting.from_pretrained downloads it and generates (no network).
The weights take the path real uploads take: preupload says "lfs", then LFS batch, PUT to storage, verify, and a commit
that carries only the LFS pointer; the download follows the Hub's redirect to the storage."""

import base64
import hashlib
import json
import os
import urllib.error
import urllib.request

import pytest
import torch
from helpers import make_target, ragged_batch
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from safetensors.torch import load

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.cards import drafter_card, push_drafter

# huggingface_hub's single-part LFS upload passes the file as `data=`, which httpx2 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


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
    assert "| eagle3 K=4 | — | 0.0 | 1 | 3.21 | — | 1.87× | — | yes |" in card.text  # no dtype, cost or repeats
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
        text = f.read()
    assert os.path.basename(config) == hashlib.sha1(b"blob %d\0" % len(text) + text).hexdigest()
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
    a = target.generate(ids, assistant_model=drafter, **kw)
    b = target.generate(ids, assistant_model=loaded, **kw)
    assert torch.equal(a, b) and torch.equal(b, target.generate(ids, **kw))


def test_push_command_revisions_and_card_checks(tmp_path, hub):
    from hf_specdec.commands import main

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
    assert hub.commits[-1]["lfs"] == ["model.safetensors"] and len(hub.lfs_uploads) == 1
    # The same weights pushed again: the LFS batch answers that the object is already stored, nothing is re-uploaded,
    # and the commit still carries the pointer.
    push_drafter(str(folder), "org/d", endpoint=hub.endpoint, token="t", base_model="org/tiny-llama")
    assert hub.commits[-1]["revision"] == "main" and hub.commits[-1]["lfs"] == ["model.safetensors"]
    assert len(hub.lfs_uploads) == 1 and hub.lfs_paths("org/d") == hub.lfs_paths("org/d", "v1")
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


def test_local_hub_refuses_what_the_hub_refuses(hub):
    """The fixture is only as good as its refusals: binary content committed inline, a pointer to an object that was
    never uploaded, an upload without the batch's one-time URL or with other bytes than announced are all refused."""

    def call(method, url, body=None, headers=None):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, body, headers or {}, method=method)) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def commit(item):
        lines = [{"key": "header", "value": {"summary": "s"}}, item]
        body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        return call("POST", f"{hub.endpoint}/api/models/org/r/commit/main", body)[0]

    HfApi(endpoint=hub.endpoint, token="t").create_repo("org/r")
    weights = bytes(range(256)) * 4
    oid = hashlib.sha256(weights).hexdigest()
    inline = {"path": "model.safetensors", "content": base64.b64encode(weights).decode(), "encoding": "base64"}
    pointer = {"path": "model.safetensors", "algo": "sha256", "oid": oid, "size": len(weights)}
    assert commit({"key": "file", "value": inline}) == 400  # binary files must go through LFS
    assert commit({"key": "lfsFile", "value": pointer}) == 422  # nothing was uploaded under that oid
    assert call("PUT", f"{hub.storage_endpoint}/upload/{oid}?token=forged", weights)[0] == 403
    request = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
               "objects": [{"oid": oid, "size": len(weights)}]}  # fmt: skip
    status, body = call("POST", f"{hub.endpoint}/org/r.git/info/lfs/objects/batch", json.dumps(request).encode())
    href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]
    assert status == 200 and href.startswith(hub.storage_endpoint)
    assert call("PUT", href, weights[::-1])[0] == 400  # not the announced content
    assert call("PUT", href, weights)[0] == 200 and call("PUT", href, weights)[0] == 403  # the URL is one-time
    assert hub.repos["org/r"]["revisions"]["main"] == {}  # the refused commits left nothing behind
    assert commit({"key": "lfsFile", "value": pointer}) == 200 and hub.lfs_paths("org/r") == {"model.safetensors": oid}
    assert call("GET", f"{hub.storage_endpoint}/lfs/{oid}", headers={"Range": "bytes=1000-"}) == (206, weights[1000:])


def test_a_card_from_a_multi_drafter_bench_shows_only_its_own_rows():
    from hf_specdec.cards import _own_rows, _results_table

    def row(method, speedup):
        return {"method": method, "kind": "drafter", "category": "all", "temperature": 0.0, "batch_size": 1,
                "mean_accepted_length": 1.5, "speedup": speedup, "identical": True}  # fmt: skip

    report = {"records": [row("medusa:medusa K=5", 1.04), row("hydra:hydra K=4", 1.07), row("hydra:hydra2 K=4", 1.5)]}
    table, _ = _results_table(_own_rows([report], "hydra:hydra"))
    assert "hydra:hydra K=4" in table and "medusa" not in table and "hydra2" not in table
    everything, _ = _results_table(_own_rows([report], "eagle3:other"))  # no row of its own: the whole comparison
    assert everything.count("\n") == 4


def test_a_card_row_shows_the_draft_cost_the_interval_and_the_verdict():
    """What a reader needs to see why a drafter pays or not: τ, the draft cost c, the speedup with its interval and
    the verdict; a run without repeats shows the bare speedup."""
    from hf_specdec.cards import _own_rows, _results_table

    base = {"method": "mtp:mtp K=5", "kind": "drafter", "category": "all", "temperature": 0.0, "batch_size": 1,
            "mean_accepted_length": 1.31, "speedup": 0.96, "identical": True}  # fmt: skip
    repeated = dict(base, draft_cost_ratio=0.123, speedup_ci95=[0.91, 1.02], verdict="within noise")
    table, _ = _results_table(_own_rows([{"records": [repeated]}, {"records": [base]}]))
    rows = table.splitlines()[2:]
    assert "| 1.31 | 0.12 | 0.96× [0.91–1.02] | within noise | yes |" in rows[0]
    assert "| 1.31 | — | 0.96× | — | yes |" in rows[1]


def test_push_refuses_symlinks_that_leave_the_folder(tmp_path, hub):
    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    secret = tmp_path / "elsewhere.json"
    secret.write_text('{"secret": "not for the Hub"}')
    (folder / "training_record.json").symlink_to(secret)
    commits = len(hub.commits)
    with pytest.raises(ValueError, match=r"symlinks to files outside it \(training_record\.json\)"):
        push_drafter(str(folder), "org/leak", endpoint=hub.endpoint, token="t", base_model="org/tiny-llama")
    assert len(hub.commits) == commits and "org/leak" not in hub.repos  # nothing was created or uploaded
    # a link that stays inside the folder is fine
    (folder / "training_record.json").unlink()
    (folder / "notes.json").write_text("{}")
    (folder / "evaluation.json").symlink_to(folder / "notes.json")
    push_drafter(str(folder), "org/ok", endpoint=hub.endpoint, token="t", base_model="org/tiny-llama")
    assert len(hub.commits) == commits + 1


def test_a_card_for_a_training_run_without_base_model_names_the_configs_target(tmp_path):
    """A `train` output has a training record; without --base-model the card takes the config's target name."""
    target = make_target("llama")
    config = Eagle3Config.for_target(target.config)
    config.target_model_name_or_path = "org/tiny-llama"
    folder = tmp_path / "run"
    AutoModelForDrafting.from_config(config).save_pretrained(folder)
    (folder / "training_record.json").write_text(json.dumps({"target": {"name_or_path": "org/tiny-llama"}}))
    assert drafter_card(str(folder)).data.base_model == "org/tiny-llama"
    with pytest.raises(ValueError, match="trained for 'org/tiny-llama'"):
        drafter_card(str(folder), base_model="org/other-model")


@pytest.mark.parametrize("repo_id", ["org/../x", "org/a--b", "../x", "a/b/c", "org/x."])
def test_push_to_an_invalid_repo_id_says_it_is_one_not_a_missing_folder(tmp_path, hub, repo_id, capsys):
    from hf_specdec.commands import main

    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    commits = len(hub.commits)
    capsys.readouterr()  # the save's progress bar
    code = main(["push", str(folder), repo_id, "--endpoint", hub.endpoint, "--token", "t", "--base-model", "org/t"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{repo_id!r} is not a Hub repository id to push to" in err[0] and "no such folder" not in err[0]
    assert len(hub.commits) == commits


def test_a_card_from_an_fp32_and_a_bf16_bench_shows_both_with_their_dtype(tmp_path):
    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    fp32 = _bench_report()
    bf16 = json.loads(json.dumps(fp32))
    bf16.setdefault("config", {})["target_dtype"] = "bfloat16"
    fp32.setdefault("config", {})["target_dtype"] = "float32"
    for r in bf16["records"]:
        r["speedup"], r["identical"], r["identical_up_to_near_ties"] = 1.5, False, True
    plain_card = str(drafter_card(str(folder), bench=[fp32, bf16], base_model="org/tiny-llama"))
    assert "on test CPU (cpu, torch " in plain_card and "linear layers" not in plain_card  # reports without kernels
    fp32["config"].update(linear_kernels="packed (7 layers)", draft_kernels="int8, packed (3 layers)")
    bf16["config"].update(linear_kernels="stock", draft_kernels="int8, packed (3 layers)")
    card = str(drafter_card(str(folder), bench=[fp32, bf16], base_model="org/tiny-llama"))
    rows = [line for line in card.splitlines() if line.startswith("| ") and "×" in line]
    assert any("| float32 |" in line for line in rows) and any("| bfloat16 |" in line for line in rows)
    assert any("1.50×" in line and "up to classified near-ties" in line for line in rows)
    measured = " ".join(card.split("Measured with")[1].split("\n\n")[0].split())  # the sentence, on one line
    assert (
        "(the target's linear layers packed (7 layers), the drafters' int8, packed (3 layers) / the target's linear "
        "layers stock, the drafters' int8, packed (3 layers))" in measured
    )
    assert "reports:" not in measured  # reports passed as dicts: no file to name


def test_a_card_names_the_bench_reports_its_results_come_from(tmp_path):
    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    paths = []
    for name in ("run-fp32.json", "run-t07.json"):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(_bench_report()), encoding="utf-8")
    card = str(drafter_card(str(folder), bench=[str(p) for p in paths], base_model="org/tiny-llama"))
    measured = " ".join(card.split("Measured with")[1].split("\n\n")[0].split())
    assert "(reports: `run-fp32.json`, `run-t07.json`)" in measured


def test_a_card_whose_drafter_does_not_pay_says_why(tmp_path):
    """No row faster than plain decoding: the card's limitations give the drafter's τ against what its pass costs
    (from the row that drafted most) and how often the adaptive length fell back to plain steps."""
    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    row = {"kind": "drafter", "category": "all", "temperature": 0.0, "batch_size": 1, "identical": True}
    adaptive = dict(
        row,
        method="eagle3:d K=5",
        mean_accepted_length=1.04,
        speedup=0.97,
        verdict="within noise",
        predicted_speedup=0.95,
        verify_cost_ratio=1.0,
        draft_cost_ratio=0.09,
        plain_step_share=0.96,
    )
    fixed = dict(row, method="eagle3:d K=5 fixed", mean_accepted_length=1.4, speedup=0.87, verdict="too few repeats")
    fixed.update(predicted_speedup=0.96, verify_cost_ratio=1.35, draft_cost_ratio=0.03, plain_step_share=0.0)
    card = str(drafter_card(str(folder), bench={"records": [adaptive, fixed]}, base_model="org/tiny-llama"))
    limits = " ".join(card.split("## Limitations")[1].split())
    assert (
        "It does not pay where measured: drafting as in `eagle3:d K=5 fixed` it commits τ 1.40 tokens per target "
        "pass, and a pass costs 1.46 plain steps (the target's pass over the draft, 1.35, and drafting at c 0.03 per "
        "draft token), so τ and pass cost predict 0.96× of plain decoding; the adaptive length runs 96% of its "
        "passes as plain steps." in limits
    )
    from hf_specdec.cards import _why_it_does_not_pay

    bare = {k: v for k, v in fixed.items() if k not in ("verify_cost_ratio", "draft_cost_ratio")}
    line = _why_it_does_not_pay([dict(bare, machine="m", dtype="float32")])
    assert "a pass costs 1.46 plain steps, so τ and pass cost predict 0.96×" in line and "nan" not in line
    faster = dict(adaptive, verdict="faster", speedup=1.2)
    card = str(drafter_card(str(folder), bench={"records": [faster, fixed]}, base_model="org/tiny-llama"))
    assert "does not pay" not in card


def test_a_card_from_benches_on_two_machines_says_which_row_ran_where():
    from hf_specdec.cards import _own_rows, _results_table

    row = {"method": "eagle3:d K=5", "kind": "drafter", "category": "all", "temperature": 0.0, "batch_size": 1,
           "mean_accepted_length": 1.5, "speedup": 1.2, "identical": True}  # fmt: skip
    intel = {"hardware": {"device_name": "Intel Xeon", "device": "cpu", "torch": "2.13.0"}, "records": [row]}
    amd = {"hardware": {"device_name": "AMD EPYC", "device": "cpu", "torch": "2.13.0"}, "records": [row]}
    table, _ = _results_table(_own_rows([intel, amd]))
    header, _, first, second = table.splitlines()
    assert header.endswith("| hardware |")
    assert first.endswith("| Intel Xeon (cpu, torch 2.13.0) |") and second.endswith("| AMD EPYC (cpu, torch 2.13.0) |")
    one, _ = _results_table(_own_rows([intel, intel]))
    assert "hardware" not in one and "Intel" not in one  # one machine: the card's sentence names it


def test_a_card_says_when_its_drafter_trained_on_a_prefix_of_its_data():
    """A run with ``max_train_examples`` (a data-scaling or same-budget run) records the whole file; its card says how
    much of it the drafter saw, and a run on all of its data says nothing more."""
    from hf_specdec.cards import _training_rows

    data = {"source": "train.jsonl", "examples": 7548, "tokens": 2006443, "max_train_examples": 2513}
    rows = dict(_training_rows({"data": data, "train_examples": 2513, "steps": 315}))
    assert rows["data"] == "train.jsonl: 7548 examples, 2006443 tokens; trained on the first 2513"
    rows = dict(_training_rows({"data": dict(data, max_train_examples=None), "train_examples": 7548}))
    assert rows["data"] == "train.jsonl: 7548 examples, 2006443 tokens"
