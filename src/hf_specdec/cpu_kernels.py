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

Which kernel is faster depends on the CPU, so by default (``rows="measured"``) a packed copy computes only the calls
whose row counts it was measured faster at on this machine (:func:`measured_row_plan`: each layer shape timed once at
a few row counts, against the stock kernel, when the model is packed); the other calls run the stock ``F.linear``,
and a layer that is never faster keeps its stock forward. The kernels were chosen on AMD EPYC VMs with native bf16
(``avx512_bf16``). On an Intel Xeon VM without it, at two threads, the packed fp32 kernel took 1.1-6.9 times the stock
one over one row and 0.2-1.0 times it over 6-16 rows; the bf16 weights took 3.7-4.5 times the stock layer over a
prompt's 1,024 rows, and the int8 ones over one row 0.55-2.7 times it, faster only on the wider layers
(``scripts/kernel_rows_bench.py``, ``model_cards/results/kernel-rows-intel-t2.md``). A target packed for every call
(``rows="all"``, what this module did before) decoded plainly at 0.66 of the stock speed there
(``model_cards/results/smollm2-linear-kernels-measured-t2.md``).

:func:`pack_draft_weights` does the same for a drafter, with cheaper weights: its linear layers compute with bf16
weights packed for oneDNN, over any number of rows, and optionally with int8 weights for the one-row calls of draft
steps. A drafter's precision decides only how often its tokens are accepted, never the output, and a one-token draft
step is bound by reading the drafter's weights with PyTorch's one-thread fp32 matrix-vector kernel; in bf16 it costs
about two thirds of that on the AMD VM, and int8 weights are half as many bytes again.

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

import bisect
import contextlib
import functools
import os
import sys
import threading
import time
import types

import torch
import torch.nn.functional as F

DEFAULT_MAX_ROWS = 64
PACKING_ROWS_HINT = 6  # the rows oneDNN lays the packed weight out for; level from 1 to 64 rows
INT8_MAX_ROWS = 2  # calls over more rows cost less with bf16 weights than with the one-row int8 kernel
MIN_KERNEL_ROWS = 3  # fewer rows are padded to this many: oneDNN's kernel for 2 rows costs about 1.2 of its 3-row one
# The row counts at which a packed kernel is timed against the stock one (rows="measured"); a call follows what was
# measured at the largest of them not above its own rows.
ROW_PROBES = (1, 2, 3, 4, 6, 8, 16, 32, 64, 256)
ROW_PLANS = ("measured", "all")


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
    state, weight = self._hf_specdec_packed, self.weight
    if state.serves(weight, x):
        return state.compute(x, self.bias)
    return F.linear(x, weight, self.bias)


