#!/usr/bin/env python
"""What a draft vocabulary that covers the context could give the SmolLM2 EAGLE-3 drafter (a diagnostic).

The drafter drafts from a fixed 4,096-token vocabulary. Where the target copies a token of the prompt (a name in
translation, a number in a summary) that token is often outside it, and no draft can match. This measures, teacher
forced and for the first draft step only, how much a *context vocabulary* would give: at each answer position the
candidates are the draft vocabulary plus every token of the sequence so far that is outside it. Those extra tokens
are scored by the target's own LM-head rows mapped into the drafter's output space by one ``H x H`` matrix ``M``
(plus one bias, the copy prior), so the drafter's own weights and its drafts from the fixed vocabulary are unchanged:

* ``fixed``: the shipped drafter as it is (its first draft token is the target's greedy token: acc_0);
* ``mapped``: ``M`` fitted in closed form (least squares from the target's LM-head rows of the draft vocabulary to the
  drafter's own LM-head rows), no training;
* ``trained``: ``M`` and the bias trained (cross-entropy on the target's greedy token over the candidates) on the
  drafter's first-step outputs over ``--train-records`` records of ``--train-features``;
* ``ceiling``: the share of positions whose target token is a candidate at all (in the vocabulary or the context).

``--joint`` trains the drafter's first step instead, together with the map and the bias (one pass, cross-entropy
on the target's greedy token), next to a control trained the same way over the fixed vocabulary alone: what the
context vocabulary adds once the drafter can learn to point at it (results ``--results`` of its own).

Reads feature dumps only (``train_smollm2_grown.py``'s of the distillation data, ``smollm2_specbench_score.py``'s
of Spec-Bench); writes ``--results`` ``.json`` and ``.md``.

Usage::

    python scripts/smollm2_context_vocab.py
    python scripts/smollm2_context_vocab.py --joint --results runs/context-vocab/joint
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from results_files import write_results  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="src/hf_specdec/assets/smollm2-drafter")
    p.add_argument("--train-features", default="runs/depth-ab/features-train")
    p.add_argument("--train-records", type=int, default=1000)
    p.add_argument("--held-out-features", default="runs/depth-ab/features-eval")
    p.add_argument("--spec-bench-features", default="runs/specbench-score", help="folder of features-<category>")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--joint",
        action="store_true",
        help="train the drafter's first step with the context vocabulary (and a control without it) instead of "
        "the map alone on the frozen drafter",
    )
    p.add_argument("--results", default="model_cards/results/smollm2-context-vocab")
    return p.parse_args(argv)


class Record:
    """One record's first-step view: the drafter's normed outputs at the scored anchors, the target's token there,
    the drafter's best fixed-vocabulary candidate, and the context tokens outside the vocabulary (with the first
    position each appears at)."""

    def __init__(self, hidden, label, best_logit, best_id, lse, label_logit, ctx_ids, ctx_first, anchors):
        self.hidden, self.label, self.best_logit, self.best_id = hidden, label, best_logit, best_id
        self.lse, self.label_logit = lse, label_logit
        self.ctx_ids, self.ctx_first, self.anchors = ctx_ids, ctx_first, anchors


def first_step(drafter, item, head):
    """``(ids, anchors, draft logits, normed outputs, target token)`` of the drafter's first step over one dumped
    example, at the anchors it is scored at (``None`` if none): step 0 at anchor ``a`` drafts the token at ``a + 2``,
    whose greedy choice is the target's argmax at ``a + 1``."""
    ids = item["input_ids"].long()
    anchors = torch.nonzero(item["loss_mask"].bool()[2:]).flatten()
    if len(anchors) == 0:
        return None
    feats = [x[None].float() for x in item["target_hidden_states"]]
    ((logits, hidden),) = drafter.ttt_forward(ids[None], feats, None, steps=1)
    with torch.no_grad():
        label = (item["target_last_hidden"][anchors + 1].float() @ head.T).argmax(-1)
    return ids, anchors, logits[0, anchors].float(), drafter.norm(hidden[0, anchors]).float(), label


