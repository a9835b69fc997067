"""Serving-time adaptation of a SpecBlock drafter (``generate(..., online_adaptation=True)``; off by default).

After each verification a bandit chooses one of three actions for the drafter: ``skip``, ``head`` (one SGD step on the
LM head and the rank head) or ``full`` (one SGD step on every draft parameter). The step minimises the draft loss (the
training loss with the target's verified tokens as hard labels: valid-prefix masked slots plus the rank head) over a
window of the most recently verified tokens. [design choice: the paper's section on the bandit was not available; the
rule below is ours, see methods.md §10]

* The signal of a round is ``s = sum over rows of (1 - q(y*))``: ``q`` the draft distribution at the first rejected
  draft, ``y*`` the target's token there (rows that accepted every draft add nothing).
* For every action, ``G_a`` is an EWMA (``beta``) of the throughput gain measured after taking it: tokens per second
  of the next round minus an EWMA of all rounds'. ``C_a`` is an EWMA of its cost in the same unit: the tokens the
  round would have produced in the time the update took (``skip`` costs 0).
* The action is ``argmax_a G_a * s / s_avg - C_a``, a random one with probability ``epsilon``; an action never taken
  counts as the best (each is tried once).

The drafter's weights change in place and stay changed after ``generate`` returns (serving adapts to its traffic);
verification stays exact whatever the drafter proposes. ``drafter.adaptation_report`` holds the last call's counts.
"""

from __future__ import annotations

import random
import time

import torch

from ...features import SoftLabels
from ...types import DraftInputs

__all__ = ["ServingAdapter", "ACTIONS"]

ACTIONS = ("skip", "head", "full")


