"""CLI mistakes print one line saying what to do and exit with status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hf_specdec.cli import main


@pytest.mark.parametrize(
    "argv,match",
    [
        (["demo", "--k", "0"], "--k must be a positive integer, got 0"),
        (["bench", "--max-new-tokens", "-3"], "--max-new-tokens must be a positive integer"),
        (["bench", "--drafter", "/no/such/drafter", "--no-peers"], "/no/such/drafter"),
        (["train", "--data", "/no/such/data.jsonl", "--target", "/no/such/target", "--out", "/tmp/x"], "no/such"),
        (["bench", "--verifier", "nonsense"], "unknown verifier 'nonsense'"),
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
        [sys.executable, "-m", "hf_specdec.cli", "bench", "--drafter", str(tmp_path / "missing"), "--no-peers"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    lines = [line for line in run.stderr.strip().splitlines() if "Loading weights" not in line]  # progress bars
    assert len(lines) == 1 and lines[0].startswith("hf-specdec bench: error:") and "Traceback" not in run.stderr
    assert "check the path" in lines[0]
