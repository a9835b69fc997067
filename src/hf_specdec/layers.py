"""Building blocks shared by drafter families: RMSNorm, rotary embeddings, a slot-masked KV cache, attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_kernels import sdpa_has_enable_gqa

__all__ = [
    "RMSNorm",
    "RotaryEmbedding",
    "ROPE_TYPES",
    "normalize_rope_scaling",
    "rope_scaling_from_config",
    "rope_parameters",
    "rope_refusal",
    "SlotKVCache",
    "SlotKVCaches",
    "compaction_index",
    "GatedMLP",
    "apply_rotary",
    "slot_attention",
    "DraftAttention",
    "DraftDecoderLayer",
    "ACT2FN_SIMPLE",
]

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


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
"""RoPE scalings :class:`RotaryEmbedding` implements (transformers' ``rope_type`` names)."""

# Keys each scaling reads (besides ``rope_type``); anything else in a scaling dict is refused, not ignored.
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "original_max_position_embeddings",
        "truncate",
    },
}
_ROPE_REQUIRED = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
    "yarn": set(),
}


def normalize_rope_scaling(scaling: dict | None, max_position_embeddings: int | None = None) -> dict | None:
    """Normalises a RoPE scaling dict to transformers-5 form without ``rope_theta``; ``None`` for plain RoPE.

    Accepts the transformers-5 form (``{"rope_type": "llama3", "factor": 8.0, ...}``, ``rope_theta`` and a
    ``partial_rotary_factor`` of 1 are dropped) and the legacy form (``{"type": "linear", "factor": 2.0}``).
    ``original_max_position_embeddings`` defaults to ``max_position_embeddings`` for llama3 / yarn, as in
    transformers. Raises `ValueError` for a scaling this module does not implement or a key it would not read:
    a silently ignored scaling puts the drafter's rotary angles out of step with the target's.
    """
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"RoPE scaling must be a dict, got {scaling!r}.")
    params = dict(scaling)
    if params.get("rope_type") == "unsupported":  # recorded by a config's `for_target` (see rope_refusal)
        raise ValueError(
            f"{params.get('error')} To build the drafter anyway, choose its RoPE yourself: pass rope_theta= and "
            "rope_scaling_parameters= (None: plain RoPE) to for_target."
        )
    rope_type = params.pop("rope_type", None)
    legacy_type = params.pop("type", None)
    rope_type = rope_type or legacy_type or "default"
    params.pop("rope_theta", None)
    partial = params.pop("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"RoPE with partial_rotary_factor={partial} is not supported by hf_specdec's drafter rotary embedding; "
            "use a drafter config with full rotary embeddings (partial_rotary_factor 1.0)."
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported by hf_specdec's drafter rotary embedding "
            f"(supported: {', '.join(ROPE_TYPES)}). Build the drafter for a target with one of those, or set the "
            "drafter's RoPE scaling explicitly to one of them."
        )
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(
            f"RoPE scaling {scaling!r} has keys {unknown} that a {rope_type!r} scaling does not use; hf_specdec "
            "refuses them rather than ignore them. Remove them if they are meant to have no effect."
        )
    missing = sorted(_ROPE_REQUIRED.get(rope_type, set()) - set(params))
    if missing:
        raise ValueError(f"RoPE scaling {scaling!r} ({rope_type}) is missing {missing}.")
    if rope_type == "default":
        return None
    if rope_type in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
        if max_position_embeddings is None:
            raise ValueError(f"RoPE scaling {scaling!r} needs original_max_position_embeddings.")
        params["original_max_position_embeddings"] = int(max_position_embeddings)
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
    return {"rope_type": rope_type, **params}


