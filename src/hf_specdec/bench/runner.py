"""Spec-Bench-style benchmark: plain ``generate``, hf_specdec drafters and transformers' own speculative methods,
interleaved in one run on the same prompts, with the metrics that explain a speedup.

Protocol (as in Spec-Bench): warm-up runs first; then, for every repeat and every prompt batch, each method runs once,
in an order rotated from batch to batch so that no method always runs first (or last) on a warm cache. Every method
sees exactly the same inputs and generation settings. Prompts are batched within their category only, so per-category
figures stay meaningful at batch size > 1.

Metrics per method, decoding mode, batch size and category (see :func:`run_benchmark`):

* ``tokens_per_s``: new tokens (up to and including EOS) over wall-clock time, summed over all repeats;
  ``tokens_per_s_by_repeat``: the same for each repeat alone;
* ``speedup``: ``tokens_per_s`` over that of plain ``generate`` in the same mode, batch size and category (pooled
  totals: on a machine whose speed drifts during the run, this mixes the drift into the ratio);
* ``speedup_by_repeat``: for every repeat, the method's tokens/s over plain's in the same repeat, on the same prompt
  batches (the two ran interleaved, so a slow spell of the machine slows both); ``speedup_median``,
  ``speedup_min``, ``speedup_max`` of these, ``speedup_ci95``: a 95 % interval, the t-interval of their logarithms
  exponentiated; ``verdict``: ``"faster"`` when the interval lies above 1, ``"slower than plain"`` when it lies
  below 1, ``"within noise"`` otherwise and ``"too few repeats"`` under 3 (all ``None`` for the baseline itself,
  whose record carries ``step_s`` instead: its wall time per target forward, the unit of ``c`` and ``v``);
* ``mean_accepted_length`` τ: tokens committed per target verification pass (plain decoding: 1). Exact for
  hf_specdec drafters; for transformers' methods, new tokens per target forward pass (their prefill included);
* ``acceptance_by_position``: for hf_specdec drafters, the rate at which the ``j``-th draft token was accepted,
  among the passes that drafted at least ``j`` tokens;
* ``alpha``: per-token acceptance rate, the maximum-likelihood estimate for a chain whose tokens are accepted
  independently with probability α (accepted draft tokens over draft tokens that were reached);
* ``draft_cost_ratio`` c: drafting time per draft token over the time of one plain decoding step (plain wall time
  over plain target forward passes, same run), counted in the passes that drafted: the drafter's pass over the
  prompt and its catch-up after plain steps of the adaptive length are not per-token costs (they are in
  ``predicted_speedup``), and charged to the few tokens of a run that mostly ran plain steps they made c look
  several plain steps large;
* ``speedup_bound``: ``min(1/c, 1/(1-α))``; drafting costs at least ``c`` target steps per token, and a pass cannot
  commit more than ``1/(1-α)`` tokens on average however long the draft;
* ``verify_cost_ratio`` v: one verification pass (``K + 1`` tokens) over one plain decoding step, and
  ``predicted_speedup`` = τ / (v + drafting time per pass in plain steps): what the measured τ, v and c imply, the
  loop's own bookkeeping excluded (hf_specdec drafters);
* ``plain_step_share`` and ``lookup_pass_share``: the passes that the adaptive draft length ran as plain steps, and
  as prompt-lookup copies alone (hf_specdec drafters);
* ``cache_length_ratio``: the target cache's length at the end of a run over the sequence length (the worst run);
  a batched cache holds masked slots of rejected tokens until compacted, so this shows how compact it stayed;
* ``length_cap_hits``: outputs that reached ``max_new_tokens`` without an EOS (first repeat), and with a task
  scorer, ``task_accuracy`` (share of outputs the task judges correct: pass@1, exact match) over ``task_scored``
  outputs;
* ``identical``: greedy outputs are token-identical to plain ``generate`` (``None`` for sampling), every row compared
  up to and including its first EOS;
* ``mismatches``, ``near_tie_mismatches``, ``real_mismatches``, ``identical_up_to_near_ties``, ``mismatch_details``:
  every greedy output that differs from plain's is classified at its first divergent token (see
  :func:`classify_divergence`): a numerical near-tie (plain's two candidates within the rounding error of the
  target's dtype) or a real difference. In half precision (bf16 / fp16) a one-token step and a multi-token
  verification pass round differently, so every speculative method, transformers' own included, can drift from plain
  greedy at near-ties; ``identical_up_to_near_ties`` is then the check that holds. In fp32 the promise is exact
  identity: near-ties are still reported but not excused (``identical_up_to_near_ties`` equals ``identical``).

Besides the records, the report's ``load`` entry holds the machine's load averages (``os.getloadavg()``) at the start
of the timed runs, after every repeat of every setting and at their end, with the CPU count, the CPUs the process may
use and torch's thread count.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ..cpu_kernels import DEFAULT_DRAFT_KERNELS, draft_kernels_for, grouped_query_sdpa, linear_kernels_for_all
from .prompts import PromptItem, render_prompt
from .report import FASTER, SLOWER, WITHIN_NOISE

__all__ = [
    "NEAR_TIE_K",
    "BenchMethod",
    "classify_divergence",
    "near_tie_tolerance",
    "plain_method",
    "adapted_target_methods",
    "drafter_method",
    "assisted_method",
    "prompt_lookup_method",
    "run_benchmark",
    "hardware_info",
]


@dataclass
class BenchMethod:
    """One decoding method of a benchmark.

    Attributes:
        name: label in the report (unique within a run).
        kind: ``"plain"``, ``"drafter"`` (an hf_specdec drafter), ``"assisted"`` (transformers' assisted generation
            with a small assistant model) or ``"prompt_lookup"`` (transformers' prompt-lookup decoding).
        model: the drafter or assistant model, if any.
        generate_kwargs: extra keyword arguments for ``target.generate``.
        max_batch_size: largest batch the method supports (transformers' speculative methods: 1).
        approximate: outputs may deviate from the target's own decoding (approximate verifiers).
        target: the model ``generate`` runs on, when not the benchmark's target: the adapted target of a drafter
            trained with a target adapter. Speedups stay against the benchmark's plain ``generate``.
        reference: name of the plain method whose greedy outputs this method must reproduce (default: the
            benchmark's plain ``generate``; a plain method is its own reference).
    """

    name: str
    kind: str
    model: Any = None
    generate_kwargs: dict = field(default_factory=dict)
    max_batch_size: int | None = None
    approximate: bool = False
    target: Any = None
    reference: str | None = None

    def skip_reason(self, batch_size: int, do_sample: bool) -> str | None:
        if self.max_batch_size is not None and batch_size > self.max_batch_size:
            return f"{self.kind} supports batch size <= {self.max_batch_size} in transformers"
        if self.approximate and do_sample:
            return "approximate verifier is greedy-only"
        return None


def plain_method(name: str = "plain", target=None) -> BenchMethod:
    """Plain ``target.generate`` (the baseline); with ``target``, plain decoding of that model (e.g. an adapted
    target), the reference its own drafter rows are checked against."""
    return BenchMethod(name=name, kind="plain", target=target, reference=name if target is not None else None)


def adapted_target_methods(drafter, adapted_target, methods: list[BenchMethod]) -> list[BenchMethod]:
    """Puts ``methods`` of a drafter trained with a target adapter (``drafter.adapt_target(target)``) on
    ``adapted_target``, after a plain row of that adapted target: their greedy outputs are checked against it,
    their speedups stay against the benchmark's plain ``generate`` of the unadapted target.

    ``adapted_target`` must be its own copy of the target: peft injects the adapter into the model it wraps, so an
    adapter on the benchmark's own target would change its plain baseline too."""
    drafter.check_target_adapter(adapted_target)
    source = os.path.basename(str(getattr(drafter, "name_or_path", "") or "").rstrip("/")) or "drafter"
    reference = plain_method(name=f"plain:adapted({source})", target=adapted_target)
    for method in methods:
        method.target, method.reference = adapted_target, reference.name
    return [reference, *methods]


def drafter_method(
    drafter,
    name: str | None = None,
    num_draft_tokens: int | None = None,
    verifier: str | None = None,
    verifier_options: dict | None = None,
    draft_options: dict | None = None,
    draft_length: str | None = None,
    lookup_tokens: int | None = None,
    forced_tokens: bool | None = None,
    copy_threshold: float | None = None,
) -> BenchMethod:
    """An hf_specdec drafter (``target.generate(assistant_model=drafter)``), optionally with a verifier, drafting
    options (e.g. ``{"tree": "eagle2", "tree_depth": 5}``), a draft-length mode (``"adaptive"``, the loop's
    default, or ``"fixed"``), the merged prompt lookup's length (``lookup_tokens``; 0: off), the n-gram copies'
    threshold (``copy_threshold``; 0: off) and whether a grammar's forced tokens are verified before drafting
    (``forced_tokens``; the loop's default: yes)."""
    from ..verification import VERIFIERS

    kwargs: dict = {"assistant_model": drafter, "spec_timing": True}
    if num_draft_tokens is not None:
        kwargs["num_assistant_tokens"] = int(num_draft_tokens)
    approximate = False
    if verifier is not None:
        if verifier not in VERIFIERS:
            raise ValueError(f"Unknown verifier {verifier!r}. Available: {sorted(VERIFIERS)}.")
        kwargs["verifier"] = verifier
        approximate = bool(VERIFIERS[verifier].approximate)
    if verifier_options:
        kwargs["verifier_options"] = dict(verifier_options)
    if draft_options:
        kwargs["draft_options"] = dict(draft_options)
    if draft_length is not None:
        kwargs["draft_length"] = draft_length
    if lookup_tokens is not None:
        kwargs["lookup_tokens"] = int(lookup_tokens)
    if copy_threshold is not None:
        kwargs["copy_threshold"] = float(copy_threshold)
    if forced_tokens is not None:
        kwargs["grammar_forced_tokens"] = bool(forced_tokens)
    if name is None:
        family = drafter.config.model_type.removesuffix("_drafter")
        source = os.path.basename(str(getattr(drafter, "name_or_path", "") or "").rstrip("/")) or "drafter"
        k = num_draft_tokens or drafter.config.num_draft_tokens
        label = verifier or ""
        if verifier is not None and verifier_options:
            short = VERIFIERS[verifier].option_labels
            label += " " + " ".join(f"{short.get(key, key)}={value}" for key, value in verifier_options.items())
        shape = f"K={k}"
        if draft_options and draft_options.get("tree"):
            sizes = [
                str(draft_options[key])
                for key in ("tree_depth", "tree_top_k", "tree_total_tokens")
                if key in draft_options
            ]
            shape = f"tree={draft_options['tree']}" + (f"({','.join(sizes)})" if sizes else "")
        others = {key: value for key, value in (draft_options or {}).items() if not key.startswith("tree")}
        if others:
            shape += " " + " ".join(f"{key}={value}" for key, value in others.items())
        if draft_length == "fixed":
            shape += " fixed"
        if lookup_tokens is not None:
            shape += f" lookup={lookup_tokens}"
        if copy_threshold is not None:
            shape += f" copy={copy_threshold:g}"
        if forced_tokens is not None:
            shape += f" forced={'on' if forced_tokens else 'off'}"
        name = f"{family}:{source} {shape}" + (f" [{label}]" if label else "")
    return BenchMethod(name=name, kind="drafter", model=drafter, generate_kwargs=kwargs, approximate=approximate)


def assisted_method(assistant, name: str | None = None, num_assistant_tokens: int | None = None) -> BenchMethod:
    """transformers' assisted generation with a small assistant model sharing the target's tokenizer."""
    kwargs: dict = {"assistant_model": assistant}
    if num_assistant_tokens is not None:
        kwargs["num_assistant_tokens"] = int(num_assistant_tokens)
    if name is None:
        source = os.path.basename(str(getattr(assistant, "name_or_path", "") or "").rstrip("/")) or "assistant"
        name = f"assisted:{source}"
    return BenchMethod(name=name, kind="assisted", model=assistant, generate_kwargs=kwargs, max_batch_size=1)


def prompt_lookup_method(num_tokens: int = 10, max_ngram_size: int = 2) -> BenchMethod:
    """transformers' prompt-lookup decoding (n-gram matches in the prompt as drafts)."""
    kwargs = {"prompt_lookup_num_tokens": int(num_tokens), "max_matching_ngram_size": int(max_ngram_size)}
    return BenchMethod(
        name=f"prompt-lookup:{num_tokens}", kind="prompt_lookup", generate_kwargs=kwargs, max_batch_size=1
    )


NEAR_TIE_K = 4.0
"""``k`` of the near-tie tolerance ``k · eps(dtype) · max(|top-1 logit|, 1)`` (see :func:`near_tie_tolerance`)."""


def near_tie_tolerance(top1_logit: float, dtype: torch.dtype, k: float = NEAR_TIE_K) -> float:
    """How far apart two logits of a greedy step can be and still count as a numerical tie in ``dtype``.

    ``tol = k · eps · max(|top-1 logit|, 1)``, with ``eps = torch.finfo(dtype).eps`` (bf16 2⁻⁷, fp16 2⁻¹⁰, fp32
    2⁻²³). ``eps · |x|`` is between one and two units in the last place (ulps) of ``x``, so ``tol`` is 4–8 ulps of
    the top logit; the ``max(·, 1)`` keeps a floor for logits near zero, where ulps say little about the rounding
    accumulated upstream.

    Why ``k = 4``: a one-token decoding step and a multi-token verification pass compute the same logits with
    different kernels (matmul tiling, attention splits), so each of the two compared logits can differ between the
    two passes by the final rounding (half an ulp) plus the rounding carried in from the last hidden state, in
    practice an ulp or two; their difference, the margin, can then move by up to about four ulps. A smaller ``k``
    calls genuine rounding flips "real"; a much larger one starts excusing real disagreements (in bf16, ``k = 4``
    already allows a logit gap of 0.31 at a top logit of 10, a probability ratio of 1.37). In fp32 the tolerance is
    about 5e-6 at a top logit of 10: in practice only exact ties.

    Args:
        top1_logit: the largest logit of the step.
        dtype: the dtype the target computed its logits in.
        k: the multiple of ``eps`` (default :data:`NEAR_TIE_K`).
    """
    return float(k) * float(torch.finfo(dtype).eps) * max(abs(float(top1_logit)), 1.0)


def classify_divergence(
    logits: torch.Tensor, plain_token: int, other_token: int | None, dtype: torch.dtype, k: float = NEAR_TIE_K
) -> dict:
    """Classifies the first token where a method's greedy output leaves plain greedy decoding's.

    ``logits`` are the target's logits at that step in the plain run (one vector over the vocabulary). The margin is
    ``|logit[plain_token] - logit[other_token]|``: plain's pick against the method's. When the method took plain's
    runner-up, the near-tie case, this is plain's top-2 margin; when it took a token further down, the margin is at
    least that, so a method that jumps past the runner-up is never excused by a tie between plain's top two.

    Returns:
        ``{"kind": "near_tie" | "real", "margin": float | None, "tolerance": float}``: ``"near_tie"`` when the margin
        is within :func:`near_tie_tolerance` of the top logit in ``dtype``; ``"real"`` otherwise, and when the
        method produced no token there (``other_token is None``, margin ``None``).
    """
    scores = logits.detach().float().flatten()
    tol = near_tie_tolerance(float(scores.max()), dtype, k)
    if other_token is None:
        return {"kind": "real", "margin": None, "tolerance": tol}
    margin = abs(float(scores[int(plain_token)]) - float(scores[int(other_token)]))
    return {"kind": "near_tie" if margin <= tol else "real", "margin": margin, "tolerance": tol}


def _rounding_dtype(model) -> torch.dtype:
    """The least precise floating dtype among the model's parameters (float32 when it has none): the precision its
    logits are rounded to, mixed-precision layouts (fp32 norms, bf16 matmuls) included."""
    best = torch.float32
    for param in model.parameters():
        if param.dtype.is_floating_point and torch.finfo(param.dtype).eps > torch.finfo(best).eps:
            best = param.dtype
    return best


def _is_half(dtype: torch.dtype) -> bool:
    return torch.finfo(dtype).bits < 32


def hardware_info(device: torch.device | str | None = None) -> dict:
    """Where the benchmark ran: device, its name, threads and library versions."""
    import transformers

    from .. import __version__

    device = torch.device(device) if device is not None else torch.device("cpu")
    info = {
        "device": device.type,
        "device_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_specdec": __version__,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class _Counter:
    """Counts forward calls of a module and the wall time spent in them (forward hooks)."""

    def __init__(self, module: torch.nn.Module | None, timed: bool):
        self.calls = 0
        self.seconds = 0.0
        self._t0 = 0.0
        self._handles = []
        if module is not None:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))
        self.timed = timed

    def _pre(self, module, args):
        self.calls += 1
        if self.timed:
            self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        if self.timed:
            self.seconds += time.perf_counter() - self._t0

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@dataclass
class _Run:
    """Measurements of one method on one prompt batch (one repeat)."""

    seconds: float
    new_tokens: int
    target_forwards: int
    sequences: torch.Tensor | None = None
    accepted: list[int] = field(default_factory=list)  # per pass, bonus included (all rows)
    drafted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    drafting_s: float = 0.0
    draft_steps: int = 0
    verify_target_s: float = 0.0  # target time in verification passes
    passes: int = 0
    plain_steps: int = 0  # passes the adaptive length ran as plain steps
    lookup_passes: int = 0  # passes that verified prompt-lookup copies alone
    cache_ratio: float | None = None  # target cache length over the sequence length at the end
    assistant_calls: int = 0
    assistant_s: float = 0.0
    target_logprob: tuple[float, int] | None = None  # (sum of log-probs, tokens) of the generated tokens
    task_scores: list[bool] | None = None  # per row, with a task scorer (first repeat)
    cap_hits: int = 0  # rows that reached max_new_tokens without an EOS
    prompt_width: int = 0
    divergences: list[dict] | None = None  # greedy: the classified first divergences from plain (first repeat)


def _count_new_tokens(new: torch.Tensor, eos_ids: set[int]) -> int:
    """Tokens per row up to and including the first EOS (rows finished early are padded after it)."""
    total = 0
    for row in new.tolist():
        count = len(row)
        for i, tok in enumerate(row):
            if tok in eos_ids:
                count = i + 1
                break
        total += count
    return total


def _eos_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _sync(device: torch.device) -> None:
    from ..generation.loop import synchronize

    synchronize(device)


def _batches(prompts: list[PromptItem], batch_size: int) -> list[list[PromptItem]]:
    by_category: dict[str, list[PromptItem]] = {}
    for item in prompts:
        by_category.setdefault(item.category, []).append(item)
    out = []
    for items in by_category.values():
        out.extend(items[i : i + batch_size] for i in range(0, len(items), batch_size))
    return out


def run_benchmark(
    target,
    tokenizer,
    methods: list[BenchMethod],
    prompts: list[PromptItem],
    *,
    max_new_tokens: int = 128,
    temperatures: tuple[float, ...] | list[float] = (0.0,),
    batch_sizes: tuple[int, ...] | list[int] = (1,),
    warmup: int = 1,
    repeats: int = 1,
    seed: int = 0,
    top_p: float | None = None,
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    config: dict | None = None,
    scorer=None,
    schemas: dict[str, dict] | None = None,
    schema_options: dict | None = None,
    linear_kernels: str = "packed",
    draft_kernels: str = DEFAULT_DRAFT_KERNELS,
) -> dict:
    """Runs every method on every prompt, interleaved, and returns a report (see :mod:`hf_specdec.bench.report`).

    Args:
        target: the target causal LM (any transformers decoder-only model, accelerate-dispatched or not).
        tokenizer: its tokenizer (chat prompts use its chat template when it has one).
        methods: what to compare; plain ``generate`` is added first if missing (it is the baseline).
        prompts: from :func:`hf_specdec.bench.prompts.load_prompts`.
        max_new_tokens: generation length per prompt.
        temperatures: ``0`` means greedy; ``T > 0`` samples at temperature ``T`` (``top_k`` off, ``top_p``).
        batch_sizes: batch sizes to measure; methods that do not support a batch size are reported as skipped.
        warmup: untimed runs of every method on the first batch before timing.
        repeats: timed passes over all prompts; a record's ``verdict`` needs at least 3 (one speedup per
            repeat).
        seed: sampling seed; every method gets the same seed for the same batch and repeat.
        max_prompt_tokens: keep only the last ``N`` tokens of longer prompts (``None``: an over-long prompt is an
            error).
        config: extra fields recorded in the report's ``config``.
        scorer: ``score(item, text) -> bool`` for a task with checkable answers
            (:func:`hf_specdec.bench.tasks.load_task`): every method's first-repeat output of every prompt, decoded
            up to its first EOS, is scored, giving ``task_accuracy`` per record.
        schemas: per prompt id, a JSON schema its output is constrained to (every method, plain included, decodes
            under it: a fresh :class:`~hf_specdec.GrammarLogitsProcessor` per ``generate`` call, through xgrammar).
        schema_options: xgrammar's options for compiling them (e.g. ``{"any_whitespace": False, "indent": 2}``: a
            fixed layout, whose newlines, indentation and keys the grammar then forces); recorded in the config.
        linear_kernels: ``"packed"`` (default): for the run, the fp32 CPU linear layers of the target (and of any
            method's own target) compute passes over 1–64 rows with pre-packed oneDNN weights where this machine
            measured them faster, for every method alike (:mod:`hf_specdec.cpu_kernels`: plain decoding's one-token
            steps too); ``"stock"``: the targets as they are. The config records which, how many layers, and per
            layer shape the rows packed (``linear_kernel_rows``; the drafters' in ``draft_kernel_rows``). Every
            method runs with
            :func:`~hf_specdec.cpu_kernels.grouped_query_sdpa` (what the speculative loop does itself), so a padded
            batch's plain baseline attends as the loop does; the config's ``attention`` says whether it applied.
        draft_kernels: ``"bf16"`` or ``"int8"``: for the run, every drafter's and assistant model's fp32 CPU
            linear layers compute with those weights, where the CPU can
            (:func:`~hf_specdec.cpu_kernels.pack_draft_weights`: a draft step costs less, the output is unchanged);
            ``"stock"``: the drafters as they are. Default: ``DEFAULT_DRAFT_KERNELS``. The config's
            ``draft_kernels`` records which.
    """
    _check_arguments(prompts, methods, max_new_tokens, repeats, warmup, batch_sizes, temperatures)
    drafters, targets = [m.model for m in methods], [target] + [m.target for m in methods if m.target is not None]
    with (
        linear_kernels_for_all(targets, linear_kernels) as packed,
        draft_kernels_for(drafters, draft_kernels, targets) as draft_packed,
        grouped_query_sdpa(target) as grouped,
    ):
        kernels = _kernels_config(packed, draft_packed, draft_kernels, grouped)
        grammars = _SchemaGrammars(schemas, tokenizer, target, schema_options) if schemas else None
        bench = _Benchmark(target, tokenizer, methods, prompts, max_new_tokens, top_p, max_prompt_tokens, grammars)
        settings = [(t, b) for t in temperatures for b in batch_sizes]
        load_record = bench.time_all(settings, warmup, repeats, seed, progress)
        bench.score_approximate_methods()
        if scorer is not None:
            bench.score_task(scorer)
        bench.classify_greedy_mismatches(settings)
        records = _build_records(bench.results, bench.skipped, settings, bench.batches_of, prompts, bench.methods,
                                 bench.plain_name, bench.reference_of, _is_half(bench.rounding_dtype))  # fmt: skip
    report_config = {
        "target": str(getattr(target, "name_or_path", "") or type(target).__name__),
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "near_tie_dtype": str(bench.rounding_dtype).removeprefix("torch."),
        "near_tie_k": NEAR_TIE_K,
        "max_new_tokens": max_new_tokens,
        "temperatures": list(temperatures),
        "top_p": top_p,
        "batch_sizes": list(batch_sizes),
        "warmup": warmup,
        "repeats": repeats,
        "seed": seed,
        "num_prompts": len(prompts),
        "categories": sorted({item.category for item in prompts}),
        "max_prompt_tokens": max_prompt_tokens,
        "methods": _describe_methods(bench.methods, bench.reference_of, bench.plain_name),
        **kernels,
    }
    if schema_options:
        report_config["schema_options"] = dict(schema_options)
    report_config.update(config or {})
    return {"hardware": hardware_info(bench.device), "config": report_config, "records": records, "load": load_record}


def _kernels_config(packed, draft_packed, draft_kernels: str, grouped: bool) -> dict:
    """What the report's config says of the run's kernels: the packed target layers and drafter layers (how many, and
    per weight shape the rows each computes) and the attention."""
    return {
        "linear_kernels": f"packed ({len(packed)} layers)" if len(packed) else "stock",
        "attention": "sdpa, grouped-query kernel for every call" if grouped else "as loaded",
        "draft_kernels": f"{draft_kernels}, packed ({len(draft_packed)} layers)" if len(draft_packed) else "stock",
        "linear_kernel_rows": packed.row_plans(),
        "draft_kernel_rows": draft_packed.row_plans(),
    }


def _check_arguments(prompts, methods, max_new_tokens, repeats, warmup, batch_sizes, temperatures) -> None:
    if not prompts:
        raise ValueError("No prompts to benchmark: check the prompt source, categories and limits.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")
    if any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}.")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {list(temperatures)}.")
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"Method names must be unique, got {names}.")


