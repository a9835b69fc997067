"""Trees in the one loop: structure, 4-D tree masks on stock targets, cache compaction, tree verifiers and policies."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, FIXED_K, make_target, ragged_batch
from sampling_check import chi_square_test
from transformers import DynamicCache

from hf_specdec import AutoModelForDrafting, DrafterPreTrainedModel, DraftInputs, Eagle3Config, Proposal
from hf_specdec.configuration_utils import DrafterConfig
from hf_specdec.generation import adaptive
from hf_specdec.generation.adaptive import DraftLengthController
from hf_specdec.generation.loop import TargetPasses
from hf_specdec.tree import (
    DynamicTree,
    StaticTree,
    ancestor_matrix,
    children_table,
    make_tree_policy,
    node_depths,
    path_nodes,
    static_tree_from_accuracies,
    validate_parents,
)
from hf_specdec.verification import ASDVerifier, GreedyVerifier, SpeculativeSamplingVerifier, TypicalAcceptanceVerifier
from hf_specdec.verification.standard import _residual

#        root
#       /    \
#      0      1
#     / \     |
#    2   3    4
#    |
#    5
PARENTS = torch.tensor([[-1, -1, 0, 0, 1, 2]])


def test_structure_of_a_known_tree():
    assert node_depths(PARENTS).tolist() == [[1, 1, 2, 2, 2, 3]]
    anc = ancestor_matrix(PARENTS)
    assert anc[0, 5].tolist() == [True, False, True, False, False, True]
    assert anc[0, 4].tolist() == [False, True, False, False, True, False]
    full = ancestor_matrix(PARENTS, include_root=True)
    assert full.shape == (1, 7, 7) and bool(full[0, :, 0].all()) and full[0, 0].sum() == 1
    table = children_table(PARENTS)
    assert table[0, 0].tolist() == [0, 1] and table[0, 1].tolist() == [2, 3] and table[0, 3].tolist() == [5, -1]
    assert path_nodes(anc, node_depths(PARENTS), torch.tensor([5]), 3).tolist() == [[0, 2, 5]]
    assert path_nodes(anc, node_depths(PARENTS), torch.tensor([-1]), 2).tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match="topological"):
        validate_parents(torch.tensor([[-1, 2, 0]]))


def _scores(argmax_per_col, vocab=12):
    """Scores whose argmax at column c is argmax_per_col[c] (a clear winner)."""
    s = torch.zeros(1, len(argmax_per_col), vocab)
    for c, t in enumerate(argmax_per_col):
        s[0, c, t] = 5.0
    return s


def test_tree_greedy_picks_the_longest_matching_path_and_its_bonus():
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    proposal = Proposal(tokens=tokens, kind="tree", parents=PARENTS)
    # root -> 3 (node 0) -> 6 (node 3) is right; node 3's own continuation is 9 (no child matches).
    scores = _scores([3, 6, 0, 0, 9, 0, 0])
    res = GreedyVerifier().verify(proposal, scores)
    assert res.num_accepted.tolist() == [2] and res.path.tolist() == [[0, 3]]
    assert res.tokens[0, :3].tolist() == [3, 6, 9]
    # Longest path wins over an earlier, shorter one: node 0 -> 5 (node 2) -> 8 (node 5).
    scores = _scores([3, 5, 0, 8, 0, 0, 1])
    res = GreedyVerifier().verify(proposal, scores)
    assert res.path.tolist() == [[0, 2, 5]] and res.tokens[0].tolist() == [3, 5, 8, 1]
    # Nothing matches: only the bonus token, from the root column.
    res = GreedyVerifier().verify(proposal, _scores([11] * 7))
    assert res.num_accepted.tolist() == [0] and res.tokens[0, 0] == 11
    # Variable length: node 5 is padding, so the deepest real path stops at node 2.
    padded = Proposal(tokens=tokens, kind="tree", parents=PARENTS, lengths=torch.tensor([5]))
    res = GreedyVerifier().verify(padded, _scores([3, 5, 0, 8, 0, 0, 1]))
    assert res.path.tolist() == [[0, 2]] and res.tokens[0, 2] == 8


def test_typical_acceptance_and_asd_on_trees():
    tokens = torch.tensor([[3, 4, 5, 6, 7, 8]])
    proposal = Proposal(tokens=tokens, kind="tree", parents=PARENTS)
    scores = _scores([3, 5, 0, 8, 0, 0, 1])
    typical = TypicalAcceptanceVerifier().verify(proposal, scores)
    assert typical.path.tolist() == [[0, 2, 5]] and TypicalAcceptanceVerifier.approximate
    asd = ASDVerifier(budget=0.0)
    asd.start(1, torch.device("cpu"), False)
    strict = asd.verify(proposal, scores)
    greedy = GreedyVerifier().verify(proposal, scores)
    assert strict.path.tolist() == greedy.path.tolist() and torch.equal(strict.tokens, greedy.tokens)
    # A cheap mismatch at the root (token 4 scores 4.95 against the argmax's 5.0) unlocks node 1's matching child,
    # while the exact path stops after one token: ASD takes the longer path, strict ASD does not.
    near = _scores([3, 9, 7, 0, 0, 0, 0])
    near[0, 0, 4] = 4.95
    strict = asd.verify(proposal, near)
    assert strict.num_accepted.item() == 1 and strict.path.tolist() == [[0]]
    relaxed = ASDVerifier(budget=8.0, gate=1.0, block_cap=2)
    relaxed.start(1, torch.device("cpu"), False)
    res = relaxed.verify(proposal, near)
    assert res.num_accepted.item() == 2 and res.path.tolist() == [[1, 4]]
    assert res.tokens[0].tolist() == [4, 7, 0] and res.token_stats["exceptions"].sum().item() == 1
    torch.testing.assert_close(res.token_stats["regret"].sum(1), torch.tensor([0.05]))
    torch.testing.assert_close(relaxed.ledger, torch.tensor([0.05]))


def _pass_logits(target, ids, mask, proposal):
    """Target logits of a tree pass through TargetPasses (the loop's own code)."""
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=target.config)

    class _NoFeatures:
        requires_target_hidden_states = False

        def target_hidden_state_ids(self):
            return []

    passes = TargetPasses(target, _NoFeatures(), mask, pos, True, cache, ids.device)
    passes.prefill(ids, pos, keep_all=False)
    logits, _ = passes.run(ids[:, -1] * 0 + 7, proposal)
    return logits, passes


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_tree_pass_equals_running_each_branch(arch, attn):
    target = make_target(arch, seed=2)
    target.set_attn_implementation(attn)
    assert target.config._attn_implementation == attn
    ids, mask = ragged_batch(2, seed=3)
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 2], [-1, 0, 1, -1, 3, 3]])
    proposal = Proposal(tokens=tokens, kind="tree", parents=parents)
    logits, _ = _pass_logits(target, ids, mask, proposal)
    anc = ancestor_matrix(parents)
    depths = node_depths(parents)
    for b in range(2):
        for i in range(6):
            path = [j for j in range(6) if anc[b, i, j]]
            path.sort(key=lambda j: int(depths[b, j]))
            seq = torch.cat([ids[b : b + 1], torch.tensor([[7] + tokens[b, path].tolist()])], dim=1)
            m = torch.cat([mask[b : b + 1], torch.ones(1, len(path) + 1, dtype=mask.dtype)], dim=1)
            ref = target(seq, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0)).logits[0, -1]
            torch.testing.assert_close(logits[b, i + 1], ref, atol=2e-5, rtol=1e-4)