def rope_scaling_from_config(config: Any) -> tuple[float, dict | None]:
    """``(rope_theta, normalised scaling)`` of a model config (a `PretrainedConfig` or a ``config.json`` dict).

    Reads transformers-5 ``rope_parameters`` (``{"rope_type": ..., "rope_theta": ...}``), the legacy
    ``rope_scaling`` dict (``{"type": ..., "factor": ...}``) and a top-level ``rope_theta``. Raises `ValueError`
    for per-layer-type RoPE, for two disagreeing RoPE dicts, and for scalings :func:`normalize_rope_scaling`
    refuses.
    """

    def get(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    max_pos = get("max_position_embeddings")
    params, legacy = get("rope_parameters"), get("rope_scaling")
    candidates = [_flat_rope(p) for p in (params, legacy) if p]
    for raw in candidates:  # some configs keep original_max_position_embeddings at the top level (Phi-3)
        if raw.get("rope_type", raw.get("type")) in ("llama3", "yarn") and get("original_max_position_embeddings"):
            raw.setdefault("original_max_position_embeddings", get("original_max_position_embeddings"))
    scalings = [normalize_rope_scaling(raw, max_pos) for raw in candidates]
    if len(scalings) == 2 and scalings[0] != scalings[1]:
        raise ValueError(
            f"The config has both rope_parameters={params!r} and rope_scaling={legacy!r}, and they disagree; "
            "keep only the one the model was trained with."
        )
    theta = next((raw["rope_theta"] for raw in candidates if raw.get("rope_theta") is not None), None)
    if theta is None:
        theta = get("rope_theta")
    return (10000.0 if theta is None else float(theta)), (scalings[0] if scalings else None)


def rope_refusal(error: Exception) -> dict:
    """A scaling dict that records why a target's RoPE cannot be reproduced; :func:`normalize_rope_scaling` raises
    it. ``for_target`` stores it so that the refusal surfaces unless the caller overrides the drafter's RoPE."""
    return {"rope_type": "unsupported", "error": str(error)}


def _flat_rope(raw: Any) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"RoPE parameters must be a dict, got {raw!r}.")
    if raw and all(isinstance(v, dict) for v in raw.values()):  # per layer type (e.g. Gemma-3)
        kinds = {repr(sorted(v.items())) for v in raw.values()}
        if len(kinds) != 1:
            raise ValueError(
                f"Per-layer-type RoPE ({sorted(raw)}) differs between layer types; hf_specdec's drafter rotary "
                "embedding has one."
            )
        raw = next(iter(raw.values()))
    return dict(raw)