@torch.no_grad()
def first_step_record(drafter, item, head, in_vocab, d2t) -> Record | None:
    """The :class:`Record` of one dumped example."""
    step = first_step(drafter, item, head)
    if step is None:
        return None
    ids, anchors, logits, hidden, label = step
    best_logit, best = logits.max(-1)
    t2d = torch.full((head.shape[0],), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    draft_index = t2d[label]
    label_logit = torch.where(draft_index >= 0, logits.gather(1, draft_index.clamp(min=0)[:, None])[:, 0], torch.nan)
    ctx_ids, first = context_tokens(ids, in_vocab)
    return Record(hidden.half(), label, best_logit, d2t[best], torch.logsumexp(logits, -1), label_logit, ctx_ids,
                  first, anchors)  # fmt: skip


def context_tokens(ids, in_vocab):
    """``(token ids, first positions)`` of the sequence's tokens outside the draft vocabulary."""
    ctx_ids = torch.unique(ids[~in_vocab[ids]])
    first = torch.stack([torch.nonzero(ids == t)[0, 0] for t in ctx_ids]) if len(ctx_ids) else torch.zeros(0).long()
    return ctx_ids, first


def context_logits(record: Record, head, proj, bias):
    """``(positions, context tokens)`` logits of the context tokens outside the vocabulary, ``-inf`` where a token
    has not appeared yet (anchor ``a`` sees the tokens up to ``a + 1``)."""
    rows = head[record.ctx_ids] @ proj  # each token's row in the drafter's output space
    scores = record.hidden.float() @ rows.T + bias
    seen = record.ctx_first[None, :] <= (record.anchors[:, None] + 1)
    return scores.masked_fill(~seen, float("-inf"))


def first_step_loss(drafter, item, head, in_vocab, t2d, proj, bias, context: bool):
    """Cross-entropy of the drafter's first draft step on the target's greedy token, over the fixed vocabulary or
    (``context``) over it and the context tokens outside it; ``None`` where no position is scored."""
    step = first_step(drafter, item, head)
    if step is None:
        return None
    ids, anchors, logits, hidden, label = step
    index = t2d[label]
    if context:
        ctx_ids, first = context_tokens(ids, in_vocab)
        view = Record(hidden, label, None, None, None, None, ctx_ids, first, anchors)
        ctx = context_logits(view, head, proj, bias)
        match = (ctx_ids[None, :] == label[:, None]) & torch.isfinite(ctx)
        copy = torch.where(match.any(-1), logits.shape[-1] + match.float().argmax(-1), -1)
        index, logits = torch.where(index >= 0, index, copy), torch.cat([logits, ctx], -1)
    ok = index >= 0
    return torch.nn.functional.cross_entropy(logits[ok], index[ok]) if ok.any() else None


def fine_tune_first_step(drafter, path, n, head, in_vocab, d2t, proj, bias, context: bool, lr: float):
    """The drafter (and, with ``context``, the map and the bias) trained for one pass over ``n`` records on its
    first draft step. Without ``context`` it is the control: what the extra training alone gives."""
    from hf_specdec.training.offline import OfflineFeatureDataset

    dataset = OfflineFeatureDataset(path)
    dataset.check_compatible(drafter.config)
    t2d = torch.full((head.shape[0],), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    proj, bias = proj.clone().requires_grad_(context), bias.clone().requires_grad_(context)
    params = [p for p in drafter.parameters() if p.requires_grad] + ([proj, bias] if context else [])
    opt = torch.optim.Adam(params, lr=lr)
    drafter.train()
    for i in range(min(n, len(dataset))):
        loss = first_step_loss(drafter, dataset[i], head, in_vocab, t2d, proj, bias, context)
        if loss is None:
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i % 200 == 0:
            print(f"{'context' if context else 'control'} record {i}: loss {loss.item():.4f}", flush=True)
    drafter.eval()
    return proj.detach(), bias.detach()


def read_records(drafter, path, head, in_vocab, d2t, limit=None) -> list[Record]:
    from hf_specdec.training.offline import OfflineFeatureDataset

    dataset = OfflineFeatureDataset(path)
    dataset.check_compatible(drafter.config)
    n = len(dataset) if limit is None else min(limit, len(dataset))
    out = [first_step_record(drafter, dataset[i], head, in_vocab, d2t) for i in range(n)]
    return [r for r in out if r is not None]


def train_projection(records, head, proj, bias, epochs: int, lr: float):
    """``M`` and the bias trained by cross-entropy over the candidates on the target's greedy token (the fixed
    vocabulary's logits enter as their log-sum-exp and the label's logit: they do not change)."""
    proj, bias = proj.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    opt = torch.optim.Adam([proj, bias], lr=lr)
    for epoch in range(epochs):
        total, count = 0.0, 0
        for i in torch.randperm(len(records), generator=torch.Generator().manual_seed(epoch)).tolist():
            r = records[i]
            if len(r.ctx_ids) == 0:
                continue
            ctx = context_logits(r, head, proj, bias)
            log_z = torch.logaddexp(r.lse, torch.logsumexp(ctx, -1))
            match = r.ctx_ids[None, :] == r.label[:, None]
            label_ctx = torch.where(match, ctx, torch.full_like(ctx, float("-inf"))).max(-1).values
            label_logit = torch.where(torch.isnan(r.label_logit), label_ctx, r.label_logit)
            ok = torch.isfinite(label_logit)
            if not ok.any():
                continue
            loss = (log_z - label_logit)[ok].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, count = total + loss.item(), count + 1
        print(f"epoch {epoch}: mean loss {total / max(count, 1):.4f}", flush=True)
    return proj.detach(), bias.detach()


@torch.no_grad()
def accuracy(records, head, proj, bias) -> dict:
    """acc_0 with the fixed vocabulary, with the context vocabulary, and the ceiling, over all scored positions."""
    n = fixed = extended = ceiling = copies = 0
    for r in records:
        n += len(r.label)
        fixed += int((r.best_id == r.label).sum())
        in_context = torch.zeros_like(r.label, dtype=torch.bool)
        pick = r.best_id
        if len(r.ctx_ids):
            ctx = context_logits(r, head, proj, bias)
            ctx_best, ctx_arg = ctx.max(-1)
            pick = torch.where(ctx_best > r.best_logit, r.ctx_ids[ctx_arg], r.best_id)
            seen = r.ctx_first[None, :] <= (r.anchors[:, None] + 1)
            in_context = ((r.ctx_ids[None, :] == r.label[:, None]) & seen).any(-1)
        extended += int((pick == r.label).sum())
        ceiling += int((~torch.isnan(r.label_logit) | in_context).sum())
        copies += int(in_context.sum())
    return {"positions": n, "acc_0_fixed": round(fixed / n, 4), "acc_0_context": round(extended / n, 4),
            "context_copies": round(copies / n, 4), "ceiling": round(ceiling / n, 4)}  # fmt: skip


def load(args):
    """``(target head, drafter loader, draft-to-target ids, in-vocabulary mask, closed-form map, its fit)``."""
    from hf_specdec import AutoModelForDrafting
    from hf_specdec.gguf_target import load_smollm2

    target, _ = load_smollm2(dtype="float32")
    target.requires_grad_(False)

    def fresh_drafter():
        drafter = AutoModelForDrafting.from_pretrained(args.drafter)
        drafter.bind_target(target)
        return drafter.eval()

    drafter = fresh_drafter()
    head = target.get_output_embeddings().weight.detach().float()
    d2t = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t
    in_vocab = torch.zeros(head.shape[0], dtype=torch.bool)
    in_vocab[d2t] = True
    own = drafter.lm_head.weight.detach().float()
    mapped = torch.linalg.lstsq(head[d2t], own).solution  # target rows -> the drafter's rows
    fit = torch.nn.functional.cosine_similarity(head[d2t] @ mapped, own, dim=1).mean().item()
    print(f"closed-form map: mean cosine {fit:.3f} between mapped target rows and the drafter's own")
    return head, fresh_drafter, d2t, in_vocab, mapped, fit


def scored_sets(args) -> dict[str, str]:
    sets = {"held-out chat": args.held_out_features}
    for path in sorted(glob.glob(os.path.join(args.spec_bench_features, "features-*"))):
        sets["Spec-Bench " + os.path.basename(path).removeprefix("features-")] = path
    return sets


def frozen_rows(args, head, drafter, d2t, in_vocab, mapped) -> tuple[list[dict], dict]:
    """The frozen drafter with the closed-form map and with the trained one, per scored set."""
    scored = {name: read_records(drafter, path, head, in_vocab, d2t) for name, path in scored_sets(args).items()}
    train = read_records(drafter, args.train_features, head, in_vocab, d2t, args.train_records)
    zero = torch.zeros(())
    proj, bias = train_projection(train, head, mapped, zero, args.epochs, args.lr)
    rows = []
    for name, records in scored.items():
        closed, learned = accuracy(records, head, mapped, zero), accuracy(records, head, proj, bias)
        rows.append({"set": name, **learned, "acc_0_mapped": closed["acc_0_context"]})
        print(rows[-1], flush=True)
    return rows, {"copy_bias": round(float(bias), 4), "train_records": len(train)}


def joint_rows(args, head, fresh_drafter, d2t, in_vocab, mapped) -> tuple[list[dict], dict]:
    """The drafter's first step trained on ``--train-records`` records without (control) and with the context
    vocabulary (the drafter, the map and the bias together), each scored per set; the shipped drafter beside them."""
    sets, zero = scored_sets(args), torch.zeros(())
    shipped = fresh_drafter()
    rows = {name: {"set": name, "acc_0_shipped": accuracy(read_records(shipped, path, head, in_vocab, d2t), head,
                                                           mapped, zero)["acc_0_fixed"]}
            for name, path in sets.items()}  # fmt: skip
    for arm, context in (("control", False), ("context", True)):
        drafter = fresh_drafter()
        proj, bias = fine_tune_first_step(drafter, args.train_features, args.train_records, head, in_vocab, d2t,
                                          mapped, zero, context, args.lr)  # fmt: skip
        for name, path in sets.items():
            acc = accuracy(read_records(drafter, path, head, in_vocab, d2t), head, proj, bias)
            rows[name].update({f"acc_0_{arm}_fixed": acc["acc_0_fixed"], "positions": acc["positions"],
                               "context_copies": acc["context_copies"]})  # fmt: skip
            if context:
                rows[name]["acc_0_context"] = acc["acc_0_context"]
            print(name, rows[name], flush=True)
    return list(rows.values()), {"train_records": args.train_records}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    head, fresh_drafter, d2t, in_vocab, mapped, fit = load(args)
    if args.joint:
        rows, extra = joint_rows(args, head, fresh_drafter, d2t, in_vocab, mapped)
    else:
        rows, extra = frozen_rows(args, head, fresh_drafter(), d2t, in_vocab, mapped)
    result = {
        "drafter": args.drafter,
        "mode": "joint" if args.joint else "frozen",
        "map_fit_cosine": round(fit, 4),
        **extra,
        "settings": {k: getattr(args, k) for k in ("epochs", "lr", "train_features")},
        "command": "python scripts/smollm2_context_vocab.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "rows": rows,
    }
    write_results(args.results, result, (joint_markdown if args.joint else markdown)(result))


def table(title: str, intro: str, columns: list[str], cells: list[list]) -> str:
    """A results page: title, one paragraph, one table (first column left-aligned, the rest right-aligned)."""
    lines = [f"# {title}", "", intro, "", "| " + " | ".join(columns) + " |", "|:---|" + "---:|" * (len(columns) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def row_cells(rows: list[dict], keys: tuple, percents: tuple) -> list[list]:
    return [[r[k] for k in keys] + [f"{r[k]:.1%}" for k in percents] for r in rows]


def markdown(result: dict) -> str:
    intro = (
        f"Command: `{result['command']}`. Drafter: `{result['drafter']}`, unchanged. Teacher-forced first draft step: "
        "acc_0 is the share of answer positions where it drafts the target's greedy token. *Context*: the candidates "
        "are the draft vocabulary plus every earlier token of the sequence outside it, scored by the target's "
        "LM-head rows mapped into the drafter's output space by one matrix: fitted in closed form (*mapped*, mean "
        f"cosine {result['map_fit_cosine']} to the drafter's own rows) or trained on "
        f"{result['train_records']} records of the distillation data's training split (*trained*, copy bias "
        f"{result['copy_bias']}). *Copies*: positions whose target token is such a context token; *ceiling*: "
        "positions whose target token is a candidate at all."
    )
    columns = ["set", "positions", "acc_0 fixed", "acc_0 context, mapped", "acc_0 context, trained", "copies",
               "ceiling"]  # fmt: skip
    cells = row_cells(result["rows"], ("set", "positions", "acc_0_fixed", "acc_0_mapped", "acc_0_context"),
                      ("context_copies", "ceiling"))  # fmt: skip
    title = "SmolLM2 EAGLE-3: what a draft vocabulary covering the context could give (a diagnostic)"
    return table(title, intro, columns, cells)


def joint_markdown(result: dict) -> str:
    intro = (
        f"Command: `{result['command']}`. From `{result['drafter']}`, the first draft step trained for one pass over "
        f"{result['train_records']} records of the distillation data's training split at lr {result['settings']['lr']} "
        "(cross-entropy on the target's greedy token): *control* over the fixed draft vocabulary, *context* over it "
        "and every earlier token of the sequence outside it (scored by the target's LM-head rows through one "
        "trained matrix and bias, trained together with the drafter). Teacher-forced acc_0 over every answer "
        "position; *copies*: positions whose target token is such a context token. Later draft steps are not "
        "trained or scored here."
    )
    columns = ["set", "positions", "shipped", "control", "context arm, fixed vocabulary", "context arm, with context",
               "copies"]  # fmt: skip
    keys = ("set", "positions", "acc_0_shipped", "acc_0_control_fixed", "acc_0_context_fixed", "acc_0_context")
    cells = row_cells(result["rows"], keys, ("context_copies",))
    title = "SmolLM2 EAGLE-3: a context vocabulary trained with the drafter's first step (a diagnostic)"
    return table(title, intro, columns, cells)


if __name__ == "__main__":
    main()