def test_tree_pass_refuses_an_attention_backend_without_4d_masks():
    target = make_target("llama")
    target.config._attn_implementation = "flash_attention_2"
    ids, mask = ragged_batch(1)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    drafter = _eagle3(target)
    passes = TargetPasses(target, drafter, mask, pos, False, DynamicCache(config=target.config), ids.device)
    proposal = Proposal(tokens=torch.tensor([[3, 4]]), kind="tree", parents=torch.tensor([-1, -1]))
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        passes.run(ids[:, -1], proposal)


def _eagle3(target, seed=0, **kw):
    torch.manual_seed(seed)
    return AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config, **kw)).eval()


def _trained_like(drafter, target):
    """Make a random EAGLE-3 drafter agree with the target often: its LM head = the target's head (tied)."""
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[: drafter.lm_head.weight.shape[0]])
    return drafter


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_eagle3_dynamic_tree_is_identical_to_plain_greedy(arch, batch):
    target = make_target(arch, seed=5, sharpen=3.0)
    drafter = _trained_like(_eagle3(target), target)
    ids, mask = ragged_batch(batch, seed=6)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kwargs)
    out = target.generate(
        ids, assistant_model=drafter, tree="eagle2", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
        return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert max(max(r) for r in out.accepted_lengths) <= 5
    assert all(d <= 10 for row in out.draft_lengths for d in row)


@pytest.mark.parametrize("tree", ["fork-10", "wide-24"])
def test_static_trees_are_identical_to_plain_greedy_with_processors(tree):
    target = make_target("llama", seed=9, sharpen=3.0)
    drafter = _trained_like(_eagle3(target, seed=1), target)
    ids, mask = ragged_batch(3, seed=2)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=20, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3
    )
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, tree=tree, **kwargs)
    assert torch.equal(out, ref)


