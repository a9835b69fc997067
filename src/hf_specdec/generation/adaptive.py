"""Adaptive draft length: how many tokens to draft in each pass, from what the loop measures.

Speculative decoding pays when the tokens a pass commits outweigh what the pass costs. With per-depth acceptance
``alpha_d`` (the chance that draft token ``d`` is accepted, given that the ones before it were), a pass that drafts
``K`` tokens commits on average

    E(K) = 1 + sum_{j=1..K} prod_{d=1..j} alpha_d

tokens and costs ``t(K)`` seconds (drafting, the target pass over ``K + 1`` tokens, verification, and feeding the
result back to the drafter). :class:`DraftLengthController` estimates both online and drafts the ``K`` in
``0..K_max`` that maximises ``E(K) / t(K)``, the expected tokens per second. ``K = 0`` is a plain decoding step (the
drafter only observes), chosen where drafting does not pay: a weak drafter, sampling at a high temperature, or a
large batch on a compute-bound device.

* ``alpha_d`` is counted per depth over the passes that drafted that deep, with exponential forgetting (``decay`` per
  pass) so that the estimate follows the text (code after prose, a repetitive passage...). In a batch every row's
  outcome counts, and the call's progress is discounted for the rows drifting apart: a call runs until its last
  row is done, and over the ``n`` passes left the row furthest behind trails the rows' mean by about
  ``z_B * sigma * sqrt(n)`` tokens (``sigma``: the spread of one row's tokens per pass, from the same acceptances;
  ``z_B``: the expected largest of ``B`` standard normals, 1.03 for 4 rows), so a chain expected to commit ``E(K)``
  per row moves the call on by ``E(K) - z_B * sigma / sqrt(n)`` per pass (at least one token). Counting each pass as
  the progress of its row furthest behind instead, as the loop did before, scored every pass from rows level with
  each other (after plain steps) as the least of four rows' outcomes: on SmolLM2 at batch 4 it put the first
  depth's acceptance far below a row's, and the loop decoded plainly where a fixed chain of two paid. (Trees in a
  batch still count the row furthest behind.)
* ``t(K)`` is measured, never assumed: a length's cost is the median of its recent passes' times, each over a
  plain step's at the context that pass attended over (the median of the recent plain steps, moved along the
  measured growth of a step's time with its context; the median ignores a pass hit by a one-off stall). A step
  over a long prompt takes longer (on SmolLM2 on a 2-core CPU 20 % over 700 slots), so read against the long
  prompt's plain steps a short prompt's drafts looked about a fifth cheaper than they were. Plain steps are the only
  anchor: a draft pass's time never moves the plain-step time, so no run of draft passes can talk the loop into
  reading drafts as cheap. While drafting wins, every other probe is a plain step, so the anchor follows the machine's
  load; a machine that slows down while drafting makes drafts look dear, the loop then takes plain steps, and
  those re-measure the anchor (a few plain steps at worst, never a slower draft). A length that was never run is
  bounded by the cheapest measured longer one (drafting less never costs more), else not chosen; probes measure
  it.
* A draft must be expected to beat a plain step by ``margin`` (5 %) to be chosen, so noise around break-even
  (a weak drafter, whose one-token draft at best pays for its wider pass) decodes plainly.
* After plain steps the drafter must catch up on the slots it did not see before it can draft. That time is
  measured apart (a fixed part and a part per slot, relative to a plain step: it is one batched pass, whose fixed
  cost dominates a few slots and whose cost per slot a long prompt) and counted against drafting, spread over the
  steps left in the call (it is paid once; the drafter then keeps up), so the loop does not flip to drafting for a
  gain the catch-up eats, nor leave a long call on plain steps because the prompt it has not seen yet is long. A
  call that starts where plain steps win (what earlier calls measured) leaves the drafter's pass over the prompt to
  that catch-up too, so a call that never drafts never runs the drafter.
* To learn, the controller tries ``K = 0`` once early (the plain-step cost), and then, now and then, a draft length
  next to the current best (hill climbing), so a length that was underestimated gets measured. The first probe comes
  after ``probe_every`` passes; while probes do not change the best choice, the gap between them doubles (up to
  ``max_probe_gap`` passes), so a drafter that does not pay costs next to nothing, and it shrinks back to
  ``probe_every`` as soon as the best choice changes. A probe's loss is its time over what plain steps take to
  commit what it committed (a probe that pays is a gain), and probes have two budgets. In each call, a probe waits
  while what it is expected to lose (its measured cost and, after plain steps, the drafter's catch-up, less the
  tokens it is expected to commit) would take the call's probes past ``probe_share`` of the call's steps: at batch 4
  on a CPU a pass over several tokens costs about three plain steps and a waiting prompt of a thousand tokens about
  five, 5–8 % of a 64-token call, so such a probe is taken in a longer call or not at all. Over the run, no probe,
  of a draft length or of prompt lookup, runs while the probes' summed loss is above ``probe_share`` of all the time
  measured. Where drafting does not pay (a batch of 4 on a CPU, where a lookup probe costs 2.4–4.9 plain steps)
  exploring then costs at most that share of each call and of the run, whatever the estimates' noise does to the
  gaps between probes.
* A few rejected drafts early on (the first pass after a prompt, two unlucky probes) can put ``alpha_1`` far below
  the drafter's real rate, and the plain steps that follow add no evidence: with probes at doubling gaps the loop
  could then decode plainly for hundreds of passes with a drafter that pays. So while the loop decodes plainly, the
  probe asks the *hopeful* estimate (each ``alpha_d`` raised by ``probe_optimism`` standard errors of its count):
  when that says a draft length would win, the probe drafts that length and the next probe comes after
  ``probe_every`` passes, not a doubled gap, until the evidence settles it either way. The choice itself stays on
  the plain estimates, and these probes are within the same budget.
* The estimates are kept per drafter, target, device, batch size, decoding mode and tree policy
  (:class:`DraftLengthMemory`, outside the drafter object), so later ``generate`` calls start from what earlier
  ones learnt.

For tree policies the choice is between the tree's sizes (:attr:`~hf_specdec.tree.policies.TreePolicy.node_budgets`:
the EAGLE-2 tree of 16 nodes offers 1, 2, 4, 8 and 16) and a plain step. A size's tokens per pass are measured
directly: their mean over the tree passes, decayed like the acceptance counts, with a pseudo-pass at the chains' prior
for as many tokens (2 for a deep tree); the hopeful estimate raises it by its standard error, and a larger tree is
never taken to commit less than a smaller one. A tree that lists its nodes best first (EAGLE-2's) holds every smaller
size as its first nodes, so each pass also tells what each smaller size would have committed: the accepted path's
nodes among the first ``n`` (exactly so for greedy decoding; under sampling, an estimate, since a smaller tree's
rejections fall differently). The costs are measured per size like the chains' lengths, so a tree stays as large as
the hardware pays for: the largest where a wider pass costs next to nothing more (a memory-bound accelerator at
batch 1), a smaller one where it does not (on SmolLM2 on a 2-core CPU a pass over 17 tokens costs 1.5–2.3 plain
steps). A size not measured yet is priced between the measured ones around it (:meth:`cost_bound`).

Prompt lookup gets its own chance before the drafter: when some row's last n-gram occurred before, the pass can verify
the copied continuations (:meth:`hf_specdec.generation.ngram.NgramIndex.proposal`) instead of a plain step or the chosen
draft, without drafting when every row has a copy (rows without one draft their chain; a tree pass gives way only where
every row has one). The drafter fails most where the target copies from its prompt (summaries quoting the article,
answers quoting passages), and that is where a copy holds. Lookup passes' tokens per pass and pass time are measured
separately (:meth:`DraftLengthController.use_lookup`): copies go first while they commit more tokens per second than the
chosen length is expected to (by ``margin``), and are tried once when nothing is known. What a copy commits is learnt
from every match, verified or not (:class:`hf_specdec.generation.ngram.CopyOutcomes` scores each copy against the text
once it is known, as a pass that verified every copy would have committed it; in a batch, rows without a copy count
their one token), so a passage that turns repetitive is noticed at its first matches; only the cost of a lookup pass
needs lookup passes, and it is re-measured at gaps that start at ``probe_every`` matches while copies lose. What copies
commit depends on the text (a passage quoted in one prompt says nothing about the next), so each call learns it again
from its own matches, starting from the earlier calls' estimate weighed as ``copy_prior`` matches; what a lookup pass
costs is the machine's, and carries over.

The choice never changes *what* is generated: greedy output stays identical to plain decoding, and sampling stays
lossless. Because the choice depends on wall-clock measurements, a sampled output for a fixed seed is not
bit-reproducible run to run with the adaptive length; pass ``draft_length="fixed"`` for that.
"""

