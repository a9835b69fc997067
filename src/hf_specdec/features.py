"""Target features and the training signal computed from them, shared by every family (a types-level module).

Families import this module (never :mod:`hf_specdec.training`): it holds the batch of target states a drafter trains
on (:class:`TargetFeatures`), the target's logits and soft labels recomputed from its final hidden state (logit
soft-capping applied here, once), and the walk that turns per-anchor accepted lengths into what the decoding loop
would accept pass by pass (:func:`walk_passes`, :func:`walk_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "TargetFeatures",
    "SoftLabels",
    "logit_softcap",
    "target_logits_from_last_hidden",
    "soft_labels",
    "walk_passes",
    "walk_metrics",
]


def logit_softcap(config) -> float | None:
    """The target's final logit soft-capping (Gemma-2 style ``final_logit_softcapping``), or ``None``."""
    if config is None:
        return None
    getter = getattr(config, "get_text_config", None)
    text = config
    if getter is not None:
        try:
            text = getter(decoder=True)
        except TypeError:
            text = getter()
    value = getattr(text, "final_logit_softcapping", None)
    if value is None:
        value = getattr(config, "final_logit_softcapping", None)
    return float(value) if value else None


@dataclass
class TargetFeatures:
    """Target states a drafter trains on, for a right-padded batch.

    Attributes:
        hidden_states: one ``(batch, seq, hidden)`` tensor per id in the drafter's ``target_layer_ids``, in that
            order (``output_hidden_states`` convention: 0 = embeddings, ``i + 1`` = output of decoder layer ``i``).
        last_hidden: ``(batch, seq, hidden)`` the target's final hidden state (``output_hidden_states[-1]``, the
            LM-head input); target logits are recomputed from it with :func:`target_logits_from_last_hidden`, which
            keeps offline feature files small (hidden size instead of vocabulary size per token). For a family that
            trains a target adapter, this is the *adapted* target's state and carries gradients.
        teacher_last_hidden: the final hidden state of the target *without* its adapter (no gradients), for a family
            that trains a target adapter; ``None`` otherwise (the teacher is then the target itself).
        softcap: the target's final logit soft-capping, applied by :meth:`logits` and :meth:`soft_labels`.
    """

    hidden_states: list[torch.Tensor]
    last_hidden: torch.Tensor
    teacher_last_hidden: torch.Tensor | None = None
    softcap: float | None = None

    def to(self, device=None, dtype=None) -> TargetFeatures:
        teacher = self.teacher_last_hidden
        return TargetFeatures(
            hidden_states=[h.to(device=device, dtype=dtype) for h in self.hidden_states],
            last_hidden=self.last_hidden.to(device=device, dtype=dtype),
            teacher_last_hidden=None if teacher is None else teacher.to(device=device, dtype=dtype),
            softcap=self.softcap,
        )

    def logits(self, target_head: nn.Module, token_ids: torch.LongTensor | None = None) -> torch.Tensor:
        """The (adapted) target's logits, float32, optionally restricted to ``token_ids`` (keeps gradients)."""
        return target_logits_from_last_hidden(target_head, self.last_hidden, token_ids, self.softcap)

    def soft_labels(self, target_head: nn.Module, token_ids: torch.LongTensor | None = None) -> SoftLabels:
        """The teacher's distribution (the target without adapter, when there is one), without gradients."""
        teacher = self.teacher_last_hidden if self.teacher_last_hidden is not None else self.last_hidden
        return soft_labels(target_head, teacher, token_ids, self.softcap)


