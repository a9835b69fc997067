"""SpecBlock: the shared drafter tester (blocks of 4, blocks of 2 so that chains cross blocks, no layer shift) plus
family checks: the shift's init, cross-block training = inference, the valid-prefix loss, the rank buckets and the
rank tree."""

import pytest
import torch
from drafter_tester import DrafterTesterMixin, prefill_inputs
from helpers import make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, SpecBlockConfig, SpecBlockForDrafting
from hf_specdec.models.specblock.modeling_specblock import rank_bucket, rank_features


class TestSpecBlock(DrafterTesterMixin):
    config_class = SpecBlockConfig
    model_class = SpecBlockForDrafting
    config_overrides = {"intermediate_size": 64}

    def make_drafter(self, target, seed=0, **overrides):
        """An untrained drafter whose layer shifts are not the identity (so that a wrong shift shows)."""
        drafter = super().make_drafter(target, seed, **overrides)
        with torch.no_grad():
            for shift in drafter.shift_proj:
                shift.weight.add_(0.1 * torch.randn_like(shift.weight))
        return drafter

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        feats = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(input_ids, feats, attention_mask, steps)

    @pytest.mark.parametrize("batch", [1, 3])
    def test_tree_greedy_identity(self, batch):
        """EAGLE-2 and static trees within a block, and the rank tree across blocks (with ASD B = 0 too)."""
        for arch in self.tree_archs:
            target = make_target(arch, seed=4)
            drafter = self.make_drafter(target, seed=2, block_size=3)
            for tree in (
                {"tree": "eagle2", "tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6},
                {"tree": "rank", "tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 12},
                {"tree": "rank"},
            ):
                ref, out = self._greedy_pair(target, drafter, batch, **tree)
                assert torch.equal(out.sequences, ref), (arch, tree)
                _, strict = self._greedy_pair(target, drafter, batch, verifier="asd", asd_budget=0.0, **tree)
                assert torch.equal(strict.sequences, ref), (arch, tree, "asd B=0")
        with pytest.raises(ValueError, match="tree_depth <= 3"):
            self._greedy_pair(target, drafter, batch, tree="fork-10")

    def test_layout_round_trip(self, tmp_path):
        """The reference layout holds drafters with the all-slot cache (round-tripped by TestSpecBlockAllSlots); one
        with the default cache is refused by name, never written as something the reference would run otherwise."""
        if self.config_overrides.get("context_slots") == "all":
            return super().test_layout_round_trip(tmp_path)
        from hf_specdec.convert import export_drafter

        target = make_target("llama", seed=7)
        drafter = self.make_drafter(target, seed=3).bind_target(target)
        with pytest.raises(ValueError, match="context_slots='first'"):
            export_drafter(drafter, str(tmp_path / "out"), "specblock-reference", target=target)

    def test_tree_sampling_distribution(self):
        """Lossless sampling along rank trees (and the control must fail)."""
        from sampling_check import check_sampling_matches_target

        check_sampling_matches_target(
            self.make_drafter, min_branch_share=None, tree="rank", tree_depth=2, tree_top_k=3, tree_total_tokens=8
        )


class TestSpecBlockCrossBlock(TestSpecBlock):
    """Blocks of 2: a chain of 3 or more drafts continues with a second block from the first one's last slot."""

    config_overrides = {"intermediate_size": 64, "block_size": 2}


class TestSpecBlockAllSlots(TestSpecBlock):
    """The reference's draft cache (all K slots of every verified position; further blocks at the first block's RoPE
    positions), with blocks of 2 so chains cross blocks and three layers so two shifts act; round-trips the layout."""

    config_overrides = {"intermediate_size": 64, "context_slots": "all", "block_size": 2, "num_hidden_layers": 3}


class TestSpecBlockNoShift(TestSpecBlock):
    """The ablation without the layer-wise shift (three layers, so that two shifts would have been there)."""

    config_overrides = {"intermediate_size": 64, "layer_shift": False, "num_hidden_layers": 3}


def test_bad_configs_fail_early():
    target = make_target("llama")
    for bad, word in (({"block_size": 0}, "block_size"), ({"rank_branch_widths": [1, 2]}, "rank_branch_widths"),
                      ({"rank_branch_widths": [0, 2, 3, 0]}, "rank_branch_widths"), ({"slot_decay": 0}, "slot_decay"),
                      ({"num_train_blocks": 0}, "num_train_blocks"), ({"layer_shift": "yes"}, "layer_shift")):  # fmt: skip
        with pytest.raises(ValueError, match=word):
            SpecBlockConfig.for_target(target.config, **bad)


def test_shift_starts_as_identity_and_survives_loading(tmp_path):
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config, num_hidden_layers=3))
    assert len(drafter.shift_proj) == 2
    h = target.config.hidden_size
    for shift in drafter.shift_proj:
        assert torch.equal(shift.weight, torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    with torch.no_grad():
        drafter.shift_proj[0].weight.add_(1.0)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModelForDrafting.from_pretrained(tmp_path)
    # from_pretrained keeps trained weights (the identity init does not overwrite them)
    assert torch.equal(loaded.shift_proj[0].weight, drafter.shift_proj[0].weight)
    plain = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config, layer_shift=False))
    assert len(plain.shift_proj) == 0 and not any("shift_proj" in k for k in plain.state_dict())


