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

* ``alpha_d`` is counted per depth over every row of every pass that drafted that deep, with exponential forgetting
  (``decay`` per pass) so that the estimate follows the text (code after prose, a repetitive passage...).
* ``t(K)`` is the measured wall time of passes that drafted ``K`` tokens (exponential moving average). Pass times
  of draft lengths not yet tried are interpolated linearly between tried ones (extrapolated with the slope of the
  nearest two, or a 10 % per token prior when only one is known).
* To learn, the controller tries ``K = 0`` once early (the plain-step cost), and then, now and then, a draft length
  next to the current best (hill climbing), so a length that was underestimated gets measured. The first probe comes
  after ``probe_every`` passes; while probes do not change the best choice, the gap between them doubles (up to
  ``max_probe_gap`` passes), so a drafter that does not pay costs next to nothing, and it shrinks back to
  ``probe_every`` as soon as the best choice changes.
* The estimates are kept per drafter, device, batch size, decoding mode and tree policy (on the drafter object),
  so later ``generate`` calls start from what earlier ones learnt.

For tree policies the choice is between the tree and a plain step; the tree's tokens per pass are measured directly.

Where a plain step wins, prompt lookup gets its own chance: when the text's last n-gram occurred before, the pass can
verify the copied continuation instead (no drafting; :func:`hf_specdec.generation.ngram.lookup_proposal`). Its tokens
per pass and pass time are measured separately (:meth:`DraftLengthController.use_lookup`): it is taken while it beats
plain steps, tried once when nothing is known, and re-tried every ``probe_every`` matches so that a passage that
turns repetitive is noticed.

The choice never changes *what* is generated: greedy output stays identical to plain decoding, and sampling stays
lossless. Because the choice depends on wall-clock measurements, a sampled output for a fixed seed is not
bit-reproducible run to run with the adaptive length; pass ``draft_length="fixed"`` for that.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DRAFT_LENGTH_MODES", "DraftLengthController", "controller_for"]

DRAFT_LENGTH_MODES = ("adaptive", "fixed")
_MEMORY_ATTR = "_hf_specdec_draft_length_memory"


