"""Blockwise parallel decoding: the shared drafter tester plus family-specific checks."""

import pytest
import torch
from drafter_tester import DrafterTesterMixin, RecordingSelector, prefill_inputs
from helpers import VOCAB, make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, BlockwiseConfig, BlockwiseForDrafting
from hf_specdec.features import TargetFeatures


class TestBlockwise(DrafterTesterMixin):
    config_class = BlockwiseConfig
    model_class = BlockwiseForDrafting
    config_overrides = {"intermediate_size": 48}
    draft_lengths = (1, 3, 4)  # at most one token per head (4 heads)
    no_foreign_layout_reason = "no other project publishes Blockwise checkpoints"

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        (feats,) = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(feats, steps)

    @pytest.mark.parametrize("batch", [1, 3])
    def test_tree_greedy_identity(self, batch):
        # fork-10 is 5 deep: give this test's drafters 5 heads
        self.config_overrides = {"intermediate_size": 48, "num_heads": 5}
        super().test_tree_greedy_identity(batch)


def _drafter(target, **kw):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(BlockwiseConfig.for_target(target.config, **kw)).eval()


def test_fresh_heads_propose_the_targets_next_token_and_nothing_is_copied(tmp_path):
    target = make_target("llama")
    drafter = _drafter(target).bind_target(target)
    for head in drafter.heads:
        assert torch.count_nonzero(head.down.weight) == 0 and torch.count_nonzero(head.up.weight) > 0
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
        logits = drafter(out.hidden_states[-1])
    for j in range(drafter.num_heads):  # W_out = 0: each head is the target's own LM head
        torch.testing.assert_close(logits[:, :, j], out.logits, rtol=1e-5, atol=1e-5)
    drafter.save_pretrained(tmp_path)
    assert not any("lm_head" in k for k in drafter.state_dict())  # the shared head is borrowed, never saved


def test_reduced_vocabulary_uses_the_target_heads_rows():
    target = make_target("llama")
    drafter = _drafter(target, draft_vocab_size=40)
    counts = torch.zeros(VOCAB)
    counts[torch.arange(6, VOCAB, 2)[:40]] = 1.0
    drafter.init_from_data(counts)
    drafter.bind_target(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ids, mask = ragged_batch(2)
    state = drafter.init_draft_state(2, 64)
    drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([7, 8])))
    prop = drafter.propose(state, 4, RecordingSelector())
    assert bool(torch.isin(prop.tokens, drafter.draft_token_ids).all())
    h = state.last_hidden
    w = target.get_output_embeddings().weight[drafter.draft_token_ids]
    for j, head in enumerate(drafter.heads):  # independent: head j's state through the LM head's rows
        want = (h + head.down(torch.relu(head.up(h)))) @ w.T
        assert torch.equal(drafter.draft_token_ids[want.argmax(-1)], prop.tokens[:, j])


def test_loss_weighs_heads_equally():
    target = make_target("llama")
    drafter = _drafter(target, num_heads=2, num_draft_tokens=2).bind_target(target)
    ids, mask = ragged_batch(2, length=10)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    last = out.hidden_states[-1]
    feats = TargetFeatures(hidden_states=[last], last_hidden=last)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    p = torch.softmax(out.logits.float(), -1)
    logits = drafter(last).float()
    want = 0.0
    for j in range(2):
        terms = [-(p[b, t + 1 + j] * torch.log_softmax(logits[b, t, j], -1)).sum()
                 for b in range(2) for t in range(10 - 2 - j) if mask[b, t + 2 + j]]  # fmt: skip
        want = want + torch.stack(terms).mean()
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