class _Benchmark:
    """One :func:`run_benchmark` call's state, phase by phase: the methods (plain first) and their references, the
    encoded prompts, the forward counters; then the timed runs (:meth:`time_all`) and the untimed checks of their
    outputs (log-likelihood of approximate methods, task scores, classified greedy mismatches)."""

    def __init__(self, target, tokenizer, methods, prompts, max_new_tokens, top_p, max_prompt_tokens, grammars=None):
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.grammars = grammars
        self.max_new_tokens, self.top_p = max_new_tokens, top_p
        self.methods = list(methods)
        if not any(m.kind == "plain" and m.target is None for m in self.methods):
            self.methods.insert(0, plain_method())
        self.plain_name = next(m.name for m in self.methods if m.kind == "plain" and m.target is None)
        self.by_name = {m.name: m for m in self.methods}
        self.reference_of = {m.name: m.reference or self.plain_name for m in self.methods}
        self._check_references()
        self.device = target.get_output_embeddings().weight.device
        self.input_device = target.get_input_embeddings().weight.device
        self.eos_ids = _eos_ids(target)
        if tokenizer.pad_token_id is None:
            raise ValueError("The tokenizer has no pad token; set `tokenizer.pad_token` (e.g. to its EOS token).")
        self.pad_id = tokenizer.pad_token_id
        self.encoded = self._encode(max_prompt_tokens)
        self.rounding_dtype = _rounding_dtype(target)
        self.results: dict[tuple, list[_Run]] = {}
        self.skipped: dict[tuple, str] = {}
        self.batches_of: dict[int, list[list[PromptItem]]] = {}

    def _check_references(self) -> None:
        for name, ref in self.reference_of.items():
            reference = self.by_name.get(ref)
            if reference is None or reference.kind != "plain" or reference.target is not self.by_name[name].target:
                raise ValueError(
                    f"Method {name!r} must be checked against a plain method of the same model, got reference "
                    f"{ref!r}; build adapted-target rows with adapted_target_methods()."
                )

    def model_of(self, method: BenchMethod):
        return self.target if method.target is None else method.target

    def _encode(self, max_prompt_tokens: int | None) -> dict:
        max_positions = getattr(self.target.config, "max_position_embeddings", None)
        encoded = {}
        for item in self.prompts:
            ids = self.tokenizer(render_prompt(item, self.tokenizer), return_tensors="pt").input_ids[0]
            if max_prompt_tokens is not None and ids.numel() > max_prompt_tokens:
                ids = ids[-max_prompt_tokens:]
            if max_positions is not None and ids.numel() + self.max_new_tokens > max_positions:
                raise ValueError(
                    f"Prompt {item.id!r} has {ids.numel()} tokens; with max_new_tokens={self.max_new_tokens} it "
                    f"exceeds the target's {max_positions} positions. Pass max_prompt_tokens (--max-prompt-tokens) "
                    "or fewer tokens."
                )
            encoded[item.id] = ids
        return encoded

    def make_inputs(self, batch: list[PromptItem]):
        seqs = [self.encoded[item.id] for item in batch]
        width = max(s.numel() for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):  # left padding
            ids[i, width - s.numel() :] = s
            mask[i, width - s.numel() :] = 1
        return ids.to(self.input_device), mask.to(self.input_device)

    def method_kwargs(self, method: BenchMethod, temperature: float, batch: list[PromptItem]) -> dict:
        kwargs = dict(method.generate_kwargs)
        kwargs.update(max_new_tokens=self.max_new_tokens, pad_token_id=self.pad_id)
        if self.grammars is not None:  # a fresh grammar processor per generate call, one grammar per row
            kwargs["logits_processor"] = LogitsProcessorList([self.grammars.processor(batch)])
        if temperature > 0:
            top_p = 1.0 if self.top_p is None else self.top_p
            kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        return kwargs

    # ---------------------------------------------------------------------------------------------- timed runs
    def _install_counters(self) -> None:
        """Target forwards per generating model (a peft-wrapped target counts its base model's), and the assistant
        models' calls and time."""
        self.target_counters = {}
        for method in self.methods:
            model = self.model_of(method)
            if id(model) not in self.target_counters:
                base = model.get_base_model() if hasattr(model, "get_base_model") else model
                self.target_counters[id(model)] = _Counter(base, timed=False)
        self.assistant_counters = {m.name: _Counter(m.model, timed=True) for m in self.methods if m.kind == "assisted"}

    def _remove_counters(self) -> None:
        for counter in [*self.target_counters.values(), *self.assistant_counters.values()]:
            counter.remove()

    def run_once(self, method: BenchMethod, batch, temperature: float, run_seed: int) -> _Run:
        ids, mask = self.make_inputs(batch)
        kwargs = self.method_kwargs(method, temperature, batch)
        if method.kind == "drafter":
            kwargs["return_dict_in_generate"] = True
        counter = self.assistant_counters.get(method.name)
        if counter is not None:
            counter.reset()
        target_counter = self.target_counters[id(self.model_of(method))]
        target_counter.reset()
        torch.manual_seed(run_seed)
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model_of(method).generate(input_ids=ids, attention_mask=mask, **kwargs)
        _sync(self.device)
        seconds = time.perf_counter() - t0
        sequences = out.sequences if hasattr(out, "sequences") else out
        run = _Run(
            seconds=seconds,
            new_tokens=_count_new_tokens(sequences[:, ids.shape[1] :], self.eos_ids),
            target_forwards=target_counter.calls,
            sequences=sequences.cpu(),
            prompt_width=ids.shape[1],
        )
        # Generation ends at an EOS or at max_new_tokens: a row without an EOS was cut by the cap.
        run.cap_hits = sum(not (set(row.tolist()) & self.eos_ids) for row in run.sequences[:, ids.shape[1] :])
        if method.kind == "drafter":
            _record_loop_timings(run, out, sequences.shape[1])
        if counter is not None:
            run.assistant_calls, run.assistant_s = counter.calls, counter.seconds
        return run

    def _active_methods(self, temperature: float, bsz: int) -> list[BenchMethod]:
        active = []
        for method in self.methods:
            reason = method.skip_reason(bsz, temperature > 0)
            if reason:
                self.skipped[(method.name, temperature, bsz)] = reason
            else:
                active.append(method)
        return active

    def time_all(self, settings, warmup: int, repeats: int, seed: int, progress: bool) -> dict:
        """Every method on every batch, ``repeats`` times, in an order rotated per batch and repeat (so no method
        always runs first); returns the machine-load record."""
        total = sum(len(_batches(self.prompts, b)) for _, b in settings) * repeats * len(self.methods)
        bar = _progress(total, progress)
        load = _LoadLog()
        self._install_counters()
        try:
            for temperature, bsz in settings:
                batches = self.batches_of.setdefault(bsz, _batches(self.prompts, bsz))
                active = self._active_methods(temperature, bsz)
                for _ in range(warmup):
                    for method in active:
                        self.run_once(method, batches[0], temperature, seed)
                for rep in range(repeats):
                    for b_idx, batch in enumerate(batches):
                        shift = (rep + b_idx) % len(active)
                        for method in active[shift:] + active[:shift]:
                            run = self.run_once(method, batch, temperature, seed + 1000 * rep + b_idx)
                            self.results.setdefault((method.name, temperature, bsz, b_idx), []).append(run)
                            bar.update(1)
                        bar.update(len(self.methods) - len(active))
                    load.repeat_done(temperature, bsz, rep)
        finally:
            bar.close()
            self._remove_counters()
        return load.record()

    # ---------------------------------------------------------------------------------------------- untimed checks
    def score_approximate_methods(self) -> None:
        """The target's log-likelihood of what each approximate method generated (their plain references too),
        under the model they generate for."""
        approximate = [m for m in self.methods if m.approximate]
        scored = {m.name for m in approximate} | {self.reference_of[m.name] for m in approximate}
        for (name, temperature, bsz, b_idx), runs in self.results.items():
            if name in scored and temperature == 0:
                _, mask = self.make_inputs(self.batches_of[bsz][b_idx])
                runs[0].target_logprob = _target_logprob(
                    self.model_of(self.by_name[name]), runs[0].sequences, mask, self.eos_ids, self.input_device
                )

    def score_task(self, scorer) -> None:
        """Task accuracy of every method's first-repeat outputs."""
        for (_, _, bsz, b_idx), runs in self.results.items():
            run = runs[0]
            texts = [
                self.tokenizer.decode(_row_tokens(row, self.eos_ids), skip_special_tokens=True)
                for row in run.sequences[:, run.prompt_width :]
            ]
            run.task_scores = [bool(scorer(item, text)) for item, text in zip(self.batches_of[bsz][b_idx], texts)]

    def classify_greedy_mismatches(self, settings) -> None:
        """Each greedy output that differs from its plain reference's, classified at its first divergent token."""
        for temperature, bsz in settings:
            if temperature > 0:
                continue
            for baseline in self.methods:
                if baseline.kind == "plain" and self.reference_of[baseline.name] == baseline.name:
                    for b_idx, batch in enumerate(self.batches_of[bsz]):
                        self._classify_batch(baseline, temperature, bsz, b_idx, batch)

    def _classify_batch(self, baseline, temperature, bsz, b_idx, batch) -> None:
        plain_runs = self.results.get((baseline.name, temperature, bsz, b_idx))
        if not plain_runs:
            return
        plain_runs[0].divergences = []
        found = {}
        for method in self.methods:
            runs = self.results.get((method.name, temperature, bsz, b_idx))
            if method.name != baseline.name and self.reference_of[method.name] == baseline.name and runs:
                found[method.name] = _first_divergences(plain_runs[0], runs[0], self.eos_ids)
        step_logits = {}
        if any(found.values()):
            ids, mask = self.make_inputs(batch)
            kwargs = self.method_kwargs(baseline, temperature, batch)
            step_logits = _plain_step_logits(
                self.model_of(baseline), plain_runs[0], ids, mask, kwargs, found, self.eos_ids, self.input_device
            )
        for name, divergences in found.items():
            for div in divergences:
                logits, div["source"] = step_logits[(div["row"], div["position"])]
                if logits is None:
                    div.update(kind="real", margin=None, tolerance=None)
                else:
                    div.update(classify_divergence(logits, div["plain_token"], div["token"], self.rounding_dtype))
                div["prompt"] = batch[div["row"]].id
            self.results[(name, temperature, bsz, b_idx)][0].divergences = divergences


