"""Tiny targets and test drafters shared by the test suite (no network: everything is built from configs)."""

from __future__ import annotations

import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_specdec.testing import make_oracle_drafter

VOCAB = 96
EOS = 5
PAD = 0
BOS = 1

_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 8}),
}
ARCHS = tuple(_ARCHS)


def make_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4, sharpen: float = 1.0, **kw):
    """A tiny random causal LM of the given architecture (float32, eval mode)."""
    config_cls, model_cls, extra = _ARCHS[arch]
    params = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=BOS,
    )
    params.update(extra)
    params.update(kw)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**params)).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(sharpen)
    return model


def ragged_batch(batch: int, length: int = 9, seed: int = 0, vocab: int = VOCAB):
    """Left-padded prompts of different lengths (row ``i`` has ``2 * i`` pads), tokens avoiding EOS/PAD/BOS."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        pads = min(2 * i, length - 2)
        mask[i, :pads] = 0
        ids[i, :pads] = PAD
    return ids, mask


def make_oracle(target, continuation, corruption=0.0, seed=0, num_draft_tokens=4):
    return make_oracle_drafter(target, continuation, corruption, seed, num_draft_tokens)
