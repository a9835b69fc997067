"""Tiny targets and test drafters shared by the test suite (no network: everything is built from configs)."""

from __future__ import annotations

import string

import torch

from hf_specdec.testing import ARCHS, BOS, EOS, PAD, VOCAB, make_oracle_drafter, ragged_batch, tiny_target

make_target = tiny_target
__all__ = ["ARCHS", "BOS", "EOS", "PAD", "VOCAB", "make_target", "ragged_batch", "make_oracle", "repetitive_prompt"]


def make_oracle(target, continuation, corruption=0.0, seed=0, num_draft_tokens=4):
    return make_oracle_drafter(target, continuation, corruption, seed, num_draft_tokens)


def repetitive_prompt(batch):
    """A ragged batch whose second half repeats text seen before (something for n-gram copies to find)."""
    ids, mask = ragged_batch(batch, length=24)
    ids[:, 12:] = ids[:, 6:18].clone()
    return ids, mask


def char_tokenizer():
    """A character-level fast tokenizer over the 96-token test vocabulary (for stop-string tests)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<s>", "<unk>", "</s>", "<x>", "<eos>"] + list(string.ascii_letters + string.digits)
    chars += list(" .,;:!?()[]{}+-*/=_") + ['"', "\n"]
    vocab = {c: i for i, c in enumerate(chars[:VOCAB])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<s>", unk_token="<unk>"
    )


# A character-level chat tokenizer (ChatML template); ids 0..5 line up with tiny_target's PAD 0 / EOS 5.
# Fixed draft length and no prompt-lookup merge: for tests of what the drafter itself proposes, pass by pass.
FIXED_K = dict(draft_length="fixed", lookup_tokens=0)

CHAT_SPECIALS = ["<pad>", "<s>", "<unk>", "<|im_start|>", "<|im_end|>", "</s>"]  # ids 0..5 (tiny_target: PAD 0, EOS 5)
CHAT_CHARS = string.ascii_letters + string.digits + " \n.,:!?'"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(chat_template=True, pad=True):
    import string  # noqa: F401  (kept local: only the chat tests need it)

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(CHAT_SPECIALS + list(CHAT_CHARS))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    kwargs = {"pad_token": "<pad>"} if pad else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        **kwargs,
    )
    if chat_template:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def chat_workspace(root, num_prompts: int = 12, seed: int = 0):
    """A folder with a tiny chat target (and its tokenizer) saved under ``target/`` and ``num_prompts`` chat prompts
    in ``prompts.jsonl``, for the command-line tests. Returns ``(target, tokenizer, rng)``; ``rng`` continues the
    seeded stream for callers that write more data."""
    import json
    import random

    tok = chat_tokenizer()
    target = tiny_target("llama", seed=0, vocab=len(tok), sharpen=20.0)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    rng = random.Random(seed)
    with open(root / "prompts.jsonl", "w") as fh:
        for i in range(num_prompts):
            words = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(3))
            fh.write(json.dumps({"id": i, "messages": [{"role": "user", "content": words}]}) + "\n")
    return target, tok, rng


def rms(x, w, eps):
    """RMSNorm by hand."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama_layer_by_hand(state, prefix, cfg, x, theta, input_norm=True):
    """A Llama decoder layer by hand over one sequence (batch 1, positions 0..T-1, causal, no cache), from a state dict
    (``prefix`` + ``self_attn.*``, ``mlp.*``, the norms); ``input_norm=False``: a layer without ``input_layernorm``
    (EAGLE-1's). An independent reference for the layouts' tests."""
    import torch.nn.functional as F

    t, h, kvh = x.shape[1], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // h
    y = rms(x, state[prefix + "input_layernorm.weight"], cfg["rms_norm_eps"]) if input_norm else x
    q = (y @ state[prefix + "self_attn.q_proj.weight"].T).view(1, t, h, hd).transpose(1, 2)
    k = (y @ state[prefix + "self_attn.k_proj.weight"].T).view(1, t, kvh, hd).transpose(1, 2)
    v = (y @ state[prefix + "self_attn.v_proj.weight"].T).view(1, t, kvh, hd).transpose(1, 2)
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(z):
        z1, z2 = z[..., : hd // 2], z[..., hd // 2 :]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, t, -1)
    x = x + att @ state[prefix + "self_attn.o_proj.weight"].T
    y = rms(x, state[prefix + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    mlp = F.silu(y @ state[prefix + "mlp.gate_proj.weight"].T) * (y @ state[prefix + "mlp.up_proj.weight"].T)
    return x + mlp @ state[prefix + "mlp.down_proj.weight"].T
