"""Shared-embedding assistants (hf_specdec.assistant): the peer that transformers' assisted generation runs in
``hf-specdec bench`` on SmolLM2, stored without the target's embedding and rebuilt around it."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_specdec.assistant import (
    assistant_from_target,
    is_shared_embedding_assistant,
    load_shared_embedding_assistant,
    save_shared_embedding_assistant,
)
from hf_specdec.testing import ragged_batch, tiny_target


def _target(**kw):
    return tiny_target("llama", tie_word_embeddings=True, **kw)


def _assistant(target, tmp_path, layers=(0, 2)):
    model = assistant_from_target(target, len(layers), list(layers))
    with torch.no_grad():  # make it differ from the target's layers, as training would
        for p in model.model.layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = str(tmp_path / "assistant")
    save_shared_embedding_assistant(model, folder, {"embeddings_from": "tiny"}, dtype=torch.float32)
    return model, folder


def test_round_trip_shares_the_embedding_and_reproduces_logits(tmp_path):
    target = _target()
    model, folder = _assistant(target, tmp_path)
    assert is_shared_embedding_assistant(folder)
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert not any("embed_tokens" in k or k.startswith("lm_head") for k in stored)
    loaded = load_shared_embedding_assistant(folder, target)
    assert loaded.get_input_embeddings() is target.get_input_embeddings()
    assert loaded.get_output_embeddings().weight is target.get_input_embeddings().weight
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    # copied layers: the init picks the named target layers
    fresh = assistant_from_target(target, 1, [3])
    for a, b in zip(fresh.model.layers[0].parameters(), target.model.layers[3].parameters()):
        assert torch.equal(a, b)
    assert not fresh.get_input_embeddings().weight.requires_grad


def test_assisted_generation_with_it_is_plain_greedy(tmp_path):
    target = _target()
    _, folder = _assistant(target, tmp_path)
    assistant = load_shared_embedding_assistant(folder, target)
    ids = torch.tensor([[7, 9, 11, 13, 17, 19]])
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=assistant, **kw)
    assert torch.equal(plain, assisted)


def test_refuses_a_target_with_another_embedding_and_a_corrupt_folder(tmp_path):
    target = _target()
    _, folder = _assistant(target, tmp_path)
    with pytest.raises(ValueError, match="train an assistant"):
        load_shared_embedding_assistant(folder, _target(vocab=target.config.vocab_size + 8))
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state.pop(sorted(state)[0])
    save_file(state, path)
    with pytest.raises(ValueError, match="corrupt"):
        load_shared_embedding_assistant(folder, target)
    with open(os.path.join(folder, "assistant_info.json")) as fh:
        assert json.load(fh)["embeddings_from"] == "tiny"


def test_save_refuses_untied_models_and_wrong_layer_lists(tmp_path):
    untied = tiny_target("llama", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        save_shared_embedding_assistant(untied, str(tmp_path / "x"), {})
    with pytest.raises(ValueError, match="init_layers"):
        assistant_from_target(_target(), 2, [0])
