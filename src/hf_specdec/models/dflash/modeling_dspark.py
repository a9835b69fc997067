"""DSpark drafter (Cheng et al., DeepSeek DeepSpec): the DFlash backbone with the anchor as the first prediction
slot, a low-rank sequential (Markov) correction, a confidence head, and a verification-length scheduler.

Lossless: every draft token is drawn from the corrected distribution ``p_k`` it is verified against, and the scheduler
decides whether draft ``k`` is verified from the confidences of drafts ``<= k``, which depend on the tokens before
``k`` only (a stopping rule on what was drafted so far), never on draft ``k`` itself.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...layers import SlotKVCache
from ...modeling_utils import PASS_TIMES_FILE
from ...types import Proposal, TokenSelector
from .configuration_dspark import DSparkConfig, check_pass_times
from .modeling_dflash import DFlashDraftState, DFlashForDrafting

__all__ = [
    "DSparkForDrafting",
    "DSparkMarkovHead",
    "DSparkConfidenceHead",
    "DSparkDraftState",
    "schedule_lengths",
    "expected_calibration_error",
    "sequential_temperature_scaling",
]

TEMPERATURE_GRID = [round(0.25 * 1.08**i, 4) for i in range(40)]  # 0.25 .. about 5.0


@dataclass
class DSparkDraftState(DFlashDraftState):
    schedule: bool = False
    last_confidence: torch.Tensor | None = None  # (batch, drafted) cumulative confidences of the last proposal


def schedule_lengths(cumulative: torch.Tensor, seconds, max_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """DSpark's verification-length scheduler (Algorithm 1).

    Admits draft positions ``(r, j)`` in order of predicted cumulative acceptance ``cumulative[r, j]`` (non-increasing
    in ``j``) for as long as the expected throughput ``tau / seconds(B / R)`` improves, where ``tau = R + sum of the
    admitted a`` (every row also commits a bonus token) and ``B`` the tokens verified (``R`` bonus slots plus the
    admitted drafts); it stops at the first admission that does not improve it. Stopping there, and never skipping an
    entry for a later one, is what keeps verification lossless: whether draft ``j`` is verified depends on the
    confidences of drafts ``<= j`` only, which the draft tokens before ``j`` determine.

    ``seconds(width)`` is the target's pass time at this batch size for ``width`` tokens per row (measured with
    ``hf-specdec profile``); the scheduler reads it at the mean width ``B / R``, as the paper's steps-per-second curve
    of the verified token count. hf_specdec's loop pads a pass to its longest row, so with uneven lengths a pass can
    cost more than this model says (the benchmark measures what it really costs). Returns ``(R,)`` lengths.
    """
    rows, n = cumulative.shape
    lengths = torch.zeros(rows, dtype=torch.long)
    if n == 0:
        return lengths
    values = cumulative.detach().float().cpu()
    caps = torch.full((rows,), n, dtype=torch.long) if max_lengths is None else max_lengths.cpu().clamp(0, n)
    order = torch.argsort(-values.flatten(), stable=True).tolist()  # ties keep j increasing within a row
    tau, tokens = float(rows), rows
    best = tau / seconds(1.0)
    for index in order:
        r, j = divmod(index, n)
        if j != int(lengths[r]) or j >= int(caps[r]):  # only a row's next position, within its cap
            continue
        theta = (tau + float(values[r, j])) / seconds((tokens + 1) / rows)
        if theta <= best:
            break
        lengths[r] = j + 1
        tau += float(values[r, j])
        tokens += 1
        best = theta
    return lengths


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor, bins: int = 10) -> float:
    """ECE: ``sum_b |B_b| / N * |mean predicted - mean observed|`` over equal-width bins of the prediction."""
    predicted, observed = predicted.float().flatten(), observed.float().flatten()
    if predicted.numel() == 0:
        return 0.0
    index = (predicted * bins).long().clamp(0, bins - 1)
    total = 0.0
    for b in range(bins):
        sel = index == b
        if bool(sel.any()):
            total += float(sel.sum()) * abs(float(predicted[sel].mean()) - float(observed[sel].mean()))
    return total / predicted.numel()


def sequential_temperature_scaling(logits, accepted, valid, grid=TEMPERATURE_GRID, bins: int = 10) -> dict:
    """DSpark's calibration: for ``k = 0..K-1`` in turn, the temperature ``T_k`` (from ``grid``) that minimises the ECE
    of the cumulative confidence ``prod_{i<=k} σ(logit_i / T_i)`` against the realised cumulative acceptance, the
    earlier temperatures fixed. ``logits`` / ``accepted`` / ``valid``: ``(N, K)`` per anchor and draft.

    Returns ``{"temperatures", "ece_before", "ece_after"}`` (per draft) and the count-weighted means."""
    n, k_max = logits.shape
    chain_obs = accepted.float().cumprod(dim=1)
    temps, before, after, counts = [], [], [], []
    cum_raw = torch.ones(n)
    cum_cal = torch.ones(n)
    for k in range(k_max):
        sel = valid[:, k]
        cum_raw = cum_raw * torch.sigmoid(logits[:, k].float())
        raw_ece = expected_calibration_error(cum_raw[sel], chain_obs[sel, k], bins)
        best_t, best_ece = 1.0, None
        for t in grid:
            ece = expected_calibration_error(
                (cum_cal * torch.sigmoid(logits[:, k].float() / t))[sel], chain_obs[sel, k], bins
            )
            if best_ece is None or ece < best_ece:
                best_t, best_ece = float(t), ece
        cum_cal = cum_cal * torch.sigmoid(logits[:, k].float() / best_t)
        temps.append(best_t)
        before.append(raw_ece)
        after.append(best_ece if best_ece is not None else raw_ece)
        counts.append(int(sel.sum()))
    total = max(sum(counts), 1)
    return {
        "temperatures": temps,
        "ece_before": before,
        "ece_after": after,
        "anchors": counts,
        "mean_ece_before": sum(e * c for e, c in zip(before, counts)) / total,
        "mean_ece_after": sum(e * c for e, c in zip(after, counts)) / total,
    }


class DSparkMarkovHead(nn.Module):
    """``W2 W1[x]``: ``markov_w1`` an embedding of the previous (target) token, ``markov_w2`` rank -> draft vocabulary
    (DeepSpec's ``VanillaMarkov`` names)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        self.markov_w2.zero_init = True  # a fresh correction adds nothing: the backbone's logits at first

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class DSparkConfidenceHead(nn.Module):
    """``w·[h_k; W1[x_{k-1}]] + b`` (DeepSpec's ``AcceptRatePredictor``)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)[..., 0]


class DSparkForDrafting(DFlashForDrafting):
    """DSpark: DFlash-style block drafting with a sequential correction ``W2 W1[x_{k-1}]`` and a confidence head.

    Example:
        >>> drafter = AutoModelForDrafting.from_config(DSparkConfig.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter)
        >>> out = target.generate(**inputs, assistant_model=profiled_drafter, confidence_schedule=True)
    """

    config_class = DSparkConfig
    first_draft_slot = 0
    max_draft_depth_source = "block_size"
    draft_options = {"confidence_schedule": False}
    lora_target_modules = DFlashForDrafting.lora_target_modules + ("markov_w2",)

    def build_extra_modules(self, config: DSparkConfig) -> None:
        self.markov_head = DSparkMarkovHead(config.target_vocab_size, config.draft_vocab_size, config.markov_rank)
        self.confidence_head = DSparkConfidenceHead(config.hidden_size + config.markov_rank)

    # -- the sequential correction and the confidence head ------------------------------------------------------------
    def correction(self, previous: torch.Tensor) -> torch.Tensor:
        """``W2 W1[x]``: ``(..., draft_vocab)`` for previous tokens ``x`` (target ids)."""
        return self.markov_head(previous.to(self.device))

    def confidence_logit(self, state: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Uncalibrated confidence logits ``w·[h_k; W1[x_{k-1}]] + b``, ``(...)``."""
        w1 = self.markov_head.markov_w1(previous.to(self.device)).to(state.dtype)
        return self.confidence_head(torch.cat([state, w1], -1))

    def calibrated(self, logits: torch.Tensor, depth: int) -> torch.Tensor:
        temps = self.config.confidence_temperatures
        return torch.sigmoid(logits.float() / (float(temps[depth]) if temps else 1.0))

    def slot_logits(self, state: DFlashDraftState, depth: int, previous: torch.Tensor) -> torch.Tensor:
        base = super().slot_logits(state, depth, previous)
        return base + self.correction(previous).float()

    def teacher_forced_slot_logits(self, states, input_ids, anchors, depth: int) -> torch.Tensor:
        t = input_ids.shape[1]
        previous = input_ids.to(self.device).gather(1, (anchors.to(self.device) + depth).clamp(max=t - 1))
        return self.target_head_logits(states[:, :, depth]) + self.correction(previous)

    # -- decoding ----------------------------------------------------------------------------------------------------
    def init_draft_state(self, batch_size: int, max_length: int, confidence_schedule: bool = False) -> DSparkDraftState:
        if confidence_schedule and self.pass_times() is None:
            raise ValueError(
                f"confidence_schedule=True needs the target's pass times on this machine ({PASS_TIMES_FILE} next to "
                "the drafter, or config.verify_seconds). Measure them with `hf-specdec profile --target ... "
                "--drafter <folder>`."
            )
        return DSparkDraftState(caches=[SlotKVCache() for _ in self.layers], schedule=bool(confidence_schedule))

    def pass_times(self) -> dict | None:
        """The target's measured pass times: ``config.verify_seconds`` when set, else the ``pass_times.json`` that
        ``hf-specdec profile`` wrote next to the folder this drafter was loaded from (read once)."""
        if self.config.verify_seconds is not None:
            return self.config.verify_seconds
        if "_pass_times" not in self.__dict__:
            path = os.path.join(str(getattr(self, "name_or_path", "") or ""), PASS_TIMES_FILE)
            table = None
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as fh:
                    table = json.load(fh)
                check_pass_times(table, path)
            self.__dict__["_pass_times"] = table
        return self.__dict__["_pass_times"]

    def pass_seconds(self, batch_size: int):
        """``seconds(width)`` of one target pass at ``batch_size`` rows, from :meth:`pass_times` (the nearest
        measured batch size, linear in the (mean) width between measured widths)."""
        table = self.pass_times()
        sizes = list(table["batch_sizes"])
        row = table["seconds"][min(range(len(sizes)), key=lambda i: abs(sizes[i] - batch_size))]
        widths = list(table["widths"])

        def seconds(width: int) -> float:
            i = bisect.bisect_left(widths, width)
            if i < len(widths) and widths[i] == width:
                return float(row[i])
            lo, hi = max(i - 1, 0), min(i, len(widths) - 1)
            if lo == hi:  # outside the measured widths: the nearest end, scaled by the width
                return float(row[lo]) * max(width, 1) / max(widths[lo], 1)
            share = (width - widths[lo]) / (widths[hi] - widths[lo])
            return float(row[lo]) + share * (float(row[hi]) - float(row[lo]))

        return seconds

    def propose(self, state: DSparkDraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """Draws the drafts left to right from the corrected distributions; with ``confidence_schedule`` the
        scheduler then sets how many of them each row verifies (``Proposal.lengths``)."""
        proposal = super().propose(state, num_tokens, select)
        previous = torch.cat([state.anchor[:, None], proposal.tokens[:, :-1]], dim=1)
        n = proposal.tokens.shape[1]
        logits = self.confidence_logit(state.hidden[:, :n], previous)
        conf = torch.stack([self.calibrated(logits[:, k], k) for k in range(n)], dim=1)
        state.last_confidence = conf.cumprod(dim=1)
        if state.schedule:
            lengths = schedule_lengths(state.last_confidence, self.pass_seconds(proposal.tokens.shape[0]))
            proposal.lengths = lengths.to(proposal.tokens.device)
        return proposal

    # -- training ----------------------------------------------------------------------------------------------------
    def slot_loss(self, depth: int, logits, state, labels, target, ok, previous) -> tuple:
        """``w_k (ce_weight CE + tv_weight ||p_d - p_t||_1)`` (weighted) and ``confidence_weight BCE(c_k, 1 - TV)``
        (plain), with the confidence error ``|c_k - (1 - TV)|`` as a metric."""
        cfg = self.config
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(labels * logp).sum(-1) if target is None else -logp.gather(-1, target.clamp_min(0)[..., None])[..., 0]
        l1 = (logp.exp() - labels).abs().sum(-1)
        label = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
        conf_logit = self.confidence_logit(state, previous).float()
        bce = F.binary_cross_entropy_with_logits(conf_logit, label, reduction="none")
        weighted = ((float(cfg.ce_weight) * ce + float(cfg.tv_weight) * l1) * ok).sum()
        plain = (float(cfg.confidence_weight) * bce * ok).sum()
        error = ((torch.sigmoid(conf_logit) - label).abs() * ok).sum().detach()
        return weighted, plain, {"confidence_abs_error": error, "confidence_count": ok.sum().float().detach()}

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        out = super().compute_loss(batch, features, target_head, **loss_kwargs)
        out.rates["confidence_error"] = ("confidence_abs_error", "confidence_count")
        return out

    # -- calibration -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def confidence_records(self, batch: dict, features, target_head) -> tuple:
        """Per held-out anchor and draft (teacher-forced, as in training): the uncalibrated confidence logits, whether
        the greedy draft equals the target's choice, and whether the draft is scored; each ``(N, block_size)``."""
        loss_mask, soft, in_vocab, _ = self.loss_targets(batch, features, target_head, {}, "soft")
        ids = batch["input_ids"].to(self.device)
        attn = batch.get("attention_mask")
        feats = [f.to(self.device, self.dtype) for f in features.hidden_states]
        bsz, t = ids.shape
        top = soft.argmax.to(self.device)
        depth = self.drafts_per_block
        logits_out, accept_out, valid_out = [], [], []
        step = int(self.config.num_anchors)
        for start in range(0, max(t - 2, 0), step):
            anchors = torch.arange(start, min(start + step, t - 2), device=self.device)[None].expand(bsz, -1)
            block_anchor = anchors + 1
            states = self.block_states(ids, feats, attn, block_anchor)
            first_ok = loss_mask.gather(1, anchors + 2) & in_vocab.gather(1, anchors + 1)
            rows_l, rows_a, rows_v = [], [], []
            for j in range(depth):
                pred = anchors + 2 + j
                pred_c, lab_c = pred.clamp(max=t - 1), (anchors + 1 + j).clamp(max=t - 1)
                ok = first_ok & (pred < t) & loss_mask.gather(1, pred_c) & in_vocab.gather(1, lab_c)
                logits = self.teacher_forced_slot_logits(states, ids, block_anchor, j)
                previous = ids.gather(1, (block_anchor + j).clamp(max=t - 1))
                rows_l.append(self.confidence_logit(states[:, :, j], previous).float())
                rows_a.append(logits.argmax(-1) == top.gather(1, lab_c))
                rows_v.append(ok)
            keep = first_ok.flatten()
            logits_out.append(torch.stack(rows_l, -1).flatten(0, 1)[keep])
            accept_out.append(torch.stack(rows_a, -1).flatten(0, 1)[keep])
            valid_out.append(torch.stack(rows_v, -1).flatten(0, 1)[keep])
        return torch.cat(logits_out).cpu(), torch.cat(accept_out).cpu(), torch.cat(valid_out).cpu()

    def calibrate_confidence(self, batches, target_head, grid=TEMPERATURE_GRID) -> dict:
        """Sequential temperature scaling on held-out ``(batch, features)`` pairs: sets
        ``config.confidence_temperatures`` and returns the report (ECE before and after, per draft and overall)."""
        was_training = self.training
        self.eval()
        records = [self.confidence_records(batch, feats, target_head) for batch, feats in batches]
        self.train(was_training)
        logits, accepted, valid = (torch.cat([r[i] for r in records]) for i in range(3))
        # a draft is scored only while the chain before it could still be accepted: the valid prefix of each anchor
        valid = valid & valid.long().cumprod(dim=1).bool()
        report = sequential_temperature_scaling(logits, accepted, valid, grid)
        self.config.confidence_temperatures = report["temperatures"]
        return report
