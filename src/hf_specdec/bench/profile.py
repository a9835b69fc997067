"""Target pass times on this machine: what a verification-length scheduler weighs expected tokens against.

:func:`measure_pass_seconds` times one target forward over ``width`` new tokens per row on top of a ``context``-token
KV cache, for each batch size and width (the cache is cropped back after every pass, as the decoding loop does after a
verification). ``hf-specdec profile`` stores the table in a drafter's config when the drafter reads one
(``verify_seconds``) and writes it as JSON.
"""

from __future__ import annotations

import statistics
import time

import torch

from .runner import _sync, hardware_info

__all__ = ["measure_pass_seconds"]


@torch.no_grad()
def measure_pass_seconds(
    target,
    batch_sizes=(1, 4, 16),
    widths=(1, 2, 3, 4, 5, 6, 7, 8),
    context: int = 256,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> dict:
    """``{"batch_sizes", "widths", "seconds", "context", "repeats", "dtype", "hardware"}``: ``seconds[i][j]`` is the
    median time of a pass over ``widths[j]`` tokens per row at ``batch_sizes[i]`` rows."""
    from transformers import DynamicCache

    if not batch_sizes or not widths or min(batch_sizes) < 1 or min(widths) < 1 or context < 1:
        raise ValueError("batch sizes, widths and the context length must be positive.")
    widths = sorted(int(w) for w in widths)
    device = target.get_input_embeddings().weight.device
    vocab = int(target.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    table = []
    for rows in batch_sizes:
        ids = torch.randint(0, vocab, (rows, context), generator=gen).to(device)
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, cache=cache, use_cache=True)
        line = []
        for width in widths:
            new = torch.randint(0, vocab, (rows, width), generator=gen).to(device)
            pos = (torch.arange(width) + context)[None].expand(rows, width).to(device)
            mask = torch.ones(rows, context + width, dtype=torch.long, device=device)
            times = []
            for i in range(warmup + repeats):
                _sync(device)
                t0 = time.perf_counter()
                target(input_ids=new, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                _sync(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                cache.crop(-width)  # back to the context (crop takes the count to drop)
            line.append(round(statistics.median(times), 6))
        table.append(line)
    return {
        "batch_sizes": [int(b) for b in batch_sizes],
        "widths": widths,
        "seconds": table,
        "context": int(context),
        "repeats": int(repeats),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "hardware": hardware_info(device),
    }
