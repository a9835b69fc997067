"""Fault injection for the long jobs: `hf-specdec regenerate`, `dump-features` and `train` are each killed with
SIGKILL at random points (delays from a seeded RNG, counted from when the job starts its work), several times, and
resumed. What they leave at the end equals what an uninterrupted run writes: the same JSONL bytes, the same feature
shards (every tensor), the same drafter weights, bit for bit.

The uninterrupted reference runs are in-process; the killed runs are subprocesses, all with one thread."""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers import chat_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file

from hf_specdec.cli import main as cli
from hf_specdec.testing import tiny_target
from hf_specdec.training.offline import INDEX_NAME
from hf_specdec.training.trainer import find_latest_checkpoint

KILLS = 3
SEED = 20261130
# The text each job writes to stderr when its work starts (its progress bar): the kill delay counts from there.
MARKERS = {"regenerate": "regenerate", "dump-features": "target features", "train": "training drafter"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    tok = chat_tokenizer()
    target = tiny_target("llama", seed=0, vocab=len(tok), sharpen=20.0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as fh:
        for i in range(24):
            words = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(3))
            fh.write(json.dumps({"id": i, "messages": [{"role": "user", "content": words}]}) + "\n")
    with open(root / "data.jsonl", "w") as fh:
        for _ in range(32):
            q = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(2))
            a = " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(rng.randint(2, 6)))
            fh.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
            fh.write("\n")
    return root


def job_args(root, job, out):
    t = str(root / "target")
    if job == "regenerate":
        return ["regenerate", "--target", t, "--data", str(root / "prompts.jsonl"), "--output", str(out),
                "--max-new-tokens", "24", "--batch-size", "2", "--temperature", "0.8", "--seed", "3"]  # fmt: skip
    if job == "dump-features":
        return ["dump-features", "--target", t, "--data", str(root / "data.jsonl"), "--output-dir", str(out),
                "--feature-dtype", "float32", "--max-length", "64", "--batch-size", "2"]  # fmt: skip
    return ["train", "--target", t, "--data", str(root / "data.jsonl"), "--output-dir", str(out),
            "--max-steps", "16", "--batch-size", "2", "--eval-fraction", "0.125", "--save-steps", "2",
            "--eval-steps", "4", "--report-to", "none", "--lr", "3e-3", "--num-draft-tokens", "3",
            "--max-length", "64", "--seed", "5"]  # fmt: skip


def resume_args(job, out):
    """How each job continues: regenerate and dump-features resume by default; train needs --resume once it has a
    checkpoint (before its first checkpoint, there is nothing to resume and the job starts over)."""
    if job == "train" and os.path.isdir(out) and find_latest_checkpoint(str(out)) is not None:
        return ["--resume"]
    return []


def run_killed(root, job, out, rng, work_s, log):
    """Runs `job` in a subprocess; kills it `delay` seconds after its progress bar appears. Returns the exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    stderr_path = out.parent / f"{job}.stderr"
    argv = [sys.executable, "-m", "hf_specdec.cli", *job_args(root, job, out), *resume_args(job, out)]
    delay = rng.uniform(0.0, 1.2 * work_s)
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if MARKERS[job] in stderr_path.read_text(errors="replace"):
            break
        time.sleep(0.01)
    time.sleep(delay)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    rc = proc.wait(timeout=120)
    log.append((job, round(delay, 3), rc))
    assert rc in (0, -signal.SIGKILL), f"{job} failed (rc {rc}):\n{stderr_path.read_text()[-3000:]}"
    return rc


def finish(root, job, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "hf_specdec.cli", *job_args(root, job, out), *resume_args(job, out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def shard_tensors(folder):
    index = json.loads((folder / INDEX_NAME).read_text())
    tensors = {}
    for shard in index["shards"]:
        with safe_open(str(folder / shard["file"]), framework="pt") as f:
            tensors.update({(shard["file"], k): f.get_tensor(k) for k in f.keys()})
    return index, tensors


def assert_same_output(job, ref, out):
    if job == "regenerate":
        assert out.read_bytes() == ref.read_bytes()
    elif job == "dump-features":
        (ri, rt), (oi, ot) = shard_tensors(ref), shard_tensors(out)
        assert oi == ri and oi["complete"]
        assert rt.keys() == ot.keys()
        for k in rt:
            assert rt[k].dtype == ot[k].dtype and torch.equal(rt[k], ot[k]), k
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())  # no leftovers
    else:
        a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        ra = json.loads((ref / "training_record.json").read_text())
        rb = json.loads((out / "training_record.json").read_text())
        assert rb["steps"] == ra["steps"] == 16
        assert rb["final_eval"] == ra["final_eval"] and rb["eval_history"] == ra["eval_history"]


def test_long_jobs_killed_at_random_points_and_resumed_give_the_uninterrupted_outputs(workspace, tmp_path):
    root = workspace
    jobs = ["regenerate", "dump-features", "train"]
    refs, work_s = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same as the subprocesses
    try:
        for job in jobs:
            refs[job] = tmp_path / "ref" / job / ("out.jsonl" if job == "regenerate" else "out")
            refs[job].parent.mkdir(parents=True)
            t0 = time.perf_counter()
            assert cli(job_args(root, job, refs[job])) == 0
            work_s[job] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)

    # The three jobs are killed and resumed concurrently, each in its own folder, with its own seeded RNG.
    log, errors = [], []

    def chain(job):
        try:
            rng = random.Random(f"{SEED}-{job}")
            out = tmp_path / "faulted" / job / ("out.jsonl" if job == "regenerate" else "out")
            out.parent.mkdir(parents=True)
            for _ in range(KILLS):
                run_killed(root, job, out, rng, work_s[job], log)
            finish(root, job, out)
            assert_same_output(job, refs[job], out)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((job, e))

    workers = [threading.Thread(target=chain, args=(job,)) for job in jobs]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print("kills (job, delay after start of work in s, exit code):", log)
    if errors:
        job, error = errors[0]
        raise AssertionError(f"{job}: {error!r}") from error
    assert sum(rc == -signal.SIGKILL for _, _, rc in log) >= 1  # at least some kills landed mid-job


def test_dump_features_resume_removes_leftovers_of_a_killed_write(workspace, tmp_path):
    out = tmp_path / "f"
    assert cli(job_args(workspace, "dump-features", out)) == 0
    names = sorted(p.name for p in out.iterdir())
    (out / f"{INDEX_NAME}.tmp-999999").write_text("{")  # a kill while the index was being replaced
    (out / ".features-00001.safetensors.tmp-999999").write_bytes(b"\0" * 10)  # ... or a shard written
    assert cli(job_args(workspace, "dump-features", out)) == 0
    assert sorted(p.name for p in out.iterdir()) == names
