"""The shared, declarative drafter tester: every drafter family's test file subclasses it.

A family states its config class, model class, small config overrides and capabilities; it inherits every check:
config round trip, Auto loading, no target weights saved, proposal shapes, greedy identity with plain ``generate``
across architectures / batch sizes / draft lengths, the sampling distribution (several draft tokens per pass, full and
reduced ``d2t`` vocabulary, joint law of adjacent positions, a subtle-bug control that must fail; see
``sampling_check.py``), drafter cache equivalence, a padded row drafting exactly like the same prompt alone, the
family's teacher-forced training unroll matching ``observe`` + ``propose`` (hook ``teacher_forced_draft_logits``),
and clear errors for a mismatched target.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from family_checks import FamilyChecksMixin
from helpers import ARCHS, VOCAB, make_target, ragged_batch
from safetensors.torch import load_file
from transformers import AutoConfig

from hf_specdec import AutoModelForDrafting, DraftInputs


class RecordingSelector:
    """Greedy / sampling selector used to call `propose` directly; records the logits it saw."""

    def __init__(self, do_sample=False, vocab_size=VOCAB):
        self.do_sample = do_sample
        self.vocab_size = vocab_size
        self.seen = []

    def __call__(self, logits, depth, vocab_ids=None):
        if vocab_ids is not None:  # reduced draft vocabulary: expand to the target vocabulary
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, vocab_ids] = logits
            logits = full
        self.seen.append(logits.detach().clone())
        if self.do_sample:
            probs = torch.softmax(logits.float(), -1)
            return torch.multinomial(probs, 1).squeeze(-1), probs
        return logits.argmax(-1), None


def prefill_inputs(target, ids, mask, first_token):
    """DraftInputs for a prompt, as the loop builds them after the prefill pass."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = target(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    nxt = torch.cat([ids[:, 1:], first_token[:, None]], dim=1)
    return DraftInputs(next_token_ids=nxt, position_ids=pos, valid=mask.bool(), hidden_states=out.hidden_states)


class TeacherForcingSelector(RecordingSelector):
    """Greedy teacher forcing through the public ``propose``: returns ``forced[:, depth]`` whatever the logits, and
    records the logits it saw (expanded to the target vocabulary)."""

    def __init__(self, forced: torch.LongTensor, vocab_size=VOCAB):
        super().__init__(False, vocab_size)
        self.forced = forced

    def __call__(self, logits, depth, vocab_ids=None):
        super().__call__(logits, depth, vocab_ids)
        return self.forced[:, depth].to(logits.device), None


def observe_slots(drafter, state, full: DraftInputs, sl: slice) -> None:
    """Observes the slots ``sl`` of a prefill observation (a verified chunk, as the loop hands them over)."""
    drafter.observe(
        state,
        DraftInputs(
            next_token_ids=full.next_token_ids[:, sl],
            position_ids=full.position_ids[:, sl],
            valid=full.valid[:, sl],
            hidden_states=None if full.hidden_states is None else tuple(h[:, sl] for h in full.hidden_states),
        ),
    )


def tv_bound(num_categories: int, num_samples: int, delta: float = 1e-4) -> float:
    """High-probability bound on the total-variation distance between an empirical and the true distribution.

    By the Bretagnolle-Huber-Carol / DKW-type inequality: P(||p̂ - p||_1 >= eps) <= 2^k exp(-n eps^2 / 2),
    so with probability >= 1 - delta, TV = ||p̂ - p||_1 / 2 <= sqrt((2 k ln 2 + 2 ln(1/delta)) / n) / 2.
    """
    eps = math.sqrt((2 * num_categories * math.log(2) + 2 * math.log(1 / delta)) / num_samples)
    return eps / 2