class _SchemaGrammars:
    """The json task's grammars: each prompt's schema compiled once (xgrammar, over the target's vocabulary), and a
    fresh :class:`~hf_specdec.GrammarLogitsProcessor` over a batch's grammars for every ``generate`` call (forced
    text spelt by the target's tokenizer)."""

    def __init__(self, schemas: dict[str, dict], tokenizer, target, options: dict | None = None):
        from ..generation.grammar import xgrammar_compiler

        self.schemas, self.options, self.tokenizer = schemas, dict(options or {}), tokenizer
        self.compiler = xgrammar_compiler(tokenizer, target.get_output_embeddings().weight.shape[0])
        self.compiled: dict = {}

    def processor(self, batch: list[PromptItem]):
        import json

        from ..generation.grammar import GrammarLogitsProcessor

        for item in batch:
            if item.id not in self.compiled:
                self.compiled[item.id] = self.compiler.compile_json_schema(json.dumps(self.schemas[item.id]),
                                                                            **self.options)  # fmt: skip
        return GrammarLogitsProcessor.from_xgrammar([self.compiled[item.id] for item in batch], self.tokenizer)


def _record_loop_timings(run: _Run, out, sequence_length: int) -> None:
    """What an hf_specdec ``generate`` reports about its passes, onto the run."""
    for acc_row, draft_row in zip(out.accepted_lengths, out.draft_lengths):
        run.accepted.extend(acc_row)
        run.drafted.extend(draft_row)
    timings = out.timings
    run.draft_s, run.drafting_s, run.draft_steps = timings["draft_s"], timings["drafting_s"], timings["draft_steps"]
    run.verify_target_s, run.passes = timings["target_s"], timings["passes"]
    run.plain_steps, run.lookup_passes = timings.get("plain_steps", 0), timings.get("lookup_passes", 0)
    if timings.get("cache_length"):
        run.cache_ratio = timings["cache_length"] / sequence_length


