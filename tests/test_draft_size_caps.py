"""Draft and tree sizes are fitted to what a call can use: chains to the tokens still to generate, EAGLE-2 trees to
the drafter's vocabulary; a static tree that asks for a rank the vocabulary lacks is refused up front."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, Eagle3Config
from hf_specdec.generation.adaptive import controller_for
from hf_specdec.tree.policies import DynamicTree, StaticTree


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, num_draft_tokens=3)).eval()
    return target, drafter


def _generate(target, **kw):
    ids, mask = ragged_batch(1)
    return target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **kw)


def test_a_huge_draft_length_is_capped_at_the_tokens_left(pair):
    target, drafter = pair
    out = _generate(target, assistant_model=drafter, num_assistant_tokens=10**8, lookup_tokens=10**8)
    assert torch.equal(out, _generate(target))
    # The adaptive controller is made for the capped length (6 tokens to generate), not for 10**8.
    assert controller_for(drafter, target, 6, None, 1, False, torch.device("cpu")).passes > 0


def test_an_eagle2_tree_is_capped_at_the_vocabulary_and_the_callers_policy_is_kept():
    asked = DynamicTree(depth=3, top_k=100_000, total_tokens=100_000)
    fitted = asked.for_vocabulary(VOCAB)
    assert (fitted.top_k, fitted.max_nodes) == (VOCAB, VOCAB + 2 * VOCAB * VOCAB)
    assert (asked.top_k, asked.max_nodes) == (100_000, 100_000)
    small = DynamicTree(depth=3, top_k=4, total_tokens=16)
    assert small.for_vocabulary(VOCAB) is small


def test_an_eagle2_tree_wider_than_the_vocabulary_still_decodes_losslessly(pair):
    target, drafter = pair
    out = _generate(target, assistant_model=drafter, tree="eagle2", tree_depth=2, tree_top_k=10**6)
    assert torch.equal(out, _generate(target))


def test_a_static_tree_rank_outside_the_vocabulary_is_refused_naming_the_path(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match=rf"path \(0, {VOCAB}\) asks for child rank {VOCAB}.*below {VOCAB}"):
        _generate(target, assistant_model=drafter, tree="static", tree_choices=[(0,), (0, VOCAB)])
    assert StaticTree([(0,), (VOCAB - 1,)]).for_vocabulary(VOCAB).max_nodes == 2
