"""Cheaper passes on CPUs: a target's fp32 linear layers computed with weights packed once for oneDNN.

A verification pass runs the target over a few new tokens (K + 1 for a chain of K, a few more for a tree). On x86
CPUs, PyTorch computes ``F.linear`` over 2–64 rows with MKL's general ``sgemm``, which re-packs the whole weight on
every call, and over one row with a matrix-vector kernel that does not use a second thread. On a 2-core AMD EPYC VM
a SmolLM2-135M pass over 6 tokens costs about 1.4–1.7 one-token steps that way, and as much with the weights packed
once for MKL; packed once for oneDNN it costs what a one-token step costs (``scripts/smollm2_pass_cost.py --layouts
stock packed``). Speculative decoding pays only when a pass costs little more than a step, so that price decides
whether a drafter pays on a CPU.

:func:`pack_linear_weights` packs each fp32 ``nn.Linear`` weight of a model once, in oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``), and computes every call over 1 to ``max_rows`` rows with
``torch.ops.mkldnn._linear_pointwise``: the one-token steps of plain decoding too, so that plain and speculative
decoding on a packed target run the same kernels and a speedup measured between them is the drafter's alone. Calls
over 1 or 2 rows are padded to 3 with zero rows, because oneDNN's kernels for one and two rows are slower than its
kernel for three: on the AMD VM a SmolLM2 pass over 2 tokens cost 1.2 times one over 3, and padding made a one-token
step 5 % faster at one thread. A pass over more rows (a prompt's prefill), any call that needs gradients, and a
layer whose weight was changed or replaced after packing run the stock ``F.linear``, so training never sees a stale
copy. Packed and stock results differ in the last bits, as any two BLAS kernels do; greedy speculative decoding on
a packed target is token-identical to plain decoding on the same packed target (``tests/test_cpu_kernels.py``).

The packed copies take as much memory as the weights they copy (a tied embedding / LM head is copied once).

:func:`grouped_query_sdpa` is the attention's part. A target with fewer key/value heads than query heads (SmolLM2:
3 and 9) is computed by transformers' SDPA attention with ``enable_gqa`` only where the call has no mask; a call with
one (any pass over several tokens, every step of a padded batch) first copies each layer's keys and values to every
query head. On the AMD VM, at a 1,000-token context, that copy made a SmolLM2 pass over 2 tokens cost 1.20 one-token
steps instead of 1.05, and at batch 4 2.12 instead of 1.24 (``scripts/smollm2_pass_cost.py``,
``smollm2-pass-cost-batch.md``; the plain one-token step at batch 1 has no mask and never copied). For CPU targets
the speculative loop turns on transformers' own switch for the grouped kernel (``TRANSFORMERS_SDPA_FORCE_GQA``) while
it decodes, and ``hf-specdec bench`` / ``demo`` keep it on for plain decoding too, so a padded batch's baseline runs
the same attention.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types

import torch
import torch.nn.functional as F

DEFAULT_MAX_ROWS = 64
PACKING_ROWS_HINT = 6  # the rows oneDNN lays the packed weight out for; level from 1 to 64 rows
MIN_KERNEL_ROWS = 3  # fewer rows are padded to this many: oneDNN's kernel for 2 rows costs about 1.2 of its 3-row one


def packed_linears_supported() -> bool:
    """Whether this PyTorch build has oneDNN's packed fp32 linear kernels (x86 builds do)."""
    return (
        bool(torch.backends.mkldnn.is_available())
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and not hasattr(module, "_hf_hook")  # accelerate owns this module's forward (offloading, device moves)
        and "forward" not in module.__dict__
    )


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    state = self._hf_specdec_packed
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < 1 or rows > state.max_rows or not state.current(self.weight, x):
        return F.linear(x, self.weight, self.bias)
    if rows >= MIN_KERNEL_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), state.packed, self.bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat([flat, flat.new_zeros(MIN_KERNEL_ROWS - rows, flat.shape[-1])])
    out = torch.ops.mkldnn._linear_pointwise(padded, state.packed, self.bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _PackedWeight:
    """One layer's packed copy and what it was packed from (the weight tensor and its in-place version)."""

    def __init__(self, weight: torch.Tensor, max_rows: int):
        self.weight = weight
        self.version = weight._version
        self.storage = weight.data_ptr()
        self.max_rows = max_rows
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACKING_ROWS_HINT)

    def current(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the packed copy may compute this call: the same weight, unchanged (not written in place, its
        ``.data`` not swapped, not moved off the CPU), an fp32 CPU input, no gradients or autocast wanted."""
        return (
            weight is self.weight
            and weight._version == self.version
            and weight.data_ptr() == self.storage
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and not torch.is_autocast_enabled("cpu")
        )


class PackedLinears:
    """The handle :func:`pack_linear_weights` returns: ``len()`` is the number of packed layers, :meth:`restore`
    (or leaving a ``with`` block) puts the stock ``forward`` back and frees the packed copies."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules

    def __len__(self) -> int:
        return len(self.modules)

    def restore(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_hf_specdec_packed", None)
        self.modules = []

    def __enter__(self) -> PackedLinears:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def pack_linear_weights(model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> PackedLinears:
    """Compute ``model``'s fp32 CPU ``nn.Linear`` layers over 1 to ``max_rows`` rows with pre-packed oneDNN weights.

    Layers that are not plain ``nn.Linear`` (quantized or adapter layers; a PEFT LoRA layer's base layer is packed),
    not fp32, not on the CPU, or whose forward accelerate or someone else already replaced are left alone. Use it on
    the target, for plain and speculative decoding alike: see the module docstring for what runs where.

    Returns:
        A :class:`PackedLinears` handle (a context manager) that undoes the change.

    Raises:
        RuntimeError: this PyTorch build has no oneDNN packed kernels (:func:`packed_linears_supported`), or the packed
            kernel disagrees with ``F.linear`` on this machine (checked once on a layer of the model).
        ValueError: ``max_rows`` below 1.
    """
    if not packed_linears_supported():
        raise RuntimeError(
            "this PyTorch build has no oneDNN packed linear kernels (torch.ops.mkldnn._linear_pointwise); leave the "
            "target's layers as they are (an x86 build of torch has them)."
        )
    if int(max_rows) < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}.")
    modules = [m for m in model.modules() if _packable(m)]
    for module in modules:
        module._hf_specdec_packed = _PackedWeight(module.weight, int(max_rows))
        module.forward = types.MethodType(_packed_forward, module)
    handle = PackedLinears(modules)
    if modules:
        _check_against_stock(modules[0], handle)
    return handle


LINEAR_KERNELS = ("packed", "stock")


def linear_kernels_for(model: torch.nn.Module, kernels: str) -> PackedLinears:
    """``kernels="packed"``: :func:`pack_linear_weights` where this build can (an empty handle where it cannot, or
    where ``model`` has no fp32 CPU layer); ``"stock"``: nothing packed. What ``hf-specdec bench`` / ``demo`` apply to
    the target for the length of a run (``--linear-kernels``)."""
    if kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear kernels must be one of {', '.join(LINEAR_KERNELS)}, got {kernels!r}.")
    if kernels == "stock" or not packed_linears_supported():
        return PackedLinears([])
    return pack_linear_weights(model)


@torch.no_grad()
def _check_against_stock(module: torch.nn.Module, handle: PackedLinears) -> None:
    """Refuse a packed kernel that computes something else than ``F.linear`` (over 1, 5 and ``max_rows`` rows)."""
    generator = torch.Generator().manual_seed(0)
    for rows in sorted({1, 5, module._hf_specdec_packed.max_rows}):
        x = torch.randn(rows, module.in_features, generator=generator)
        expected = F.linear(x, module.weight, module.bias)
        scale = float(expected.abs().max()) or 1.0
        if not torch.allclose(module(x), expected, rtol=0, atol=1e-4 * scale):
            handle.restore()
            raise RuntimeError(
                f"oneDNN's packed linear kernel disagrees with F.linear over {rows} rows on this machine; leave the "
                "target's layers as they are and report your torch version and CPU."
            )


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # transformers' switch: SDPA's grouped-query kernel, masked calls too
_gqa_lock = threading.Lock()
_gqa_users = 0
_gqa_saved: str | None = None


def grouped_query_sdpa_applies(model: torch.nn.Module) -> bool:
    """Whether :func:`grouped_query_sdpa` changes how ``model`` attends: SDPA attention on the CPU, fewer key/value
    heads than query heads, and a torch with SDPA's ``enable_gqa`` (2.5 and later). On CUDA transformers keeps masked
    calls off the grouped kernel on purpose (it falls back to the slow math kernel there), so GPU targets are left
    alone."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    param = next(model.parameters(), None)
    return (
        sdpa_has_enable_gqa()
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and param is not None
        and param.device.type == "cpu"
        and bool(heads)
        and bool(kv_heads)
        and kv_heads < heads
    )


@functools.cache
def sdpa_has_enable_gqa() -> bool:
    """Whether this torch's ``scaled_dot_product_attention`` takes ``enable_gqa`` (2.5 and later)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


@contextlib.contextmanager
def grouped_query_sdpa(model: torch.nn.Module):
    """While inside, ``model``'s masked SDPA calls use the grouped-query kernel instead of copying the keys and
    values to every query head (where :func:`grouped_query_sdpa_applies`; yields whether it does).

    The switch is transformers' environment variable, so it holds for the whole process while any caller is inside
    (nested and concurrent callers are counted; the variable's earlier value comes back when the last one leaves).
    A user who set it keeps their value. Another model decoding at the same time in another thread then uses the
    grouped kernel too: the same attention, computed without the copy."""
    if not grouped_query_sdpa_applies(model):
        yield False
        return
    _enter_gqa()
    try:
        yield True
    finally:
        _leave_gqa()


def _enter_gqa() -> None:
    global _gqa_users, _gqa_saved
    with _gqa_lock:
        if _gqa_users == 0:
            _gqa_saved = os.environ.get(GQA_SWITCH)
            if _gqa_saved is None:
                os.environ[GQA_SWITCH] = "1"
        _gqa_users += 1


def _leave_gqa() -> None:
    global _gqa_users
    with _gqa_lock:
        _gqa_users -= 1
        if _gqa_users == 0 and _gqa_saved is None:
            os.environ.pop(GQA_SWITCH, None)
