#!/usr/bin/env python
"""Overhead of hf_specdec's decoding loop per iteration, relative to one plain target forward (ratios, not times).

Measured in one run on a tiny Llama target, with a replay drafter that costs nothing (so what is left is the loop:
logits processing, verification, bookkeeping, cache cropping, host syncs):

* ``t_step``   one plain decode forward (1 token, KV cache) -- the unit;
* ``t_verify`` one target forward over K + 1 tokens (what a speculative iteration must pay anyway);
* ``t_iter``   one speculative iteration of ``generate(assistant_model=oracle)`` at full acceptance;
* ``t_plain``  one token of plain ``generate`` (transformers' own per-token overhead, for comparison).

Usage: python scripts/loop_overhead.py [--hidden 64] [--layers 2] [--k 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_specdec  # noqa: F401  (installs the generate hook)
from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.testing import make_oracle_drafter


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_time(model, prompt, n_tokens: int, repeats: int, inner: int = 20) -> float:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache, use_cache=True)
    length = prompt.shape[1]
    ids = torch.full((1, n_tokens), 7, dtype=torch.long)
    pos = torch.arange(length, length + n_tokens)[None]

    def run():
        with torch.no_grad():
            for _ in range(inner):
                model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
                cache.crop(-n_tokens)

    return median_time(run, repeats) / inner


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=101)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        eos_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    prompt = torch.randint(3, args.vocab, (1, 32))
    k, n_new = args.k, args.new_tokens

    t_step = forward_time(target, prompt, 1, args.repeats)
    t_verify = forward_time(target, prompt, k + 1, args.repeats)

    gen_kwargs = dict(max_new_tokens=n_new, do_sample=False, eos_token_id=None)
    cont = target.generate(prompt, **gen_kwargs)[:, prompt.shape[1] :]
    cont = torch.cat([cont, cont[:, -1:].repeat(1, k + 1)], dim=1)
    oracle = make_oracle_drafter(target, cont, num_draft_tokens=k)
    out = target.generate(prompt, assistant_model=oracle, return_dict_in_generate=True, **gen_kwargs)
    assert torch.equal(out.sequences[:, prompt.shape[1] :], cont[:, :n_new]), "oracle run must be lossless"
    iterations = len(out.accepted_lengths[0])
    t_prefill = median_time(lambda: target.generate(prompt, max_new_tokens=1, do_sample=False), args.repeats)
    t_spec = median_time(lambda: target.generate(prompt, assistant_model=oracle, **gen_kwargs), args.repeats)
    t_plain_total = median_time(lambda: target.generate(prompt, **gen_kwargs), args.repeats)
    t_iter = (t_spec - t_prefill) / iterations
    t_plain = (t_plain_total - t_prefill) / (n_new - 1)

    eagle = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=k)).eval()
    t_eagle_total = median_time(lambda: target.generate(prompt, assistant_model=eagle, **gen_kwargs), args.repeats)
    eagle_out = target.generate(prompt, assistant_model=eagle, return_dict_in_generate=True, **gen_kwargs)
    eagle_iters = len(eagle_out.accepted_lengths[0])
    t_eagle_iter = (t_eagle_total - t_prefill) / eagle_iters

    print(
        f"tiny Llama target: hidden={args.hidden} layers={args.layers} vocab={args.vocab}, K={k}, "
        f"{n_new} new tokens, {args.threads} thread(s)"
    )
    print(f"  tau with the replay drafter          : {out.mean_accepted_length:.2f} ({iterations} iterations)")
    print(f"  verify forward (K+1 tokens) / step   : {t_verify / t_step:6.2f}")
    print(f"  speculative iteration / step         : {t_iter / t_step:6.2f}")
    print(f"  loop overhead per iteration / step   : {(t_iter - t_verify) / t_step:6.2f}")
    print(f"  plain generate per token / step      : {t_plain / t_step:6.2f}   (transformers' own overhead)")
    print(f"  EAGLE-3 iteration (untrained) / step : {t_eagle_iter / t_step:6.2f}   (K drafter passes included)")
    print(f"  EAGLE-3 draft cost c per draft token : {(t_eagle_iter - t_iter) / k / t_step:6.2f}")


if __name__ == "__main__":
    main()
