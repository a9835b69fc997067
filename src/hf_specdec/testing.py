"""Test and benchmark utilities: a replay ("oracle") drafter that proposes a known continuation.

It lets you check acceptance bookkeeping exactly (a perfect oracle reaches τ = K + 1) and measure the loop's own
overhead with a drafter that costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

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

from .configuration_utils import DrafterConfig
from .modeling_utils import DrafterPreTrainedModel
from .types import DraftInputs, Proposal

__all__ = [
    "OracleDrafterConfig",
    "OracleDrafter",
    "make_oracle_drafter",
    "tiny_target",
    "ragged_batch",
    "ARCHS",
]

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


def tiny_target(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 4, sharpen: float = 1.0, **kw):
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


class OracleDrafterConfig(DrafterConfig):
    """Config of :class:`OracleDrafter`: ``corruption`` is the probability of replacing a proposed token."""

    model_type = "oracle_drafter"
    corruption: float = 0.0
    seed: int = 0


@dataclass
class _OracleState:
    n_gen: torch.Tensor | None = None
    started: bool = False
    generator: torch.Generator | None = None


class OracleDrafter(DrafterPreTrainedModel):
    """Proposes tokens from ``continuation`` (the generated part of the target's own greedy output, one row per
    batch row), optionally corrupted with probability ``config.corruption``. Reads no target features."""

    config_class = OracleDrafterConfig
    requires_target_hidden_states = False

    def __init__(self, config: OracleDrafterConfig):
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))  # a PreTrainedModel needs one parameter
        self.continuation: torch.LongTensor | None = None
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size: int, max_length: int) -> _OracleState:
        if self.continuation is None or self.continuation.shape[0] != batch_size:
            raise ValueError("OracleDrafter.continuation must hold one row per batch row.")
        return _OracleState(generator=torch.Generator().manual_seed(self.config.seed))

    def observe(self, state: _OracleState, inputs: DraftInputs) -> None:
        added = inputs.valid.long().sum(1).cpu()
        # The prefill observation covers the prompt and commits one generated token; later ones commit `added`.
        state.n_gen = torch.ones_like(added) if not state.started else state.n_gen + added
        state.started = True

    def propose(self, state: _OracleState, num_tokens: int, select) -> Proposal:
        cont = self.continuation.cpu()
        idx = (state.n_gen[:, None] + torch.arange(num_tokens)[None]).clamp(max=cont.shape[1] - 1)
        tokens = cont.gather(1, idx)
        if self.config.corruption > 0:
            flip = torch.rand(tokens.shape, generator=state.generator) < self.config.corruption
            tokens = torch.where(flip, (tokens + 1) % self.config.target_vocab_size, tokens)
        return Proposal(tokens=tokens.to(self.device), kind="chain")


def make_oracle_drafter(target, continuation, corruption: float = 0.0, seed: int = 0, num_draft_tokens: int = 4):
    """An :class:`OracleDrafter` for ``target`` replaying ``continuation`` (``(batch, n)`` token ids)."""
    config = OracleDrafterConfig.for_target(
        target.config, corruption=corruption, seed=seed, num_draft_tokens=num_draft_tokens
    )
    drafter = OracleDrafter(config)
    drafter.continuation = continuation
    return drafter.eval()
