"""The simulated τ walks each sequence pass by pass as the decoding loop does, and predicts what `generate` measures."""

import pytest
import torch
from helpers import FIXED_K, make_target
from test_training_trainer import args, fresh, self_distilled

from hf_specdec.features import walk_metrics, walk_passes
from hf_specdec.training.data import DataCollator, DrafterDataset
from hf_specdec.training.features import capture_target_features
from hf_specdec.training.trainer import DrafterTrainer


def test_walk_moves_on_by_accepted_plus_one_and_caps_at_k():
    # Loss region = positions 2..11; the walk starts at anchor 1 (the prefill commits token 2).
    loss_mask = torch.tensor([[0, 0] + [1] * 10])
    accepted = torch.zeros(1, 12, dtype=torch.long)
    accepted[0, 1] = 9  # capped at K = 3: commits 4 tokens, moves to anchor 5
    accepted[0, 5] = 0  # rejection: commits the bonus token only, anchor 6
    accepted[0, 6] = 2  # commits 3, anchor 9; then 11 - 9 - 1 = 1 draft left before the end of the region
    accepted[0, 9] = 3
    assert walk_passes(accepted, loss_mask, 3) == [[[4, 1, 3, 2]]]
    metrics = walk_metrics(walk_passes(accepted, loss_mask, 3))
    # The region's last pass (cut short by the end of the data) is left out of the rate, kept in the `_all` sums.
    assert metrics["walk_tokens"].item() == 8 and metrics["walk_passes"].item() == 3
    assert metrics["walk_tokens_all"].item() == 10 and metrics["walk_passes_all"].item() == 4


def test_walk_handles_several_regions_and_padding():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 0]])
    accepted = torch.full((1, 12), 5)
    # Region 1..3 starts at anchor 0; region 6..9 at anchor 5; a pass never drafts past its region.
    assert walk_passes(accepted, loss_mask, 4) == [[[3], [4]]]


def test_walk_differs_from_averaging_every_position():
    # An easy stretch (every draft accepted) followed by a hard one (nothing accepted): averaging the accepted
    # prefix over every position weights the easy stretch by its length in positions, the loop by its passes.
    loss_mask = torch.ones(1, 22, dtype=torch.long)
    loss_mask[0, 0] = 0
    accepted = torch.zeros(1, 22, dtype=torch.long)
    accepted[0, :11] = 4
    passes = walk_passes(accepted, loss_mask, 4)[0][0]
    walked = sum(passes[:-1]) / len(passes[:-1])
    averaged = 1 + accepted[0, :20].float().mean().item()
    assert passes == [5, 5, 5, 1, 1, 1, 1, 1]
    assert walked == pytest.approx(19 / 7) and averaged == pytest.approx(3.2)  # the old estimate overstates τ


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = make_target("llama", seed=2, sharpen=20.0)
    data = self_distilled(target, 8, new=26)
    run = args(tmp_path_factory.mktemp("walk"), max_steps=30, save_steps=100, learning_rate=1e-2)
    drafter = fresh(target)
    DrafterTrainer(drafter, target, run, data).train()
    prompts = torch.stack([data[i]["input_ids"][:6] for i in range(len(data))])  # seen in training: high acceptance
    return target, drafter.eval(), prompts


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("trained", [True, False])
def test_walked_tau_equals_the_tau_generate_measures(setup, k, trained, tmp_path):
    """Training ≡ inference end to end: on the target's own greedy output, the walk over the teacher-forced chains
    gives the loop's accepted lengths pass by pass (each row's last pass, cut by the length limit, aside)."""
    target, drafter, prompts = setup
    if not trained:
        drafter = fresh(target).eval()
    drafter.config.num_draft_tokens = k
    prompt_len, new = prompts.shape[1], 30
    out = target.generate(
        prompts,
        assistant_model=drafter,
        num_assistant_tokens=k,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        return_dict_in_generate=True,
        **FIXED_K,
    )
    assert torch.equal(out.sequences, target.generate(prompts, max_new_tokens=new, do_sample=False, eos_token_id=None))
    seqs = out.sequences
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, prompt_len:] = 1
    batch = {"input_ids": seqs, "attention_mask": torch.ones_like(seqs), "loss_mask": loss_mask}
    feats = capture_target_features(target, seqs, batch["attention_mask"], drafter.config.target_layer_ids)
    with torch.no_grad():
        loss_out = drafter.compute_loss(batch, feats, target.get_output_embeddings(), steps=k)
    walked = walk_passes(loss_out.accepted, loss_mask, k)
    loop_passes = [p for row in out.accepted_lengths for p in row[:-1]]
    for row, region in zip(out.accepted_lengths, walked):
        assert region[0][:-1] == row[:-1]
    if trained:  # passes of every length 1..K + 1 occur: the walk is checked on long and short jumps alike
        assert set(loop_passes) == set(range(1, k + 2)), loop_passes

    # The trainer's metric is that walk: its simulated τ is the loop's τ without each row's last pass.
    dataset = DrafterDataset([{"input_ids": r.tolist(), "loss_mask": m.tolist()} for r, m in zip(seqs, loss_mask)])
    run = args(tmp_path, max_steps=1, loss_kwargs={"steps": k})
    metrics = DrafterTrainer(drafter, target, run, dataset, dataset).draft_metrics()
    assert metrics.simulated_tau == pytest.approx(sum(loop_passes) / len(loop_passes), abs=1e-12)
    assert len(metrics.accuracy) == k


def test_walk_matches_generate_on_a_left_padded_ragged_batch(setup):
    """Prompts of different lengths: `generate` left-pads them, training right-pads the same sequences."""
    target, drafter, prompts = setup
    k, new = 4, 30
    drafter.config.num_draft_tokens = k
    lens = [6, 4, 5, 6, 3, 6, 5, 4]
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, width - n :] = prompts[i, :n]
        mask[i, width - n :] = 1
    kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
    out = target.generate(
        ids, assistant_model=drafter, num_assistant_tokens=k, return_dict_in_generate=True, **kw, **FIXED_K
    )
    assert torch.equal(out.sequences, target.generate(ids, **kw))
    items = [
        {"input_ids": out.sequences[i, width - n :], "loss_mask": torch.tensor([0] * n + [1] * new)}
        for i, n in enumerate(lens)
    ]
    batch = DataCollator(pad_token_id=0)(items)
    feats = capture_target_features(
        target, batch["input_ids"], batch["attention_mask"], drafter.config.target_layer_ids
    )
    with torch.no_grad():
        loss_out = drafter.compute_loss(batch, feats, target.get_output_embeddings(), steps=k)
    walked = walk_passes(loss_out.accepted, batch["loss_mask"], k)
    for row, region in zip(out.accepted_lengths, walked):
        assert region[0][:-1] == row[:-1]
    assert max(p for row in out.accepted_lengths for p in row[:-1]) > 2
