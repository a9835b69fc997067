"""CLI mistakes print one line saying what to do and exit with status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_specdec.commands import main


@pytest.mark.parametrize(
    "argv,match",
    [
        (["demo", "--k", "0"], "--k must be a positive integer, got 0"),
        (["bench", "--max-new-tokens", "-3"], "--max-new-tokens must be a positive integer"),
        (["bench", "--drafter", "/no/such/drafter", "--no-peers"], "/no/such/drafter"),
        (["train", "--data", "/no/such/data.jsonl", "--target", "/no/such/target", "--out", "/tmp/x"], "no/such"),
        (["bench", "--verifier", "nonsense"], "unknown verifier 'nonsense'"),
        (["bench", "--dtype", "float8", "--no-peers"], "--dtype must be one of auto, float32, bfloat16, float16"),
        (["selfcheck", "--arch", "bogus"], "--arch 'bogus' is not a tiny architecture selfcheck builds"),
        (["selfcheck", "--batch", "0"], "--batch must be a positive integer, got 0"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, match, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors exit 2 as well
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err and match in err[-1], err
    assert not any("Traceback" in line for line in err)


def test_the_console_script_prints_no_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "hf_specdec", "bench", "--drafter", str(tmp_path / "missing"), "--no-peers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    lines = [line for line in run.stderr.strip().splitlines() if "Loading weights" not in line]  # progress bars
    assert len(lines) == 1 and lines[0].startswith("hf-specdec bench: error:") and "Traceback" not in run.stderr
    assert "check the path" in lines[0]


@pytest.fixture
def drafter_folder(tmp_path):
    from helpers import make_target

    from hf_specdec import AutoModelForDrafting, Eagle3Config

    target = make_target("llama")
    folder = tmp_path / "drafter"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    return folder


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", ["itself", "itself-by-another-path", "a-file", "another-model"])
def test_convert_never_writes_over_its_source_a_file_or_another_model(tmp_path, drafter_folder, case, capsys):
    out = {
        "itself": drafter_folder,
        "itself-by-another-path": drafter_folder / ".." / drafter_folder.name,
        "a-file": tmp_path / "afile",
        "another-model": tmp_path / "old-run",
    }[case]
    if case == "a-file":
        out.write_text("notes")
    if case == "another-model":
        out.mkdir()
        (out / "tokenizer.json").write_text("{}")
    before, before_out = _files(drafter_folder), (out.read_bytes() if out.is_file() else None)
    code = main(["convert", str(drafter_folder), str(out), "--to", "eagle3-vllm"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert {"itself": "is SRC itself", "itself-by-another-path": "is SRC itself", "a-file": "is a file",
            "another-model": "already holds files (tokenizer.json)"}[case] in err  # fmt: skip
    assert _files(drafter_folder) == before  # the source is untouched
    if case == "a-file":
        assert out.read_bytes() == before_out
    if case == "another-model":
        assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]


def test_convert_into_a_new_or_empty_folder_works(tmp_path, drafter_folder):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        assert main(["convert", str(drafter_folder), str(out), "--to", "eagle3-vllm"]) == 0
        assert (out / "config.json").is_file()


def test_convert_from_a_layout_the_checkpoint_is_not_in_says_which_it_looks_like(tmp_path, drafter_folder, capsys):
    foreign = tmp_path / "vllm"
    assert main(["convert", str(drafter_folder), str(foreign), "--to", "eagle3-vllm"]) == 0
    out = tmp_path / "out"
    assert main(["convert", str(foreign), str(out), "--from", "medusa-vllm"]) == 2
    err = capsys.readouterr().err
    assert "is not in the 'medusa-vllm' layout" in err and "looks like the 'eagle3-vllm' layout" in err, err
    assert "Traceback" not in err and not out.exists()


def test_a_mistyped_local_path_is_said_so_at_once_not_after_hub_retries(tmp_path, monkeypatch, capsys):
    from hf_specdec import AutoModelForDrafting

    (tmp_path / "runs" / "my-drafter").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # were the Hub asked, this would fail slowly
    with pytest.raises(FileNotFoundError, match=r"No folder 'runs/my-drafer' exists here .*runs/ holds: my-drafter"):
        AutoModelForDrafting.from_pretrained("runs/my-drafer")
    assert main(["convert", "runs/my-drafer", "out", "--to", "eagle3-vllm"]) == 2
    assert "runs/ holds: my-drafter" in capsys.readouterr().err


def test_a_repo_id_the_hub_lacks_says_it_was_taken_for_one(hub):
    from hf_specdec import AutoModelForDrafting

    with pytest.raises(OSError, match=r"'nobody/nothing' is no local folder, so it was taken for a Hub repository"):
        AutoModelForDrafting.from_pretrained("nobody/nothing")


@pytest.mark.parametrize(
    "name,hint", [("eagle4", "Did you mean 'eagle3'"), ("medusa-3", "'medusa'"), ("zzz", "Families: ")]
)
def test_a_mistyped_family_name_is_said_so_with_the_nearest_names_not_sent_to_the_hub(name, hint, monkeypatch):
    import huggingface_hub
    from helpers import make_target

    from hf_specdec.training.recipes import make_drafter

    def no_hub(*a, **k):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(
        ValueError, match=rf"'{name}' is not a drafter family and no folder '{name}' exists here"
    ) as err:
        make_drafter(make_target("llama"), name)
    assert hint in str(err.value) and "namespace/name" in str(err.value)