def _build_records(results, skipped, settings, batches_of, prompts, methods, plain_name, reference_of, half) -> list:
    """One record per method, decoding setting (temperature, batch size) and category (``"all"`` first), each
    against the baseline ``plain_name``'s record of the same setting and category (see :func:`_aggregate`)."""
    records = []
    for temperature, bsz in settings:
        batches = batches_of[bsz]
        categories = sorted({item.category for item in prompts})
        groups = [("all", list(range(len(batches))))]
        if len(categories) > 1:
            for cat in categories:
                groups.append((cat, [i for i, b in enumerate(batches) if b[0].category == cat]))
        for cat, idx in groups:
            plain = _aggregate(results, plain_name, temperature, bsz, idx, None, plain_name, half=half, plain_row=True)
            for method in methods:
                key = (method.name, temperature, bsz)
                base = {
                    "method": method.name,
                    "kind": method.kind,
                    "mode": "sampling" if temperature > 0 else "greedy",
                    "temperature": float(temperature),
                    "batch_size": bsz,
                    "category": cat,
                    "num_prompts": sum(len(batches[i]) for i in idx),
                    "approximate": method.approximate,
                }
                if key in skipped:
                    records.append({**base, "skipped": skipped[key]})
                    continue
                if method.name == plain_name:  # the baseline: its record is ``plain`` itself
                    records.append({**base, **plain})
                    continue
                rec = _aggregate(
                    results,
                    method.name,
                    temperature,
                    bsz,
                    idx,
                    plain,
                    reference_of[method.name],
                    half=half,
                    plain_row=method.kind == "plain",
                )
                if reference_of[method.name] != plain_name:
                    rec["reference"] = reference_of[method.name]
                records.append({**base, **rec})
    return records