def target_logits_from_last_hidden(
    target_head: nn.Module, last_hidden: torch.Tensor, token_ids: torch.LongTensor | None = None, softcap=None
) -> torch.Tensor:
    """Target logits (float32) from the final hidden state, optionally restricted to ``token_ids`` (a draft vocab).

    ``target_head`` is the target's LM head (``target.get_output_embeddings()``); ``softcap`` applies a final logit
    soft-capping (Gemma-2 style) when the target config has one.
    """
    weight = target_head.weight
    bias = getattr(target_head, "bias", None)
    if token_ids is not None:
        weight = weight[token_ids.to(weight.device)]
        bias = None if bias is None else bias[token_ids.to(weight.device)]
    logits = nn.functional.linear(last_hidden.to(device=weight.device, dtype=weight.dtype), weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@dataclass
class SoftLabels:
    """The teacher's distribution at every position (position ``s`` predicts token ``s + 1``).

    Attributes:
        probs: ``(batch, seq, V')`` float32 softmax over ``token_ids`` (the full vocabulary when ``None``).
        argmax: ``(batch, seq)`` index into ``token_ids`` (a token id when ``token_ids`` is ``None``) of the most
            likely token among ``token_ids``.
        full_argmax: ``(batch, seq)`` the teacher's greedy token id over the full vocabulary.
        context_ids / context_first: with a context vocabulary (:mod:`hf_specdec.context_vocab`), ``(batch, C)``
            each row's candidates after the draft vocabulary's columns and the position each first appears at.
    """

    probs: torch.Tensor
    argmax: torch.LongTensor
    full_argmax: torch.LongTensor
    context_ids: torch.LongTensor | None = None
    context_first: torch.LongTensor | None = None


@torch.no_grad()
def soft_labels(
    target_head: nn.Module, last_hidden: torch.Tensor, token_ids: torch.LongTensor | None = None, softcap=None
) -> SoftLabels:
    """Soft labels from the target's final hidden state (softcapping applied), restricted to ``token_ids``."""
    logits = target_logits_from_last_hidden(target_head, last_hidden, token_ids, softcap)
    argmax = logits.argmax(-1)
    if token_ids is None:
        full_argmax = argmax
    else:
        full = target_logits_from_last_hidden(target_head, last_hidden, None, softcap)
        full_argmax = full.argmax(-1)
        del full
    return SoftLabels(probs=torch.softmax(logits, dim=-1), argmax=argmax, full_argmax=full_argmax)


def _regions(mask: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of ones in ``mask`` as ``(first, last)`` positions."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - 1))
            start = None
    if start is not None:
        out.append((start, len(mask) - 1))
    return out


def walk_passes(accepted: torch.Tensor, loss_mask: torch.Tensor, num_draft_tokens: int) -> list[list[list[int]]]:
    """Walks each sequence pass by pass, as the decoding loop does under greedy verification.

    Anchor ``t`` is the state after the loop has committed tokens ``0..t + 1``: the drafter has seen the target's
    features up to position ``t`` and drafts tokens ``t + 2, t + 3, ...``. ``accepted[b, t]`` is the number of
    leading drafts of that chain that equal the target's choice (teacher forced, as in training). A pass at anchor
    ``t`` accepts ``a = min(accepted[b, t], num_draft_tokens)`` drafts plus the target's bonus token and moves on to
    anchor ``t + a + 1``. Each loss region (a maximal run of ``loss_mask``) is walked like one ``generate`` call on
    its prefix: the prefill pass commits the region's first token, so the walk starts at anchor ``first - 1``, and it
    stops when the region's last token is committed.

    Args:
        accepted: ``(batch, seq)`` accepted drafts per anchor (values for anchors with nothing to draft are unused).
        loss_mask: ``(batch, seq)`` 1 on the tokens the drafter is trained to predict (padding excluded).
        num_draft_tokens: ``K``, the drafts per pass.

    Returns:
        Per row, per loss region, the committed-token count (``a + 1``) of every pass, in order: the same numbers as
        ``generate(...).accepted_lengths`` for a row whose output is the target's own greedy continuation (the
        region's last pass aside, which the loop cuts at its length limit).
    """
    acc_rows = accepted.detach().long().cpu().tolist()
    mask_rows = loss_mask.detach().long().cpu().tolist()
    out = []
    for acc, mask in zip(acc_rows, mask_rows):
        row = []
        for first, last in _regions(mask):
            passes, t = [], max(first - 1, 0)
            while t + 2 <= last:
                a = max(0, min(int(acc[t]), num_draft_tokens, last - t - 1))
                passes.append(a + 1)
                t += a + 1
            row.append(passes)
        out.append(row)
    return out


def walk_metrics(passes: list[list[list[int]]], device=None) -> dict[str, torch.Tensor]:
    """Summable walk statistics: ``walk_tokens`` / ``walk_passes`` over every pass but each region's last (whose
    length the end of the data cuts short, as the length limit cuts the loop's), and ``walk_tokens_all`` /
    ``walk_passes_all`` over every pass. ``simulated_tau = walk_tokens / walk_passes``."""
    tokens = n = tokens_all = n_all = 0
    for row in passes:
        for region in row:
            tokens_all += sum(region)
            n_all += len(region)
            tokens += sum(region[:-1])
            n += max(len(region) - 1, 0)
    values = {"walk_tokens": tokens, "walk_passes": n, "walk_tokens_all": tokens_all, "walk_passes_all": n_all}
    return {k: torch.tensor(float(v), device=device) for k, v in values.items()}