class DraftLengthController:
    """Chooses the draft length of each pass (see the module docstring).

    Args:
        k_max: the longest chain to draft (``num_assistant_tokens``), or for trees the tree's node count.
        tree: whether the proposal is a tree (then the arms are ``{0, k_max}``).
        decay: forgetting factor per pass for the acceptance counts and tokens-per-pass of trees.
        cost_smoothing: weight of a new measurement in a pass time's moving average.
        probe_every: passes before the first probe of a neighbouring draft length (and the gap after a change).
        max_probe_gap: the longest gap between two probes.
    """

    def __init__(
        self,
        k_max: int,
        tree: bool = False,
        decay: float = 0.97,
        cost_smoothing: float = 0.3,
        probe_every: int = 12,
        max_probe_gap: int = 192,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}.")
        self.k_max = int(k_max)
        self.tree = bool(tree)
        self.decay = float(decay)
        self.smoothing = float(cost_smoothing)
        self.probe_every = int(probe_every)
        self.max_probe_gap = max(int(max_probe_gap), self.probe_every)
        self._probe_gap = self.probe_every
        self._next_probe = self.probe_every
        self._last_best: int | None = None
        self.reached = [0.0] * (self.k_max + 1)  # index d: rows that drafted token d after accepting d - 1
        self.accepted = [0.0] * (self.k_max + 1)
        self.tree_tokens: float | None = None  # tokens committed per row per tree pass (moving average)
        self.cost: dict[int, float] = {}
        self.passes = 0
        self._probe_side = 1
        self.last_choice: int | None = None
        self.lookup_tokens: float | None = None  # tokens committed per row per lookup-only pass (moving average)
        self.lookup_cost: float | None = None  # seconds of a lookup-only pass (moving average)
        self._lookup_matches = 0
        self._lookup_gap = self.probe_every
        self._lookup_next = self.probe_every

    # ------------------------------------------------------------------ estimates
    def alphas(self) -> list[float]:
        """Per-depth acceptance ``alpha_1..alpha_Kmax`` (a depth never reached takes the one before it; depth 1
        starts at 0.5 before any evidence)."""
        out = []
        prev = 0.5
        for d in range(1, self.k_max + 1):
            r = self.reached[d]
            # A weak prior (one pseudo-observation at the previous depth's rate) keeps rare depths sane.
            a = (self.accepted[d] + prev) / (r + 1.0)
            out.append(a)
            prev = a
        return out

    def expected_tokens(self, k: int) -> float:
        """Expected tokens a pass drafting ``k`` commits (per row)."""
        if k <= 0:
            return 1.0
        if self.tree:
            return self.tree_tokens if self.tree_tokens is not None else 1.0 + self.k_max * 0.5
        total, p = 1.0, 1.0
        for a in self.alphas()[:k]:
            p *= a
            total += p
        return total

    def pass_time(self, k: int) -> float | None:
        """Estimated seconds of a pass drafting ``k`` tokens (``None`` before any measurement)."""
        if k in self.cost:
            return self.cost[k]
        if not self.cost:
            return None
        known = sorted(self.cost)
        lower = [x for x in known if x < k]
        upper = [x for x in known if x > k]
        if lower and upper:
            a, b = lower[-1], upper[0]
            w = (k - a) / (b - a)
            return self.cost[a] * (1 - w) + self.cost[b] * w
        side = lower if lower else upper
        if len(side) >= 2:
            a, b = (side[-2], side[-1]) if lower else (side[0], side[1])
            slope = max((self.cost[b] - self.cost[a]) / (b - a), 0.0)
        else:
            slope = 0.1 * self.cost[side[0]] / max(side[0] + 1, 1)
        anchor = side[-1] if lower else side[0]
        return max(self.cost[anchor] + slope * (k - anchor), 1e-9)

    def arms(self) -> list[int]:
        return [0, self.k_max] if self.tree else list(range(self.k_max + 1))

    def best(self, limit: int | None = None) -> int:
        """The draft length with the highest expected tokens per second (ties: the longer one)."""
        limit = self.k_max if limit is None else min(limit, self.k_max)
        best_k, best_rate = None, -math.inf
        for k in self.arms():
            if k > limit:
                continue
            t = self.pass_time(k)
            if t is None:
                return limit  # nothing measured yet: draft
            rate = self.expected_tokens(k) / t
            if rate >= best_rate:
                best_k, best_rate = k, rate
        return best_k if best_k is not None else 0

    # ------------------------------------------------------------------ the two calls the loop makes
    def choose(self, limit: int) -> int:
        """The draft length of the next pass, at most ``limit`` (the tokens left before the length limit)."""
        limit = min(limit, self.k_max)
        if limit <= 0:
            return 0
        if self.tree and limit < self.k_max:
            limit = self.k_max  # the loop caps tree passes itself; the tree arm stays the tree
        n = self.passes
        if 0 not in self.cost and n == 1:
            choice = 0  # learn what a plain step costs
        else:
            choice = self.best(limit)
            if choice != self._last_best:  # the estimates moved: look around again soon
                self._last_best = choice
                self._probe_gap = self.probe_every
                self._next_probe = min(self._next_probe, n + self.probe_every)
            if n > 1 and n >= self._next_probe:
                self._probe_gap = min(2 * self._probe_gap, self.max_probe_gap)
                self._next_probe = n + self._probe_gap
                arms = [k for k in self.arms() if k <= limit]
                i = arms.index(choice) if choice in arms else 0
                j = min(max(i + self._probe_side, 0), len(arms) - 1)
                if j == i:
                    j = min(max(i - self._probe_side, 0), len(arms) - 1)
                self._probe_side = -self._probe_side
                choice = arms[j]
        self.last_choice = choice
        return choice

    def use_lookup(self) -> bool:
        """Whether a pass for which :meth:`choose` gave ``0`` should verify prompt-lookup copies instead (asked only
        when some row has a match): yes while lookup passes commit more tokens per second than plain steps, when
        either is not measured yet, and now and then to notice that it started paying (after ``probe_every``
        matches, then at gaps that double while it keeps losing, up to ``max_probe_gap``)."""
        self._lookup_matches += 1
        plain = self.cost.get(0)
        if self.lookup_cost is None or self.lookup_tokens is None or plain is None:
            return True
        if self.lookup_tokens / self.lookup_cost > 1.0 / plain:
            self._lookup_gap = self.probe_every
            self._lookup_next = self._lookup_matches + self.probe_every
            return True
        if self._lookup_matches >= self._lookup_next:
            self._lookup_gap = min(2 * self._lookup_gap, self.max_probe_gap)
            self._lookup_next = self._lookup_matches + self._lookup_gap
            return True
        return False

    def update(
        self,
        k: int,
        drafted: torch.Tensor,
        committed: torch.Tensor,
        active: torch.Tensor,
        seconds: float,
        lookup: bool = False,
    ):
        """Records a pass: ``k`` asked for, per-row ``drafted`` tokens and ``committed`` tokens, which rows were
        still generating (``active``), and the pass's wall time. ``lookup``: the pass verified prompt-lookup copies
        in place of the plain step ``k = 0`` (measured apart from plain steps)."""
        self.passes += 1
        if lookup:
            act = active.bool().cpu()
            if bool(act.any()):
                mean = float(committed.cpu()[act].float().mean())
                s = self.smoothing
                self.lookup_tokens = mean if self.lookup_tokens is None else (1 - s) * self.lookup_tokens + s * mean
                self.lookup_cost = seconds if self.lookup_cost is None else (1 - s) * self.lookup_cost + s * seconds
            return
        self.cost[k] = seconds if k not in self.cost else (1 - self.smoothing) * self.cost[k] + self.smoothing * seconds
        if k <= 0:
            return
        act = active.bool().cpu()
        if not bool(act.any()):
            return
        drafted = drafted.cpu()[act].tolist()
        committed = committed.cpu()[act].tolist()
        if self.tree:
            mean = sum(committed) / len(committed)
            self.tree_tokens = (
                mean if self.tree_tokens is None else self.decay * self.tree_tokens + (1 - self.decay) * mean
            )
            return
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


def controller_for(drafter, k_max: int, tree_key, bsz: int, do_sample: bool, device) -> DraftLengthController:
    """The drafter's controller for this setting (created on first use, then reused across ``generate`` calls)."""
    memory = drafter.__dict__.setdefault(_MEMORY_ATTR, {})
    key = (str(device), int(bsz), bool(do_sample), tree_key, int(k_max))
    ctrl = memory.get(key)
    if ctrl is None:
        ctrl = memory[key] = DraftLengthController(k_max, tree=tree_key is not None)
    return ctrl