class DrafterTesterMixin(FamilyChecksMixin):
    config_class = None
    model_class = None
    config_overrides: dict = {}
    greedy_archs = ARCHS
    draft_lengths = (1, 3, 6)
    supports_reduced_vocab = True  # draft_vocab_size < target_vocab_size, set through init_from_data (d2t)

    # ------------------------------------------------------------------------------------------------ helpers
    def _assert_reduced_vocab_refused(self):
        """A family without a reduced draft vocabulary must refuse ``draft_vocab_size < target_vocab_size``."""
        target = make_target("llama")
        with pytest.raises(ValueError, match="draft_vocab_size"):
            self.make_drafter(target, draft_vocab_size=VOCAB // 2)

    def make_config(self, target, **overrides):
        return self.config_class.for_target(target.config, **{**self.config_overrides, **overrides})

    def make_drafter(self, target, seed=0, **overrides):
        torch.manual_seed(seed)
        return AutoModelForDrafting.from_config(self.make_config(target, **overrides)).eval()

    # ------------------------------------------------------------------------------------------------ config
    def test_config_round_trip(self, tmp_path):
        target = make_target("llama")
        config = self.make_config(target)
        assert config.model_type.endswith("_drafter")
        again = self.config_class.from_dict(config.to_dict())
        assert again.to_dict() == config.to_dict()
        config.save_pretrained(tmp_path)
        loaded = AutoConfig.from_pretrained(tmp_path)
        assert type(loaded) is self.config_class
        strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
        assert strip(loaded.to_dict()) == strip(config.to_dict())
        assert loaded.target_hidden_size == target.config.hidden_size
        assert loaded.target_vocab_size == target.config.vocab_size

    def test_config_rejects_bad_values(self):
        target = make_target("llama")
        with pytest.raises(ValueError, match="target_layer_ids"):
            self.make_config(target, target_layer_ids=[99])
        with pytest.raises(ValueError, match="draft_vocab_size"):
            self.make_config(target, draft_vocab_size=target.config.vocab_size + 1)
        with pytest.raises(ValueError, match="num_draft_tokens"):
            self.make_config(target, num_draft_tokens=0)

    # ------------------------------------------------------------------------------------------------ loading
    def test_auto_loading_round_trip(self, tmp_path):
        target = make_target("llama")
        drafter = self.make_drafter(target)
        assert isinstance(drafter, self.model_class)
        drafter.save_pretrained(tmp_path)
        assert os.path.exists(tmp_path / "model.safetensors")
        loaded = AutoModelForDrafting.from_pretrained(tmp_path).eval()
        assert type(loaded) is self.model_class
        sd_a, sd_b = drafter.state_dict(), loaded.state_dict()
        assert sd_a.keys() == sd_b.keys()
        for key in sd_a:
            assert torch.equal(sd_a[key], sd_b[key]), key
        ids, mask = ragged_batch(2)
        a = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=8, do_sample=False)
        b = target.generate(ids, attention_mask=mask, assistant_model=loaded, max_new_tokens=8, do_sample=False)
        assert torch.equal(a, b)

    def test_no_target_weights_saved(self, tmp_path):
        target = make_target("llama")
        drafter = self.make_drafter(target)
        drafter.bind_target(target)
        drafter.save_pretrained(tmp_path)
        saved = load_file(str(tmp_path / "model.safetensors"))
        target_tensors = [p for p in target.state_dict().values() if p.dim() == 2]
        for key, tensor in saved.items():
            for t in target_tensors:
                assert not (tensor.shape == t.shape and torch.equal(tensor, t)), f"{key} is a copy of a target weight"
        if self.model_class.borrows_target_embeddings:
            assert not any("embed_tokens" in k for k in saved)
        cfg = json.loads((tmp_path / "config.json").read_text())
        assert cfg["model_type"] == self.config_class.model_type

    # ------------------------------------------------------------------------------------------------ proposals
    @pytest.mark.parametrize("do_sample", [False, True])
    def test_proposal_shapes(self, do_sample):
        target = make_target("llama")
        drafter = self.make_drafter(target).bind_target(target)
        ids, mask = ragged_batch(3)
        state = drafter.init_draft_state(3, 64)
        drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([7, 8, 9])))
        sel = RecordingSelector(do_sample)
        prop = drafter.propose(state, 4, sel)
        assert prop.kind == "chain"  # trees come from tree_start / tree_expand
        assert prop.tokens.shape == (3, 4) and prop.tokens.dtype == torch.long
        assert int(prop.tokens.min()) >= 0 and int(prop.tokens.max()) < target.config.vocab_size
        if do_sample:
            assert prop.draft_probs.shape == (3, 4, target.config.vocab_size)
            torch.testing.assert_close(prop.draft_probs.sum(-1), torch.ones(3, 4))
        else:
            assert prop.draft_probs is None

    def test_cache_equivalence(self):
        """Observing a context in one go equals observing it in pieces with a discarded proposal in between."""
        target = make_target("llama")
        drafter = self.make_drafter(target).bind_target(target)
        ids, mask = ragged_batch(2, length=12)
        first = torch.tensor([11, 12])
        full = prefill_inputs(target, ids, mask, first)
        s_full = drafter.init_draft_state(2, 64)
        drafter.observe(s_full, full)
        sel_full = RecordingSelector()
        p_full = drafter.propose(s_full, 3, sel_full)

        s_inc = drafter.init_draft_state(2, 64)
        cut = 7

        def part(sl):
            return DraftInputs(
                next_token_ids=full.next_token_ids[:, sl],
                position_ids=full.position_ids[:, sl],
                valid=full.valid[:, sl],
                hidden_states=tuple(h[:, sl] for h in full.hidden_states),
            )

        drafter.observe(s_inc, part(slice(0, cut)))
        drafter.propose(s_inc, 3, RecordingSelector())  # speculative work that must be discarded
        drafter.observe(s_inc, part(slice(cut, None)))
        sel_inc = RecordingSelector()
        p_inc = drafter.propose(s_inc, 3, sel_inc)
        assert torch.equal(p_full.tokens, p_inc.tokens)
        for a, b in zip(sel_full.seen, sel_inc.seen):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    def test_padded_row_drafts_like_unpadded(self):
        """A left-padded row of a batch drafts exactly what the same prompt drafts alone, without padding."""
        target = make_target("llama", seed=1)
        drafter = self.make_drafter(target, seed=2).bind_target(target)
        ids, mask = ragged_batch(3, length=12, seed=7)
        assert int((mask == 0).sum(1).max()) == 4  # rows 1 and 2 are padded
        first = torch.tensor([21, 22, 23])
        state = drafter.init_draft_state(3, 64)
        drafter.observe(state, prefill_inputs(target, ids, mask, first))
        batched = RecordingSelector()
        prop = drafter.propose(state, 4, batched)
        for b in range(3):
            row = ids[b, mask[b].bool()][None]
            alone = drafter.init_draft_state(1, 64)
            drafter.observe(alone, prefill_inputs(target, row, torch.ones_like(row), first[b : b + 1]))
            single = RecordingSelector()
            prop_b = drafter.propose(alone, 4, single)
            assert torch.equal(prop.tokens[b : b + 1], prop_b.tokens), f"row {b}"
            for depth, (a, c) in enumerate(zip(batched.seen, single.seen)):
                finite = torch.isfinite(c[0])
                assert torch.equal(torch.isfinite(a[b]), finite)
                torch.testing.assert_close(a[b][finite], c[0][finite], rtol=1e-4, atol=1e-4, msg=f"row {b}, {depth}")

    # ------------------------------------------------------------------------------------------------ training
    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        """The family's training unroll: a list over draft depths ``j < steps`` of ``(batch, seq, draft_vocab)``
        logits, where anchor ``t`` at depth ``j`` predicts token ``t + 2 + j`` having been fed the true tokens up to
        ``t + 1 + j`` (``hidden_states``: the target's ``output_hidden_states`` over ``input_ids``). Return ``None``
        (with a reason in the family's test file) only for a family whose training has no such unroll."""
        raise NotImplementedError(f"{type(self).__name__} must define teacher_forced_draft_logits (or return None)")

    @pytest.mark.parametrize("vocab", ["full", "reduced"])
    def test_training_unroll_matches_propose(self, vocab):
        """What training optimises is what inference drafts: the family's teacher-forced training unroll gives, at
        every anchor and depth, the logits that ``observe`` + the public ``propose`` give with a selector forcing
        the true tokens. Batch of 3 with left padding (rows with 0, 2 and 4 pads); anchors observed one slot at a
        time, with the speculative work of each proposal discarded by the next ``observe``."""
        if vocab == "reduced" and not self.supports_reduced_vocab:
            self._assert_reduced_vocab_refused()
            return
        steps = 3
        target = make_target("llama", seed=1)
        cfg = {"draft_vocab_size": 40} if vocab == "reduced" else {}
        drafter = self.make_drafter(target, seed=2, **cfg).bind_target(target)
        if vocab == "reduced":
            counts = torch.zeros(VOCAB)
            counts[torch.arange(6, VOCAB, 2)[:40]] = 1.0  # even ids from 6: a non-trivial d2t
            drafter.init_from_data(counts)
            assert not torch.equal(drafter.draft_token_ids.cpu(), torch.arange(40))
        ids, mask = ragged_batch(3, length=14, seed=8)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            out = target(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
            unroll = self.teacher_forced_draft_logits(drafter, ids, out.hidden_states, mask, steps)
        assert unroll is not None, (
            f"{type(self).__name__} must define teacher_forced_draft_logits (the family's training unroll), so that "
            "training is checked against inference"
        )
        assert len(unroll) == steps
        full = prefill_inputs(target, ids, mask, torch.zeros(3, dtype=torch.long))  # last slot is never used
        vocab_ids = drafter.draft_token_ids
        state = drafter.init_draft_state(3, 64)
        seq = ids.shape[1]
        compared = 0
        observe_slots(drafter, state, full, slice(0, 1))
        for anchor in range(seq - steps):
            if anchor > 0:
                observe_slots(drafter, state, full, slice(anchor, anchor + 1))
            forced = ids[:, anchor + 2 : anchor + 1 + steps]  # true tokens fed after depths 0..steps-2
            forced = torch.cat([forced, forced[:, -1:]], dim=1)  # the last depth's choice is not fed back
            sel = TeacherForcingSelector(forced)
            drafter.propose(state, steps, sel)
            rows = mask[:, anchor].bool()  # anchors on padding are not trained
            for depth in range(steps):
                got = sel.seen[depth][rows][:, vocab_ids]
                want = unroll[depth][rows, anchor].float()
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"anchor {anchor}, depth {depth}")
            compared += int(rows.sum())
        assert compared == int(mask[:, : seq - steps].sum())

    # ------------------------------------------------------------------------------------------------ generation
    @pytest.mark.parametrize("batch", [1, 3])
    @pytest.mark.parametrize("arch", ARCHS)
    def test_greedy_identity(self, arch, batch):
        if arch not in self.greedy_archs:
            pytest.fail(f"{arch} missing from greedy_archs")
        target = make_target(arch, seed=1)
        drafter = self.make_drafter(target, seed=2)
        ids, mask = ragged_batch(batch, seed=3)
        # Make one row stop early: its 4th greedy token becomes the EOS id.
        probe = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None)
        eos = int(probe[batch - 1, ids.shape[1] + 3])
        for k in self.draft_lengths:
            kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos)
            ref = target.generate(ids, **kwargs)
            out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=k, **kwargs)
            assert torch.equal(out, ref), f"{arch} batch={batch} K={k}"
        # The early row really stopped early and is padded afterwards, as plain generate does.
        row = ref[batch - 1, ids.shape[1] :].tolist()
        assert row.index(eos) <= 3
        assert all(t == target.generation_config.pad_token_id for t in row[row.index(eos) + 1 :])

    @pytest.mark.parametrize("batch", [1, 3])
    def test_asd_strict_settings_are_greedy(self, batch):
        """ASD with B = 0, M = 0 or g = 0 is strict greedy verification, for every family, token for token."""
        target = make_target("llama", seed=1)
        drafter = self.make_drafter(target, seed=2)
        ids, mask = ragged_batch(batch, seed=4)
        kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False)
        ref = target.generate(ids, **kwargs)
        for options in ({"asd_budget": 0.0}, {"asd_block_cap": 0}, {"asd_gate": 0.0}):
            out = target.generate(ids, assistant_model=drafter, verifier="asd", return_dict_in_generate=True,
                                  **options, **kwargs)  # fmt: skip
            assert torch.equal(out.sequences, ref), options
            assert out.approximate is True and out.verifier == "asd"
            assert float(out.verifier_stats["regret"].sum()) == 0.0

    def test_explicit_custom_generate_form(self):
        import hf_specdec

        target = make_target("qwen3")
        drafter = self.make_drafter(target)
        ids, mask = ragged_batch(2)
        ref = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            custom_generate=hf_specdec.speculative_generate,
            drafter=drafter,
        )
        assert torch.equal(out, ref)

    @pytest.mark.parametrize("vocab", ["full", "reduced"])
    def test_sampling_distribution(self, vocab):
        """Lossless sampling: the law of generated tokens matches the target's (every position, and the joint law of
        adjacent positions), with K = 3 tokens drafted per pass, for the full and a reduced (``d2t``) draft
        vocabulary; the same test rejects a verifier that samples from p instead of the residual after a rejection.
        See ``sampling_check.py`` for the settings, the power and the false-failure probability."""
        from sampling_check import check_sampling_matches_target

        if vocab == "reduced" and not self.supports_reduced_vocab:
            self._assert_reduced_vocab_refused()
            return
        check_sampling_matches_target(self.make_drafter, reduced_vocab=vocab == "reduced")

    def test_mismatched_target_raises(self):
        target = make_target("llama")
        drafter = self.make_drafter(target)
        other = make_target("llama", hidden_size=48, num_attention_heads=4)
        ids, mask = ragged_batch(1)
        with pytest.raises(ValueError, match="hidden size: drafter expects 32, target .* has 48"):
            other.generate(ids, assistant_model=drafter, max_new_tokens=4)
        other_vocab = make_target("llama", vocab=128)
        with pytest.raises(ValueError, match="vocabulary size: drafter expects 96"):
            other_vocab.generate(ids, assistant_model=drafter, max_new_tokens=4)
        if drafter.requires_target_hidden_states:
            deeper = make_target("llama", layers=6)
            with pytest.raises(ValueError, match="number of layers"):
                deeper.generate(ids, assistant_model=drafter, max_new_tokens=4)
