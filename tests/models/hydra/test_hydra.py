"""Hydra: the shared drafter tester plus family-specific checks."""

import torch
from drafter_tester import DrafterTesterMixin, RecordingSelector, prefill_inputs
from helpers import make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, HydraConfig, HydraForDrafting
from hf_specdec.tree.policies import StaticTree


class TestHydra(DrafterTesterMixin):
    config_class = HydraConfig
    model_class = HydraForDrafting
    config_overrides = {"num_heads": 5, "num_layers": 2}
    draft_lengths = (1, 3, 5)

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        (feats,) = drafter.select_target_features(hidden_states)
        return drafter(feats, input_ids, steps, attention_mask=attention_mask)


class TestHydraPlusPlus(TestHydra):
    """Hydra++: the prefix attention layer over the target's states, deeper heads, dropout (off in eval)."""

    config_overrides = {"num_heads": 5, "num_layers": 2, "prefix_layer": True, "intermediate_size": 48, "dropout": 0.2}
    layouts_refusing = {"hydra-zankner": "prefix_norm"}  # zankner/Hydra's prefix layer ends with a norm


def _drafter(target, **kw):
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(HydraConfig.for_target(target.config, **kw)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return drafter.bind_target(target)


def _independent(drafter, k, h, path_ids):
    """Head k by hand: P x + SiLU(W x + b), then the projection, on x = [h; E(path)]."""
    head = drafter.heads[k]
    emb = drafter.embed_target_tokens(path_ids)
    x = torch.cat([h, emb.flatten(-2)], dim=-1)
    y = x @ head.proj.weight.T + torch.nn.functional.silu(x @ head.first.weight.T + head.first.bias)
    return y @ head.lm_head.weight.T


def test_heads_read_the_path_so_far():
    target = make_target("llama")
    drafter = _drafter(target, num_heads=3, num_draft_tokens=3)
    ids, mask = ragged_batch(2)
    first = torch.tensor([7, 8])
    state = drafter.init_draft_state(2, 64)
    drafter.observe(state, prefill_inputs(target, ids, mask, first))
    assert torch.equal(state.last_token, first)
    prop = drafter.propose(state, 3, RecordingSelector())
    path = first[:, None]
    with torch.no_grad():
        for k in range(3):
            want = _independent(drafter, k, state.last_hidden, path).argmax(-1)
            assert torch.equal(prop.tokens[:, k], want)
            path = torch.cat([path, prop.tokens[:, k : k + 1]], dim=1)


def test_tree_nodes_condition_on_their_own_paths():
    """Children of different nodes at the same depth differ (the heads read each node's path), and every node's
    children are the top choices of head d on exactly its path."""
    target = make_target("llama")
    drafter = _drafter(target, num_heads=3, num_draft_tokens=3)
    ids, mask = ragged_batch(1)
    state = drafter.init_draft_state(1, 64)
    drafter.observe(state, prefill_inputs(target, ids, mask, torch.tensor([9])))
    tree = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)])
    prop = tree.propose(drafter, state)
    toks = prop.tokens[0]
    last = state.last_token
    with torch.no_grad():
        for node, path in enumerate(tree.paths):
            if len(path) == 1:
                continue
            parent_nodes = []
            p = tree.parents[node]
            while p >= 0:
                parent_nodes.append(p)
                p = tree.parents[p]
            ancestors = [int(toks[i]) for i in reversed(parent_nodes)]
            path_ids = torch.tensor([[int(last[0]), *ancestors]])
            logits = _independent(drafter, len(path) - 1, state.last_hidden, path_ids)
            rank = path[-1]
            assert int(toks[node]) == int(torch.topk(logits, rank + 1, dim=-1).indices[0, rank])


def test_init_from_target_starts_each_head_at_the_target_head():
    target = make_target("llama")
    drafter = AutoModelForDrafting.from_config(HydraConfig.for_target(target.config)).eval().bind_target(target)
    drafter.init_from_target(target)
    ids, mask = ragged_batch(2)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
        logits = drafter(out.hidden_states[-1], ids)
    for k in range(drafter.num_heads):  # first block zero, residual projection = identity on h: the target's head
        torch.testing.assert_close(logits[k], out.logits, rtol=1e-5, atol=1e-5)