def _describe_methods(methods: list[BenchMethod], reference_of: dict, plain_name: str) -> list[dict]:
    """The report config's entry per method: name, kind, generation options and its reference if not the baseline."""
    return [
        {
            "name": m.name,
            "kind": m.kind,
            **_describe_kwargs(m.generate_kwargs),
            **({"reference": reference_of[m.name]} if reference_of[m.name] != plain_name else {}),
        }
        for m in methods
    ]


class _LoadLog:
    """The machine's load averages (1, 5 and 15 minutes) at the start of the timed runs, after every repeat and at
    their end, with the CPUs the process may use: on a shared machine a timing means little without them."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.start = _loadavg()
        self.per_repeat: list[dict] = []

    def repeat_done(self, temperature: float, batch_size: int, repeat: int) -> None:
        self.per_repeat.append(
            {
                "temperature": float(temperature),
                "batch_size": batch_size,
                "repeat": repeat,
                "elapsed_s": round(time.perf_counter() - self.t0, 2),
                "loadavg": _loadavg(),
            }
        )

    def record(self) -> dict:
        """The report's ``load`` entry."""
        return {
            "loadavg_start": self.start,
            "per_repeat": self.per_repeat,
            "loadavg_end": _loadavg(),
            "cpu_count": os.cpu_count(),
            "process_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        }


def _loadavg() -> list[float] | None:
    """``os.getloadavg()`` rounded (``None`` where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


@torch.no_grad()
def _forced_logits(target, sequences: torch.Tensor, prompt_mask: torch.Tensor, eos_ids: set[int], device):
    """One teacher-forced target pass over ``sequences`` (left-padded prompts + generated tokens, padding after EOS
    masked). Returns the logits that predict each generated token, the generated tokens and their validity mask."""
    width = prompt_mask.shape[1]
    new = sequences[:, width:]
    valid = torch.ones_like(new, dtype=torch.bool)
    for row, tokens in enumerate(new.tolist()):
        for i, tok in enumerate(tokens):
            if tok in eos_ids:
                valid[row, i + 1 :] = False
                break
    mask = torch.cat([prompt_mask.cpu(), valid.long()], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = target(
        input_ids=sequences.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device)
    ).logits[:, width - 1 : -1]
    return logits, new, valid


def _target_logprob(target, sequences: torch.Tensor, prompt_mask: torch.Tensor, eos_ids: set[int], device):
    """Sum of the target's log-probabilities of the generated tokens (up to and including EOS) and their count."""
    logits, new, valid = _forced_logits(target, sequences, prompt_mask, eos_ids, device)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, new.to(logits.device)[..., None]).squeeze(-1)
    return float(logp.cpu()[valid].sum()), int(valid.sum())