from __future__ import annotations

import math
import statistics
import threading
import weakref
from collections import deque

import torch

__all__ = [
    "DRAFT_LENGTH_MODES",
    "DraftLengthController",
    "DraftLengthMemory",
    "batch_progress",
    "controller_for",
    "draft_length_memory",
]

DRAFT_LENGTH_MODES = ("adaptive", "fixed")
# Each draft depth is taken to be accepted half the time before any was measured (the chains' prior, and a tree
# size's: n nodes as a chain of n, which gives a deep tree 2 tokens).
_PRIOR_ACCEPTANCE = 0.5


class DraftLengthController:
    """Chooses the draft length of each pass (see the module docstring).

    Args:
        k_max: the longest chain to draft (``num_assistant_tokens``), or for trees the tree's node count.
        tree: whether the proposal is a tree (then the arms are a plain step and the ``budgets``).
        budgets: for trees, the tree sizes to choose among (the policy's ``node_budgets``; ``k_max`` is the largest;
            default: ``k_max`` alone).
        decay: forgetting factor per pass for the acceptance counts and tokens-per-pass of trees.
        copy_window: recent passes with a copy whose outcome (tokens per row a lookup pass commits there) is
            averaged.
        copy_prior: how many of a call's own copy outcomes the estimate of earlier calls weighs as (what a copy
            commits depends on the text: a passage quoted in one prompt says little about the next one, so a call
            starts from earlier calls' estimate and its own outcomes take over after a few matches).
        window: recent pass times kept per draft length (and of plain steps); a length's cost is the median of its
            times over the median of the plain steps'.
        margin: how much more a draft must be expected to commit per second than a plain step before it is taken
            (0.05: 5 % more), so that measurement noise does not make the loop draft where drafting breaks even.
        probe_every: passes before the first probe of a neighbouring draft length (and the gap after a change).
        max_probe_gap: the longest gap between two probes.
        probe_share: the most probes may lose (0.02: 2 %), each one's loss being its time over what plain steps
            take to commit what it committed: a probe waits while its expected loss would take the call's probes
            past this share of the call's steps, and while the probes so far (prompt-lookup re-measures too) have
            lost more than this share of all the time measured.
        probe_optimism: while the loop decodes plainly, a probe drafts the length that estimates raised by this many
            standard errors (of each depth's acceptance count) say would win, and comes again after
            ``probe_every`` passes while they say so (0: probes of the neighbouring length at doubling gaps only).
        rows: the batch's rows; with several, a chain's expected progress is discounted for the rows drifting apart
            (see the module docstring).
    """

    def __init__(
        self,
        k_max: int,
        tree: bool = False,
        budgets: tuple[int, ...] | None = None,
        decay: float = 0.97,
        copy_window: int = 32,
        copy_prior: float = 4.0,
        window: int = 8,
        margin: float = 0.05,
        probe_every: int = 12,
        max_probe_gap: int = 192,
        probe_share: float = 0.02,
        probe_optimism: float = 1.0,
        rows: int = 1,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}.")
        for name, value in (("margin", margin), ("probe_optimism", probe_optimism)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}.")
        self.k_max = int(k_max)
        self.tree = bool(tree)
        self.budgets = _tree_budgets(self.k_max, budgets) if self.tree else ()
        self.decay = float(decay)
        self.margin = float(margin)
        self.probe_every = int(probe_every)
        self.max_probe_gap = max(int(max_probe_gap), self.probe_every)
        self.probe_share = float(probe_share)
        self.probe_optimism = float(probe_optimism)
        self.rows = max(int(rows), 1)
        # the expected largest of `rows` standard normals (Blom's approximation): how far the last row trails
        self._trail = (
            statistics.NormalDist().inv_cdf((self.rows - 0.375) / (self.rows + 0.25)) if self.rows > 1 else 0.0
        )
        self._probe_gap = self.probe_every
        self._next_probe = self.probe_every
        self._last_best: int | None = None
        self.reached = [0.0] * (self.k_max + 1)  # index d: rows that drafted token d after accepting d - 1
        self.accepted = [0.0] * (self.k_max + 1)
        # Per tree size: the passes that tell what it commits, the tokens per row (and their squares), each decayed
        # like the acceptance counts.
        self.tree_passes = [0.0] * len(self.budgets)
        self.tree_sum = [0.0] * len(self.budgets)
        self.tree_sq = [0.0] * len(self.budgets)
        # draft length (0: a plain step) -> recent passes as (context, seconds): the slots the pass attended over
        self.times: dict[int, deque] = {}
        self.step_slope = _StepSlope()  # how a plain step's time grows with its context
        self.context = 0  # the slots the next pass attends over (choose's, else begin_call's)
        self._recorded = 0  # pass times recorded
        self._fitted_at, self._line, self._costs = -1, None, {}  # the anchor and costs as of _recorded == _fitted_at
        self._bounds: dict[int, float | None] = {}  # cost_bound per draft length, refitted with the costs
        self._catchup_fit: tuple[float, float] | None = None  # _catchup_line as of the last catch-up recorded
        self.catchup: deque = deque(maxlen=window)  # (slots, seconds) of recent catch-ups
        self.widest_catchup: tuple[int, float] | None = None  # the catch-up over the most slots so far
        self.window = int(window)
        self.passes = 0
        self._probe_side = 1
        self._probes = 0
        self._probing = False  # the pass being planned explores (a probe or a lookup re-measure)
        self.measured_seconds = 0.0  # every recorded pass, catch-ups included
        self.probe_loss_seconds = 0.0  # what probes cost over plain steps committing the same (negative: a gain)
        self._call_start, self._call_probe_loss = 0, 0.0  # passes before this call; what its probes lost
        self._steps_left = 0  # the steps left in the call as of the last choose
        self.last_choice: int | None = None
        self.copy_outcomes: deque = deque(maxlen=copy_window)  # per row, what this call's recent lookup passes commit
        self.copy_prior = float(copy_prior)
        self._earlier_copies: float | None = None  # earlier calls' estimate of what a lookup pass commits
        self.lookup_times: deque = deque(maxlen=window)  # lookup-only passes as (context, seconds)
        self._lookup_matches = 0
        self._lookup_gap = self.probe_every
        self._lookup_next = self.probe_every

    # ------------------------------------------------------------------ estimates
    def alphas(self, optimism: float = 0.0) -> list[float]:
        """Per-depth acceptance ``alpha_1..alpha_Kmax`` (a depth never reached takes the one before it; depth 1
        starts at 0.5 before any evidence); with ``optimism``, each raised by that many standard errors of its
        count (the hopeful estimate probes ask)."""
        out = []
        prev = _PRIOR_ACCEPTANCE
        for d in range(1, self.k_max + 1):
            n = self.reached[d] + 1.0
            # A weak prior (one pseudo-observation at the previous depth's rate) keeps rare depths sane.
            a = (self.accepted[d] + prev) / n
            out.append(min(a + optimism * (a * (1.0 - a) / n) ** 0.5, 1.0))
            prev = a
        return out

    def expected_tokens(self, k: int, optimism: float = 0.0, steps_left: int | None = None) -> float:
        """Expected tokens by which a pass drafting ``k`` moves the call on (per row; in a batch, with the rows'
        drift over ``steps_left``, by default the steps left as of the last :meth:`choose`, discounted; ``optimism``:
        :meth:`alphas`')."""
        if k <= 0:
            return 1.0
        if self.tree:
            return self.tree_tokens(k, optimism)
        k = min(k, self.k_max)
        return self._tokens_by_length(k, optimism, steps_left)[k]

    def tree_tokens(self, nodes: int | None = None, optimism: float = 0.0) -> float:
        """Tokens per row a tree of ``nodes`` nodes (one of :attr:`budgets`; default the largest) commits: one, plus
        what each size up to it adds over the size below it (the smallest, over a plain step). Each addition is its
        mean over the tree passes that tell it (decayed like the acceptance counts) with one pseudo-pass at the
        chains' prior (the size of ``n`` nodes as a chain of ``n``), raised by ``optimism`` standard errors. Like the
        chains' depths, a size the loop has not drafted lately keeps what it adds to the smaller ones while they
        are re-measured; estimated on its own it would sink to its prior while they rose, and look no better than
        a smaller size that costs less. A mean weighted like the chains' counts, not a moving average started at
        the first pass: one unlucky first tree pass (one token) weighs as one pass (a moving average kept it at
        97 %, and in a trace over SmolLM2's demo prompts such a start kept the estimate below 1.2 for 12 calls)."""
        nodes = self.k_max if nodes is None else nodes
        total, below = 1.0, 0
        for i, size in enumerate(self.budgets):
            if size > nodes:
                break
            prior = sum(_PRIOR_ACCEPTANCE**j for j in range(below + 1, size + 1))
            n = self.tree_passes[i] + 1.0
            mean = (self.tree_sum[i] + prior) / n
            variance = max((self.tree_sq[i] + prior**2) / n - mean * mean, 0.0)
            total += mean + optimism * (variance / n) ** 0.5
            below = size
        return total

    @property
    def step_time(self) -> float | None:
        """Seconds of a plain step now, at the current :attr:`context` (``None`` before one): the anchor every cost
        is relative to (:meth:`step_time_at`)."""
        return self.step_time_at(self.context)

    def step_time_at(self, context: int) -> float | None:
        """Seconds of a plain step over ``context`` slots now: the median of the recent plain steps, each moved to
        ``context`` along :attr:`step_slope` (a step attends over every slot before it: on SmolLM2 on a 2-core CPU
        one over 700 slots takes 20 % longer than one over 50, so plain steps measured on a long prompt made the
        drafts of the short prompt after it look cheap); never below half the fastest of them."""
        line = self._anchor_line()
        if line is None:
            return None
        intercept, slope, floor = line
        return max(intercept + slope * context, floor)

    def _anchor_line(self) -> tuple[float, float, float] | None:
        """``(intercept, slope, floor)`` of :meth:`step_time_at` (``None`` before a plain step), fitted again only
        after a pass time was recorded (the loop asks for costs many times a pass)."""
        if self._fitted_at != self._recorded:
            self._fitted_at, self._costs, self._bounds = self._recorded, {}, {}
            plain, slope = self.times.get(0), self.step_slope.slope
            self._line = None
            if plain:  # a median of the steps moved to context 0: moving them all on to any context keeps it
                intercept = statistics.median(seconds - slope * at for at, seconds in plain)
                self._line = intercept, slope, 0.5 * min(seconds for _, seconds in plain)
        return self._line

    def _relative(self, samples) -> float:
        """The median of ``(context, seconds)`` passes' times, each in plain steps over its own context."""
        return statistics.median(seconds / self.step_time_at(at) for at, seconds in samples)

    def relative_cost(self, k: int) -> float | None:
        """Measured time of a pass drafting ``k`` tokens, in plain steps (the median of its recent passes, each over a
        plain step at its own context; a plain step is 1 by definition); ``None`` while not measured: no draft
        length's cost is assumed."""
        if self._anchor_line() is None:
            return None
        if k <= 0:
            return 1.0
        if k not in self._costs:  # refitted with the anchor
            samples = self.times.get(k)
            self._costs[k] = self._relative(samples) if samples else None
        return self._costs[k]

    def catchup_cost(self, slots: int) -> float:
        """Time, in plain steps, the drafter needs to catch up on ``slots`` verified slots it has not seen (after
        plain steps, or a waiting prompt): a fixed part and a part per slot (:meth:`_catchup_line`), 0 before any
        catch-up was measured."""
        step = self.step_time
        if not self.catchup or not slots or step is None:
            return 0.0
        if self._catchup_fit is None:
            self._catchup_fit = self._catchup_line()
        fixed, per_slot = self._catchup_fit
        return (fixed + per_slot * slots) / step

    def _catchup_line(self) -> tuple[float, float]:
        """``(seconds, seconds per slot)`` of a catch-up, fitted to the recent ones and the widest ever measured.

        A catch-up is one batched pass: over a few slots its fixed cost dominates (and a size the kernels have not
        seen yet can take longer), over a long prompt its cost per slot. So the cost per slot is the least-squares
        slope over the measured sizes, never below 0 and never above the cheapest rate any catch-up measured (its
        time over its slots bounds the slope from above: the bound alone where one size was measured), and the
        fixed part is the median of what the slope leaves. Extrapolating the small catch-ups' rate per slot instead
        priced a waiting 769-token prompt at 200 plain steps (the real one costs about one), so the call never
        drafted."""
        points = list(self.catchup)
        if self.widest_catchup not in points:  # pushed out of the recent ones: it still anchors the slope
            points.append(self.widest_catchup)
        bound = min(seconds / slots for slots, seconds in points)
        mean_slots = statistics.fmean(slots for slots, _ in points)
        spread = sum((slots - mean_slots) ** 2 for slots, _ in points)
        if spread == 0:
            return 0.0, bound
        mean_seconds = statistics.fmean(seconds for _, seconds in points)
        slope = sum((slots - mean_slots) * (seconds - mean_seconds) for slots, seconds in points) / spread
        per_slot = min(max(slope, 0.0), bound)
        return max(statistics.median(seconds - per_slot * slots for slots, seconds in points), 0.0), per_slot

    def cost_bound(self, k: int) -> float | None:
        """``k``'s measured cost, else the cheapest measured cost of a longer draft (a pass never costs less for
        drafting more, so that bounds it from above); ``None`` when neither was measured. A tree size not measured
        yet is priced on the line between the nearest measured sizes around it (a plain step costs 1): a tree's
        sizes lie far apart (1 to 16 nodes), and priced at the larger size's cost a small tree never looks worth a
        probe where the sizes next to the largest commit little more for their cost, however well a small one
        would pay. Drafting it measures it."""
        cost = self.relative_cost(k)
        if cost is not None or k <= 0:
            return cost
        if k not in self._bounds:  # refitted with the anchor
            self._bounds[k] = self._bound_from_others(k)
        return self._bounds[k]

    def _bound_from_others(self, k: int) -> float | None:
        measured = {j: c for j in self.times if (c := self.relative_cost(j)) is not None}
        longer = {j: c for j, c in measured.items() if j > k}
        if not longer:
            return None
        if not self.tree:
            return min(longer.values())
        shorter = max((j for j in measured if j < k), default=None)
        above = min(longer)
        if shorter is None:
            return longer[above]
        return measured[shorter] + (longer[above] - measured[shorter]) * (k - shorter) / (above - shorter)

    def rate(
        self, k: int, pending_slots: int = 0, steps_left: int | None = None, optimism: float = 0.0
    ) -> float | None:
        """Expected tokens per plain-step time of drafting ``k`` (a plain step: 1), the catch-up on
        ``pending_slots`` counted against drafting: against this pass alone, or, given the ``steps_left`` in the
        call, spread over them (the drafter catches up once, then keeps up while the call drafts: a waiting prompt
        is paid for by every draft after it, not by the first); ``None`` while no measurement bounds ``k``'s cost
        (:meth:`cost_bound`); ``optimism``: :meth:`alphas`'."""
        cost = self.cost_bound(k)
        if cost is None:
            return None
        catchup = self.catchup_cost(pending_slots) if k > 0 else 0.0
        return _spread_rate(self.expected_tokens(k, optimism, steps_left), cost, catchup, steps_left)

    def arms(self) -> list[int]:
        return [0, *self.budgets] if self.tree else list(range(self.k_max + 1))

    def best(
        self, limit: int | None = None, pending_slots: int = 0, steps_left: int | None = None, optimism: float = 0.0
    ) -> int:
        """The measured draft length with the highest expected tokens per second (ties: the longer one; the
        catch-up on ``pending_slots`` spread over ``steps_left``, see :meth:`rate`; ``optimism``: :meth:`alphas`');
        a draft must beat a plain step by ``margin`` to be chosen."""
        limit = self.k_max if limit is None else min(limit, self.k_max)
        if not self.times:
            return limit  # nothing measured yet: draft
        tokens = self._tokens_by_length(limit, optimism, steps_left)
        catchup = self.catchup_cost(pending_slots)
        best_k, best_rate = 0, 1.0 + self.margin
        for k in self.arms():
            cost = self.cost_bound(k) if 0 < k <= limit else None
            if cost is None:
                continue
            rate = _spread_rate(tokens[k], cost, catchup, steps_left)
            if rate >= best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _tokens_by_length(self, limit: int, optimism: float, steps_left: int | None = None) -> dict[int, float]:
        """:meth:`expected_tokens` of every draft length up to ``limit`` (chains: in one pass over the acceptances;
        :meth:`best` asks for all of them at every pass)."""
        if self.tree:
            return {k: self.tree_tokens(k, optimism) for k in self.budgets if k <= limit}
        tokens, total, square, p = {0: 1.0}, 1.0, 1.0, 1.0
        for k, a in enumerate(self.alphas(optimism)[:limit], start=1):
            p *= a  # the chance a row commits more than k tokens
            total += p  # a row's expected tokens ...
            square += (2 * k + 1) * p  # ... and their expected square
            tokens[k] = max(total - self._trailing(total, square - total * total, steps_left), 1.0)
        return tokens

    def _trailing(self, tokens: float, variance: float, steps_left: int | None) -> float:
        """Tokens per pass by which the batch's last row trails its rows' mean ``tokens`` over the passes left (the
        module docstring): ``z_B * sigma / sqrt(passes)``; 0 at batch 1."""
        if not self._trail or variance <= 0.0:
            return 0.0
        steps = self._steps_left if steps_left is None else steps_left
        passes = max(steps / tokens, 1.0)
        return self._trail * math.sqrt(variance / passes)

    # ------------------------------------------------------------------ the calls the loop makes
    def choose(self, limit: int, pending_slots: int = 0, context: int | None = None) -> int:
        """The draft length of the next pass, at most ``limit`` (the tokens left before the length limit);
        ``pending_slots``: verified slots the drafter has not seen yet (it catches up before drafting); ``context``:
        the slots the pass attends over (its costs are read, and its time recorded, at that context)."""
        if context is not None:
            self.context = int(context)
        steps_left, limit = limit, min(limit, self.k_max)
        self._steps_left, self._probing = steps_left, False
        if limit <= 0:
            return 0
        if self.tree and limit < self.k_max:
            limit = self.k_max  # the loop caps tree passes itself; the tree arm stays the tree
        n = self.passes
        if self.step_time is None and n >= 1:
            choice = 0  # learn what a plain step costs
        else:
            choice = self.best(limit, pending_slots, steps_left)
            if choice != self._last_best:  # the estimates moved: look around again soon
                self._last_best = choice
                self._probe_gap = self.probe_every
                self._next_probe = min(self._next_probe, n + max(self.probe_every // 4, 1))
            if n > 1 and n >= self._next_probe and self._within_probe_budget():
                choice = self._probe(choice, limit, pending_slots, steps_left)
        self.last_choice = choice
        return choice

    def _probe(self, choice: int, limit: int, pending_slots: int, steps_left: int) -> int:
        """A probe, when this call affords it (:meth:`_call_affords`), else ``choice``: while the loop decodes
        plainly, the draft length the hopeful estimate says would win, if any; else, while drafting wins, every
        other probe is a plain step (it re-measures the anchor every cost is relative to); otherwise the draft
        length next to ``choice`` (alternating sides), so that its cost gets measured."""
        hopeful = self.best(limit, pending_slots, steps_left, self.probe_optimism) if choice == 0 else 0
        plain_turn = choice > 0 and self._probes % 2 == 0
        arm = hopeful or (0 if plain_turn else self._neighbour(choice, limit))
        if not self._call_affords(self._draft_loss(arm, pending_slots)):
            return choice  # asked again at the next pass: a later, cheaper moment of this call or the next call
        self._probe_gap = self.probe_every if hopeful else min(2 * self._probe_gap, self.max_probe_gap)
        self._next_probe = self.passes + self._probe_gap
        if not hopeful:
            self._probes += 1
            self._probe_side = self._probe_side if plain_turn else -self._probe_side
        self._probing = True
        return arm

    def _neighbour(self, choice: int, limit: int) -> int:
        """The draft length next to ``choice`` on the side whose turn it is."""
        arms = [k for k in self.arms() if k <= limit]
        i = arms.index(choice) if choice in arms else 0
        j = min(max(i + self._probe_side, 0), len(arms) - 1)
        if j == i:
            j = min(max(i - self._probe_side, 0), len(arms) - 1)
        return arms[j]

    def _draft_loss(self, k: int, pending_slots: int) -> float | None:
        """What a pass drafting ``k`` is expected to lose against plain steps, in plain steps: its cost and the
        drafter's catch-up on ``pending_slots``, less the tokens it is expected to commit (the plain estimate, not
        the hopeful one); 0 for a plain step, ``None`` while its cost is not known."""
        cost = self.cost_bound(k) if k > 0 else 1.0
        if cost is None:
            return None
        return cost + (self.catchup_cost(pending_slots) if k > 0 else 0.0) - self.expected_tokens(k)

    def _call_affords(self, loss: float | None) -> bool:
        """Whether a probe expected to lose ``loss`` plain steps keeps what this call's probes lose within
        ``probe_share`` of the call's steps (the passes so far and the steps left): a probe over several tokens
        that costs three steps in a batch of 4 is 5 % of a 64-token call, whatever the run-wide budget has saved
        up. A probe whose cost is not measured yet is afforded (running it measures it)."""
        step = self.step_time
        if loss is None or step is None:
            return True
        spent = self._call_probe_loss / step
        return spent + max(loss, 0.0) <= self.probe_share * (self.passes - self._call_start + self._steps_left)

    def _within_probe_budget(self) -> bool:
        """Whether what probes have lost so far is at most ``probe_share`` of all the time measured."""
        return self.probe_loss_seconds <= self.probe_share * self.measured_seconds

    def use_lookup(self, chosen_rate: float = 1.0) -> bool:
        """Whether a pass should verify the rows' prompt-lookup copies before the drafter's chain (asked only when
        some row has a match; ``chosen_rate``: the expected tokens per plain-step time of what :meth:`choose` gave,
        1 for a plain step): yes while lookup passes commit more tokens per second than that by ``margin``, when
        either is not measured yet, and now and then while they lose, to re-measure what a lookup pass costs (after
        ``probe_every`` matches, then at gaps that double, up to ``max_probe_gap``)."""
        if self.step_time is None:
            return False  # a plain step first: lookups are measured against it
        self._lookup_matches += 1
        rate = self.lookup_rate()
        if rate is not None and rate > chosen_rate * (1.0 + self.margin):
            self._lookup_gap = self.probe_every
            self._lookup_next = self._lookup_matches + self.probe_every
            return True
        if rate is None or (self._lookup_matches >= self._lookup_next and self._lookup_probe_afforded()):
            if rate is not None:
                self._lookup_gap = min(2 * self._lookup_gap, self.max_probe_gap)
                self._lookup_next = self._lookup_matches + self._lookup_gap
            self._probing = True
            return True
        return False

    def _lookup_probe_afforded(self) -> bool:
        """Whether a lookup pass that re-measures its cost may run now: within the probes' budget, and its
        expected loss (its cost less the tokens copies commit, in plain steps) within this call's share."""
        loss = self._relative(self.lookup_times) - self.lookup_tokens
        return self._within_probe_budget() and self._call_affords(loss)

    @property
    def lookup_tokens(self) -> float | None:
        """Tokens per row a lookup pass commits: the mean over this call's recent passes with a copy, verified or
        not, with earlier calls' estimate counted as ``copy_prior`` of them (``None`` before any)."""
        n, prior = len(self.copy_outcomes), self._earlier_copies
        if prior is None:
            return statistics.fmean(self.copy_outcomes) if n else None
        return (sum(self.copy_outcomes) + self.copy_prior * prior) / (n + self.copy_prior)

    def begin_call(self, context: int = 0) -> None:
        """A new ``generate`` call over a prompt of ``context`` slots: what copies commit is learnt again from its
        text, from the estimate so far (calls in other threads sharing this controller start over with it: their
        decisions change, never their output)."""
        self.context = int(context)
        self._call_start, self._call_probe_loss = self.passes, 0.0
        self._earlier_copies = self.lookup_tokens
        self.copy_outcomes.clear()

    def record_copies(self, outcomes: list[float]) -> None:
        """Records what lookup passes committed or would have committed, in tokens per row
        (:class:`~hf_specdec.generation.ngram.CopyOutcomes`)."""
        self.copy_outcomes.extend(outcomes)

    def lookup_rate(self) -> float | None:
        """Tokens per plain-step time of passes that verify prompt-lookup copies alone: :attr:`lookup_tokens` over
        the measured lookup passes' median time (``None`` before either is known)."""
        if not self.lookup_times or self.lookup_tokens is None or self.step_time is None:
            return None
        return self.lookup_tokens / self._relative(self.lookup_times)

    def update(
        self,
        k: int,
        drafted: torch.Tensor,
        committed: torch.Tensor,
        active: torch.Tensor,
        seconds: float,
        lookup: bool = False,
        catchup_seconds: float = 0.0,
        catchup_slots: int = 0,
        ends: torch.Tensor | None = None,
        accepted_nodes: torch.Tensor | None = None,
    ):
        """Records a pass: ``k`` asked for, per-row ``drafted`` tokens and ``committed`` tokens, which rows were
        still generating (``active``), and the pass's wall time. ``lookup``: the pass verified prompt-lookup copies
        in place of the plain step ``k = 0`` (its time is measured apart from plain steps; what copies commit comes
        through :meth:`record_copies`). ``catchup_seconds``: the part of
        ``seconds`` the drafter spent catching up on ``catchup_slots`` slots of earlier plain steps (measured apart,
        so a draft length's cost is its own). ``ends``: the rows' lengths after the pass (a probe's loss and, for
        trees, a size's tokens count the progress of the row furthest behind, :func:`batch_progress`).
        ``accepted_nodes``: for a tree listed best first, ``(batch, A)`` each row's accepted path as node indices,
        ``-1`` padded (then the pass also tells what each smaller tree size would have committed)."""
        self.passes += 1
        act = active.bool().cpu()
        self._charge_probe(seconds, committed, act, ends)
        seconds = max(seconds - catchup_seconds, 1e-9)
        if lookup:  # what the copies commit is recorded apart, for every match (record_copies)
            self.lookup_times.append((self.context, seconds))
            return
        self.times.setdefault(k, deque(maxlen=self.window)).append((self.context, seconds))
        self._recorded += 1
        if k <= 0:
            self.step_slope.add(self.context, seconds)
        if catchup_slots:
            self.record_catchup(catchup_slots, catchup_seconds)
        if k <= 0 or not bool(act.any()):
            return
        drafted_rows, committed_rows = drafted.cpu()[act].tolist(), committed.cpu()[act].tolist()
        ends_rows = None if ends is None else ends.cpu()[act].tolist()
        if self.tree:
            paths = None if accepted_nodes is None else accepted_nodes.cpu()[act].tolist()
            self._record_tree(k, committed_rows, ends_rows, paths)
            return
        self._record_acceptance(drafted_rows, committed_rows)

    def record_catchup(self, slots: int, seconds: float) -> None:
        """Records the drafter's batched pass over ``slots`` verified slots it had not seen: a catch-up after plain
        steps (:meth:`update`), or its pass over a call's prompt (the loop times it alike)."""
        self.catchup.append((slots, seconds))
        self._catchup_fit = None
        if self.widest_catchup is None or slots >= self.widest_catchup[0]:
            self.widest_catchup = (slots, seconds)

    def _charge_probe(self, seconds: float, committed: torch.Tensor, act: torch.Tensor, ends) -> None:
        """Adds the pass's time (catch-up included) to the time measured and, when it explored, what it cost over
        the plain steps that would have committed what it did (the call's progress: the row furthest behind)."""
        self.measured_seconds += seconds
        probing, self._probing = self._probing, False
        step = self.step_time if probing else None
        if step is None or not bool(act.any()):
            return
        done = committed.cpu()[act].tolist()
        if ends is not None and len(done) > 1:
            progress = batch_progress([e - c for e, c in zip(ends.cpu()[act].tolist(), done)], done)
        else:
            progress = min(done)
        self.probe_loss_seconds += seconds - progress * step
        self._call_probe_loss += seconds - progress * step

    def _record_tree(self, nodes: int, committed: list[int], ends: list[int] | None, paths: list | None) -> None:
        """Records what a tree pass of ``nodes`` nodes tells: given the rows' accepted ``paths`` (node indices of a
        tree listed best first), what each size up to ``nodes`` adds over the size below it (a path's nodes among
        the first ``n`` are what the tree of ``n`` accepts; the drafted size itself commits what it committed, a
        prompt-lookup copy merged into a chain-shaped size included); without them (a policy of one size), what the
        tree adds over a plain step. A size's tokens are the call's progress (:func:`batch_progress`; the rows' mean
        without ``ends``)."""
        if paths is None and len(self.budgets) > 1:
            raise ValueError(
                "A tree of several sizes needs the rows' accepted paths (accepted_nodes) to record a pass."
            )
        starts = None if ends is None or len(committed) < 2 else [e - c for e, c in zip(ends, committed)]
        below = 1.0
        for i, size in enumerate(self.budgets):
            self.tree_passes[i] *= self.decay
            self.tree_sum[i] *= self.decay
            self.tree_sq[i] *= self.decay
            if size > nodes:
                continue
            done = committed if paths is None or size == nodes else _committed_within(size, committed, paths)
            tokens = statistics.fmean(done) if starts is None else batch_progress(starts, done)
            self.tree_passes[i] += 1.0
            self.tree_sum[i] += tokens - below
            self.tree_sq[i] += (tokens - below) ** 2
            below = tokens

    def _record_acceptance(self, drafted: list[int], committed: list[int]) -> None:
        for d in range(1, self.k_max + 1):
            self.reached[d] *= self.decay
            self.accepted[d] *= self.decay
        for length, c in zip(drafted, committed):
            acc = max(c - 1, 0)
            for d in range(1, min(length, self.k_max) + 1):
                if acc >= d - 1:
                    self.reached[d] += 1.0
                    if acc >= d:
                        self.accepted[d] += 1.0


def _spread_rate(tokens: float, cost: float, catchup: float, steps_left: int | None) -> float:
    """Expected tokens per plain-step time of a pass that commits ``tokens`` for ``cost`` plain steps after a
    catch-up of ``catchup`` plain steps, spread over the ``steps_left`` in the call
    (:meth:`DraftLengthController.rate`)."""
    if steps_left is None or steps_left <= tokens:
        return tokens / (cost + catchup)
    return steps_left / (catchup + steps_left * cost / tokens)


class _StepSlope:
    """How a plain step's time grows with the slots it attends over, in seconds per slot: the least-squares slope over
    the plain steps measured, each weighed ``decay`` less per later plain step (so it spans several calls' prompts,
    and follows the machine). 0 until their contexts spread over ``min_spread`` slots (a standard deviation: one
    short call's do not tell it from the noise); never negative, and never so steep that a step over no slots would
    take less than half the mean step."""

    def __init__(self, decay: float = 0.995, min_spread: float = 64.0):
        self.decay, self.min_spread = decay, min_spread
        self.sums = [0.0] * 5  # weight, context, context², seconds, context·seconds

    def add(self, context: int, seconds: float) -> None:
        terms = (1.0, context, context * context, seconds, context * seconds)
        self.sums = [self.decay * total + term for total, term in zip(self.sums, terms)]

    @property
    def slope(self) -> float:
        weight, context, context_sq, seconds, cross = self.sums
        if weight == 0.0:
            return 0.0
        mean_context, mean_seconds = context / weight, seconds / weight
        variance = context_sq / weight - mean_context**2
        if variance < self.min_spread**2:
            return 0.0
        slope = (cross / weight - mean_context * mean_seconds) / variance
        return min(max(slope, 0.0), 0.5 * mean_seconds / mean_context)


def batch_progress(starts: list[int], committed: list[int]) -> int:
    """How far a batched pass moved the call on: from the shortest row before the pass to the shortest after it
    (a call runs until its last row is done)."""
    return min(s + c for s, c in zip(starts, committed)) - min(starts)


def _committed_within(size: int, committed: list[int], paths: list[list[int]]) -> list[int]:
    """What each row would have committed with the tree's first ``size`` nodes: its accepted path's nodes among them
    and the target's token after them (at most what it committed: a pass is cut at EOS and the length limit)."""
    return [min(c, 1 + sum(0 <= node < size for node in path)) for c, path in zip(committed, paths)]


def _tree_budgets(k_max: int, budgets) -> tuple[int, ...]:
    """The tree sizes a tree's controller chooses among, checked: ``k_max`` alone by default."""
    sizes = tuple(sorted({int(b) for b in budgets})) if budgets else (k_max,)
    if sizes[0] < 1 or sizes[-1] != k_max:
        raise ValueError(f"Tree budgets must lie in [1, {k_max}] and include {k_max}; got {list(sizes)}.")
    return sizes


class DraftLengthMemory:
    """What the adaptive length has learnt for one drafter: a :class:`DraftLengthController` per target and setting
    (device, batch size, decoding mode, tree policy, ``K_max``), so a later ``generate`` call starts from what earlier
    ones measured instead of probing again.

    It is held here, per drafter (never inside the drafter), and forgets a target when the target is freed.
    Threads that share a drafter *and* a target share its controllers: each call's measurements feed them, which can
    change how many tokens another call drafts, never what it generates. :meth:`reset` starts over (after the
    machine's load changes for good, or to make a timing comparison start cold)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_target: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def controller(
        self, target, k_max: int, tree_key, bsz: int, do_sample: bool, device, variant: tuple = (), budgets=None
    ):
        """The controller for this setting (created cold on first use); ``variant``: drafting options that differ
        from the loop's defaults (calls that draft differently learn apart); ``budgets``: a tree's sizes (the tree
        key sets them)."""
        key = (str(device), int(bsz), bool(do_sample), tree_key, int(k_max), variant)
        with self._lock:
            memory = self._by_target.setdefault(target, {})
            if key not in memory:
                memory[key] = DraftLengthController(k_max, tree=tree_key is not None, budgets=budgets, rows=bsz)
            return memory[key]

    def reset(self) -> None:
        with self._lock:
            self._by_target.clear()


_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MEMORIES_LOCK = threading.Lock()


def draft_length_memory(drafter) -> DraftLengthMemory:
    """The drafter's :class:`DraftLengthMemory` (created on first use; forgotten with the drafter)."""
    with _MEMORIES_LOCK:
        if drafter not in _MEMORIES:
            _MEMORIES[drafter] = DraftLengthMemory()
        return _MEMORIES[drafter]


def controller_for(
    drafter, target, k_max: int, tree_key, bsz: int, do_sample: bool, device, variant: tuple = (), budgets=None
) -> DraftLengthController:
    """The drafter's controller for this target and setting (see :class:`DraftLengthMemory`)."""
    return draft_length_memory(drafter).controller(target, k_max, tree_key, bsz, do_sample, device, variant, budgets)