class _PackedWeight:
    """One layer's packed copy (in ``dtype``) and what it was packed from (the weight tensor, its in-place version)."""

    tolerances = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # of a correct kernel, relative (see tolerance)

    def __init__(self, weight: torch.Tensor, max_rows: int, dtype: torch.dtype = torch.float32):
        self.weight = weight
        self.version = weight._version
        self.storage = weight.data_ptr()
        self.max_rows = max_rows
        self.dtype = dtype
        # oneDNN's fp32 kernels for one and two rows are slower than its three-row one; its bf16 ones are not
        self.min_rows = MIN_KERNEL_ROWS if dtype == torch.float32 else 1
        self.plan: frozenset[int] | None = None  # the ROW_PROBES whose calls it computes (None: every call)
        with torch.no_grad():
            self.packed = self._packed_copy(weight.detach())

    def _packed_copy(self, weight: torch.Tensor):
        hint = PACKING_ROWS_HINT if self.dtype == torch.float32 else 1
        return torch.ops.mkldnn._reorder_linear_weight(weight.to(self.dtype).contiguous(), hint)

    def compute(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` with the packed copy, in ``x``'s dtype (a call :meth:`serves`)."""
        if self.dtype != x.dtype:  # bf16 copies: the input and bias in, the output back
            bias = None if bias is None else bias.to(self.dtype)
            return self._kernel(x.to(self.dtype), bias).to(x.dtype)
        rows = x.numel() // x.shape[-1]
        if rows >= self.min_rows:
            return self._kernel(x, bias)
        flat = torch.constant_pad_nd(x.reshape(rows, x.shape[-1]), (0, 0, 0, self.min_rows - rows))
        return self._kernel(flat, bias)[:rows].reshape(*x.shape[:-1], -1)

    def _kernel(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    @property
    def tolerance(self) -> float:
        """How far from :meth:`reference` a correct kernel may land, relative to the result's largest entry."""
        return self.tolerances[self.dtype]

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What :meth:`compute` should give: ``F.linear`` on ``x``, the weight and the bias rounded to ``dtype``."""
        return F.linear(*[None if t is None else t.to(self.dtype).float() for t in (x, self.weight, bias)])

    def serves(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the packed copy may compute this call: 1 to ``max_rows`` rows of an fp32 CPU input, rows its
        :attr:`plan` serves, the same weight, unchanged (not written in place, its ``.data`` not swapped, not moved
        off the CPU), no gradients or autocast wanted."""
        width = x.shape[-1] if x.dim() else 0
        rows = x.numel() // width if width else 0
        if not 1 <= rows <= self.max_rows or (self.plan is not None and _probe_of(rows) not in self.plan):
            return False  # the common refusal first: a plain step's one-row calls where the stock kernel is faster
        return (
            weight is self.weight
            and weight._version == self.version
            and weight.data_ptr() == self.storage
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
            and not torch.is_autocast_enabled("cpu")
        )


class _Int8Weight(_PackedWeight):
    """One layer's bf16 packed copy, plus its weight in int8 with one bf16 scale per output row for PyTorch's
    weight-only int8 kernel (``torch._weight_int8pack_mm``; inputs stay bf16). A call over one or two rows (a draft
    step) reads the int8 weight, half the bytes of bf16; over more rows (a pass over accepted tokens, a prompt) the
    bf16 kernel, whose cost grows far less with the rows, computes."""

    def __init__(self, weight: torch.Tensor, max_rows: int):
        super().__init__(weight, max_rows, torch.bfloat16)
        with torch.no_grad():
            w = weight.detach().float()
            self.scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30).to(torch.bfloat16)
            self.int8 = torch.round(w / self.scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

    @staticmethod
    def _reads_int8(x: torch.Tensor) -> bool:
        return x.numel() // x.shape[-1] <= INT8_MAX_ROWS

    def compute(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self._reads_int8(x):
            return super().compute(x, bias)
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.int8, self.scales).to(x.dtype).reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias

    def reference(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self._reads_int8(x):
            return super().reference(x, bias)
        weight = self.int8.float() * self.scales.float()[:, None]
        return F.linear(x.to(torch.bfloat16).float(), weight, bias)


class PackedLinears:
    """The handle :func:`pack_linear_weights` returns: ``len()`` is the number of packed layers, :meth:`restore`
    (or leaving a ``with`` block) puts the stock ``forward`` back and frees the packed copies."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules

    def __len__(self) -> int:
        return len(self.modules)

    def row_plans(self) -> dict[str, str]:
        """Per weight shape (``"out x in"``), the rows of the calls its packed kernel computes (``"6-64"``,
        ``"none"``, ``"1-64"``; the rest run ``F.linear``), as measured (:func:`measured_row_plan`) or asked."""
        plans = {}
        for module in self.modules:
            state = module._hf_specdec_packed
            out_features, in_features = state.weight.shape
            plans[f"{out_features}x{in_features}"] = _rows_text(state.plan, state.max_rows)
        return plans

    def restore(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_hf_specdec_packed", None)
        self.modules = []

    def __enter__(self) -> PackedLinears:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def pack_linear_weights(
    model: torch.nn.Module, max_rows: int = DEFAULT_MAX_ROWS, rows: str = "measured"
) -> PackedLinears:
    """Compute ``model``'s fp32 CPU ``nn.Linear`` layers over 1 to ``max_rows`` rows with pre-packed oneDNN weights:
    ``rows="measured"`` (default) only the row counts at which this machine measured the packed kernel faster than
    the stock one (:func:`measured_row_plan`), ``"all"`` every call.

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
    max_rows = int(max_rows)
    return _pack([m for m in model.modules() if _packable(m)], lambda weight: _PackedWeight(weight, max_rows), rows)


def pack_draft_weights(
    drafter: torch.nn.Module, target: torch.nn.Module | None = None, weights: str = "bf16", rows: str = "measured"
) -> PackedLinears:
    """Compute a drafter's fp32 CPU ``nn.Linear`` layers with cheaper weights, over the row counts at which this
    machine measured that faster than the stock fp32 layer (``rows="measured"``, :func:`measured_row_plan`) or over
    any number of rows (``"all"``); their outputs come back in fp32, and everything else stays fp32.

    - ``weights="bf16"``: weights rounded to bf16 and packed once for oneDNN; inputs rounded to bf16.
    - ``weights="int8"``: the same, and besides, weights in int8 with one bf16 scale per output row for PyTorch's
      weight-only int8 kernel (``torch._weight_int8pack_mm``; inputs stay bf16), which computes calls over one or two
      rows (draft steps): half the bytes of bf16 to read. Calls over more rows use the bf16 copy, which costs less
      there on a CPU with native bf16 (with ``rows="measured"``, each where this CPU measured it faster than the fp32
      layer; the rest run the fp32 layer). Only weights are rounded to int8, not inputs: a layer that reads the
      target's hidden states, whose few large channels would swamp an int8 input, loses no more than in bf16.

    A drafter's precision changes only how often its tokens are accepted, never what the target outputs: greedy
    decoding stays token-identical to plain decoding and sampling stays lossless, since the target verifies every
    token against the draft probabilities the drafter actually used. On a CPU a one-token draft step is bound by
    reading the drafter's weights, and PyTorch's fp32 matrix-vector kernel uses one thread, so smaller weights in a
    kernel's own layout cost less: on the 2-core AMD VM the shipped SmolLM2 drafter's draft cost ratio fell from 0.06 to
    0.04 of a target step in bf16 and to 0.03 with int8 draft steps, with the same τ
    (``model_cards/results/smollm2-draft-kernels.md``, ``smollm2-draft-kernels-int8.md``). Never use it on a target.

    Layers are chosen as :func:`pack_linear_weights` chooses them; a layer whose weight is also one of ``target``'s
    parameters (a head or embedding the drafter shares with it) is left alone.

    Raises:
        ValueError: ``weights`` is not one of ``"bf16"``, ``"int8"``.
        RuntimeError: this PyTorch build or CPU has no such kernels (:func:`bf16_linears_supported`,
            :func:`int8_linears_supported`), or the kernel disagrees with ``F.linear`` (checked once on a layer).
    """
    if weights not in _DRAFT_WEIGHTS:
        raise ValueError(f"draft weights must be one of {', '.join(_DRAFT_WEIGHTS)}, got {weights!r}.")
    if not _draft_weights_supported(weights):
        raise RuntimeError(
            f"this PyTorch build or CPU has no {weights} linear kernels; leave the drafter's layers as they are."
        )
    shared = {id(p) for p in target.parameters()} if target is not None else set()
    modules = [m for m in drafter.modules() if _packable(m) and id(m.weight) not in shared]
    return _pack(modules, lambda weight: _DRAFT_WEIGHTS[weights](weight, sys.maxsize), rows)


def _pack(modules: list[torch.nn.Module], packed_copy, rows: str) -> PackedLinears:
    if rows not in ROW_PLANS:
        raise ValueError(f"rows must be one of {', '.join(ROW_PLANS)}, got {rows!r}.")
    for module in modules:
        module._hf_specdec_packed = packed_copy(module.weight)
        module.forward = types.MethodType(_packed_forward, module)
    handle = PackedLinears(modules)
    if modules:
        _check_against_stock(modules[0], handle)
    if rows == "measured":
        for module in modules:
            module._hf_specdec_packed.plan = measured_row_plan(module._hf_specdec_packed, module.bias)
        slower = PackedLinears([m for m in modules if not m._hf_specdec_packed.plan])
        slower.restore()  # a layer whose packed kernel is never faster keeps its stock forward, at no cost per call
        handle.modules = [m for m in modules if "forward" in m.__dict__]
    return handle


def _rows_text(plan: frozenset[int] | None, max_rows: int) -> str:
    """``plan``'s row counts as ranges (``"1, 6-64"``; ``"any"`` for no upper bound)."""
    probes = [p for p in ROW_PROBES if p <= max_rows]
    served = probes if plan is None else [p for p in probes if p in plan]
    ranges: list[list[int]] = []
    for p in served:
        i = probes.index(p)
        end = probes[i + 1] - 1 if i + 1 < len(probes) else max_rows
        if ranges and ranges[-1][1] == p - 1:
            ranges[-1][1] = end
        else:
            ranges.append([p, end])
    text = ", ".join(str(a) if a == b else f"{a}-{'any' if b >= sys.maxsize else b}" for a, b in ranges)
    return text or "none"


def _probe_of(rows: int) -> int:
    """The largest of :data:`ROW_PROBES` not above ``rows``: the measurement a call over ``rows`` rows follows."""
    return ROW_PROBES[bisect.bisect_right(ROW_PROBES, rows) - 1]


_PLANS: dict[tuple, frozenset[int]] = {}
_PLANS_LOCK = threading.Lock()


def measured_row_plan(state: _PackedWeight, bias: torch.Tensor | None = None, repeats: int = 3) -> frozenset[int]:
    """The :data:`ROW_PROBES` (up to the layer's ``max_rows``) at which the packed kernel computed a layer of this
    shape faster than ``F.linear`` on this machine, at the current thread count: each the fastest of ``repeats``
    timed calls after one untimed one, the two kernels alternating. Measured once per kind of copy, shape and thread
    count in a process (a model's layers of one shape share it).

    Which kernel is faster depends on the CPU, not only on the shapes (see the module docstring): on a CPU without
    native bf16 the int8 drafter weights pay over one row on the wider layers only, the bf16 ones hardly anywhere, and
    the packed fp32 kernel over one row not at all (``model_cards/results/kernel-rows-intel-t2.md``)."""
    key = (type(state).__name__, state.dtype, tuple(state.weight.shape), bias is not None, torch.get_num_threads())
    with _PLANS_LOCK:
        if key not in _PLANS:
            probes = [rows for rows in ROW_PROBES if rows <= state.max_rows]
            _PLANS[key] = frozenset(rows for rows in probes if _packed_is_faster(state, bias, rows, repeats))
        return _PLANS[key]


@torch.no_grad()
def _packed_is_faster(state: _PackedWeight, bias: torch.Tensor | None, rows: int, repeats: int) -> bool:
    x = torch.randn(rows, state.weight.shape[1], generator=torch.Generator().manual_seed(rows))  # not the global RNG
    weight = state.weight.detach()
    best = {"stock": float("inf"), "packed": float("inf")}
    calls = {"stock": lambda: F.linear(x, weight, bias), "packed": lambda: state.compute(x, bias)}
    for i in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    return best["packed"] < best["stock"]


def bf16_linears_supported() -> bool:
    """Whether oneDNN's packed linear kernels run bf16 on this build and CPU (:func:`pack_draft_weights`)."""
    return packed_linears_supported() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_linears_supported() -> bool:
    """Whether this build has PyTorch's weight-only int8 linear kernel for the CPU, and oneDNN's bf16 kernels besides
    (:func:`pack_draft_weights` with ``weights="int8"``)."""
    return hasattr(torch, "_weight_int8pack_mm") and bf16_linears_supported()


_DRAFT_WEIGHTS = {  # the kinds of cheaper drafter weights: the copy of one layer's weight
    "bf16": functools.partial(_PackedWeight, dtype=torch.bfloat16),
    "int8": _Int8Weight,
}


def _draft_weights_supported(weights: str) -> bool:
    return bf16_linears_supported() if weights == "bf16" else int8_linears_supported()


LINEAR_KERNELS = ("packed", "stock")
DRAFT_KERNELS = (*_DRAFT_WEIGHTS, "stock")
# what bench and demo give drafters unless told otherwise (model_cards/results/smollm2-draft-kernels-int8.md)
DEFAULT_DRAFT_KERNELS = "int8"


def linear_kernels_for(model: torch.nn.Module, kernels: str) -> PackedLinears:
    """``kernels="packed"``: :func:`pack_linear_weights` where this build can (an empty handle where it cannot, or
    where ``model`` has no fp32 CPU layer); ``"stock"``: nothing packed. What ``hf-specdec bench`` / ``demo`` apply to
    the target for the length of a run (``--linear-kernels``)."""
    if kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear kernels must be one of {', '.join(LINEAR_KERNELS)}, got {kernels!r}.")
    if kernels == "stock" or not packed_linears_supported():
        return PackedLinears([])
    return pack_linear_weights(model)


def draft_kernels_for(drafters: list, kernels: str, targets: list[torch.nn.Module]) -> PackedLinears:
    """``kernels="bf16"`` or ``"int8"``: :func:`pack_draft_weights` with those weights on each drafter (or assistant
    model; ``None`` entries are skipped), leaving alone every weight one of ``targets`` holds, where this build and CPU
    can (an empty handle where they cannot); ``"stock"``: nothing packed. What ``hf-specdec bench`` / ``demo`` apply to
    the drafters for the length of a run (``--draft-kernels``)."""
    if kernels not in DRAFT_KERNELS:
        raise ValueError(f"draft kernels must be one of {', '.join(DRAFT_KERNELS)}, got {kernels!r}.")
    if kernels == "stock" or not _draft_weights_supported(kernels):
        return PackedLinears([])
    held = torch.nn.ModuleList(targets)
    drafters = {id(d): d for d in drafters if d is not None and all(d is not t for t in targets)}.values()
    return _packed_together(functools.partial(pack_draft_weights, d, held, kernels) for d in drafters)


def linear_kernels_for_all(models: list[torch.nn.Module], kernels: str) -> PackedLinears:
    """:func:`linear_kernels_for` on each distinct model of ``models`` (a benchmark's target and an adapted copy of
    it), as one handle."""
    distinct = {id(m): m for m in models}.values()
    return _packed_together(functools.partial(linear_kernels_for, m, kernels) for m in distinct)


def _packed_together(packings) -> PackedLinears:
    """One handle over what each ``packing()`` packed; if one fails, those already packed are restored."""
    handle = PackedLinears([])
    try:
        for packing in packings:
            handle.modules += packing().modules
    except BaseException:
        handle.restore()
        raise
    return handle


@torch.no_grad()
def _check_against_stock(module: torch.nn.Module, handle: PackedLinears) -> None:
    """Refuse a packed kernel that computes something else than ``F.linear`` (over 1, 5 and ``max_rows`` rows, at most
    64; bf16 layers against ``F.linear`` on bf16-rounded inputs and weights, to bf16's precision; int8 layers' one-row
    calls against the int8 weights they read)."""
    generator = torch.Generator().manual_seed(0)
    state = module._hf_specdec_packed
    for rows in sorted({1, 5, min(state.max_rows, DEFAULT_MAX_ROWS)}):
        x = torch.randn(rows, module.in_features, generator=generator)
        expected = state.reference(x, module.bias)
        scale = float(expected.abs().max()) or 1.0
        if not torch.allclose(module(x), expected, rtol=0, atol=state.tolerance * scale):
            handle.restore()
            raise RuntimeError(
                f"the packed {state.dtype} linear kernel disagrees with F.linear over {rows} rows on this machine; "
                "leave the model's layers as they are and report your torch version and CPU."
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