def rope_parameters(
    head_dim: int,
    theta: float,
    scaling: dict | None = None,
    max_position_embeddings: int | None = None,
    seq_len: int | None = None,
    device=None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scale of a (possibly scaled) RoPE, as transformers computes them.

    Args:
        head_dim: rotary dimension.
        theta: RoPE base.
        scaling: a dict from :func:`normalize_rope_scaling` (``None``: plain RoPE).
        max_position_embeddings: the model's context length (used by ``dynamic`` and ``yarn``).
        seq_len: current sequence length (``dynamic`` only: frequencies change once it exceeds
            ``max_position_embeddings``).
    """
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (arange / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    factor = scaling.get("factor")
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("dynamic RoPE scaling needs max_position_embeddings.")
        seq = max(int(seq_len or 0), max_position_embeddings)
        base = theta * ((factor * seq / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (arange / head_dim)), 1.0
    if rope_type == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings, device)
    raise ValueError(f"RoPE scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}).")


def _yarn(head_dim: int, theta: float, scaling: dict, max_position_embeddings, device) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): per-frequency blend of interpolation and extrapolation, plus a cos/sin scale."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation per frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for explicit ``position_ids``, with transformers' RoPE scalings.

    Args:
        head_dim: rotary dimension.
        theta: RoPE base (``rope_theta``).
        scaling: ``None`` (plain RoPE) or a scaling dict (``rope_type`` linear, dynamic, yarn or llama3; legacy
            ``{"type": ..., "factor": ...}`` is accepted too); anything else raises `ValueError`.
        max_position_embeddings: context length (needed by dynamic and by yarn / llama3 without
            ``original_max_position_embeddings``).

    ``dynamic`` (NTK) scaling recomputes the frequencies from the largest position of each call once it exceeds
    ``max_position_embeddings``, as transformers does for a sequence decoded left to right.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = normalize_rope_scaling(scaling, max_position_embeddings)
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = rope_parameters(head_dim, theta, self.scaling, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def rope_type(self) -> str:
        return (self.scaling or {}).get("rope_type", "default")

    def reset_parameters(self) -> None:
        inv_freq, self.attention_scaling = rope_parameters(
            self.head_dim, self.theta, self.scaling, self.max_position_embeddings, device=self.inv_freq.device
        )
        self.inv_freq = inv_freq

    def forward(self, position_ids: torch.LongTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(position_ids.device)
        if self.rope_type == "dynamic" and position_ids.numel():
            seq_len = int(position_ids.max()) + 1
            if seq_len > self.max_position_embeddings:
                inv_freq = rope_parameters(
                    self.head_dim, self.theta, self.scaling, self.max_position_embeddings, seq_len, position_ids.device
                )[0]
        # the angles of both halves at once: position * [inv_freq; inv_freq] (a draft step's few ops add up)
        emb = position_ids.float()[..., None] * inv_freq.repeat(2)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


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


def compaction_index(valid: torch.Tensor, min_waste: int = 16, min_share: float = 0.1):
    """Where a batched slot cache should move its live slots, if it is worth it.

    Rows accept different numbers of tokens, so a shared slot cache accumulates dead slots (padding, rejected tokens):
    the cache grows faster than the longest row. When the dead slots common to all rows exceed ``min_waste`` slots
    and ``min_share`` of the cache, returns ``(index, new_valid)``: ``index[b, j]`` is the old slot that becomes slot
    ``j`` of row ``b`` (live slots keep their order and are right-aligned, so new slots keep coming after them), and
    ``new_valid`` the new ``(batch, max live)`` mask. Keys are stored after RoPE, so moving slots changes nothing the
    attention computes. Returns ``None`` when compaction would not pay.
    """
    live = valid.bool()
    total = live.shape[1]
    count = live.long().sum(dim=1)
    longest = int(count.max()) if count.numel() else 0
    waste = total - longest
    if waste < min_waste or waste < min_share * total:
        return None
    order = torch.sort((~live).to(torch.int8), dim=1, stable=True).indices[:, :longest]  # live slots first, in order
    shift = longest - count
    src = torch.arange(longest, device=valid.device)[None] - shift[:, None]
    new_valid = src >= 0
    index = order.gather(1, src.clamp_min(0))
    return index, new_valid


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

    def compact(self, min_waste: int = 16, min_share: float = 0.1) -> bool:
        """Drops slots dead in every row (see :func:`compaction_index`); returns whether it did."""
        if self.keys is None:
            return False
        plan = compaction_index(self.valid, min_waste, min_share)
        if plan is None:
            return False
        index, new_valid = plan
        idx = index[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        self.keys = self.keys.gather(2, idx)
        self.values = self.values.gather(2, idx)
        self.valid = new_valid
        return True

    def crop(self, length: int) -> None:
        if self.keys is not None and length < self.length:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]
            self.valid = self.valid[:, :length]


class SlotKVCaches:
    """One :class:`SlotKVCache` per draft layer or module, all over the same verified slots (so ``length``,
    ``valid``, ``crop`` and ``compact`` agree across them): a stack of draft layers writes every slot to each of its
    caches, chained modules (one per draft step) write a drafted slot only to the module that drafted it."""

    def __init__(self, num_caches: int):
        self.caches = [SlotKVCache() for _ in range(num_caches)]

    @property
    def length(self) -> int:
        return self.caches[0].length

    @property
    def valid(self) -> torch.Tensor | None:
        return self.caches[0].valid

    def crop(self, length: int) -> None:
        for cache in self.caches:
            cache.crop(length)

    def compact(self, min_waste: int = 16, min_share: float = 0.1) -> bool:
        done = [cache.compact(min_waste, min_share) for cache in self.caches]
        return done[0]


def slot_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_valid: torch.Tensor,
    causal: bool = True,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over a slot cache.

    Args:
        q: ``(batch, heads, T, d)`` queries for the last ``T`` slots of ``k``.
        k, v: ``(batch, kv_heads, S, d)`` all slots, including the ``T`` new ones at the end.
        key_valid: ``(batch, S)`` bool.
        causal: new slot ``t`` only sees slots up to itself (False: the new slots see each other fully).
        attn_mask: ``(batch, T, S)`` bool, an explicit pattern (e.g. tree drafting: each node sees the verified
            slots and its ancestors' slots); replaces ``causal`` and is combined with ``key_valid``.
    """
    heads, t = q.shape[1], q.shape[2]
    grouped = k.shape[1] != heads and q.device.type == "cpu" and sdpa_has_enable_gqa()
    if k.shape[1] != heads and not grouped:  # CUDA's masked grouped kernel is the slow math one: copy there
        rep = heads // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    mask = _slot_mask(key_valid, t, causal, attn_mask)
    if grouped:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _slot_mask(key_valid: torch.Tensor, t: int, causal: bool, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """``(batch, 1, t, S)`` what the last ``t`` slots' queries see (see :func:`slot_attention`). A query always sees
    itself, so rows of pure padding never produce NaNs."""
    bsz, s = key_valid.shape
    if t == 1 and attn_mask is None:  # a draft step: the valid slots and itself (a few ops fewer than below)
        mask = key_valid.clone()
        mask[:, -1] = True
        return mask[:, None, None, :]
    mask = key_valid[:, None, None, :].expand(bsz, 1, t, s)
    q_slot = torch.arange(s - t, s, device=key_valid.device)
    k_slot = torch.arange(s, device=key_valid.device)
    if attn_mask is not None:
        mask = mask & attn_mask.to(device=key_valid.device, dtype=torch.bool)[:, None]
    elif causal:
        mask = mask & (k_slot[None, :] <= q_slot[:, None])[None, None]
    return mask | (k_slot[None, :] == q_slot[:, None])[None, None]


class DraftAttention(nn.Module):
    """Multi-head attention of a draft decoder layer over a :class:`SlotKVCache` (GQA, RoPE, optional bias).

    ``in_features`` may differ from the output width (a layer that reads ``[embedding; feature]``, ``2 * hidden``).
    ``bias`` puts biases on all four projections (Llama's ``attention_bias``); ``o_bias=False`` keeps ``o_proj``
    without one (Qwen2's attention: biases on q/k/v only). :meth:`forward` serves decoding (verified slots, chains,
    tree nodes); :meth:`ttt` the training-time unroll.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        o_bias: bool | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, out_features, bias=bias if o_bias is None else o_bias)

    def _qkv(self, x, cos, sin):
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, cache: SlotKVCache, valid: torch.Tensor, causal: bool = True, attn_mask=None):
        bsz, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        keys, values, key_valid = cache.append(k, v, valid)
        out = slot_attention(q, keys, values, key_valid, causal=causal, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))

    def ttt(self, x, cos, sin, key_valid: torch.Tensor, prev_kv: list) -> torch.Tensor:
        """Attention of one unrolled draft step over a whole sequence: anchor ``t`` sees the step-0 keys causally
        (the verified context) plus its own keys of steps ``1..j``, as the ``j``-th drafted slot does at inference.

        ``prev_kv`` holds ``(k, v)`` of the earlier steps (step 0 first); this step's are appended to it."""
        bsz, t, _ = x.shape
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._qkv(x, cos, sin)
        prev_kv.append((k, v))
        rep = h // kvh

        def expand(z):
            return z.repeat_interleave(rep, dim=1) if rep > 1 else z

        k0, v0 = expand(prev_kv[0][0]), expand(prev_kv[0][1])
        scale = hd**-0.5
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # (B, h, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & key_valid[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)[None, None]
        scores0 = scores0.masked_fill(~allowed, torch.finfo(scores0.dtype).min)
        if len(prev_kv) == 1:
            probs = torch.softmax(scores0.float(), dim=-1).to(q.dtype)
            out = probs @ v0
        else:
            diag_k = torch.stack([expand(kk) for kk, _ in prev_kv[1:]], dim=-2)  # (B, h, T, j, d)
            diag_v = torch.stack([expand(vv) for _, vv in prev_kv[1:]], dim=-2)
            scores_d = (q[..., None, :] * diag_k).sum(-1) * scale  # (B, h, T, j)
            probs = torch.softmax(torch.cat([scores0, scores_d], dim=-1).float(), dim=-1).to(q.dtype)
            out = probs[..., :t] @ v0 + (probs[..., t:, None] * diag_v).sum(-2)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class DraftDecoderLayer(nn.Module):
    """A pre-norm Llama decoder layer over a :class:`SlotKVCache` (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, gated ``mlp``), shaped by a config with the draft decoder layer fields.
    ``config.attention_bias`` biases all four attention projections; ``qkv_bias`` q/k/v only (Qwen2's attention)."""

    def __init__(self, config, qkv_bias: bool = False):
        super().__init__()
        h = config.hidden_size
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = DraftAttention(h, h, heads, kv_heads, head_dim, bias or qkv_bias, o_bias=bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, cache: SlotKVCache, valid, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, valid, attn_mask=attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def ttt(self, x, cos, sin, key_valid: torch.Tensor, prev_kv: list) -> torch.Tensor:
        """The layer in one training-time-test step (see :meth:`DraftAttention.ttt`)."""
        x = x + self.self_attn.ttt(self.input_layernorm(x), cos, sin, key_valid, prev_kv)
        return x + self.mlp(self.post_attention_layernorm(x))
