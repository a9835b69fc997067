"""Every subcommand that reads a file or folder, given one that is missing, empty, not UTF-8 or holds the wrong keys,
exits with status 2 and one line that names that input; with ``--debug`` the same mistake raises its traceback."""

from __future__ import annotations

import itertools

import pytest
from helpers import chat_workspace

from hf_specdec.commands import main

KINDS = ["missing", "empty", "not-utf8", "wrong-keys"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from hf_specdec.training.recipes import make_drafter

    root = tmp_path_factory.mktemp("inputs")
    target, _, _ = chat_workspace(root)
    make_drafter(target, "eagle3").save_pretrained(root / "drafter")
    return root


def bad_file(root, kind, name):
    """A JSONL data or prompt file of one bad kind."""
    path = root / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {"missing": None, "empty": b"", "not-utf8": b'{"prompt": "caf\xe9"}\n', "wrong-keys": b'{"foo": 1}\n'}
    if content[kind] is not None:
        path.write_bytes(content[kind])
    return path


def bad_folder(root, kind, name, file="config.json", wrong=b'{"foo": 1}'):
    """A model or feature folder of one bad kind: its ``file`` absent, not UTF-8, or with keys nothing expects."""
    path = root / kind / name
    if kind == "missing":
        return path
    path.mkdir(parents=True, exist_ok=True)
    if kind != "empty":
        (path / file).write_bytes(b'{"model_type": "caf\xe9"}' if kind == "not-utf8" else wrong)
    return path


# (command, which input, argv builder taking (root, the bad input, a fresh output name))
T, D = "{target}", "{drafter}"
SLOTS = {
    ("train", "--data"): (bad_file, "t.jsonl", ["train", "--target", T, "--data", "{bad}", "--output-dir", "{out}", "--max-steps", "1"]),
    ("regenerate", "--data"): (bad_file, "r.jsonl", ["regenerate", "--target", T, "--data", "{bad}", "--output", "{out}"]),
    ("dump-features", "--data"): (bad_file, "d.jsonl", ["dump-features", "--target", T, "--data", "{bad}", "--output-dir", "{out}"]),
    ("distill", "--data"): (bad_file, "s.jsonl", ["distill", "--target", T, "--data", "{bad}", "--output-dir", "{out}", "--num-shards", "1"]),
    ("bench", "--prompts"): (bad_file, "p.jsonl", ["bench", "--target", T, "--drafter", D, "--prompts", "{bad}", "--no-peers"]),
    ("bench", "--drafter"): (bad_folder, "bd", ["bench", "--target", T, "--drafter", "{bad}", "--no-peers"]),
    ("bench", "--target"): (bad_folder, "bt", ["bench", "--target", "{bad}", "--drafter", D, "--no-peers"]),
    ("convert", "SRC"): (bad_folder, "cv", ["convert", "{bad}", "{out}"]),
    ("push", "FOLDER"): (bad_folder, "pf", ["push", "{bad}", "org/x", "--endpoint", "http://127.0.0.1:9", "--base-model", "o/t"]),
    ("train", "--features"): (bad_folder, "ft", ["train", "--target", T, "--features", "{bad}", "--output-dir", "{out}"]),
}  # fmt: skip
WRONG_TARGET = b'{"model_type": "llama", "hidden_size": "wide"}'


def argv_for(root, slot, kind):
    maker, name, template = SLOTS[slot]
    extra = {"file": "index.json"} if slot == ("train", "--features") else {}
    if slot == ("bench", "--target"):
        extra = {"wrong": WRONG_TARGET}
    bad = maker(root, kind, f"{slot[0]}-{name}", **extra)
    values = {"target": root / "target", "drafter": root / "drafter", "bad": bad, "out": root / "out" / kind / name}
    return [part.format(**{k: str(v) for k, v in values.items()}) for part in template], str(bad)


CASES = list(itertools.product(SLOTS, KINDS))


@pytest.mark.parametrize("slot,kind", CASES, ids=[f"{c}-{o.lstrip('-').lower()}-{k}" for (c, o), k in CASES])
def test_a_bad_input_exits_2_with_one_line_naming_it(workspace, slot, kind, capsys):
    argv, bad = argv_for(workspace, slot, kind)
    capsys.readouterr()
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]  # bars
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"hf-specdec {slot[0]}: error: ") and bad in err[0], err[0]
    assert "Traceback" not in err[0]


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_instead(workspace, where):
    argv, _ = argv_for(workspace, ("train", "--data"), "wrong-keys")
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(ValueError, match="unknown record kind"):
        main(argv)