def test_identity_shift_is_the_model_without_shift():
    """W_s = [I 0] (the init) drafts exactly what the same weights without the shift draft; a trained W_s does not."""
    target = make_target("llama", seed=1)
    torch.manual_seed(0)
    shifted = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config)).eval().bind_target(target)
    plain = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config, layer_shift=False)).eval()
    plain.load_state_dict({k: v for k, v in shifted.state_dict().items() if not k.startswith("shift_proj")})
    plain.bind_target(target)
    ids, mask = ragged_batch(2, length=10)
    inputs = prefill_inputs(target, ids, mask, torch.tensor([7, 9]))

    def first_block(drafter):
        state = drafter.init_draft_state(2, 64)
        drafter.observe(state, inputs)
        return drafter.first_block(state).logits

    torch.testing.assert_close(first_block(shifted), first_block(plain))
    h = target.config.hidden_size
    with torch.no_grad():
        shifted.shift_proj[0].weight[:, h:].add_(0.5 * torch.randn(h, h))  # W_s now reads h_{k-1} too
    assert not torch.allclose(first_block(shifted), first_block(plain), atol=1e-3)


@pytest.mark.parametrize("context_slots", ["first", "all"])
def test_cross_block_training_matches_inference_continuations(context_slots):
    """A block continuing from slot M - 1 (1 <= M <= K) with the true token there, as training unrolls it, equals the
    block the rank tree drafts from the same slot at inference (with either draft cache)."""
    target = make_target("llama", seed=1)
    drafter = TestSpecBlock().make_drafter(target, seed=2, context_slots=context_slots).bind_target(target)
    ids, mask = ragged_batch(2, length=16, seed=5)
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                     position_ids=(mask.cumsum(-1) - 1).clamp_min(0))  # fmt: skip
        feats = drafter.select_target_features(out.hidden_states)
        k = drafter.block_size
        anchor = 8
        for m in range(1, k + 1):
            anchors = torch.full((2, 1), anchor)
            first, (second,) = drafter.training_blocks(ids, feats, mask, anchors, [torch.full((2, 1), m)])
            full = prefill_inputs(target, ids, mask, torch.zeros(2, dtype=torch.long))
            state = drafter.init_draft_state(2, 64)
            drafter.observe(state, type(full)(next_token_ids=full.next_token_ids[:, : anchor + 1],
                                              position_ids=full.position_ids[:, : anchor + 1],
                                              valid=full.valid[:, : anchor + 1],
                                              hidden_states=tuple(h[:, : anchor + 1] for h in full.hidden_states)))  # fmt: skip
            blk = drafter.first_block(state)
            torch.testing.assert_close(blk.logits, first.logits.float(), rtol=1e-4, atol=1e-4)
            whole = torch.zeros(2, 1, dtype=torch.long)
            ctx, cmask = drafter._context(state, 1)
            token = ids[:, anchor + 1 + m][:, None]
            nxt = drafter.next_blocks([blk], [(whole, torch.full((2, 1), m))], blk.hidden[:, :, m - 1], token,
                                      blk.base + m, ctx, cmask)  # fmt: skip
            torch.testing.assert_close(nxt.logits, second.logits.float(), rtol=1e-4, atol=1e-4, msg=f"M={m}")


