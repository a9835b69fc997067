"""DSpark: the shared drafter tester plus family checks (the sequential correction, the confidence head, the loss and
the verification-length scheduler)."""

import pytest
import torch
from drafter_tester import DrafterTesterMixin
from helpers import make_target, ragged_batch

from hf_specdec import AutoModelForDrafting, DSparkConfig, DSparkForDrafting
from hf_specdec.models.dflash.modeling_dspark import schedule_lengths


class TestDSpark(DrafterTesterMixin):
    config_class = DSparkConfig
    model_class = DSparkForDrafting
    config_overrides = {"intermediate_size": 64, "block_size": 6, "markov_rank": 8}

    def make_drafter(self, target, seed=0, **overrides):
        drafter = super().make_drafter(target, seed, **overrides)
        with torch.no_grad():  # a fresh correction is zero: give it weights so that the tests see it
            drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
        return drafter

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        feats = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(input_ids, feats, attention_mask, steps)


def _unit_seconds(per_token: float):
    return lambda width: 1.0 + per_token * (width - 1)


def test_scheduler_admits_in_order_of_cumulative_confidence_while_throughput_grows():
    cum = torch.tensor([[0.9, 0.5], [0.2, 0.1]])
    # free extra tokens: everything is admitted
    assert schedule_lengths(cum, _unit_seconds(0.0)).tolist() == [2, 2]
    # 0.3 per extra token per row (the mean width B / R): (0, 0) 2.9 / 1.15 > 2, (0, 1) 3.4 / 1.3 > 2.52, then
    # (1, 0) 3.6 / 1.45 < 2.62: stop there, (1, 1) is never looked at
    assert schedule_lengths(cum, _unit_seconds(0.3)).tolist() == [2, 0]
    # expensive tokens: nothing pays, a plain step for every row
    assert schedule_lengths(cum, _unit_seconds(1.0)).tolist() == [0, 0]
    # a cap per row is respected, and rows only grow by prefixes
    assert schedule_lengths(cum, _unit_seconds(0.0), torch.tensor([1, 2])).tolist() == [1, 2]
    # the stop is final: a later entry that would pay on its own is not admitted after a refusal
    cum = torch.tensor([[0.5, 0.05, 0.05], [0.45, 0.44, 0.43]])
    assert schedule_lengths(cum, _unit_seconds(0.2)).tolist()[0] <= 1


def _profiled(target, seed=6, per_token=0.15, **cfg):
    drafter = TestDSpark().make_drafter(target, seed=seed, **cfg)
    widths = list(range(1, drafter.config.block_size + 2))
    drafter.config.verify_seconds = {
        "batch_sizes": [1, 64],
        "widths": widths,
        "seconds": [[1.0 + per_token * (w - 1) for w in widths]] * 2,
    }
    with torch.no_grad():  # confidences that depend on the previous token and spread over (0, 1)
        hidden = drafter.config.hidden_size
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.weight[:, hidden:].normal_(0, 40.0, generator=torch.Generator().manual_seed(seed))
        drafter.confidence_head.proj.bias.fill_(1.0)
    return drafter


@pytest.mark.parametrize("batch", [1, 3])
def test_scheduled_greedy_decoding_is_identical(batch):
    target = make_target("llama", seed=1)
    drafter = _profiled(target)
    ids, mask = ragged_batch(batch, seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=drafter, confidence_schedule=True, return_dict_in_generate=True,
                          draft_length="fixed", lookup_tokens=0, **kw)  # fmt: skip
    assert torch.equal(out.sequences, target.generate(ids, **kw))
    lengths = {d for row in out.draft_lengths for d in row}
    assert len(lengths) > 1 and max(lengths) <= drafter.config.block_size  # the scheduler did vary them


