"""Small assistant models that share their target's token embeddings (for transformers' assisted generation).

A peer for ``hf-specdec bench`` on SmolLM2-135M-Instruct: transformers' assisted generation needs an assistant with
the target's tokenizer, and SmolLM2's 49,152 x 576 embedding (tied to its LM head) would make up 28 of the 35 M
parameters of any small model on that vocabulary. The shipped assistant therefore stores only its own decoder layers
and final norm; :func:`load_shared_embedding_assistant` builds a stock ``LlamaForCausalLM`` (or any causal LM class
of its config) around the target's embedding module, shared and tied. The folder holds:

* ``config.json``: the assistant's transformers config (``tie_word_embeddings`` true, the target's vocabulary and
  hidden size);
* ``model.safetensors``: every weight except the embedding and the LM head;
* ``assistant_info.json``: ``{"embeddings_from": <target name or path>, "vocab_size": ..., "hidden_size": ...}`` and
  how it was trained.

``scripts/train_smollm2_assistant.py`` trains it with hf_specdec's self-distillation data.
"""

from __future__ import annotations

import json
import os

import torch

EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
INFO_FILE = "assistant_info.json"


def assistant_from_target(target, num_layers: int, init_layers: list[int] | None = None):
    """A ``num_layers``-layer copy of ``target``'s architecture: decoder layers copied from ``init_layers`` (default
    the first ones), final norm copied, embedding shared with ``target`` (and tied LM head) and frozen: training the
    result trains its own layers and norm only. For decoder-only models laid out as ``model.layers`` / ``model.norm``
    (Llama, Qwen2, Mistral, Gemma, ...)."""
    import copy

    inner = getattr(target, "model", None)
    if not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ValueError(
            f"{type(target).__name__} is not laid out as model.layers / model.norm; build the assistant "
            "with transformers directly"
        )

    from transformers import AutoModelForCausalLM

    init_layers = list(init_layers or range(num_layers))
    if len(init_layers) != num_layers:
        raise ValueError(f"init_layers names {len(init_layers)} layers, num_layers is {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    config.tie_word_embeddings = True
    if getattr(config, "layer_types", None):
        config.layer_types = [target.config.layer_types[i] for i in init_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    for dst, src in enumerate(init_layers):
        model.model.layers[dst].load_state_dict(target.model.layers[src].state_dict())
    model.model.norm.load_state_dict(target.model.norm.state_dict())
    model.set_input_embeddings(target.get_input_embeddings())
    model.tie_weights()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def save_shared_embedding_assistant(model, folder: str, info: dict, dtype: torch.dtype = torch.bfloat16) -> None:
    """Writes ``model`` (a causal LM with tied embeddings) without its embedding and LM head: config, weights in
    ``dtype`` and ``assistant_info.json``."""
    from safetensors.torch import save_file

    if not getattr(model.config, "tie_word_embeddings", False):
        raise ValueError("a shared-embedding assistant needs tie_word_embeddings=True in its config")
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    state = {
        k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items() if k not in EMBEDDING_KEYS
    }
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    emb = model.get_input_embeddings().weight
    info = {**info, "vocab_size": int(emb.shape[0]), "hidden_size": int(emb.shape[1])}
    with open(os.path.join(folder, INFO_FILE), "w", encoding="utf-8") as fh:
        json.dump(info, fh, indent=1)


def is_shared_embedding_assistant(folder: str | None) -> bool:
    return bool(folder) and os.path.isfile(os.path.join(folder, INFO_FILE))


def load_shared_embedding_assistant(folder: str, target, dtype: torch.dtype | None = None):
    """The assistant in ``folder`` built around ``target``'s input embedding (shared, not copied) and tied to it.

    Raises ``ValueError`` when the target's embedding does not have the shape the assistant was trained with, or when
    the weight file lacks or adds weights (a corrupt or foreign folder)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(folder, INFO_FILE), encoding="utf-8") as fh:
        info = json.load(fh)
    emb = target.get_input_embeddings()
    shape = (int(info["vocab_size"]), int(info["hidden_size"]))
    if tuple(emb.weight.shape) != shape:
        raise ValueError(
            f"the assistant in {folder} shares the embedding of {info.get('embeddings_from')!r} (vocabulary x hidden "
            f"{shape[0]} x {shape[1]}), but this target's embedding is {tuple(emb.weight.shape)}; load it with that "
            "target, or train an assistant for this one (scripts/train_smollm2_assistant.py)."
        )
    config = AutoConfig.from_pretrained(folder)
    dtype = dtype or emb.weight.dtype
    # the small random embedding the config implies is built and then replaced by the target's (a second's work)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = load_file(os.path.join(folder, "model.safetensors"))
    expected = {k for k in model.state_dict() if k not in EMBEDDING_KEYS}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{folder}/model.safetensors does not match its config.json (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); the folder is corrupt: retrain it (scripts/train_smollm2_assistant.py)."
        )
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    model.set_input_embeddings(emb)
    model.tie_weights()
    if model.get_output_embeddings().weight is not emb.weight:
        raise ValueError(f"could not tie the assistant's LM head to the target's embedding ({folder})")
    model.to(emb.weight.device)
    model.config._name_or_path = folder
    model.name_or_path = folder
    return model.eval()