def test_valid_prefix_loss_ignores_slots_after_a_wrong_one():
    """Slot 1's draft loss only counts where slot 0 drafted the teacher's choice: with slot 0 wrong everywhere the
    draft loss sends no gradient to slot 1's logits, with slot 0 right it does."""
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config, block_size=2))
    from hf_specdec.features import SoftLabels
    from hf_specdec.models.specblock.modeling_specblock import _Blocks

    bsz, t, v = 1, 6, target.config.vocab_size
    probs = torch.softmax(torch.randn(bsz, t, v), -1)
    soft = SoftLabels(probs=probs, argmax=probs.argmax(-1), full_argmax=probs.argmax(-1))
    loss_mask = torch.ones(bsz, t, dtype=torch.bool)
    for slot0_right in (False, True):
        logits = torch.randn(bsz, t, 2, v)
        want0 = soft.argmax  # slot 0 at base s = t + 1 predicts with the label at s
        base = torch.arange(t)[None] + 1
        lab0 = want0.gather(1, base.clamp(max=t - 1))
        logits[:, :, 0] = -5.0
        if slot0_right:
            logits[:, :, 0].scatter_(-1, lab0[..., None], 5.0)
        logits.requires_grad_(True)
        blocks = _Blocks(torch.randn(bsz, t, 2, target.config.hidden_size), logits, [], torch.arange(1, 2), base)
        draft, _, _ = drafter._block_loss(blocks, torch.ones(bsz, t, dtype=torch.bool), soft, loss_mask,
                                          torch.ones(bsz, t, dtype=torch.bool))  # fmt: skip
        (grad,) = torch.autograd.grad(draft, logits)
        assert (grad[:, :, 1].abs().sum() > 0) == slot0_right


def test_rank_buckets_and_features():
    logits = torch.arange(30.0).flip(0)[None]  # token i has rank i + 1
    buckets = [int(rank_bucket(logits, torch.tensor([i]))[0]) for i in (0, 1, 3, 4, 9, 10, 29)]
    assert buckets == [0, 1, 1, 2, 2, 3, 3]
    f = rank_features(torch.randn(2, 5, 40))
    assert f.shape == (2, 5, 15) and torch.isfinite(f).all()
    small = rank_features(torch.randn(3, 12))  # a vocabulary under 20 tokens
    assert small.shape == (3, 15) and torch.isfinite(small).all()


def test_rank_tree_follows_the_buckets(monkeypatch):
    """Bucket 0 everywhere: each block is its greedy chain, continued from its last slot (plus the first slot's
    siblings); a bucket-1 slot branches rank_branch_widths[1] wide; bucket 3 gives up: no block follows."""
    target = make_target("llama", seed=1)
    drafter = TestSpecBlock().make_drafter(target, seed=2).bind_target(target)
    ids, mask = ragged_batch(1, length=10)
    k = drafter.block_size

    def tree_with(buckets):
        def fake(hidden, logits):
            out = torch.full((*hidden.shape[:-1], 4), -10.0)
            return out.scatter(-1, torch.as_tensor(buckets).expand(*hidden.shape[:-1])[..., None], 10.0)

        monkeypatch.setattr(drafter, "rank_logits", fake)
        state = drafter.init_draft_state(1, 64)
        drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([7])))
        return drafter.rank_tree(state, 2, 3, 200)

    def depths(prop):  # depths of the real nodes (the rest is padding)
        par = prop.parents[0].tolist()
        out = []
        for p in par:
            out.append(1 if p < 0 else out[p] + 1)
        return out[: int(prop.lengths[0])]

    greedy = tree_with([0] * k)
    d = depths(greedy)
    finite = greedy.tokens.shape[1]
    assert max(d) == 2 * k  # two blocks deep
    assert d.count(1) == 3  # slot 0 of the first block branches top_k wide
    # the first block's K greedy slots and slot 0's 2 alternatives, then 3 continuations (the chain's end and the 2
    # alternatives, M = 1) of K greedy slots each
    assert len(d) == k + 2 + 3 * k and finite >= len(d)
    give_up = tree_with([3] * k)
    d = depths(give_up)  # greedy slots kept, no block from the chain's end; slot 0's alternatives still continue
    assert d.count(1) == 3 and len(d) == k + 2 + 2 * k and max(d) == 1 + k
    branch = tree_with([1] * k)  # slot 0 branches 3 wide (bucket 1: 4, capped by top_k 3) and nothing follows it in
    d = depths(branch)  # its block; each branch continues with a block that branches the same way at its slot 0
    assert d.count(1) == 3 and len(d) == 3 + 3 * 3 and max(d) == 2