class OracleTreeConfig(DrafterConfig):
    model_type = "oracle_tree_test_drafter"
    corruption: float = 0.0


def _chain_proposal(logits_per_depth: list[torch.Tensor], select) -> Proposal:
    """A test drafter's chain: at each depth the token the loop's selector picks from that depth's logits."""
    tokens, probs = zip(*(select(logits, depth) for depth, logits in enumerate(logits_per_depth)))
    draft_probs = torch.stack(probs, dim=1) if probs[0] is not None else None
    return Proposal(tokens=torch.stack(tokens, dim=1), draft_probs=draft_probs)


class OracleTreeDrafter(DrafterPreTrainedModel):
    """A test tree drafter that knows the target's greedy continuation and hides it at rank 1: at depth ``d`` its
    best guess (rank 0) is wrong and its second guess is the right token (unless corrupted, per row). With
    :data:`ORACLE_TREE` the right path is the second branch at every depth (nodes 1, 3, 5), so accepted paths are
    deep and never the first nodes of the tree: a bug in gathering or compacting the path shows."""

    config_class = OracleTreeConfig
    requires_target_hidden_states = False
    supports_tree_drafting = True

    def __init__(self, config):
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))
        self.continuation = None
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size, max_length):
        return {"n_gen": None, "gen": torch.Generator().manual_seed(0)}

    def observe(self, state, inputs):
        added = inputs.valid.long().sum(1)
        state["n_gen"] = torch.ones_like(added) if state["n_gen"] is None else state["n_gen"] + added

    def _guess(self, state, depth):
        v = self.config.target_vocab_size
        idx = (state["n_gen"] + depth).clamp(max=self.continuation.shape[1] - 1)
        right = self.continuation.gather(1, idx[:, None]).squeeze(1)
        flip = torch.rand(right.shape, generator=state["gen"]) < self.config.corruption
        right = torch.where(flip, (right + 2) % v, right)
        logits = torch.zeros(right.shape[0], v)
        logits[torch.arange(right.shape[0]), (right + 1) % v] = 2.0  # rank 0: wrong
        logits[torch.arange(right.shape[0]), right] = 1.0  # rank 1: right
        return logits

    def tree_start(self, state):
        return self._guess(state, 0), None

    def tree_expand(self, state, exp):
        return self._guess(state, exp.depth)[:, None].expand(-1, exp.tokens.shape[1], -1)

    def propose(self, state, num_tokens, select):
        """Its chain: its best guess at every depth (a tree's chain-shaped sizes are drafted as this chain)."""
        return _chain_proposal([self._guess(state, depth) for depth in range(num_tokens)], select)


ORACLE_TREE = [(0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)]