def _row_tokens(row: torch.Tensor, eos_ids: set[int]) -> list[int]:
    """A generated row up to and including its first EOS (what follows is padding)."""
    tokens = row.tolist()
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1]
    return tokens


def _first_divergences(plain: _Run, other: _Run, eos_ids: set[int]) -> list[dict]:
    """Rows where ``other``'s greedy output differs from ``plain``'s (each up to and including its first EOS), with
    the first divergent position (0 = the first generated token), plain's token there and ``other``'s (``None``
    when ``other``'s row ended before it)."""
    out = []
    for row in range(plain.sequences.shape[0]):
        a = _row_tokens(plain.sequences[row, plain.prompt_width :], eos_ids)
        b = _row_tokens(other.sequences[row, other.prompt_width :], eos_ids)
        if a == b:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if pos >= len(a):  # plain stopped without EOS (the length limit) while the other went on: nothing to score
            out.append({"row": row, "position": pos, "plain_token": None, "token": b[pos]})
        else:
            out.append({"row": row, "position": pos, "plain_token": a[pos], "token": b[pos] if pos < len(b) else None})
    return out


class _StepLogitsRecorder(LogitsProcessor):
    """A logits processor (last in the list) that keeps the scores of the requested ``(row, step)`` pairs: the exact
    logits a greedy step chose from. Returns the scores unchanged."""

    def __init__(self, prompt_width: int, wanted: set[tuple[int, int]]):
        self.prompt_width = prompt_width
        self.steps: dict[int, list[int]] = {}
        for row, step in wanted:
            self.steps.setdefault(step, []).append(row)
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width
        for row in self.steps.get(step, ()):
            self.logits[(row, step)] = scores[row].detach().float().cpu()
        return scores