def test_scheduled_sampling_is_lossless_and_the_control_is_rejected():
    from sampling_check import (
        PROMPT,
        ResidualIsTargetVerifier,
        describe,
        exact_laws,
        fails_check,
        law_pvalues,
        sample,
        sampling_target,
    )

    target = sampling_target()
    laws = exact_laws(target, PROMPT)
    drafter = _profiled(target, per_token=0.05)
    out, gen = sample(target, drafter, confidence_schedule=True, draft_length="fixed", lookup_tokens=0)
    assert len({d for row in out.draft_lengths for d in row}) > 2
    pvalues = law_pvalues(gen, laws)
    assert not fails_check(pvalues), describe(pvalues)
    _, bad = sample(target, drafter, verifier=ResidualIsTargetVerifier(), confidence_schedule=True,
                    draft_length="fixed", lookup_tokens=0)  # fmt: skip
    assert fails_check(law_pvalues(bad, laws))


def test_schedule_without_pass_times_fails_early():
    target = make_target("llama")
    drafter = TestDSpark().make_drafter(target)
    ids, mask = ragged_batch(1)
    with pytest.raises(ValueError, match="hf-specdec profile"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, confidence_schedule=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="verify_seconds"):
        DSparkConfig.for_target(
            target.config, verify_seconds={"batch_sizes": [1], "widths": [2, 1], "seconds": [[1, 1]]}
        )


def test_sequential_temperature_scaling_repairs_overconfidence():
    from hf_specdec.models.dflash.modeling_dspark import expected_calibration_error, sequential_temperature_scaling

    g = torch.Generator().manual_seed(0)
    true_logits = torch.randn(4000, 3, generator=g) * 1.5
    accepted = torch.rand(4000, 3, generator=g) < torch.sigmoid(true_logits)
    valid = torch.ones(4000, 3, dtype=torch.bool)
    report = sequential_temperature_scaling(true_logits * 3.0, accepted, valid)  # an overconfident head
    assert report["mean_ece_after"] < 0.5 * report["mean_ece_before"]
    assert 2.0 < report["temperatures"][0] < 4.5  # close to the factor 3 that broke it
    # a calibrated head is left about as it is (the control: scaling cannot make a calibrated head much better)
    fine = sequential_temperature_scaling(true_logits, accepted, valid)
    assert fine["mean_ece_before"] < 0.05 and 0.7 < fine["temperatures"][0] < 1.4
    assert expected_calibration_error(torch.tensor([0.95, 0.95]), torch.tensor([1.0, 0.0])) == pytest.approx(0.45)


def test_loss_terms_and_confidence_label():
    from hf_specdec.features import TargetFeatures

    target = make_target("llama")
    drafter = TestDSpark().make_drafter(target).bind_target(target).eval()
    ids, mask = ragged_batch(2, length=10)
    with torch.no_grad():
        out = target(ids, attention_mask=mask, output_hidden_states=True)
    hs = [out.hidden_states[i] for i in drafter.config.target_layer_ids]
    feats = TargetFeatures(hidden_states=hs, last_hidden=out.hidden_states[-1])
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}
    with torch.no_grad():
        got = drafter.compute_loss(batch, feats, target.get_output_embeddings())
        states = drafter.block_states(ids, hs, mask, torch.arange(1, 10)[None].expand(2, 9))
    p = torch.softmax(out.logits.float(), -1)
    cfg = drafter.config
    weighted, plain, count = 0.0, 0.0, 0
    for j in range(cfg.block_size):
        terms, bces = [], []
        for b in range(2):
            for t in range(10 - 2 - j):
                if not (mask[b, t + 2 + j] and mask[b, t + 2]):
                    continue
                prev = ids[b, t + 1 + j]
                logits = drafter.target_head_logits(states[b, t, j]) + drafter.correction(prev)
                q = torch.softmax(logits.float(), -1)
                l1 = (q - p[b, t + 1 + j]).abs().sum()
                terms.append(cfg.ce_weight * -(p[b, t + 1 + j] * q.log()).sum() + cfg.tv_weight * l1)
                c = torch.sigmoid(drafter.confidence_logit(states[b, t, j], prev))
                bces.append(torch.nn.functional.binary_cross_entropy(c, 1 - l1 / 2))
        weighted = weighted + torch.exp(torch.tensor(-j / 4.0)) * torch.stack(terms).mean()
        plain, count = plain + torch.stack(bces).sum(), count + len(bces)
    torch.testing.assert_close(got.loss, weighted + plain / count, rtol=1e-4, atol=1e-5)


