"""MTP: the shared drafter tester (one module and two chained modules) plus family checks: the loss, the layout of
MTP layers stored after a target's own, and a target checkpoint that ships them serving as its own drafter."""

import json

import pytest
import torch
from drafter_tester import DrafterTesterMixin
from helpers import llama_layer_by_hand, make_target, ragged_batch, rms
from safetensors.torch import save_file

from hf_specdec import AutoModelForDrafting, MtpConfig, MtpForDrafting
from hf_specdec.convert import detect_layout, export_drafter, import_drafter
from hf_specdec.features import TargetFeatures


class TestMtp(DrafterTesterMixin):
    config_class = MtpConfig
    model_class = MtpForDrafting
    config_overrides = {"intermediate_size": 64}

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        (feats,) = drafter.select_target_features(hidden_states)
        return drafter.unroll(input_ids, feats, attention_mask, steps)


class TestMtpTwoModules(TestMtp):
    """Two chained modules: draft token 1 comes from the second module, later ones reuse it; trees write each
    depth's nodes to the cache of the module that drafts them."""

    config_overrides = {"intermediate_size": 64, "num_mtp_modules": 2}


def _native_checkpoint(tmp_path, target, num_modules=2, extra=None):
    """A target checkpoint that ships dense MTP layers after its own (model.layers.{L + k}.*)."""
    target.save_pretrained(tmp_path / "target")
    cfg = json.loads((tmp_path / "target" / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    mtp = {}
    for k in range(num_modules):
        p = f"model.layers.{layers + k}."
        shapes = {
            "enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
            "shared_head.norm.weight": (hidden,), "input_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
            "post_attention_layernorm.weight": (hidden,), "mlp.gate_proj.weight": (48, hidden),
            "mlp.up_proj.weight": (48, hidden), "mlp.down_proj.weight": (hidden, 48),
        }  # fmt: skip
        for name, shape in shapes.items():
            scale = 1.0 if name.endswith("norm.weight") else 0.2
            mtp[p + name] = (torch.randn(*shape, generator=g) * 0.1 + (1.0 if scale == 1.0 else 0.0)) * scale
        mtp[p + "shared_head.head.weight"] = target.get_output_embeddings().weight.detach().clone()
    mtp.update(extra or {})
    save_file(mtp, str(tmp_path / "target" / "mtp.safetensors"))
    cfg.update(num_nextn_predict_layers=num_modules, intermediate_size=48)
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))
    return tmp_path / "target", mtp, cfg


def test_native_mtp_layers_import_match_an_independent_forward_and_draft(tmp_path):
    target = make_target("llama")
    folder, mtp, cfg = _native_checkpoint(tmp_path, target)
    assert detect_layout(str(folder)) == "mtp-layers"
    drafter = import_drafter(str(folder), target_config=target.config).eval().bind_target(target)
    assert drafter.config.num_mtp_modules == 2 and drafter.config.target_num_hidden_layers == cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 90, (1, 9), generator=g)
    with torch.no_grad():
        feats = target(ids, output_hidden_states=True).hidden_states[-1]
        (step0,) = drafter.unroll(ids, feats, steps=1)
        # DeepSeek-V3's module 1: h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), h = norm(block(h')), head(h)
        p, eps = f"model.layers.{cfg['num_hidden_layers']}.", cfg["rms_norm_eps"]
        emb = target.get_input_embeddings()(torch.cat([ids[:, 1:], ids[:, -1:]], 1))
        x = torch.cat([rms(emb, mtp[p + "enorm.weight"], eps), rms(feats, mtp[p + "hnorm.weight"], eps)], -1)
        x = llama_layer_by_hand(mtp, p, cfg, x @ mtp[p + "eh_proj.weight"].T, cfg["rope_parameters"]["rope_theta"])
        want = rms(x, mtp[p + "shared_head.norm.weight"], eps) @ mtp[p + "shared_head.head.weight"].T
    torch.testing.assert_close(step0, want, rtol=1e-4, atol=1e-4)
    # the target that ships the layers drafts for itself, identically to its own greedy decoding
    ids2, mask = ragged_batch(3)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids2, assistant_model=drafter, **kw), target.generate(ids2, **kw))
    # ... and through the Auto API, straight from the target's own folder
    auto = AutoModelForDrafting.from_pretrained(str(folder), target_config=target.config)
    assert isinstance(auto, MtpForDrafting) and auto.config.num_mtp_modules == 2
    # export writes the same layout back
    out = export_drafter(drafter, str(tmp_path / "exported"), "mtp-layers")
    again = import_drafter(out, target_config=target.config)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)


