"""Medusa-1: the shared drafter tester plus family-specific checks (zero init, loss weights, trees, layouts)."""

import json
import os

import pytest
import torch
from drafter_tester import DrafterTesterMixin, RecordingSelector, prefill_inputs
from helpers import VOCAB, make_target, ragged_batch
from safetensors.torch import save_file

from hf_specdec import AutoModelForDrafting, MedusaConfig, MedusaForDrafting
from hf_specdec.convert import export_drafter, import_drafter
from hf_specdec.features import TargetFeatures


class TestMedusa(DrafterTesterMixin):
    config_class = MedusaConfig
    model_class = MedusaForDrafting
    config_overrides = {}
    draft_lengths = (1, 3, 5)  # at most one token per head (5 heads)

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        # The heads read only the target's state at the anchor: no tokens are fed.
        (feats,) = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(feats, steps)


def _drafter(target, **kw):
    torch.manual_seed(0)
    return AutoModelForDrafting.from_config(MedusaConfig.for_target(target.config, **kw)).eval()


def _randomise(drafter, scale=0.05):
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return drafter


def test_zero_init_survives_post_init_and_loading(tmp_path):
    target = make_target("llama")
    fresh = _drafter(target, num_layers=2)
    for head in fresh.heads:
        for block in head.blocks:
            assert torch.count_nonzero(block.linear.weight) == 0  # W1 = 0: a fresh block adds SiLU(b) to h_t
            assert torch.count_nonzero(block.linear.bias) > 0
        assert head.lm_head.weight.std() > 0
    trained = _randomise(_drafter(target, num_layers=2))
    trained.save_pretrained(tmp_path)
    loaded = AutoModelForDrafting.from_pretrained(tmp_path)
    for key, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key  # loading never re-initialises trained weights


def test_init_from_target_makes_each_head_the_target_head():
    target = make_target("llama")
    drafter = _drafter(target, draft_vocab_size=40)
    counts = torch.zeros(VOCAB)
    counts[torch.arange(6, VOCAB, 2)[:40]] = 1.0
    drafter.init_from_data(counts)
    drafter.bind_target(target)
    drafter.init_from_target(target)
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
        heads = drafter(out.hidden_states[-1])  # (B, T, heads, Vd)
    rows = target.get_output_embeddings().weight[drafter.draft_token_ids]
    for j, head in enumerate(drafter.heads):  # W1 = 0, W2 = the LM head's rows: logits of h + SiLU(b)
        shifted = out.hidden_states[-1] + torch.nn.functional.silu(head.blocks[0].linear.bias)
        torch.testing.assert_close(heads[:, :, j], shifted @ rows.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # with b = 0 as well, every head is the target's own head on the draft vocabulary
        for head in drafter.heads:
            head.blocks[0].linear.bias.zero_()
        heads = drafter(out.hidden_states[-1])
    for j in range(drafter.num_heads):
        torch.testing.assert_close(heads[:, :, j], out.logits[..., drafter.draft_token_ids], rtol=1e-5, atol=1e-5)


def test_loss_is_the_decayed_sum_of_head_cross_entropies():
    target = make_target("llama")
    drafter = _randomise(_drafter(target, num_heads=3, num_draft_tokens=3)).bind_target(target)
    ids, mask = ragged_batch(2, length=12)
    loss_mask = mask.clone()
    loss_mask[:, :4] = 0
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    last = out.hidden_states[-1]
    feats = TargetFeatures(hidden_states=[last], last_hidden=last)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}
    got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    # independent: head j at anchor t against the target's distribution at t + 1 + j (the token t + 2 + j)
    p = torch.softmax(target.get_output_embeddings()(last).float(), -1)
    logits = drafter(last).float()
    want = 0.0
    valid_all = (loss_mask * mask).bool()
    for j in range(3):
        terms = []
        for b in range(2):
            for t in range(12 - 2 - j):
                if valid_all[b, t + 2 + j]:
                    terms.append(-(p[b, t + 1 + j] * torch.log_softmax(logits[b, t, j], -1)).sum())
        want = want + 0.8**j * torch.stack(terms).mean()
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-5)
    # decay is a loss kwarg; the hard-label variant scores the data's token
    flat = drafter.compute_loss(batch, feats, target.get_output_embeddings(), decay=1.0)
    assert float(flat.loss.detach()) > float(got.loss.detach())
    drafter.config.loss_labels = "hard"
    hard = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    assert not torch.isclose(hard.loss, got.loss)
    with pytest.raises(TypeError, match="unknown loss kwargs"):
        drafter.compute_loss(batch, feats, target.get_output_embeddings(), steps=2)


def test_heads_draft_independently_and_trees_use_the_next_head():
    target = make_target("llama")
    drafter = _randomise(_drafter(target)).bind_target(target)
    ids, mask = ragged_batch(2)
    state = drafter.init_draft_state(2, 64)
    drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([7, 8])))
    sel = RecordingSelector()
    prop = drafter.propose(state, 5, sel)
    with torch.no_grad():
        heads = drafter(state.last_hidden)
    assert torch.equal(prop.tokens, heads.argmax(-1))
    # a 63-node Medusa tree reproduces plain greedy decoding
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    ref = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, assistant_model=drafter, tree="medusa-63", **kw), ref)


