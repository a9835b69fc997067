"""Tiny targets and test drafters shared by the test suite (no network: everything is built from configs)."""

from __future__ import annotations

from hf_specdec.testing import ARCHS, BOS, EOS, PAD, VOCAB, make_oracle_drafter, ragged_batch, tiny_target

make_target = tiny_target
__all__ = ["ARCHS", "BOS", "EOS", "PAD", "VOCAB", "make_target", "ragged_batch", "make_oracle"]


def make_oracle(target, continuation, corruption=0.0, seed=0, num_draft_tokens=4):
    return make_oracle_drafter(target, continuation, corruption, seed, num_draft_tokens)


def char_tokenizer():
    """A character-level fast tokenizer over the 96-token test vocabulary (for stop-string tests)."""
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<pad>", "<s>", "<unk>", "</s>", "<x>", "<eos>"] + list(string.ascii_letters + string.digits)
    chars += list(" .,;:!?()[]{}+-*/=_")
    vocab = {c: i for i, c in enumerate(chars[:VOCAB])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<s>", unk_token="<unk>"
    )