def test_mixture_of_experts_and_mla_layers_are_refused(tmp_path):
    target = make_target("llama")
    layers = target.config.num_hidden_layers
    extra = {f"model.layers.{layers}.mlp.experts.0.up_proj.weight": torch.zeros(4, 4)}
    folder, _, _ = _native_checkpoint(tmp_path, target, num_modules=1, extra=extra)
    with pytest.raises(ValueError, match="mixture-of-experts.*hf-specdec train --drafter mtp"):
        import_drafter(str(folder), target_config=target.config)
    extra = {f"model.layers.{layers}.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(4, 4)}
    folder, _, _ = _native_checkpoint(tmp_path / "mla", target, num_modules=1, extra=extra)
    with pytest.raises(ValueError, match="MLA attention"):
        import_drafter(str(folder), target_config=target.config)


def test_loss_is_the_mean_cross_entropy_of_the_unrolled_steps():
    target = make_target("llama")
    torch.manual_seed(0)
    cfg = MtpConfig.for_target(target.config, intermediate_size=64, num_mtp_modules=2)
    drafter = AutoModelForDrafting.from_config(cfg).eval().bind_target(target)
    ids, mask = ragged_batch(2, length=10)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    top = out.hidden_states[-1]
    feats = TargetFeatures(hidden_states=[top], last_hidden=top)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
    steps = drafter.unroll(ids, top, mask)
    assert len(steps) == 2  # D modules, D steps by default (DeepSeek's objective)
    p = torch.softmax(out.logits.float(), -1)
    want = 0.0
    for j, logits in enumerate(steps):
        ce = [
            -(p[b, t + 1 + j] * torch.log_softmax(logits[b, t].float(), -1)).sum()
            for b in range(2)
            for t in range(10 - 2 - j)
            if mask[b, t + 2 + j]
        ]
        want = want + torch.stack(ce).mean() / 2
    torch.testing.assert_close(got.loss, want, rtol=1e-4, atol=1e-5)


def test_bad_configs_fail_early():
    target = make_target("llama")
    for bad in ({"num_mtp_modules": 0}, {"ttt_steps": 0}, {"loss_labels": "nope"}, {"ttt_decay": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            MtpConfig.for_target(target.config, **bad)


def test_tree_nodes_attend_to_the_cache_of_the_module_that_drafts_them():
    """Three modules: depth-1 nodes go to module 2's cache, depth-2 nodes to module 3's, which holds none of the
    depth-1 siblings; along one path the tree's draft logits equal the chain's."""
    from drafter_tester import TeacherForcingSelector, prefill_inputs

    from hf_specdec.tree.policies import TreeExpansion

    target = make_target("llama", seed=1)
    torch.manual_seed(0)
    cfg = MtpConfig.for_target(target.config, intermediate_size=64, num_mtp_modules=3)
    drafter = AutoModelForDrafting.from_config(cfg).eval().bind_target(target)
    ids, mask = ragged_batch(2, seed=3)
    first = torch.tensor([7, 8])
    forced = torch.tensor([[11, 12, 13], [21, 22, 23]])
    with torch.no_grad():
        inputs = prefill_inputs(target, ids, mask, first)
        chain_state = drafter.init_draft_state(2, 64)
        drafter.observe(chain_state, inputs)
        selector = TeacherForcingSelector(forced)
        drafter.propose(chain_state, 3, selector)
        tree_state = drafter.init_draft_state(2, 64)
        drafter.observe(tree_state, inputs)
        root, _ = drafter.tree_start(tree_state)
        sibling = torch.tensor([[30, 31]]).T  # a second depth-1 node per row, expanded too
        level1 = drafter.tree_expand(
            tree_state,
            TreeExpansion(
                tokens=torch.cat([forced[:, :1], sibling], 1),
                parent=torch.full((2, 2), -1),
                depth=1,
                ancestors=torch.zeros(2, 2, 0, dtype=torch.bool),
            ),
        )
        level2 = drafter.tree_expand(
            tree_state,
            TreeExpansion(
                tokens=forced[:, 1:2],
                parent=torch.zeros(2, 1, dtype=torch.long),
                depth=2,
                ancestors=torch.tensor([[[True, False]], [[True, False]]]),
            ),
        )
    torch.testing.assert_close(root.float(), selector.seen[0])
    torch.testing.assert_close(level1[:, 0], selector.seen[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(level2[:, 0], selector.seen[2], rtol=1e-5, atol=1e-5)
    assert [c.length for c in tree_state.cache.caches][1:] == [
        tree_state.committed_slots + 2,
        tree_state.committed_slots + 1,
    ]