def test_online_adaptation_is_lossless_and_learns(monkeypatch):
    """With serving-time adaptation on, greedy output stays identical to plain generate (batch 1 and 3, ragged), the
    bandit tries every action and the drafter's weights change; off (the default), nothing changes."""
    target = make_target("llama", seed=1)
    drafter = TestSpecBlock().make_drafter(target, seed=2)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    for batch in (1, 3):
        ids, mask = ragged_batch(batch, seed=batch)
        kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False)
        ref = target.generate(ids, **kwargs)
        now = {k: v.clone() for k, v in drafter.state_dict().items()}
        out = target.generate(ids, assistant_model=drafter, **kwargs)
        assert torch.equal(out, ref)
        assert all(torch.equal(v, now[k]) for k, v in drafter.state_dict().items())  # off by default
        out = target.generate(ids, assistant_model=drafter, online_adaptation=True, adaptation_lr=1e-2,
                              num_assistant_tokens=3, draft_length="fixed", lookup_tokens=0, **kwargs)  # fmt: skip
        assert torch.equal(out, ref)
    report = drafter.adaptation_report
    assert report["rounds"] > 3 and all(report["actions"][a] >= 1 for a in ("skip", "head", "full"))
    changed = [k for k, v in drafter.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("lm_head") for k in changed) and any(k.startswith("layers.") for k in changed)
    with pytest.raises(ValueError, match="adaptation_lr"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, online_adaptation=True, adaptation_lr=0)


def test_adaptation_steps_lower_the_loss_on_the_window():
    """The update the bandit runs is a descent step: one small step lowers the window's loss (small enough that no
    argmax flips, which would change which slots the valid-prefix mask scores), for the heads and for everything."""
    from hf_specdec.models.specblock.adaptation import ServingAdapter

    target = make_target("llama", seed=1)
    drafter = TestSpecBlock().make_drafter(target, seed=2).bind_target(target)
    ids, mask = ragged_batch(2, length=20, seed=9)
    inputs = prefill_inputs(target, ids, mask, torch.tensor([7, 9]))
    adapter = ServingAdapter(drafter, lr=1e-3)
    adapter.remember(inputs, drafter.select_target_features(inputs.hidden_states))

    def window_loss():
        with torch.no_grad():
            return float(adapter.window_loss())

    for params in (adapter.head_params, adapter.all_params):
        first = window_loss()
        adapter.step(params)
        assert window_loss() < first


def test_bench_adaptation_row_gets_its_own_drafter(tmp_path):
    """A bench row with online adaptation on runs its own copy of the drafter (the other rows keep the saved one);
    ``--draft-option "online_adaptation=true;adaptation_lr=..."`` is one row with both options."""
    from types import SimpleNamespace

    from hf_specdec.commands.bench import _draft_option_args, _row_drafter

    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config))
    drafter.save_pretrained(tmp_path)
    (options,) = _draft_option_args(SimpleNamespace(draft_option=["online_adaptation=true;adaptation_lr=0.01"]))
    assert options == {"online_adaptation": True, "adaptation_lr": 0.01}
    copy = _row_drafter(drafter, str(tmp_path), options)
    assert copy is not drafter and type(copy) is type(drafter)
    assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), drafter.state_dict().values()))
    assert _row_drafter(drafter, str(tmp_path), {"online_adaptation": False}) is drafter
    assert _row_drafter(drafter, str(tmp_path), {"adaptation_lr": 0.01}) is drafter


def test_init_from_target_starts_in_the_targets_output_space():
    """``lm_head`` starts as the target's LM-head rows of the draft vocabulary, ``norm`` as the target's final norm."""
    target = make_target("llama", seed=3)
    with torch.no_grad():
        target.model.norm.weight.mul_(1.5)
    drafter = AutoModelForDrafting.from_config(SpecBlockConfig.for_target(target.config, draft_vocab_size=40))
    drafter.bind_target(target)
    counts = torch.zeros(target.config.vocab_size)
    counts[torch.arange(6, 86, 2)] = 1.0
    drafter.init_from_data(counts)
    drafter.init_from_target(target)
    head = target.get_output_embeddings().weight
    assert torch.equal(drafter.lm_head.weight, head[drafter.draft_token_ids])
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight)


