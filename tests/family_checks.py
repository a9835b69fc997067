"""Checks every drafter family inherits (through the shared tester): tree and variable-length variants of greedy
identity, a compute_loss + trainer smoke step, and a round trip through each of the family's checkpoint layouts.

A family's test file states its config and capabilities; these checks read the family's class attributes
(``supports_tree_drafting``, ``trains_target_adapter``) and the layout registry, never its name.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_target, ragged_batch

from hf_specdec import Proposal


def _truncating(drafter, seed: int):
    """Wraps ``drafter.propose`` so that each pass keeps a random number of its tokens per row (0 included), as a
    drafter stopping early at low confidence would. The tokens behind the cut are replaced with junk."""
    original = drafter.propose
    gen = torch.Generator().manual_seed(seed)

    def propose(state, num_tokens, select):
        proposal = original(state, num_tokens, select)
        bsz, n = proposal.tokens.shape
        lengths = torch.randint(0, n + 1, (bsz,), generator=gen)
        col = torch.arange(n)[None]
        junk = (proposal.tokens + 1) % drafter.config.target_vocab_size
        tokens = torch.where(
            col.to(proposal.tokens.device) < lengths[:, None].to(proposal.tokens.device), proposal.tokens, junk
        )
        return Proposal(tokens=tokens, draft_probs=proposal.draft_probs, kind=proposal.kind, lengths=lengths)

    drafter.propose = propose
    return drafter


class FamilyChecksMixin:
    """Mixed into ``DrafterTesterMixin``: needs ``make_drafter(target, seed, **overrides)`` and ``model_class``."""

    tree_archs = ("llama", "qwen3")
    no_foreign_layout_reason: str = ""  # set (with the reason) for a family without other projects' checkpoints
    layouts_refusing: dict = {}  # layout name -> a word of the error with which it refuses this config on export

    def _greedy_pair(self, target, drafter, batch, **extra):
        ids, mask = ragged_batch(batch, seed=batch + 3)
        kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
        ref = target.generate(ids, **kwargs)
        out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs, **extra)
        return ref, out

    @pytest.mark.parametrize("batch", [1, 3])
    def test_tree_greedy_identity(self, batch):
        if not self.model_class.supports_tree_drafting:
            target = make_target("llama")
            with pytest.raises(ValueError, match="cannot draft trees"):
                self._greedy_pair(target, self.make_drafter(target), batch, tree="fork-10")
            return
        for arch in self.tree_archs:
            target = make_target(arch, seed=4)
            drafter = self.make_drafter(target, seed=2)
            for tree in (
                {"tree": "eagle2", "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6},
                {"tree": "fork-10"},
            ):
                ref, out = self._greedy_pair(target, drafter, batch, **tree)
                assert torch.equal(out.sequences, ref), (arch, tree)
                # ASD along the tree with no budget is strict greedy verification.
                _, strict = self._greedy_pair(target, drafter, batch, verifier="asd", asd_budget=0.0, **tree)
                assert torch.equal(strict.sequences, ref), (arch, tree, "asd B=0")

    def test_tree_sampling_distribution(self):
        """Lossless tree sampling (EAGLE-2 trees of the family's untrained drafter) passes the shared distribution
        check, whose subtle-bug control (p instead of the residual after a rejection) must fail it."""
        from sampling_check import check_sampling_matches_target

        if not self.model_class.supports_tree_drafting:
            target = make_target("llama")
            ids, _ = ragged_batch(1)
            with pytest.raises(ValueError, match="cannot draft trees"):
                target.generate(ids, assistant_model=self.make_drafter(target), do_sample=True, tree="eagle2")
            return
        check_sampling_matches_target(
            self.make_drafter, min_branch_share=None, tree="eagle2", tree_depth=3, tree_top_k=3, tree_total_tokens=8
        )

    @pytest.mark.parametrize("batch", [1, 3])
    def test_variable_length_greedy_identity(self, batch):
        target = make_target("llama", seed=5)
        drafter = _truncating(self.make_drafter(target, seed=1), seed=batch)
        # Fixed K and no lookup merge, so that the drafter's own truncation is what varies the lengths.
        ref, out = self._greedy_pair(
            target, drafter, batch, num_assistant_tokens=4, draft_length="fixed", lookup_tokens=0
        )
        assert torch.equal(out.sequences, ref)
        drafted = {d for row in out.draft_lengths for d in row}
        assert 0 in drafted and len(drafted) > 2  # passes really were of different lengths

    def test_compute_loss_and_one_trainer_step(self, tmp_path):
        from test_training_trainer import args, self_distilled

        from hf_specdec.training.trainer import DrafterTrainer

        target = make_target("llama", seed=6)
        data = self_distilled(target, 8)
        drafter = self.make_drafter(target, seed=0).train()
        before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
        target_before = {n: p.detach().clone() for n, p in target.named_parameters()}
        trainer = DrafterTrainer(drafter, target, args(tmp_path, max_steps=2, save_steps=2, eval_steps=2), data)
        record = trainer.train()
        losses = [h["loss"] for h in trainer.history]
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
        changed = [n for n, p in trainer.unwrapped_drafter.named_parameters() if not torch.equal(p.detach(), before[n])]
        assert changed, "one training step changed no drafter parameter"
        # The target's own weights never change (an adapter family adds and trains only its adapter's weights).
        base = {
            n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in trainer.target.named_parameters()
        }
        assert set(target_before) <= set(base)
        assert all(torch.equal(base[n].detach(), w) for n, w in target_before.items())
        assert record["steps"] == 2

    def test_layout_round_trip(self, tmp_path):
        from hf_specdec.convert import LAYOUTS, export_drafter, import_drafter

        model_type = self.model_class.config_class.model_type
        layouts = [lay for lay in LAYOUTS.values() if lay.family == model_type and lay.save and lay.load]
        if self.no_foreign_layout_reason:  # a family no other project publishes checkpoints of
            assert not layouts, f"{model_type} now has layouts {layouts}: drop no_foreign_layout_reason"
            return
        assert layouts, f"{model_type} registers no import/export layout (models/<family>/convert_<family>.py)"
        target = make_target("llama", seed=7)
        drafter = self.make_drafter(target, seed=3)
        drafter.bind_target(target)
        for layout in layouts:
            folder = tmp_path / layout.name
            if layout.name in self.layouts_refusing:  # a layout that cannot hold this config refuses it by name
                with pytest.raises(ValueError, match=self.layouts_refusing[layout.name]):
                    export_drafter(drafter, str(folder), layout.name, target=target)
                continue
            export_drafter(drafter, str(folder), layout.name, target=target)
            back = import_drafter(str(folder), layout.name, target_config=target.config)
            want = drafter.state_dict()
            got = back.state_dict()
            assert set(got) == set(want), layout.name
            for key in want:
                torch.testing.assert_close(got[key].float(), want[key].float(), msg=f"{layout.name}: {key}")
            ids, mask = ragged_batch(2)
            kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
            assert torch.equal(
                target.generate(ids, assistant_model=back.eval(), **kwargs), target.generate(ids, **kwargs)
            )