def _plain_step_logits(target, plain: _Run, ids, mask, kwargs: dict, found: dict, eos_ids: set[int], device) -> dict:
    """The target's logits at every first divergence in ``found`` (``{method: [divergence, ...]}``), as plain greedy
    decoding saw them: ``{(row, position): (logits, source)}``.

    Plain ``generate`` is replayed on the same batch with the same settings, untimed, with a recorder at the end of
    the logits processors, so the logits are those of the one-token steps that made plain's choices (a teacher-forced
    pass would round like a verification pass: the very difference being classified). Where the replay does not
    reproduce plain's row up to the divergence (non-deterministic kernels), one teacher-forced pass over plain's
    output stands in (``source`` says which).
    """
    wanted = {(d["row"], d["position"]) for divs in found.values() for d in divs if d["plain_token"] is not None}
    recorder = _StepLogitsRecorder(ids.shape[1], wanted)
    kwargs = dict(kwargs)
    kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), recorder])
    with torch.no_grad():
        out = target.generate(input_ids=ids, attention_mask=mask, **kwargs)
    replay = (out.sequences if hasattr(out, "sequences") else out).cpu()
    result: dict[tuple[int, int], tuple[torch.Tensor | None, str]] = {}
    forced = None
    for row, pos in sorted(wanted):
        mine = plain.sequences[row, plain.prompt_width :][: pos + 1]
        again = replay[row, ids.shape[1] :][: pos + 1]
        if (row, pos) in recorder.logits and torch.equal(mine, again):
            result[(row, pos)] = (recorder.logits[(row, pos)], "replay")
            continue
        if forced is None:
            forced = _forced_logits(target, plain.sequences, mask, eos_ids, device)[0]
        result[(row, pos)] = (forced[row, pos].float().cpu(), "teacher_forced")
    for divs in found.values():  # plain ended at the length limit where the other output went on: nothing to score
        for d in divs:
            result.setdefault((d["row"], d["position"]), (None, "none"))
    return result


def _describe_kwargs(kwargs: dict) -> dict:
    out = {}
    for key, value in kwargs.items():
        if key in ("assistant_model", "spec_timing"):
            continue
        out[key] = value
    return out


def _aggregate(
    results, name, temperature, bsz, idx, plain: dict | None, reference: str, half: bool = False, plain_row=False
) -> dict:
    """One record's measurements: speed against ``plain`` (the baseline's record; ``None``: this is the baseline),
    greedy identity against the ``reference`` method's outputs; ``plain_row``: plain decoding (tau 1)."""
    runs = [r for i in idx for r in results.get((name, temperature, bsz, i), [])]
    rec = _speed(results, name, temperature, bsz, idx, plain)
    tokens, forwards = rec["new_tokens"], rec["target_forwards"]
    plain = rec if plain is None else plain
    step_s = plain.get("step_s")
    accepted = [a for r in runs for a in r.accepted]
    drafted = [d for r in runs for d in r.drafted]
    tau = alpha = cost = verify_cost = predicted = None
    by_position = None
    if runs and runs[0].accepted or accepted:
        tau = sum(accepted) / len(accepted)
        by_position, alpha = _acceptance(accepted, drafted)
        steps = sum(r.draft_steps for r in runs)
        if steps and step_s:
            cost = sum(r.drafting_s for r in runs) / steps / step_s
        passes = sum(r.passes for r in runs)
        if passes and step_s:
            verify_cost = sum(r.verify_target_s for r in runs) / passes / step_s
            per_pass = (sum(r.verify_target_s for r in runs) + sum(r.draft_s for r in runs)) / passes / step_s
            predicted = tau / per_pass if per_pass > 0 else None
    elif forwards:
        tau = tokens / forwards if name != "plain" else 1.0
        calls = sum(r.assistant_calls for r in runs)
        if calls and step_s:
            cost = sum(r.assistant_s for r in runs) / calls / step_s
    if rec.get("step_s") is not None or plain_row:  # plain decoding
        tau = 1.0
    bound = None
    limits = []
    if cost:
        limits.append(1.0 / cost)
    if alpha is not None:
        limits.append(math.inf if alpha >= 1.0 else 1.0 / (1.0 - alpha))
    if limits and min(limits) < math.inf:
        bound = min(limits)
    identity = _greedy_identity(results, name, reference, temperature, bsz, idx, half)
    logprobs = [r.target_logprob for i in idx for r in results.get((name, temperature, bsz, i), [])[:1]]
    logprob = None
    if logprobs and all(x is not None for x in logprobs):
        total = sum(x[0] for x in logprobs)
        count = sum(x[1] for x in logprobs)
        logprob = total / count if count else None
    rec.update(
        mean_accepted_length=_round(tau),
        acceptance_by_position=[_round(x) for x in by_position] if by_position else None,
        alpha=_round(alpha),
        draft_cost_ratio=_round(cost),
        speedup_bound=_round(bound),
        verify_cost_ratio=_round(verify_cost),
        predicted_speedup=_round(predicted),
        **identity,
        target_logprob=_round(logprob),
    )
    passes = sum(r.passes for r in runs)
    if passes:
        rec["plain_step_share"] = _round(sum(r.plain_steps for r in runs) / passes)
        rec["lookup_pass_share"] = _round(sum(r.lookup_passes for r in runs) / passes)
    firsts = [r for i in idx for r in results.get((name, temperature, bsz, i), [])[:1]]
    rec["length_cap_hits"] = sum(r.cap_hits for r in firsts)  # outputs cut by max_new_tokens, not ended by EOS
    scores = [s for r in firsts for s in (r.task_scores or [])]
    if scores:
        rec["task_accuracy"] = _round(sum(scores) / len(scores))
        rec["task_scored"] = len(scores)
    ratios = [r.cache_ratio for r in runs if r.cache_ratio is not None]
    if ratios:
        # The batched cache keeps masked slots of rejected tokens until it is compacted: its length at the end of
        # a run over the sequence length (prompt padding included), the worst run.
        rec["cache_length_ratio"] = _round(max(ratios))
    return rec