class ServingAdapter:
    def __init__(self, drafter, lr: float = 1e-5, seed: int = 0, window: int = 64, beta: float = 0.9,
                 epsilon: float = 0.05):  # fmt: skip
        if not lr > 0:
            raise ValueError(f"adaptation_lr must be > 0, got {lr!r}.")
        self.drafter = drafter
        self.lr, self.window, self.beta, self.epsilon = float(lr), int(window), float(beta), float(epsilon)
        self.rng = random.Random(seed)
        self.gain = {a: None for a in ACTIONS}  # None: never taken
        self.cost = {a: 0.0 for a in ACTIONS}
        self.counts = {a: 0 for a in ACTIONS}
        self.signal_avg: float | None = None
        self.tps_avg: float | None = None
        self.pending: str | None = None  # the action whose gain the next round measures
        self.last_time: float | None = None
        self.rounds = 0
        self.feats = self.tokens = self.valid = None  # the window of verified slots
        heads = ("lm_head.", "rank_head.")
        self.head_params = [p for n, p in drafter.named_parameters() if n.startswith(heads)]
        self.all_params = [p for _, p in drafter.named_parameters()]
        drafter.adaptation_report = self.report()

    # -- bookkeeping -------------------------------------------------------------------------------------------------
    def report(self) -> dict:
        return {
            "rounds": self.rounds,
            "actions": dict(self.counts),
            "gain": {a: g for a, g in self.gain.items()},
            "cost": dict(self.cost),
        }

    def _ewma(self, old, new):
        return new if old is None else self.beta * old + (1 - self.beta) * new

    def remember(self, inputs: DraftInputs, feats: list) -> None:
        """Adds the verified slots (raw target states, the token after each, validity) to the window."""
        f = torch.cat([x.detach() for x in feats], dim=-1)
        tok = inputs.next_token_ids.to(f.device)
        valid = inputs.valid.to(f.device)
        if self.feats is None:
            self.feats, self.tokens, self.valid = f, tok, valid
        else:
            self.feats = torch.cat([self.feats, f], dim=1)[:, -self.window :]
            self.tokens = torch.cat([self.tokens, tok], dim=1)[:, -self.window :]
            self.valid = torch.cat([self.valid, valid], dim=1)[:, -self.window :]

    @staticmethod
    def signal(inputs: DraftInputs) -> float:
        """``sum over rows of (1 - q(y*))`` at the first rejected draft of the last proposal (chains)."""
        fb = inputs.feedback
        prop = fb.proposal
        if not prop.is_linear:
            raise ValueError(
                "online_adaptation reads the draft distribution at the first rejected draft of a chain; it does not "
                "support tree proposals. Drop tree= or online_adaptation."
            )
        logits = prop.extras.get("draft_logits")
        if logits is None or prop.num_nodes == 0:
            return 0.0
        n = fb.num_accepted.to(logits.device)
        lengths = prop.lengths.to(logits.device) if prop.lengths is not None else torch.full_like(n, prop.num_nodes)
        rejected = n < lengths
        if not bool(rejected.any()):
            return 0.0
        rows = torch.arange(n.shape[0], device=logits.device)
        at = n.clamp(max=prop.num_nodes - 1)
        q = torch.softmax(logits[rows, at].float(), dim=-1)
        y = inputs.next_token_ids.to(logits.device)[rows, n.clamp(max=inputs.next_token_ids.shape[1] - 1)]
        ids = prop.extras["vocab_ids"]
        if ids is not None:  # reduced draft vocabulary: q of a token outside it is 0
            index = torch.full((int(ids.max()) + 2,), -1, dtype=torch.long, device=logits.device)
            index[ids.to(logits.device)] = torch.arange(ids.numel(), device=logits.device)
            col = index[y.clamp(max=index.numel() - 1)]
            q_y = torch.where(
                col >= 0, q.gather(1, col.clamp_min(0)[:, None])[:, 0], torch.zeros_like(n, dtype=q.dtype)
            )
        else:
            q_y = q.gather(1, y[:, None])[:, 0]
        return float(((1 - q_y) * rejected).sum())

    # -- one round ---------------------------------------------------------------------------------------------------
    def after_verification(self, inputs: DraftInputs) -> None:
        now = time.perf_counter()
        fb = inputs.feedback
        tokens = float((fb.num_accepted + 1).sum())
        if self.last_time is not None:
            tps = tokens / max(now - self.last_time, 1e-9)
            if self.pending is not None:
                base = tps if self.tps_avg is None else self.tps_avg
                self.gain[self.pending] = self._ewma(self.gain[self.pending], tps - base)
            self.tps_avg = self._ewma(self.tps_avg, tps)
        s = self.signal(inputs)
        self.signal_avg = self._ewma(self.signal_avg, s)
        action = self.choose(s)
        self.counts[action] += 1
        self.rounds += 1
        spent = 0.0
        if action != "skip" and s > 0:
            t0 = time.perf_counter()
            self.step(self.head_params if action == "head" else self.all_params)
            spent = time.perf_counter() - t0
            if self.tps_avg is not None:
                self.cost[action] = self._ewma(self.cost[action] if self.counts[action] > 1 else None,
                                               spent * self.tps_avg)  # fmt: skip
        self.pending = action
        self.last_time = time.perf_counter()
        self.drafter.adaptation_report = self.report()

    def choose(self, s: float) -> str:
        if s <= 0:
            return "skip"  # nothing was rejected: nothing to learn from
        untried = [a for a in ACTIONS if self.gain[a] is None]
        if untried:
            return untried[0]
        if self.rng.random() < self.epsilon:
            return self.rng.choice(ACTIONS)
        scale = s / max(self.signal_avg or s, 1e-9)
        return max(ACTIONS, key=lambda a: self.gain[a] * scale - self.cost[a])

    def window_loss(self) -> torch.Tensor | None:
        """The draft loss (valid-prefix masked slots plus the rank head) over the window, with the verified tokens as
        hard labels; ``None`` while the window is too short."""
        d = self.drafter
        window_valid = self.valid
        if window_valid is None or int(window_valid.sum()) < 3:
            return None
        bsz, w = self.tokens.shape
        ids = torch.cat([self.tokens[:, :1], self.tokens], dim=1)  # ids[t + 1] is the token after slot t
        feats = torch.cat([self.feats, self.feats[:, -1:]], dim=1)
        valid = torch.cat([window_valid, torch.zeros_like(window_valid[:, :1])], dim=1)
        # hard labels: slot s's label is the token at s + 1, as a one-hot over the draft vocabulary
        vocab = d.config.draft_vocab_size
        if d.reduced_vocabulary:
            index = torch.full((d.config.target_vocab_size,), -1, dtype=torch.long, device=ids.device)
            index[d.draft_token_ids.to(ids.device)] = torch.arange(vocab, device=ids.device)
            col = index[ids]
        else:
            col = ids
        nxt = torch.cat([col[:, 1:], torch.full_like(col[:, :1], -1)], dim=1)
        in_vocab = nxt >= 0
        probs = torch.zeros(bsz, w + 1, vocab, device=ids.device)
        probs.scatter_(2, nxt.clamp_min(0)[..., None], 1.0)
        soft = SoftLabels(probs=probs, argmax=nxt.clamp_min(0), full_argmax=nxt.clamp_min(0))
        loss_mask = valid & torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        first, _ = d.training_blocks(ids, [feats], valid, None, [])
        draft, rank, _ = d._block_loss(first, valid, soft, loss_mask, in_vocab)
        return draft + float(d.config.rank_loss_weight) * rank

    def step(self, params) -> None:
        """One SGD step of ``lr`` on :meth:`window_loss` for ``params`` (the others stay frozen: no graph is built
        through them)."""
        chosen = {id(p) for p in params}
        flags = [(p, p.requires_grad) for p in self.all_params]
        try:
            for p, _ in flags:
                p.requires_grad_(id(p) in chosen)
            with torch.enable_grad():
                loss = self.window_loss()
                if loss is None or not loss.requires_grad:
                    return
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if g is not None:
                        p.add_(g.to(p.dtype), alpha=-self.lr)
        finally:
            for p, flag in flags:
                p.requires_grad_(flag)