def test_impossible_lengths_fail_early():
    target = make_target("llama")
    drafter = _drafter(target, num_heads=3, num_draft_tokens=3)
    ids, mask = ragged_batch(1)
    with pytest.raises(ValueError, match="at most 3 tokens ahead"):
        target.generate(ids, assistant_model=drafter, num_assistant_tokens=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="at most 3 tokens ahead"):
        target.generate(ids, assistant_model=drafter, tree="medusa-63", max_new_tokens=4)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig.for_target(target.config, num_heads=2, num_draft_tokens=3)


def _independent_heads(blocks, projs, h):
    """A Medusa head by hand: x + SiLU(W x + b) per block, then the projection."""
    outs = []
    for layers, proj in zip(blocks, projs):
        x = h
        for w, b in layers:
            x = x + torch.nn.functional.silu(x @ w.T + (0 if b is None else b))
        outs.append(x @ proj.T)
    return torch.stack(outs, dim=-2)


@pytest.mark.parametrize("layout", ["medusa-fasterdecoding", "medusa-vllm"])
def test_import_matches_an_independent_forward_of_the_source_layout(tmp_path, layout):
    target = make_target("llama")
    hidden, heads, layers = target.config.hidden_size, 3, 2
    g = torch.Generator().manual_seed(0)
    blocks = [[(torch.randn(hidden, hidden, generator=g) * 0.1, torch.randn(hidden, generator=g) * 0.1)
               for _ in range(layers)] for _ in range(heads)]  # fmt: skip
    truncated = layout == "medusa-vllm"
    vocab = 40 if truncated else VOCAB
    projs = [torch.randn(vocab, hidden, generator=g) for _ in range(heads)]
    state, config = {}, {}
    if layout == "medusa-fasterdecoding":
        for h in range(heads):
            for layer, (w, b) in enumerate(blocks[h]):
                state[f"{h}.{layer}.linear.weight"], state[f"{h}.{layer}.linear.bias"] = w, b
            state[f"{h}.{layers}.weight"] = projs[h]
        config = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "tiny"}
    else:
        token_map = torch.arange(6, VOCAB, 2)[:40]
        for h in range(heads):
            for layer, (w, b) in enumerate(blocks[h]):
                state[f"medusa_heads.blocks.{h}.layers.{layer}.weight"] = w
                state[f"medusa_heads.blocks.{h}.layers.{layer}.bias"] = b
            state[f"medusa_heads.lm_heads.{h}.weight"] = projs[h]
        state["token_map"] = token_map
        config = {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": layers, "hidden_size": hidden,
                  "vocab_size": VOCAB, "truncated_vocab_size": 40, "medusa_fc_bias": True}  # fmt: skip
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(config))
    drafter = import_drafter(str(src), "auto", target_config=target.config)
    h = torch.randn(2, 5, hidden, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(drafter(h), _independent_heads(blocks, projs, h), rtol=1e-5, atol=1e-5)
    if truncated:
        assert torch.equal(drafter.draft_token_ids, token_map)
    # and it drafts losslessly for the target
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))
    # export writes the same layout back
    out = tmp_path / "out"
    export_drafter(drafter, str(out), layout)
    if layout == "medusa-fasterdecoding":  # the file Medusa's training script writes and TGI / TensorRT-LLM read
        assert sorted(os.listdir(out)) == ["config.json", "medusa_lm_head.safetensors"]
    again = import_drafter(str(out), layout, target_config=target.config)
    with torch.no_grad():
        torch.testing.assert_close(again(h), drafter(h))


def test_fasterdecoding_export_refuses_a_reduced_vocabulary(tmp_path):
    target = make_target("llama")
    drafter = _drafter(target, draft_vocab_size=40)
    with pytest.raises(ValueError, match="full vocabulary"):
        export_drafter(drafter, str(tmp_path / "x"), "medusa-fasterdecoding")


def test_typical_acceptance_on_the_medusa_tree_commits_only_typical_tokens():
    """Medusa's opt-in approximate verifier on its 63-node tree: flagged approximate, and re-scored with a fresh
    target pass every committed token is the target's argmax or passes p(x) > min(eps, delta * exp(-H(p)))."""
    target = make_target("llama", seed=3)
    drafter = _randomise(_drafter(target), scale=0.5).bind_target(target)
    ids, mask = ragged_batch(2)
    eps, delta = 0.2, 0.5
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, tree="medusa-63", verifier="typical",
        typical_posterior_threshold=eps, typical_posterior_alpha=delta, max_new_tokens=16, do_sample=False,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert out.approximate and out.verifier == "typical"
    seq = out.sequences
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = target(seq, attention_mask=full_mask, position_ids=pos).logits.float()
    p = torch.softmax(logits[:, ids.shape[1] - 1 : -1], -1)
    new = seq[:, ids.shape[1] :]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    chosen = p.gather(-1, new[..., None])[..., 0]
    typical = chosen > torch.clamp(delta * torch.exp(-entropy), max=eps)
    greedy = new == p.argmax(-1)
    assert bool((typical | greedy).all())
    assert bool((~greedy).any())  # the check has teeth: some committed tokens are not the argmax
