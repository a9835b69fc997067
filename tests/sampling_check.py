"""Statistical check that speculative sampling is lossless (shared by the drafter tester and the loop tests).

The check samples ``NUM_SAMPLES`` continuations of one prompt in a single batched ``generate`` call and compares
them with the target's exact law, computed by enumerating every continuation (as plain sampling would draw them):

* each of the ``NUM_TOKENS`` generated positions with a chi-square goodness-of-fit test, and
* the **joint** law of every pair of adjacent positions ``(x_i, x_{i+1})`` with a chi-square test (a verifier can
  keep every marginal right and still get the dependence between the tokens of one pass wrong).

Cells with an expected count below 5 are pooled into one cell. With ``m`` tests, the check fails when a p-value is
below ``ALPHA / m`` (Bonferroni), so a correct verifier fails it with probability at most ``ALPHA`` = 1e-4 (up to the
chi-square approximation; the empirical p-values of a correct verifier were checked to be uniform, see the README).

Settings are chosen so that the check is not vacuous:

* ``NUM_DRAFT_TOKENS`` = 3 and ``max_new_tokens = K + 2``: the first verification pass drafts K = 3 tokens (the loop
  drafts ``k = min(K, remaining - 1)``), so rejections at depth 0, 1 and 2 and full acceptances (bonus token) all
  occur in the sample, and the check asserts that each of them happens in at least 0.5 % of the rows;
* a tiny target (vocabulary 16, ``sharpen`` 10, temperature 0.9, top-k 10) whose distributions are neither flat nor
  one-hot, so that an untrained drafter's draft law differs materially from it (about half the draft tokens are
  rejected);
* the reduced-vocabulary variant gives the drafter a draft vocabulary of 12 of the 16 ids through a non-trivial
  ``d2t`` map that leaves out two of the target's most likely tokens;
* a control with a *subtle* bug, :class:`ResidualIsTargetVerifier` (the real lossless verifier whose token after a
  rejection is drawn from ``p`` instead of the residual ``norm(max(0, p - q))``), must fail the same test.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from helpers import make_target
from transformers import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from hf_specdec.verification.standard import SpeculativeSamplingVerifier

VOCAB = 16
SHARPEN = 10.0
TEMPERATURE = 0.9
TOP_K = 10
PROMPT = (7, 9, 11, 13, 6, 8)
NUM_DRAFT_TOKENS = 3
NUM_TOKENS = NUM_DRAFT_TOKENS + 2  # generated tokens checked: the prefill's token, then a pass drafting K tokens
NUM_SAMPLES = 4000
ALPHA = 1e-4  # family-wise probability that a correct verifier fails the check
MIN_EXPECTED = 5.0
REDUCED_DRAFT_VOCAB = 12
MIN_BRANCH_SHARE = 0.005  # each first-pass outcome (rejection at depth 0..K-1, full acceptance) must occur this often


@functools.lru_cache(maxsize=1)
def sampling_target():
    """The tiny target of the check (Llama, vocabulary 16, no EOS so that every row generates ``NUM_TOKENS``).

    One instance per process (never modified by the tests), so that its exact laws are enumerated once."""
    return make_target("llama", seed=5, vocab=VOCAB, sharpen=SHARPEN, eos_token_id=None)


def generation_kwargs(**overrides):
    kwargs = dict(
        max_new_tokens=NUM_TOKENS,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=TOP_K,
        top_p=1.0,
        num_assistant_tokens=NUM_DRAFT_TOKENS,
        return_dict_in_generate=True,
    )
    kwargs.update(overrides)
    return kwargs


# ---------------------------------------------------------------------------------------------------- exact laws
@dataclass
class ExactLaws:
    """Exact law of the first generated tokens: ``marginals[i]`` of ``x_{i+1}``, ``pairs[i]`` of
    ``(x_{i+1}, x_{i+2})``; ``pruned_mass`` is the probability of the continuations left out of the enumeration."""

    marginals: list[torch.Tensor]
    pairs: list[torch.Tensor]
    pruned_mass: float


_LAWS_CACHE: dict = {}


def exact_laws(
    target, prompt, num_tokens=NUM_TOKENS, temperature=TEMPERATURE, top_k=TOP_K, prune=1e-8, extra_processors=()
):
    """Exact marginal and adjacent-pair laws of the first ``num_tokens`` sampled tokens (temperature + top-k).

    ``extra_processors`` (pure functions of ``(prefixes, scores)``, one row per path) run first, where ``generate``
    puts a user's ``logits_processor``. Enumerates every continuation whose probability exceeds ``prune``; the
    pruned mass is reported (and is far below what the test can resolve). Cached per target object and settings.
    """
    prompt = torch.as_tensor(prompt)
    key = (id(target), tuple(prompt.tolist()), num_tokens, temperature, top_k, prune, id(extra_processors))
    if key in _LAWS_CACHE and _LAWS_CACHE[key][0] is target:
        return _LAWS_CACHE[key][1]
    procs = LogitsProcessorList([*extra_processors, TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k)])
    vocab = target.config.vocab_size
    prefixes = prompt[None]  # (paths, len)
    weights = torch.ones(1, dtype=torch.float64)
    marginals, pairs = [], []
    cache = DynamicCache(config=target.config)  # one token per path and step after the prompt
    with torch.no_grad():
        for step in range(num_tokens):
            feed = prefixes if step == 0 else prefixes[:, -1:]
            logits = target(feed, cache=cache, use_cache=True).logits[:, -1].float()
            probs = torch.softmax(procs(prefixes, logits), -1).double()  # (paths, vocab)
            joint = weights[:, None] * probs
            marginals.append(joint.sum(0))
            if step > 0:  # law of (previous token, this token)
                pair = torch.zeros(vocab, vocab, dtype=torch.float64)
                pair.index_add_(0, prefixes[:, -1], joint)
                pairs.append(pair)
            if step == num_tokens - 1:
                break
            flat = joint.flatten()
            idx = (flat > prune).nonzero().squeeze(-1)
            prefixes = torch.cat([prefixes[idx // vocab], (idx % vocab)[:, None]], dim=1)
            cache.reorder_cache(idx // vocab)  # each surviving path continues its parent's cache
            weights = flat[idx]
    laws = ExactLaws(marginals, pairs, pruned_mass=float(1.0 - marginals[-1].sum()))
    _LAWS_CACHE[key] = (target, laws)
    return laws


def exact_marginals(target, prompt, steps: int = 3, temperature=TEMPERATURE, top_k=TOP_K) -> list[torch.Tensor]:
    """Exact marginal law of each of the first ``steps`` sampled tokens (float32, as before)."""
    return [m.float() for m in exact_laws(target, prompt, steps, temperature, top_k).marginals]


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


# ---------------------------------------------------------------------------------------------------- tests
def chi_square_test(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = MIN_EXPECTED):
    """Pearson's chi-square goodness of fit of ``counts`` to ``probs`` (any shape, flattened).

    Cells whose expected count is below ``min_expected`` are pooled into one cell (merged into the smallest kept
    cell if the pool itself is too small). Returns ``(p_value, statistic, degrees_of_freedom)``.
    """
    counts = counts.flatten().double()
    probs = probs.flatten().double()
    n = counts.sum()
    expected = n * probs
    keep = expected >= min_expected
    obs = counts[keep].clone()
    exp = expected[keep].clone()
    rest_obs = counts[~keep].sum()
    rest_exp = (n - exp.sum()).clamp_min(0.0)
    if rest_exp >= min_expected:
        obs = torch.cat([obs, rest_obs[None]])
        exp = torch.cat([exp, rest_exp[None]])
    else:
        j = exp.argmin()
        obs[j] += rest_obs
        exp[j] += rest_exp
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof < 1:
        return 1.0, float(stat), dof
    p_value = torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0)
    return float(p_value), float(stat), dof


def law_pvalues(generated: torch.Tensor, laws: ExactLaws) -> dict[str, float]:
    """p-values of every position's marginal and every adjacent pair's joint law (``generated``: (n, tokens))."""
    vocab = laws.marginals[0].numel()
    out = {}
    for i, law in enumerate(laws.marginals):
        out[f"x{i + 1}"] = chi_square_test(torch.bincount(generated[:, i], minlength=vocab), law)[0]
    for i, law in enumerate(laws.pairs):
        cells = generated[:, i] * vocab + generated[:, i + 1]
        out[f"(x{i + 1},x{i + 2})"] = chi_square_test(torch.bincount(cells, minlength=vocab * vocab), law)[0]
    return out


def fails_check(pvalues: dict[str, float], alpha: float = ALPHA) -> bool:
    return min(pvalues.values()) < alpha / len(pvalues)


def describe(pvalues: dict[str, float]) -> str:
    return ", ".join(f"{k}: p={v:.2g}" for k, v in pvalues.items())


# ---------------------------------------------------------------------------------------------------- controls
class ResidualIsTargetVerifier(SpeculativeSamplingVerifier):
    """The real lossless verifier with a subtle bug: where every draft token offered after the kept prefix was
    rejected (chains: at the first rejection; trees: every child of the last accepted node), the next token is drawn
    from the target's ``p`` at that point instead of the residual ``norm(max(0, p - q))``. Acceptance decisions are
    the real ones, and every marginal stays close to right; yet the output law is wrong. The check must reject it."""

    name = "sampling_residual_is_p_test_control"

    def verify(self, proposal, scores):
        result = super().verify(proposal, scores)
        dev = scores.device
        n = result.num_accepted.to(dev)
        rows = torch.arange(n.shape[0], device=dev)
        if proposal.is_linear:
            last = n - 1  # the last accepted node (-1: the last committed token)
        else:
            path = result.path.to(dev)
            last = torch.where(n > 0, path[rows, (n - 1).clamp_min(0)], torch.full_like(n, -1))
        parents = proposal.batched_parents().to(dev)
        offered = ((parents == last[:, None]) & proposal.node_valid().to(dev)).any(1)  # it had draft children
        redraw = torch.multinomial(torch.softmax(scores[rows, last + 1], dim=-1), 1)
        tokens = result.tokens.clone()
        tokens[rows, n] = torch.where(offered, redraw.squeeze(-1).to(tokens.device), tokens[rows, n])
        return dataclasses.replace(result, tokens=tokens)


# ---------------------------------------------------------------------------------------------------- the check
def sample(target, drafter, num_samples=NUM_SAMPLES, seed=0, verifier=None, prompt=PROMPT, **overrides):
    """``num_samples`` continuations of ``prompt`` in one batched ``generate`` call (rows are independent).

    The draft length is fixed unless ``overrides`` say otherwise: the check is about the verifier's law, and every
    pass must exercise it (the adaptive length has its own law test in ``tests/test_adaptive.py``)."""
    overrides.setdefault("draft_length", "fixed")
    prompt = torch.as_tensor(prompt)
    ids = prompt[None].repeat(num_samples, 1)
    torch.manual_seed(seed)
    out = target.generate(ids, assistant_model=drafter, verifier=verifier, **generation_kwargs(**overrides))
    return out, out.sequences[:, prompt.numel() :]


def first_pass_outcomes(out, num_draft_tokens=NUM_DRAFT_TOKENS) -> torch.Tensor:
    """Share of rows whose first verification pass committed 1..K+1 tokens (rejection at depth 0..K-1, or all)."""
    first = torch.tensor([row[0] for row in out.accepted_lengths])
    return torch.bincount(first, minlength=num_draft_tokens + 2)[1 : num_draft_tokens + 2].double() / first.numel()


def reduce_draft_vocab(drafter, laws: ExactLaws, draft_vocab_size: int = REDUCED_DRAFT_VOCAB) -> torch.Tensor:
    """Gives ``drafter`` a draft vocabulary that leaves out the target's 2nd and 4th most likely tokens (and the
    least likely ones), through the family's ``init_from_data``; returns the draft vocabulary's target ids."""
    mass = torch.stack(laws.marginals).sum(0)
    order = torch.argsort(mass, descending=True)
    left_out = set(order[[1, 3]].tolist())
    kept = [t for t in order.tolist() if t not in left_out][:draft_vocab_size]
    counts = torch.zeros(mass.numel())
    counts[kept] = 1.0
    drafter.init_from_data(counts)
    ids = torch.tensor(sorted(kept))
    assert torch.equal(drafter.draft_token_ids.sort().values.cpu(), ids), "init_from_data did not set the draft vocab"
    assert not torch.equal(ids, torch.arange(draft_vocab_size)), "the d2t map must not be the identity"
    return ids


def check_sampling_matches_target(
    make_drafter,
    reduced_vocab: bool = False,
    num_samples: int = NUM_SAMPLES,
    seed: int = 0,
    control=ResidualIsTargetVerifier,
    min_branch_share: float | None = MIN_BRANCH_SHARE,
    **overrides,
):
    """The shared lossless-sampling check (see the module docstring). ``make_drafter(target, seed=..., **cfg)``
    builds the family's (untrained) drafter; ``overrides`` go to ``generate`` (e.g. a tree policy), ``control`` is
    the buggy verifier class that must be rejected (``None`` to skip it; it handles chains and trees).
    ``min_branch_share``: how often each first-pass outcome (1..K+1 tokens committed) must occur (``None``: not
    checked; e.g. EAGLE-2 trees of an untrained drafter rarely accept 3 deep: with ``tree="eagle2", tree_depth=3,
    tree_top_k=3, tree_total_tokens=8`` the check passes and the control is rejected at p ~ 1e-121)."""
    target = sampling_target()
    laws = exact_laws(target, PROMPT)
    assert laws.pruned_mass < 1e-4, laws.pruned_mass
    cfg = {"draft_vocab_size": REDUCED_DRAFT_VOCAB} if reduced_vocab else {}
    drafter = make_drafter(target, seed=6, **cfg)
    if reduced_vocab:
        ids = reduce_draft_vocab(drafter, laws)
        outside = [float(m[~torch.isin(torch.arange(VOCAB), ids)].sum()) for m in laws.marginals]
        assert min(outside) > 0.05, f"the target rarely leaves the draft vocabulary: {outside}"

    out, gen = sample(target, drafter, num_samples, seed, **overrides)
    # More than one token per pass, and every branch of the rule exercised in the first pass.
    assert all(row[0] >= NUM_DRAFT_TOKENS for row in out.draft_lengths), "the first pass must draft K tokens"
    shares = first_pass_outcomes(out)
    assert min_branch_share is None or bool((shares >= min_branch_share).all()), (
        f"first-pass outcomes (1..K+1 tokens committed) {shares.tolist()}: every rejection depth and full acceptance "
        "must occur; this drafter's law is too close to (or too far from) the target's for the check"
    )
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), f"the output law differs from the target's: {describe(pvalues)}"

    if control is not None:
        _, bad = sample(target, drafter, num_samples, seed, verifier=control(), **overrides)
        bad_p = law_pvalues(bad, laws)
        assert fails_check(bad_p), (
            "the check cannot tell apart a verifier that samples from p instead of the residual after a rejection "
            f"({describe(bad_p)}); the drafter's law is too close to the target's"
        )
    return out, pvalues
