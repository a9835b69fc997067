"""``hf-specdec selfcheck``: verifies an installation end to end on tiny models built from configs (no network).

For each architecture and batch size it compares plain greedy ``generate`` with speculative ``generate`` using
(a) a fresh (untrained) drafter of every family hf_specdec ships and (b) a replay drafter that proposes the target's own continuation with some tokens
corrupted, and prints whether the outputs are identical, the mean accepted length τ and the target passes saved.
"""

from __future__ import annotations

import time

import torch

from . import models
from .auto import AutoModelForDrafting
from .registry import DRAFTERS
from .testing import make_oracle_drafter, ragged_batch, tiny_target

__all__ = ["run_selfcheck"]


def run_selfcheck(
    architectures=("llama", "qwen2", "qwen3", "mistral", "gemma"),
    batch_sizes=(1, 3),
    num_draft_tokens: int = 4,
    max_new_tokens: int = 48,
    verbose: bool = True,
) -> bool:
    """Runs the check; returns ``True`` when every speculative output equals plain ``generate``."""
    rows, all_ok = [], True
    for arch in architectures:
        target = tiny_target(arch, seed=1)
        fresh = [
            (
                f"{spec.name} (untrained)",
                AutoModelForDrafting.from_config(
                    spec.config_class.for_target(target.config, num_draft_tokens=num_draft_tokens)
                ).eval(),
            )
            for spec in DRAFTERS.values()
            if spec.model_class.__module__.startswith(models.__name__ + ".")  # the families hf_specdec ships
        ]
        for bsz in batch_sizes:
            ids, mask = ragged_batch(bsz, seed=bsz)
            kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
            t0 = time.perf_counter()
            ref = target.generate(ids, **kwargs)
            t_plain = time.perf_counter() - t0
            cont = torch.cat([ref[:, ids.shape[1] :], ref[:, -1:].repeat(1, num_draft_tokens + 1)], dim=1)
            replay = make_oracle_drafter(target, cont, corruption=0.2, num_draft_tokens=num_draft_tokens)
            for name, drafter in (*fresh, ("replay, 20% corrupted", replay)):
                t0 = time.perf_counter()
                out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
                t_spec = time.perf_counter() - t0
                same = torch.equal(out.sequences, ref)
                all_ok &= same
                forwards = int(out.num_target_forwards.max())
                rows.append((arch, bsz, name, same, out.mean_accepted_length, forwards, t_plain / t_spec))
    if verbose:
        print(f"{'target':<8} {'batch':>5}  {'drafter':<22} {'identical':>9} {'tau':>5} {'passes':>6} {'speedup':>7}")
        for arch, bsz, name, same, tau, fwd, speed in rows:
            print(f"{arch:<8} {bsz:>5}  {name:<22} {str(same):>9} {tau:5.2f} {fwd:>6} {speed:6.2f}x")
        print(
            f"plain generate needs {max_new_tokens} target passes per row. Tiny random targets: the speedup column "
            "only shows that the machinery runs, not real-model gains."
        )
        print("ALL IDENTICAL" if all_ok else "MISMATCH: speculative output differs from plain generate")
    return all_ok