def test_profile_and_calibrate_commands(tmp_path):
    """`hf-specdec profile` stores measured pass times in the drafter; `hf-specdec calibrate` fits the temperatures
    on the held-out split of a feature dump and reports the calibration error before and after."""
    import json

    from helpers import chat_workspace

    from hf_specdec.commands import main as cli

    target, tok, rng = chat_workspace(tmp_path)
    t = str(tmp_path / "target")
    with open(tmp_path / "data.jsonl", "w") as fh:
        for _ in range(16):
            words = " ".join("".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(6))
            fh.write(
                json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": words}]})
                + "\n"
            )
    drafter = AutoModelForDrafting.from_config(DSparkConfig.for_target(target.config, intermediate_size=32, block_size=4,
                                                                     markov_rank=8))  # fmt: skip
    drafter.save_pretrained(tmp_path / "dspark")
    assert cli(["profile", "--target", t, "--drafter", str(tmp_path / "dspark"), "--batch-sizes", "1", "2",
                "--widths", "1", "3", "5", "--context", "16", "--repeats", "1", "--warmup", "0",
                "--out", str(tmp_path / "profile.json")]) == 0  # fmt: skip
    table = json.loads((tmp_path / "profile.json").read_text())
    assert table["batch_sizes"] == [1, 2] and len(table["seconds"]) == 2 and len(table["seconds"][0]) == 3
    config_before = (tmp_path / "dspark" / "config.json").read_text()
    assert 'verify_seconds": null' in config_before or "verify_seconds" not in config_before
    stored = json.loads((tmp_path / "dspark" / "pass_times.json").read_text())  # this machine's, beside the weights
    assert stored["seconds"] == table["seconds"] and stored["widths"] == [1, 3, 5]
    loaded = AutoModelForDrafting.from_pretrained(tmp_path / "dspark")
    assert loaded.config.verify_seconds is None and loaded.pass_times()["seconds"] == table["seconds"]
    loaded.init_draft_state(1, 32, confidence_schedule=True)  # the scheduler finds the table

    assert cli(["dump-features", "--target", t, "--data", str(tmp_path / "data.jsonl"), "--output-dir",
                str(tmp_path / "feats"), "--feature-dtype", "float32", "--max-length", "64", "--batch-size", "4",
                "--layer-ids", *map(str, drafter.config.target_layer_ids)]) == 0  # fmt: skip
    assert cli(["calibrate", "--target", t, "--drafter", str(tmp_path / "dspark"), "--features", str(tmp_path / "feats"),
                "--eval-fraction", "0.25", "--out", str(tmp_path / "cal.json")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "cal.json").read_text())
    assert len(report["temperatures"]) == 4 and report["mean_ece_after"] <= report["mean_ece_before"] + 1e-9
    assert sum(report["anchors"]) > 0
    assert (
        AutoModelForDrafting.from_pretrained(tmp_path / "dspark").config.confidence_temperatures
        == report["temperatures"]
    )


