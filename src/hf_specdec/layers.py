"""Building blocks shared by drafter families: RMSNorm, rotary embeddings, a slot-masked KV cache, attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNorm", "RotaryEmbedding", "SlotKVCache", "GatedMLP", "apply_rotary", "slot_attention", "ACT2FN_SIMPLE"]

ACT2FN_SIMPLE = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm computed in float32 (as Llama's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Standard (Llama) rotary position embedding for explicit ``position_ids``."""

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.head_dim = head_dim
        self.theta = theta

    def reset_parameters(self) -> None:
        device = self.inv_freq.device
        self.inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        )

    def forward(self, position_ids: torch.LongTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq.to(position_ids.device)[None, None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Applies RoPE to ``x`` of shape ``(batch, heads, seq, head_dim)``; cos/sin are ``(batch, seq, head_dim)``."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACT2FN_SIMPLE[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class SlotKVCache:
    """A drafter KV cache whose slots can be individually invalidated.

    Batch rows advance by different amounts per decoding step; instead of per-row surgery, slots of rejected tokens
    stay in the tensors and are masked out through ``valid``. Trailing slots can be dropped with :meth:`crop`.
    Keys are stored after RoPE, so slot order does not need to match positions.
    """

    keys: torch.Tensor | None = None  # (batch, kv_heads, slots, head_dim)
    values: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # (batch, slots) bool

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
        if self.keys is None:
            self.keys, self.values, self.valid = keys, values, valid
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
            self.valid = torch.cat([self.valid, valid], dim=1)
        return self.keys, self.values, self.valid

    def crop(self, length: int) -> None:
        if self.keys is not None and length < self.length:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]
            self.valid = self.valid[:, :length]


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    causal: bool = True,
) -> torch.Tensor:
    """SDPA over a slot cache.

    Args:
        q: ``(batch, heads, T, d)`` queries for the last ``T`` slots of ``k``.
        k, v: ``(batch, kv_heads, S, d)`` all slots, including the ``T`` new ones at the end.
        key_valid: ``(batch, S)`` bool.
        causal: new slot ``t`` only sees slots up to itself (False: the new slots see each other fully).
    """
    bsz, heads, t, _ = q.shape
    s = k.shape[2]
    if k.shape[1] != heads:
        rep = heads // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = key_valid[:, None, None, :].expand(bsz, 1, t, s)
    q_slot = torch.arange(s - t, s, device=q.device)
    k_slot = torch.arange(s, device=q.device)
    if causal:
        mask = mask & (k_slot[None, :] <= q_slot[:, None])[None, None]
    # A query always sees itself, so rows of pure padding never produce NaNs.
    mask = mask | (k_slot[None, :] == q_slot[:, None])[None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