def _oracle_tree(target, ids, mask, n, corruption=0.0):
    cont = target.generate(ids, attention_mask=mask, max_new_tokens=n + 8, do_sample=False, eos_token_id=None)
    drafter = OracleTreeDrafter(OracleTreeConfig.for_target(target.config, corruption=corruption)).eval()
    drafter.continuation = cont[:, ids.shape[1] :]
    return drafter


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_scores_and_logits_follow_the_accepted_path(batch):
    target = make_target("qwen2", seed=4)
    ids, mask = ragged_batch(batch, seed=1)
    drafter = _oracle_tree(target, ids, mask, 16, corruption=0.25)
    kwargs = dict(
        attention_mask=mask, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
        output_scores=True, output_logits=True, eos_token_id=None,
    )  # fmt: skip
    ref = target.generate(ids, **kwargs)
    out = target.generate(ids, assistant_model=drafter, tree="static", tree_choices=ORACLE_TREE, **FIXED_K, **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(max(r) for r in out.accepted_lengths) == 4
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}, {"min_new_tokens": 30}])
def test_prefix_dependent_processors_see_each_nodes_own_path(options):
    """The drafter's continuation is the *plain* greedy one, so every node is scored with a processor whose
    prefix must be that node's path; a node scored with a sibling's path would flip tokens."""
    target = make_target("llama", seed=6)
    ids, mask = ragged_batch(3, seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, **options)
    ref = target.generate(ids, **kwargs)
    drafter = _oracle_tree(target, ids, mask, 30, corruption=0.2)
    drafter.continuation = torch.cat([ref[:, ids.shape[1] :], ref[:, -8:]], dim=1)
    out = target.generate(
        ids, assistant_model=drafter, tree="static", tree_choices=ORACLE_TREE, return_dict_in_generate=True,
        **FIXED_K, **kwargs,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert max(max(r) for r in out.accepted_lengths) == 4


def test_oracle_tree_accepts_deep_ragged_paths_and_stays_identical():
    target = make_target("llama", seed=2)
    ids, mask = ragged_batch(3, seed=5)
    drafter = _oracle_tree(target, ids, mask, 40, corruption=0.3)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    out = target.generate(
        ids, assistant_model=drafter, tree="static", tree_choices=ORACLE_TREE, return_dict_in_generate=True,
        **FIXED_K, **kwargs,
    )  # fmt: skip
    assert torch.equal(out.sequences, target.generate(ids, **kwargs))
    acc = out.accepted_lengths
    assert max(max(r) for r in acc) == 4 and min(min(r) for r in acc) == 1
    assert len({tuple(r) for r in acc}) == 3  # rows accepted different lengths in the same passes


class _ScriptedTreeSizes(DraftLengthController):
    """Replays tree sizes (0: a plain step) and keeps its instances."""

    script = [10, 2, 0, 8, 1, 4, 3, 10]
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made.append(self)

    def choose(self, limit, pending_slots=0, context=None):
        return self.script[self.passes % len(self.script)]


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_under_every_tree_size_and_each_pass_tells_the_smaller_sizes(monkeypatch, batch):
    monkeypatch.setattr(adaptive, "DraftLengthController", _ScriptedTreeSizes)
    monkeypatch.setattr(_ScriptedTreeSizes, "made", [])
    target = make_target("llama", seed=2)
    ids, mask = ragged_batch(batch, seed=5)
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    ref = target.generate(ids, **kwargs)
    drafter = _oracle_tree(target, ids, mask, 30, corruption=0.2)
    out = target.generate(
        ids, assistant_model=drafter, tree="eagle2", tree_depth=4, tree_top_k=3, tree_total_tokens=10,
        return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    assert torch.equal(out.sequences, ref)
    assert {d for row in out.draft_lengths for d in row} >= {10, 8, 4, 3, 2, 1}
    assert max(max(row) for row in out.accepted_lengths) >= 3
    (ctrl,) = _ScriptedTreeSizes.made
    assert ctrl.budgets == (1, 2, 4, 8, 10)
    told = dict(zip(ctrl.budgets, ctrl.tree_passes))
    assert told[1] > told[2] > told[4] > told[8] > told[10] > 0  # a size is told by every pass at least as large
    assert ctrl.tree_tokens(10) > ctrl.tree_tokens(2) > ctrl.tree_tokens(1)  # the right path is the second branch


def test_cache_after_tree_passes_equals_a_fresh_forward_over_the_output():
    target = make_target("llama", seed=3)
    ids = torch.randint(6, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    drafter = _oracle_tree(target, ids, mask, 20, corruption=0.2)
    # A fixed draft length: the adaptive one reads measured timings, and may take plain steps under load.
    out = target.generate(
        ids, assistant_model=drafter, tree="static", tree_choices=ORACLE_TREE, max_new_tokens=20,
        do_sample=False, eos_token_id=None, return_dict_in_generate=True, **FIXED_K,
    )  # fmt: skip
    assert max(max(r) for r in out.accepted_lengths) == 4  # whole right paths (nodes 1, 3, 5) were accepted
    seq = out.sequences[:, :-1]  # the cache covers every token but the last one
    fresh = DynamicCache(config=target.config)
    target(seq, cache=fresh, use_cache=True)
    assert out.cache.get_seq_length() == seq.shape[1]
    for got, want in zip(out.cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


def test_dynamic_tree_is_ancestor_closed_and_ranked_by_path_probability():
    class FixedDrafter:
        supports_tree_drafting = True

        def __init__(self):
            torch.manual_seed(0)
            self.logits = torch.randn(2, 50)
            self.calls = []

        def tree_start(self, state):
            return self.logits, None

        def tree_expand(self, state, exp):
            self.calls.append(exp)
            g = torch.Generator().manual_seed(exp.depth)
            return torch.randn(exp.tokens.shape[0], exp.tokens.shape[1], 50, generator=g)

    drafter = FixedDrafter()
    policy = DynamicTree(depth=4, top_k=3, total_tokens=12)
    proposal = policy.propose(drafter, None)
    parents = proposal.parents
    validate_parents(parents)
    assert proposal.tokens.shape == (2, 12)
    # Each expansion's ancestors are the expanded nodes on its path; depths go 1, 2, 3.
    assert [c.depth for c in drafter.calls] == [1, 2, 3]
    assert drafter.calls[1].ancestors.shape == (2, 3, 3) and bool((drafter.calls[1].ancestors.sum(-1) == 1).all())
    # The drafter's greedy chain (top-1 child at every depth) is always kept, however unlikely its path.
    greedy = [drafter.logits.argmax(-1)]
    for depth in (1, 2, 3):
        g = torch.Generator().manual_seed(depth)
        greedy.append(torch.randn(2, 3, 50, generator=g)[:, 0].argmax(-1))  # the greedy node is expanded first
    anc = ancestor_matrix(parents)
    depths = node_depths(parents)
    for b in range(2):
        leaves = [i for i in range(12) if int(depths[b, i]) == 4]
        paths = [
            [
                int(proposal.tokens[b, j])
                for j in sorted(anc[b, i].nonzero().flatten().tolist(), key=lambda j: int(depths[b, j]))
            ]
            for i in leaves
        ]
        assert [int(t[b]) for t in greedy] in paths
    exact = DynamicTree(depth=4, top_k=3, total_tokens=12, keep_greedy_path=False).propose(FixedDrafter(), None)
    validate_parents(exact.parents)
    # The root's top-3 children are always in the tree (they carry the highest values).
    top3 = torch.topk(drafter.logits, 3).indices
    for b in range(2):
        roots = proposal.tokens[b][parents[b] == -1]
        assert set(top3[b].tolist()) <= set(roots.tolist())


class _PathDrafter:
    """Draft logits that depend on each node's whole path (seeded by it): a tree built shallower or narrower than
    another shows whether it drafted the same nodes."""

    supports_tree_drafting = True

    def __init__(self, rows: int = 2, vocab: int = 40):
        self.rows, self.vocab = rows, vocab

    def logits(self, path: tuple) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(path) % 2**31)
        return 3.0 * torch.randn(self.vocab, generator=g)

    def tree_start(self, state):
        self.slots = [[] for _ in range(self.rows)]  # per row: the path of each expanded node, in expansion order
        return torch.stack([self.logits((b,)) for b in range(self.rows)]), None

    def tree_expand(self, state, exp):
        out = []
        for b in range(self.rows):
            paths = [
                (self.slots[b][p] if p >= 0 else (b,)) + (int(t),)
                for p, t in zip(exp.parent[b].tolist(), exp.tokens[b])
            ]
            self.slots[b].extend(paths)
            out.append(torch.stack([self.logits(path) for path in paths]))
        return torch.stack(out)


@pytest.mark.parametrize("keep_greedy_path", [True, False])
def test_a_dynamic_tree_lists_its_nodes_best_first_so_each_prefix_is_a_smaller_tree(keep_greedy_path):
    policy = DynamicTree(depth=5, top_k=4, total_tokens=20, keep_greedy_path=keep_greedy_path)
    assert policy.node_budgets == (1, 2, 4, 8, 16, 20)
    full = policy.propose(_PathDrafter(), None)
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 20):
        small = policy.with_budget(n)
        assert small.max_depth == min(5, n) and small.max_nodes == n
        got = small.propose(_PathDrafter(), None)
        assert torch.equal(got.tokens, full.tokens[:, :n]), n
        assert torch.equal(got.batched_parents(), full.parents[:, :n]), n
    if keep_greedy_path:  # up to the depth, a size is the drafter's greedy chain, drafted one node a depth
        assert [policy.with_budget(n).top_k for n in (3, 5, 6, 7, 16)] == [1, 1, 2, 3, 4]
        chain = policy.with_budget(3).propose(_PathDrafter(), None)
        assert chain.is_linear  # proposed as the chain it is: its target pass needs no tree mask
        drafter = _PathDrafter()
        for b in range(2):
            path = (b,)
            for t in chain.tokens[b].tolist():
                assert t == int(drafter.logits(path).argmax())
                path = (*path, t)
    with pytest.raises(ValueError, match=r"budget must lie in \[1, 20\]"):
        policy.with_budget(21)
    assert StaticTree(ORACLE_TREE).node_budgets == (6,)
    with pytest.raises(ValueError, match="trees of 6 nodes only"):
        StaticTree(ORACLE_TREE).with_budget(3)


def test_the_accepted_paths_first_nodes_are_what_a_smaller_tree_accepts():
    """Greedy verification of the tree of ``n`` nodes accepts exactly the full tree's accepted nodes among its first
    ``n``: what the adaptive length records for each smaller size from one pass."""
    policy = DynamicTree(depth=5, top_k=3, total_tokens=16)
    drafter = _PathDrafter(rows=1, vocab=12)
    full = policy.propose(drafter, None)
    anc = ancestor_matrix(full.parents)[0]  # a node's ancestors and itself: its path, in index order
    columns = [(0,)] + [(0, *full.tokens[0, anc[i]].tolist()) for i in range(16)]  # the root, then each node's path
    lengths = set()
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        # The target's next token after each column: the drafter's top token 70 % of the time, else a random one.
        argmax = [
            int(drafter.logits(p).argmax())
            if torch.rand(1, generator=g) < 0.7
            else int(torch.randint(12, (1,), generator=g))
            for p in columns
        ]
        scores = _scores(argmax, vocab=12)
        res = GreedyVerifier().verify(full, scores)
        path = res.path[0, : int(res.num_accepted[0])].tolist()
        for n in policy.node_budgets:
            small = Proposal(tokens=full.tokens[:, :n], kind="tree", parents=full.parents[:, :n])
            accepted = int(GreedyVerifier().verify(small, scores[:, : n + 1]).num_accepted[0])
            assert accepted == sum(node < n for node in path), (seed, n)
            lengths.add(accepted)
    assert len(lengths) >= 3  # paths of several lengths were checked


def test_static_tree_from_accuracies_is_best_first():
    acc = [[0.8, 0.1, 0.05], [0.7, 0.1], [0.6]]
    tree = static_tree_from_accuracies(acc, 4)
    assert tree == [(0,), (0, 0), (0, 0, 0), (1,)]
    policy = StaticTree(tree)
    assert policy.max_depth == 3 and policy.parents == [-1, -1, 0, 2]


def test_tree_options_are_checked():
    assert make_tree_policy() is None
    assert isinstance(make_tree_policy("eagle2", tree_depth=3), DynamicTree)
    with pytest.raises(ValueError, match="tree='eagle2'"):
        make_tree_policy(tree_depth=3)
    with pytest.raises(ValueError, match="Unknown tree"):
        make_tree_policy("bushy")
    with pytest.raises(ValueError, match="tree_depth must be"):
        make_tree_policy("eagle2", tree_depth=0)
    with pytest.raises(ValueError, match="no parent path"):
        StaticTree([(0, 1)])
    target = make_target("llama")
    ids, mask = ragged_batch(1)
    from hf_specdec.testing import make_oracle_drafter

    oracle = make_oracle_drafter(target, ids)
    with pytest.raises(ValueError, match="cannot draft trees"):
        target.generate(ids, assistant_model=oracle, tree="eagle2", max_new_tokens=4)
    with pytest.raises(ValueError, match="tree='eagle2'"):
        target.generate(ids, assistant_model=oracle, tree_top_k=2, max_new_tokens=4)


# ------------------------------------------------------------------------------------------------ tree sampling
class RootHeadConfig(DrafterConfig):
    model_type = "root_head_test_drafter"


class RootHeadDrafter(DrafterPreTrainedModel):
    """A test tree drafter: every node's children are the top-k of the target's own distribution after the last
    verified token (Medusa-like: the same head for every depth). Its first candidates carry most of the target's
    mass, so rejections and the residual matter — a sampling bug there shows up fast."""

    config_class = RootHeadConfig
    requires_target_hidden_states = False
    requires_target_logits = True
    supports_tree_drafting = True

    def __init__(self, config):
        super().__init__(config)
        self.placeholder = torch.nn.Parameter(torch.zeros(1))
        self.post_init()

    def _init_weights(self, module):
        pass

    def init_draft_state(self, batch_size, max_length):
        return {}

    def observe(self, state, inputs: DraftInputs):
        slot = torch.arange(inputs.valid.shape[1])
        last = torch.where(inputs.valid, slot, -1).max(1).values
        state["root"] = inputs.logits[torch.arange(inputs.valid.shape[0]), last].float()
        if inputs.feedback is not None:
            state.setdefault("feedback", []).append(inputs.feedback)

    def tree_start(self, state):
        return state["root"], None

    def tree_expand(self, state, exp):
        return state["root"][:, None].expand(-1, exp.tokens.shape[1], -1)

    def propose(self, state, num_tokens, select):
        """Its chain, each token drawn by the loop's selector from the same head (a tree's chain-shaped sizes)."""
        return _chain_proposal([state["root"]] * num_tokens, select)


class ResidualIsPBug(SpeculativeSamplingVerifier):
    """Subtle bug: after a rejection the next sibling is judged against p instead of the residual."""

    name = "residual_is_p_bug_test"

    def verify(self, proposal, scores):
        import hf_specdec.verification.standard as std

        original = std._residual
        std._residual = lambda p, q: p
        try:
            return super().verify(proposal, scores)
        finally:
            std._residual = original


def _tree_sampling_target():
    return make_target("llama", seed=11, vocab=24, sharpen=12.0)


def _exact_second_third(target, prompt):
    """Exact law of (token 2, token 3) of plain sampling (temperature 1), summing over token 1."""
    with torch.no_grad():
        p1 = torch.softmax(target(prompt[None]).logits[0, -1], -1)
        v = p1.shape[0]
        pre = torch.cat([prompt[None].expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2 = torch.softmax(target(pre).logits[:, -1], -1)  # (v, v)
        pre3 = torch.cat([pre.repeat_interleave(v, 0), torch.arange(v).repeat(v)[:, None]], dim=1)
        p3 = torch.softmax(target(pre3).logits[:, -1], -1).view(v, v, v)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # (v2, v3)
    return joint


def _sample_tree(target, drafter, prompt, n, verifier, tree):
    ids = prompt[None].expand(n, -1)
    out = target.generate(
        ids, assistant_model=drafter, do_sample=True, max_new_tokens=3, tree="static", tree_choices=tree,
        verifier=verifier, top_k=0, temperature=1.0, eos_token_id=None, return_dict_in_generate=True, **FIXED_K,
    )  # fmt: skip
    gen = out.sequences[:, prompt.shape[0] :]
    return gen[:, 1], gen[:, 2], out


def _chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return chi_square_test(counts, probs)[0]


TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]


@pytest.mark.parametrize("verifier,lossless", [(None, True), ("residual_is_p_bug_test", False)])
def test_tree_sampling_is_lossless_and_the_subtle_bug_is_caught(verifier, lossless):
    """The joint law of two tokens drawn through one tree pass matches plain sampling (chi-square, p > 1e-3; the
    chance of a false failure is 0.1%); the control, with the residual replaced by p after a rejection, fails."""
    from hf_specdec.verification import register_verifier

    register_verifier(ResidualIsPBug)
    torch.manual_seed(0)
    target = _tree_sampling_target()
    drafter = RootHeadDrafter(RootHeadConfig.for_target(target.config)).eval()
    prompt = torch.tensor([1, 7, 9, 14])
    joint = _exact_second_third(target, prompt)
    t2s, t3s = [], []
    for _ in range(4):
        t2, t3, out = _sample_tree(target, drafter, prompt, 1500, verifier, TREE)
        t2s.append(t2)
        t3s.append(t3)
    t2, t3 = torch.cat(t2s), torch.cat(t3s)
    v = joint.shape[0]
    counts = torch.bincount(t2 * v + t3, minlength=v * v).double()
    p_joint = _chi_square_pvalue(counts, joint.flatten().double())
    p_second = _chi_square_pvalue(torch.bincount(t2, minlength=v).double(), joint.sum(1).double())
    # The passes did exercise rejections of first candidates and acceptances deep in the tree.
    acc = [a for row in out.accepted_lengths for a in row]
    assert min(acc) == 1 and max(acc) == 2  # 2 = the length limit (3 new tokens, one from the prefill)
    if lossless:
        assert p_joint > 1e-3 and p_second > 1e-3, (p_joint, p_second)
    else:
        assert min(p_joint, p_second) < 1e-6, (p_joint, p_second)


class _FixedTreeSize(DraftLengthController):
    """Always drafts one tree size (``size``, set per test)."""

    size = 0

    def choose(self, limit, pending_slots=0, context=None):
        return self.size


@pytest.mark.parametrize(
    "size,verifier,lossless", [(2, None, True), (4, None, True), (2, "residual_is_p_bug_test", False)]
)
def test_sampling_is_lossless_with_every_tree_size(monkeypatch, size, verifier, lossless):
    """The EAGLE-2 tree (depth 2, top-k 3, 6 nodes) drafted at a size the adaptive length chose: 2 nodes are a
    chain, drafted by the drafter's chain drafting (sampled from its distribution) and verified as a chain; 4 nodes a
    tree. The joint law of two tokens matches plain sampling, and the control with the residual replaced by p
    fails."""
    from hf_specdec.verification import register_verifier

    register_verifier(ResidualIsPBug)
    monkeypatch.setattr(adaptive, "DraftLengthController", _FixedTreeSize)
    monkeypatch.setattr(_FixedTreeSize, "size", size)
    torch.manual_seed(0)
    target = _tree_sampling_target()
    drafter = RootHeadDrafter(RootHeadConfig.for_target(target.config)).eval()
    prompt = torch.tensor([1, 7, 9, 14])
    joint = _exact_second_third(target, prompt)
    out = target.generate(
        prompt[None].expand(6000, -1), assistant_model=drafter, do_sample=True, max_new_tokens=3, tree="eagle2",
        tree_depth=2, tree_top_k=3, tree_total_tokens=6, verifier=verifier, top_k=0, temperature=1.0,
        eos_token_id=None, lookup_tokens=0, return_dict_in_generate=True,
    )  # fmt: skip
    gen = out.sequences[:, prompt.shape[0] :]
    v = joint.shape[0]
    counts = torch.bincount(gen[:, 1] * v + gen[:, 2], minlength=v * v).double()
    p_joint = _chi_square_pvalue(counts, joint.flatten().double())
    assert {d for row in out.draft_lengths for d in row} == {size}
    acc = [a for row in out.accepted_lengths for a in row]
    assert min(acc) == 1 and max(acc) == 2
    if lossless:
        assert p_joint > 1e-3, p_joint
    else:
        assert p_joint < 1e-6, p_joint


def test_residual_helper():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    torch.testing.assert_close(_residual(p, q), torch.tensor([[0.0, 0.6, 0.4]]))


def test_feedback_reports_the_accepted_path():
    target = _tree_sampling_target()
    drafter = RootHeadDrafter(RootHeadConfig.for_target(target.config)).eval()
    ids, mask = ragged_batch(2, vocab=24, seed=3)
    state_holder = {}
    original = drafter.init_draft_state

    def capture(batch_size, max_length):
        state_holder["s"] = original(batch_size, max_length)
        return state_holder["s"]

    drafter.init_draft_state = capture
    out = target.generate(
        ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=10, tree="fork-10",
        return_dict_in_generate=True, **FIXED_K,
    )  # fmt: skip
    feedback = state_holder["s"]["feedback"]
    assert [f.step for f in feedback] == list(range(len(feedback)))
    for f in feedback:
        assert f.proposal.kind == "tree"
        for b in range(2):
            n = int(f.num_accepted[b])
            nodes = f.accepted_nodes[b, :n].tolist()
            assert all(x >= 0 for x in nodes) and bool((f.accepted_nodes[b, n:] == -1).all())
            # The path is a chain of parent links starting at the root.
            parents = f.proposal.batched_parents()[b]
            assert all(int(parents[c]) == (nodes[i - 1] if i else -1) for i, c in enumerate(nodes))
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    assert torch.equal(out.sequences, ref)
