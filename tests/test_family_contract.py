"""The family contract (what a drafter class implements, refused by name when a part is missing) and the draft
vocabulary, which every drafter has from the base class."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import make_target

from hf_specdec import AutoModelForDrafting, DrafterPreTrainedModel, Eagle3Config
from hf_specdec.modeling_utils import FAMILY_CONTRACT, check_family_contract
from hf_specdec.registry import DRAFTERS
from hf_specdec.testing import OracleDrafter, OracleDrafterConfig


def test_every_registered_family_keeps_the_contract():
    assert len(DRAFTERS) >= 10
    for spec in DRAFTERS.values():
        check_family_contract(spec.model_class)  # raises naming what is missing
        if spec.model_class.supports_tree_drafting:
            for name in FAMILY_CONTRACT["supports_tree_drafting"]:
                assert getattr(spec.model_class, name) is not getattr(DrafterPreTrainedModel, name), spec.name


class _Decodes(OracleDrafter):
    """An oracle drafter: implements the decoding methods, no tree ones."""


# (what the subclass changes, the methods the error must name)
_BROKEN_PARTS = [
    ({"propose": DrafterPreTrainedModel.propose}, ["propose"]),
    ({"observe": DrafterPreTrainedModel.observe}, ["observe"]),
    ({"supports_tree_drafting": True}, ["tree_start", "tree_expand"]),
    ({"trains_target_adapter": True}, ["target_adapter_config"]),
]


@pytest.mark.parametrize(("changes", "missing"), _BROKEN_PARTS)
def test_a_drafter_missing_part_of_the_contract_is_refused_when_built_naming_it(changes, missing):
    config = OracleDrafterConfig.for_target(make_target("llama").config)
    _Decodes(config)  # the control: the decoding methods are there
    broken = type("Broken", (OracleDrafter,), changes)
    with pytest.raises(TypeError, match=re.escape(f"Broken does not implement {missing}")):
        broken(config)


def test_a_drafter_without_vocabulary_maps_drafts_over_the_full_vocabulary():
    target = make_target("llama")
    drafter = OracleDrafter(OracleDrafterConfig.for_target(target.config))
    vocab = target.config.vocab_size
    assert not drafter.has_vocabulary_maps and not drafter.reduced_vocabulary
    assert torch.equal(drafter.draft_token_ids, torch.arange(vocab))
    logits = torch.randn(2, vocab)
    assert drafter.draft_to_target_logits(logits) is logits
    drafter.check_draft_vocab()  # nothing to check
    with pytest.raises(ValueError, match="full vocabulary; it has no draft vocabulary to set"):
        drafter.set_draft_vocab(torch.arange(vocab))


def test_a_reduced_vocabulary_comes_from_the_base_class():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, draft_vocab_size=16))
    assert drafter.has_vocabulary_maps and drafter.reduced_vocabulary
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    chosen = torch.arange(0, 32, 2)
    counts[chosen] = 5
    drafter.init_from_data(counts)
    assert torch.equal(drafter.draft_token_ids, chosen)
    full = drafter.draft_to_target_logits(torch.zeros(1, 16))
    assert torch.isinf(full[0, 1]) and full[0, 2] == 0
    drafter.t2d[1] = True  # a corrupt map: the check run after loading names it
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        drafter.check_loaded_weights()