@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_family_commands_refuse_a_family_that_did_not_register_them(tmp_path, command, capsys):
    """`profile` and `calibrate` apply to the families that register them (here DSpark): another drafter is refused
    in one line naming the families it applies to, before anything is measured or written."""
    from helpers import chat_workspace

    from hf_specdec import Eagle3Config
    from hf_specdec.commands import main as cli
    from hf_specdec.registry import get_drafter_spec

    assert get_drafter_spec("dspark").commands == ("profile", "calibrate")
    target, _, _ = chat_workspace(tmp_path)
    folder = tmp_path / "eagle3"
    AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config)).save_pretrained(folder)
    before = sorted(p.name for p in folder.iterdir())
    extra = ["--features", str(tmp_path / "none")] if command == "calibrate" else ["--repeats", "1", "--warmup", "0"]
    capsys.readouterr()
    assert cli([command, "--target", str(tmp_path / "target"), "--drafter", str(folder), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"`hf-specdec {command}` does not apply to Eagle3ForDrafting" in err and "dspark" in err
    assert sorted(p.name for p in folder.iterdir()) == before


def _deepspec_checkpoint(tmp_path):
    """A DeepSpec-style DSpark checkpoint folder built around transformers' MuseGlimmer backbone: (target, backbone
    model, state, config, folder)."""
    import json

    from safetensors.torch import save_file
    from test_dflash import _muse_glimmer

    target = make_target("llama")
    model, folder = _muse_glimmer(target, tmp_path, sliding_window=256)
    g = torch.Generator().manual_seed(3)
    rank, hidden, vocab = 8, target.config.hidden_size, target.config.vocab_size
    state = {k.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm."): v
             for k, v in model.state_dict().items()}  # fmt: skip
    state.update({
        "markov_head.markov_w1.weight": torch.randn(vocab, rank, generator=g),
        "markov_head.markov_w2.weight": torch.randn(vocab, rank, generator=g) * 0.5,
        "confidence_head.proj.weight": torch.randn(1, hidden + rank, generator=g) * 0.1,
        "confidence_head.proj.bias": torch.zeros(1),
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
        "lm_head.weight": target.get_output_embeddings().weight.detach().clone(),
    })  # fmt: skip
    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "layer_types", "sliding_window")}
    cfg.update(architectures=["DSparkDraftModel"], markov_rank=rank, markov_head_type="vanilla", vocab_size=vocab,
               enable_confidence_head=True, confidence_head_with_markov=True)  # fmt: skip
    src = tmp_path / "deepspec"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    return target, model, state, cfg, src


def test_deepspec_layout_matches_an_independent_forward_and_round_trips(tmp_path):
    """A DeepSpec-style DSpark checkpoint (DFlash backbone + markov_head + confidence_head, flat config, its own copies
    of the target's embeddings and LM head): the draft logits equal transformers' MuseGlimmer backbone forward (every
    slot, the anchor's included) through the target's head plus W2 W1[previous token]."""
    from hf_specdec.convert import detect_layout, export_drafter, import_drafter

    target, model, state, cfg, src = _deepspec_checkpoint(tmp_path)
    g = torch.Generator().manual_seed(4)
    assert detect_layout(str(src)) == "dspark-deepspec"
    drafter = import_drafter(str(src), target_config=target.config).eval().bind_target(target)
    assert isinstance(drafter, DSparkForDrafting) and drafter.drafts_per_block == 5
    ids = torch.randint(6, 90, (1, 14), generator=g)
    s = 8  # context: tokens 0..7; the block's anchor is token 8, the drafts predict tokens 9..13
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        ctx = torch.cat([hs[i + 1][:, :s] for i in (0, 2)], -1)
        noise = torch.tensor([[int(ids[0, s])] + [3] * 4])
        ref_states = model(noise_embeds=target.get_input_embeddings()(noise), context_hidden_states=ctx,
                           position_ids=torch.arange(s + 5)[None]).last_hidden_state  # fmt: skip
        feats = drafter.select_target_features(hs)
        states = drafter.block_states(ids, feats, None, torch.tensor([[s]]))
        for k in range(5):
            got = drafter.teacher_forced_slot_logits(states, ids, torch.tensor([[s]]), k)[0, 0]
            prev = ids[0, s + k]
            bias = state["markov_head.markov_w1.weight"][prev] @ state["markov_head.markov_w2.weight"].T
            want = target.get_output_embeddings()(ref_states[0, k]) + bias
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    out = export_drafter(drafter, str(tmp_path / "out"), "dspark-deepspec", target=target)
    again = import_drafter(out, target_config=target.config)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor)