def _greedy_identity(results, name, reference, temperature, bsz, idx, half) -> dict[str, Any]:
    """How a method's greedy first-repeat outputs compare with its plain reference's: identical, the share of
    differing rows, and the differences classified (near-ties, real); all ``None`` when sampling."""
    keys = ("identical", "divergence_rate", "mismatches", "near_tie_mismatches", "real_mismatches",
            "identical_up_to_near_ties", "mismatch_details")  # fmt: skip
    if temperature != 0:
        return dict.fromkeys(keys)
    rows, details, complete = 0, [], True
    for i in idx:
        plain_run = results.get((reference, temperature, bsz, i), [])[:1]
        mine = results.get((name, temperature, bsz, i), [])[:1]
        if not plain_run or not mine:
            complete = False
            continue
        rows += plain_run[0].sequences.shape[0]
        details.extend(mine[0].divergences or [])  # set for every greedy first-repeat run, [] for plain's
    near_ties = sum(d.get("kind") == "near_tie" for d in details)
    return dict(
        identical=not details and complete,
        divergence_rate=_round(len(details) / rows) if rows else None,
        mismatches=len(details),
        near_tie_mismatches=near_ties,
        real_mismatches=len(details) - near_ties,
        # fp32 promises exact identity: near-ties are reported there but not excused.
        identical_up_to_near_ties=complete and near_ties == len(details) and (half or not details),
        mismatch_details=details,
    )


def _speed(results, name, temperature, bsz, idx, plain: dict | None) -> dict:
    """Throughput of one record over the batches ``idx``, its pooled speedup over ``plain`` (the baseline's record;
    ``None``: this is the baseline, which also gets ``step_s``, the wall time of one plain step) and the per-repeat
    speedups with their spread (see :func:`_speedup_spread`)."""
    runs = [r for i in idx for r in results.get((name, temperature, bsz, i), [])]
    seconds = sum(r.seconds for r in runs)
    tokens = sum(r.new_tokens for r in runs)
    forwards = sum(r.target_forwards for r in runs)
    by_repeat = [_round(x) for x in _repeat_throughputs(results, name, temperature, bsz, idx)]
    rec: dict[str, Any] = {
        "new_tokens": tokens,
        "wall_s": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None,
        "tokens_per_s_by_repeat": by_repeat,
        "target_forwards": forwards,
        "median_run_s": round(statistics.median(r.seconds for r in runs), 4) if runs else None,
    }
    if plain is None:
        rec["step_s"] = seconds / forwards if forwards else None
    base = rec if plain is None else plain
    rec["speedup"] = (
        round(rec["tokens_per_s"] / base["tokens_per_s"], 4)
        if rec["tokens_per_s"] and base.get("tokens_per_s")
        else None
    )
    rec.update(_speedup_spread(by_repeat, (plain or {}).get("tokens_per_s_by_repeat") or []))
    return rec


def _repeat_throughputs(results, name, temperature, bsz, idx) -> list[float | None]:
    """Tokens per second of each repeat over the batches ``idx``: repeat ``r``'s new tokens over its wall time
    (``None`` for a repeat that took no time)."""
    per_batch = [results.get((name, temperature, bsz, i), []) for i in idx]
    out = []
    for rep in range(min((len(runs) for runs in per_batch), default=0)):
        seconds = sum(runs[rep].seconds for runs in per_batch)
        tokens = sum(runs[rep].new_tokens for runs in per_batch)
        out.append(tokens / seconds if seconds > 0 else None)
    return out


def _speedup_spread(mine: list, plain: list) -> dict:
    """Per-repeat speedups and what they support.

    Repeat ``r``'s speedup is its tokens/s over plain's tokens/s in the same repeat, on the same prompt batches
    (``mine[r] / plain[r]``): the two ran interleaved, minutes apart at most, so a machine whose speed drifts over
    an hour moves both. Returns ``speedup_by_repeat``, their ``speedup_median``, ``speedup_min``, ``speedup_max``,
    ``speedup_ci95`` (:func:`_speedup_interval`) and the ``verdict`` (:func:`_verdict`); all ``None`` (the list
    empty) without a ratio, as for the baseline itself.
    """
    ratios = [a / b for a, b in zip(mine, plain) if a and b]
    interval = _speedup_interval(ratios)
    return {
        "speedup_by_repeat": [_round(x) for x in ratios],
        "speedup_median": _round(statistics.median(ratios)) if ratios else None,
        "speedup_min": _round(min(ratios, default=None)),
        "speedup_max": _round(max(ratios, default=None)),
        "speedup_ci95": [_round(x) for x in interval] if interval else None,
        "verdict": _verdict(interval, len(ratios)) if ratios else None,
    }


# The 0.975 quantile of Student's t for 1..30 degrees of freedom.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip


def _t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (beyond the table: the Cornish-Fisher
    expansion around the normal quantile, within 1e-4 there)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def _speedup_interval(ratios: list[float]) -> tuple[float, float] | None:
    """95 % interval of the speedup from per-repeat ratios: the t-interval of their logarithms, exponentiated (an
    interval for the geometric mean ratio; ``None`` under two ratios).

    Logarithms because a ratio is multiplicative (0.5× and 2× are equally far from 1) and a machine's slowdowns
    scale both runs of a repeat alike; a t-interval rather than a bootstrap because with the usual 3 to 5 repeats a
    bootstrap interval hardly reaches past the smallest and largest ratio, so it would call "faster" far more often
    than 5 % of the time when the true speedup is 1.
    """
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    half = _t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    center = statistics.fmean(logs)
    return math.exp(center - half), math.exp(center + half)


MIN_VERDICT_REPEATS = 3
"""Fewer per-repeat speedups than this give no verdict (``"too few repeats"``)."""


def _verdict(interval: tuple[float, float] | None, repeats: int) -> str:
    """``"faster"`` when the 95 % interval lies above 1, ``"slower than plain"`` when it lies below 1, else
    ``"within noise"``; ``"too few repeats"`` under :data:`MIN_VERDICT_REPEATS` ratios."""
    if repeats < MIN_VERDICT_REPEATS or interval is None:
        return "too few repeats"
    low, high = interval
    if low > 1.0:
        return FASTER
    if high < 1.0:
        return SLOWER
    return WITHIN_NOISE


def _acceptance(accepted: list[int], drafted: list[int]) -> tuple[list[float], float | None]:
    """Per-position acceptance rates and α from per-pass committed counts (bonus included) and draft lengths."""
    k_max = max(drafted, default=0)
    if k_max == 0:
        return [], None
    reached_at = [0] * k_max
    accepted_at = [0] * k_max
    total_acc = total_reached = 0
    for a, k in zip(accepted, drafted):
        n = min(max(a - 1, 0), k)  # accepted draft tokens (a is cut by EOS / the length limit)
        for j in range(k):
            reached_at[j] += 1
            accepted_at[j] += j < n
        total_acc += n
        total_reached += min(n + 1, k)
    by_position = [accepted_at[j] / reached_at[j] if reached_at[j] else 0.0 for j in range(k_max)]
    alpha = total_acc / total_reached if total_reached else None
    return by_position, alpha


def _round(x, digits: int = 5):
    """``digits`` significant digits."""
    return None if x is None else float(f"{float(x):.{digits}g}")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True)