# -- the reference layout ---------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    freqs = pos[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _reference_pass(sd, cfg, x, pos, allowed, prefix):
    """The reference's decoder stack written out from its description: ``x`` ``(B, N, K, H)`` slots at RoPE ``pos``
    ``(N * K,)``; keys are ``prefix`` (per layer ``(k, v)`` ``(B, kv, C, d)``) then the slots themselves, visible
    where ``allowed`` ``(N * K, C + N * K)``; between layers slot k reads W_s [h_k; h_{k-1}] (slot 0 itself).
    Returns the pre-norm states and each layer's ``(k, v)`` of the slots."""
    b, n, k, h = x.shape
    heads, kvh, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["rms_norm_eps"]
    d = h // heads
    kvs = []
    for i in range(cfg["num_hidden_layers"]):
        if i > 0:
            prev = torch.cat([x[:, :, :1], x[:, :, :-1]], dim=2)
            x = torch.cat([x, prev], -1) @ sd[f"shift_proj.{i - 1}.weight"].T
        flat = x.reshape(b, n * k, h)
        y = _rms(flat, sd[f"layers.{i}.input_layernorm.weight"], eps)
        q = (y @ sd[f"layers.{i}.self_attn.q_proj.weight"].T).view(b, n * k, heads, d).transpose(1, 2)
        kk = (y @ sd[f"layers.{i}.self_attn.k_proj.weight"].T).view(b, n * k, kvh, d).transpose(1, 2)
        vv = (y @ sd[f"layers.{i}.self_attn.v_proj.weight"].T).view(b, n * k, kvh, d).transpose(1, 2)
        q, kk = _rope(q, pos, cfg["rope_theta"]), _rope(kk, pos, cfg["rope_theta"])
        kvs.append((kk, vv))
        keys = torch.cat([prefix[i][0], kk], 2) if prefix else kk
        vals = torch.cat([prefix[i][1], vv], 2) if prefix else vv
        keys, vals = keys.repeat_interleave(heads // kvh, 1), vals.repeat_interleave(heads // kvh, 1)
        scores = (q @ keys.transpose(-1, -2)) / d**0.5
        att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vals
        flat = flat + att.transpose(1, 2).reshape(b, n * k, h) @ sd[f"layers.{i}.self_attn.o_proj.weight"].T
        y = _rms(flat, sd[f"layers.{i}.post_attention_layernorm.weight"], eps)
        gate = torch.nn.functional.silu(y @ sd[f"layers.{i}.mlp.gate_proj.weight"].T)
        flat = flat + (gate * (y @ sd[f"layers.{i}.mlp.up_proj.weight"].T)) @ sd[f"layers.{i}.mlp.down_proj.weight"].T
        x = flat.view(b, n, k, h)
    return x, kvs


def _reference_heads(sd, cfg, hidden):
    """Draft logits and rank logits (``[sg(norm(h)); top-20 summary] -> 256 -> SiLU -> 4``) of pre-norm states."""
    normed = _rms(hidden, sd["norm.weight"], cfg["rms_norm_eps"])
    logits = normed @ sd["lm_head.weight"].T
    top = logits.topk(20, -1).values
    lse = torch.logsumexp(top, -1, keepdim=True)
    lp = top - lse
    gaps = torch.stack([top[..., 0] - top[..., i] for i in (1, 2, 4)], -1)
    feats = torch.cat([lp[..., :10], gaps, lp[..., :1].exp(), -(lp.exp() * lp).sum(-1, keepdim=True)], -1)
    mid = torch.nn.functional.silu(torch.cat([normed, feats], -1) @ sd["rank_head.0.weight"].T)
    return logits, mid @ sd["rank_head.2.weight"].T


def _reference_inputs(sd, cfg, cond, token_emb):
    """``fuse([RMSNorm(cond); RMSNorm(e); RMSNorm(q_k)])`` for every slot: ``(B, N, K, H)``."""
    eps, k = cfg["rms_norm_eps"], cfg["diffspec_draft_token_num"]
    c = _rms(cond, sd["input_layer.condition_norm.weight"], eps)[:, :, None].expand(-1, -1, k, -1)
    e = _rms(token_emb, sd["input_layer.token_norm.weight"], eps)[:, :, None].expand(-1, -1, k, -1)
    q = _rms(sd["input_layer.position_queries.weight"], sd["input_layer.query_norm.weight"], eps)
    return torch.cat([c, e, q.expand_as(c)], -1) @ sd["input_layer.fuse.weight"].T


def _reference_checkpoint(tmp_path, target, k=3, layers=2, seed=0):
    """A checkpoint in the reference layout with random weights (GQA, the shift, a rank head)."""
    from hf_specdec.convert import write_checkpoint

    g = torch.Generator().manual_seed(seed)
    h, v = target.config.hidden_size, target.config.vocab_size
    heads = target.config.num_attention_heads
    kvh, d, inter = max(heads // 2, 1), h // heads, 48
    cfg = {"architectures": ["LlamaForCausalLMSpecBlock"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kvh,
           "num_hidden_layers": layers, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "rope_scaling": None, "max_position_embeddings": 256, "vocab_size": v, "draft_vocab_size": v,
           "target_hidden_size": h, "diffspec_draft_token_num": k, "rank_classes": 4, "num_ttt_blocks": 3}  # fmt: skip

    def w(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    sd = {"input_layer.condition_proj.weight": w(h, 3 * h), "input_layer.fuse.weight": w(h, 3 * h),
          "input_layer.position_queries.weight": w(k, h, scale=1.0), "norm.weight": 1 + w(h),
          "lm_head.weight": w(v, h), "rank_head.0.weight": w(256, h + 15), "rank_head.2.weight": w(4, 256),
          "input_layer.embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
          "d2t": torch.zeros(v, dtype=torch.long), "t2d": torch.ones(v, dtype=torch.bool)}  # fmt: skip
    for name in ("condition_norm", "token_norm", "query_norm"):
        sd[f"input_layer.{name}.weight"] = 1 + w(h)
    for i in range(layers):
        sd.update({f"layers.{i}.self_attn.q_proj.weight": w(heads * d, h), f"layers.{i}.self_attn.k_proj.weight":
                   w(kvh * d, h), f"layers.{i}.self_attn.v_proj.weight": w(kvh * d, h),
                   f"layers.{i}.self_attn.o_proj.weight": w(h, heads * d), f"layers.{i}.mlp.gate_proj.weight":
                   w(inter, h), f"layers.{i}.mlp.up_proj.weight": w(inter, h), f"layers.{i}.mlp.down_proj.weight":
                   w(h, inter), f"layers.{i}.input_layernorm.weight": 1 + w(h),
                   f"layers.{i}.post_attention_layernorm.weight": 1 + w(h)})  # fmt: skip
        if i:
            sd[f"shift_proj.{i - 1}.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1) + w(h, 2 * h)
    folder = tmp_path / "reference"
    write_checkpoint(str(folder), cfg, sd)
    return folder, cfg, sd


def test_reference_layout_drafts_what_the_reference_computes(tmp_path):
    """A reference checkpoint imported with the all-slot cache: block 1 at every position (slot k at t sees all slots
    of positions < t and its block's slots <= k) and a block continuing from slot M - 1 (the anchor's earlier
    positions whole, the anchor's block up to M - 1, the first block's RoPE positions) give the logits and rank logits
    of the reference's forward, written out independently here."""
    from hf_specdec.convert import detect_layout, import_drafter

    target = make_target("llama", seed=1)
    folder, cfg, sd = _reference_checkpoint(tmp_path, target)
    assert detect_layout(str(folder)) == "specblock-reference"
    drafter = import_drafter(str(folder), target_config=target.config).bind_target(target)
    assert drafter.config.context_slots == "all" and drafter.block_size == 3 and drafter.config.layer_shift
    n_layers, k = target.config.num_hidden_layers, 3
    ids = torch.randint(5, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    t = ids.shape[1]
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i] for i in (2, n_layers // 2, n_layers - 3)], -1)  # the reference's layers
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], 1)
        x = _reference_inputs(sd, cfg, feats @ sd["input_layer.condition_proj.weight"].T,
                              sd["input_layer.embed_tokens.weight"][nxt])  # fmt: skip
        pos = (torch.arange(t)[:, None] + 1 + torch.arange(k)).reshape(-1)
        src, slot = torch.arange(t).repeat_interleave(k), torch.arange(k).repeat(t)
        allowed = (src[None] < src[:, None]) | ((src[None] == src[:, None]) & (slot[None] <= slot[:, None]))
        ref_hidden, ref_kv = _reference_pass(sd, cfg, x, pos, allowed, None)
        ref_logits, ref_rank = _reference_heads(sd, cfg, ref_hidden)
        ours = drafter.select_target_features(hs)
        anchor, m = 7, 2
        first, (second,) = drafter.training_blocks(ids, ours, None, None, [torch.full((1, t), m)])
        torch.testing.assert_close(first.logits.float(), ref_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(drafter.rank_logits(first.hidden, first.logits).float(), ref_rank,
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        # block 2 at the anchor, from slot M - 1 with the true token there
        cond = ref_hidden[:, anchor, m - 1][:, None]
        token = sd["input_layer.embed_tokens.weight"][ids[:, anchor + 1 + m]][:, None]
        x2 = _reference_inputs(sd, cfg, cond, token)
        before = src < anchor
        here = (src == anchor) & (slot < m)
        prefix = [(kk[:, :, before | here], vv[:, :, before | here]) for kk, vv in ref_kv]
        own = torch.ones(k, k, dtype=torch.bool).tril()
        allowed2 = torch.cat([torch.ones(k, int((before | here).sum()), dtype=torch.bool), own], 1)
        hidden2, _ = _reference_pass(sd, cfg, x2, pos[anchor * k : anchor * k + k], allowed2, prefix)
        logits2, _ = _reference_heads(sd, cfg, hidden2)
        torch.testing.assert_close(second.logits[:, anchor].float(), logits2[:, 0], rtol=1e-4, atol=1e-4)


def test_reference_layout_refuses_what_it_cannot_run(tmp_path):
    """Another rank-head size, head_dim, vocabulary or an unknown tensor: refused by name."""
    import json

    from hf_specdec.convert import import_drafter, write_checkpoint

    target = make_target("llama", seed=1)
    folder, cfg, sd = _reference_checkpoint(tmp_path, target)
    for change, word in (({"rank_classes": 5}, "classes"), ({"head_dim": 4}, "head_dim"),
                         ({"vocab_size": cfg["vocab_size"] + 1}, "vocabulary")):  # fmt: skip
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=word):
            import_drafter(str(folder), target_config=target.config)
    write_checkpoint(str(folder), cfg, {**sd, "input_layer.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected"):
        import_drafter(str(folder), target_config=target.config)


def test_all_slot_cache_compaction_keeps_every_block():
    """With the all-slot cache, every padding token leaves K dead entries; where all rows have them the cache is
    compacted at once, and the short row's first block and a block continuing from it (which must skip the anchor's
    own cached block) equal the same row drafted alone."""
    target = make_target("llama", seed=1)
    drafter = TestSpecBlock().make_drafter(target, seed=2, context_slots="all", block_size=3).bind_target(target)
    g = torch.Generator().manual_seed(4)
    long, short = torch.randint(5, 90, (1, 40), generator=g), torch.randint(5, 90, (1, 8), generator=g)
    pad = torch.zeros(1, 20, dtype=torch.long)  # padding in both rows: slots dead in every row, worth dropping
    ids = torch.cat([torch.cat([pad, long], 1), torch.cat([pad, torch.zeros(1, 32, dtype=torch.long), short], 1)])
    mask = (ids != 0).long()
    first_token = torch.tensor([7, 9])

    def draft(ids, mask, first_token, row):
        state = drafter.init_draft_state(ids.shape[0], 128)
        with torch.no_grad():
            drafter.observe(state, prefill_inputs(target, ids, mask, first_token))
            if ids.shape[0] > 1:
                assert state.caches[0].length < ids.shape[1] * 3, "the cache was not compacted"
            blk = drafter.first_block(state)
            ctx, cmask = drafter._context(state, 1)
            m = torch.full((ids.shape[0], 1), 2)
            whole = torch.zeros_like(m)
            token = torch.full((ids.shape[0], 1), 11)
            nxt = drafter.next_blocks([blk], [(whole, m)], blk.hidden[:, :, 1], token, blk.base + 2, ctx, cmask)
        return blk.logits[row], nxt.logits[row]

    alone = draft(short, torch.ones_like(short), first_token[1:], 0)
    batched = draft(ids, mask, first_token, 1)
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
