"""The shared, declarative drafter tester: every drafter family's test file subclasses it.

A family states its config class, model class, small config overrides and capabilities; it inherits every check:
config round trip, Auto loading, no target weights saved, proposal shapes, greedy identity with plain ``generate``
across architectures / batch sizes / draft lengths, the sampling distribution, drafter cache equivalence, and clear
errors for a mismatched target.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
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


def tv_bound(num_categories: int, num_samples: int, delta: float = 1e-4) -> float:
    """High-probability bound on the total-variation distance between an empirical and the true distribution.

    By the Bretagnolle-Huber-Carol / DKW-type inequality: P(||p̂ - p||_1 >= eps) <= 2^k exp(-n eps^2 / 2),
    so with probability >= 1 - delta, TV = ||p̂ - p||_1 / 2 <= sqrt((2 k ln 2 + 2 ln(1/delta)) / n) / 2.
    """
    eps = math.sqrt((2 * num_categories * math.log(2) + 2 * math.log(1 / delta)) / num_samples)
    return eps / 2


class DrafterTesterMixin:
    config_class = None
    model_class = None
    config_overrides: dict = {}
    proposal_kind = "chain"
    greedy_archs = ARCHS
    draft_lengths = (1, 3, 6)

    # ------------------------------------------------------------------------------------------------ helpers
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
        assert prop.kind == self.proposal_kind == drafter.proposal_kind
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

    def test_sampling_distribution(self):
        """Lossless sampling: the law of generated tokens matches the target's, even with a poor drafter."""
        from sampling_check import check_sampling_matches_target

        check_sampling_matches_target(self.make_drafter, num_samples=3000)

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
