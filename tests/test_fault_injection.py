"""Fault injection for the long jobs: `hf-specdec regenerate`, `dump-features` and `train` are each killed with
SIGKILL at random points, three times each, and resumed. A kill point is drawn from a seeded RNG: after a random
amount of work made durable (JSONL lines, feature shards, checkpointed steps), plus a random delay into what follows
(so kills also land mid-line, mid-shard, mid-checkpoint; one landing after the job finished is fine too). The job is
then resumed. What they leave at the end equals what an uninterrupted run writes: the same JSONL bytes, the same feature
shards (every tensor), the same drafter weights, bit for bit.

The uninterrupted reference runs are in-process; the killed runs are separate processes running the CLI's `main`,
forked from a forkserver that has imported hf_specdec, torch and transformers once (a fresh `python -m hf_specdec`
spends ~4 s importing, which would take most kills and most of the time budget). All of them use one thread."""

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
from helpers import chat_workspace
from safetensors import safe_open
from safetensors.torch import load_file

from hf_specdec.commands import main as cli
from hf_specdec.training.offline import INDEX_NAME
from hf_specdec.training.trainer import find_latest_checkpoint

KILLS = 3
SEED = 20261130


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    target, tok, rng = chat_workspace(root, num_prompts=24)
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
                "--feature-dtype", "float32", "--max-length", "64", "--batch-size", "1",
                "--shard-tokens", "150"]  # fmt: skip
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


PRELOAD = ["torch", "transformers", "accelerate", "safetensors", "hf_specdec.commands", "hf_specdec.training.recipes",
           "hf_specdec.training.trainer", "hf_specdec.training.offline", "hf_specdec.training.regenerate",
           "transformers.models.llama.modeling_llama"]  # fmt: skip


def _cli_child(argv, log_path):
    """A job process: the CLI's `main`, with stdout/stderr into ``log_path``, one thread (as the reference)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    os._exit(int(cli(argv) or 0))


def start(ctx, root, job, out):
    log_path = out.parent / f"{job}.log"
    proc = ctx.Process(target=_cli_child, args=([*job_args(root, job, out), *resume_args(job, out)], str(log_path)))
    proc.start()
    return proc, log_path


def run_killed(ctx, root, job, out, target_units, delay, log):
    """Runs `job` in its own process; once its output holds ``target_units`` units of work (JSONL lines, shards,
    training steps checkpointed), waits ``delay`` seconds and SIGKILLs it. Returns the exit code."""
    proc, log_path = start(ctx, root, job, out)
    deadline = time.monotonic() + 60  # a job that hangs is killed here and shows up as a mismatch or failure below
    while proc.exitcode is None and time.monotonic() < deadline and units(job, out) < target_units:
        time.sleep(0.002)
    time.sleep(delay)
    if proc.exitcode is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    log.append((target_units, round(delay, 3), proc.exitcode, units(job, out)))
    assert proc.exitcode in (0, -signal.SIGKILL), f"{job} failed ({proc.exitcode}):\n{log_path.read_text()[-3000:]}"
    return proc.exitcode


def units(job, out) -> int:
    """Work a job has made durable: JSONL lines, completed shards, or the step of its newest checkpoint."""
    if job == "regenerate":
        return out.read_bytes().count(b"\n") if out.exists() else 0
    if job == "dump-features":
        try:
            return len(json.loads((out / INDEX_NAME).read_text())["shards"])
        except (OSError, ValueError):
            return 0
    names = os.listdir(out) if out.is_dir() else []
    return max([int(n.split("-")[1]) for n in names if n.startswith("checkpoint-") and n[11:].isdigit()], default=0)


def finish(ctx, root, job, out):
    proc, log_path = start(ctx, root, job, out)
    proc.join(120)
    if proc.exitcode is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
    assert proc.exitcode == 0, f"{job} failed ({proc.exitcode}):\n{log_path.read_text()[-3000:]}"


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

    # Each job is killed and resumed in its own folder, with its own seeded RNG, one job at a time (so the work runs
    # as fast as in the reference run, and the kill delays spread over all of it).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    log = []
    for job in jobs:
        rng = random.Random(f"{SEED}-{job}")
        out = tmp_path / "faulted" / job / ("out.jsonl" if job == "regenerate" else "out")
        out.parent.mkdir(parents=True)
        # Kill points: after a random amount of durable work (a sorted random sample of the job's units, the
        # first possibly 0: before any), plus a random delay (up to a fifth of the job's time) into what follows.
        total = units(job, refs[job])
        targets = sorted(rng.sample(range(0, total - 1), KILLS))
        for target in targets:
            run_killed(ctx, root, job, out, target, rng.uniform(0.0, work_s[job] / 5), log)
        finish(ctx, root, job, out)
        print(f"{job}: kills (after units, delay s, exit code, units left):", log[-KILLS:])
        assert_same_output(job, refs[job], out)
    assert sum(entry[2] == -signal.SIGKILL for entry in log) >= 1  # at least some kills landed mid-job


def test_dump_features_resume_removes_leftovers_of_a_killed_write(workspace, tmp_path):
    out = tmp_path / "f"
    assert cli(job_args(workspace, "dump-features", out)) == 0
    names = sorted(p.name for p in out.iterdir())
    (out / f"{INDEX_NAME}.tmp-999999").write_text("{")  # a kill while the index was being replaced
    (out / ".features-00001.safetensors.tmp-999999").write_bytes(b"\0" * 10)  # ... or a shard written
    assert cli(job_args(workspace, "dump-features", out)) == 0
    assert sorted(p.name for p in out.iterdir()) == names