def _specforge_checkpoint(tmp_path, cfg: dict, state: dict, name: str = "specforge", **nested) -> str:
    """The DeepSpec checkpoint rewritten as SpecForge writes DSpark: the DSpark fields in ``dflash_config`` (none at
    the top level), no embeddings or LM head."""
    import json

    from safetensors.torch import save_file

    keys = ("mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type", "enable_confidence_head",
            "confidence_head_with_markov")  # fmt: skip
    config = {k: v for k, v in cfg.items() if k not in keys}
    config["dflash_config"] = {**{k: cfg[k] for k in keys}, "projector_type": "dspark", "attention_mode": "gqa",
                               "confidence_head_alpha": 1.0, **nested}  # fmt: skip
    folder = tmp_path / name
    folder.mkdir()
    weights = {k: v.contiguous() for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_specforge_layout_reads_the_same_drafter_and_round_trips(tmp_path):
    """SpecForge's DSpark config nests the DSpark fields in ``dflash_config`` and ships no target weights: the same
    tensors give the same drafter as the DeepSpec layout, early checkpoints with the heads under ``logit_head.`` too,
    and an export reads back identical with the fields where SpecForge's config class and its training configs look."""
    import json

    from hf_specdec.convert import detect_layout, export_drafter, import_drafter

    target, _, state, cfg, src = _deepspec_checkpoint(tmp_path)
    reference = import_drafter(str(src), target_config=target.config).state_dict()
    folder = _specforge_checkpoint(tmp_path, cfg, state)
    assert detect_layout(folder) == "dspark-specforge"
    drafter = import_drafter(folder, target_config=target.config)
    assert drafter.state_dict().keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(drafter.state_dict()[name], tensor)
    old = {
        ("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v for k, v in state.items()
    }
    early = _specforge_checkpoint(tmp_path, cfg, old, name="early")
    assert detect_layout(early) == "dspark-specforge"
    torch.testing.assert_close(
        import_drafter(early, target_config=target.config).state_dict()["markov_head.markov_w1.weight"],
        reference["markov_head.markov_w1.weight"],
    )
    out = export_drafter(drafter, str(tmp_path / "out"), "dspark-specforge")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dflash_config"]["markov_rank"] == written["markov_rank"] == cfg["markov_rank"]
    assert written["dflash_config"]["target_layer_ids"] == cfg["target_layer_ids"]
    assert detect_layout(out) == "dspark-specforge"
    again = import_drafter(out, target_config=target.config)
    for name, tensor in reference.items():
        torch.testing.assert_close(again.state_dict()[name], tensor)


@pytest.mark.parametrize(
    "nested, top, message",
    [
        ({"attention_mode": "kda"}, {}, "kda"),
        ({"attention_modes": ["gqa", "mla"]}, {}, "mla"),
        ({"enable_confidence_head": False}, {}, "confidence head"),
        ({"confidence_head_with_markov": False}, {}, "confidence head"),
        ({"markov_head_type": "gated"}, {}, "vanilla"),
        ({"projector_type": "mlp"}, {}, "projector_type"),
        ({"shift_label": True}, {}, "shift_label"),
        ({}, {"is_causal": True}, "causal"),
        ({}, {"draft_vocab_size": 32}, "full-vocabulary"),
    ],
)
def test_specforge_variants_hf_specdec_cannot_run_are_refused(tmp_path, nested, top, message):
    """SpecForge's DSpark configs include variants this DSpark is not (linear / latent attention layers, no confidence
    head, causal blocks, a reduced draft vocabulary): each is refused by name, never loaded as something else."""
    import json

    from hf_specdec.convert import import_drafter

    target, _, state, cfg, _ = _deepspec_checkpoint(tmp_path)
    folder = _specforge_checkpoint(tmp_path, cfg, state, **nested)
    config = json.loads(open(f"{folder}/config.json").read())
    config.update(top)
    with open(f"{folder}/config.json", "w") as fh:
        json.dump(config, fh)
    with pytest.raises(ValueError, match=message):
        import_drafter(folder, target_config=target.config)
