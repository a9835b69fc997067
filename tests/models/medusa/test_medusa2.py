"""Medusa-2: the shared drafter tester (a fresh drafter declares no adapter) plus the joint training round trip."""

import pytest
import torch
from drafter_tester import DrafterTesterMixin
from helpers import make_target, ragged_batch
from test_training_trainer import args, self_distilled

from hf_specdec import AutoModelForDrafting, Medusa2Config, Medusa2ForDrafting
from hf_specdec.training.trainer import DrafterTrainer


class TestMedusa2(DrafterTesterMixin):
    config_class = Medusa2Config
    model_class = Medusa2ForDrafting
    config_overrides = {"lora_r": 2}
    draft_lengths = (1, 3, 5)
    no_foreign_layout_reason = "the Medusa layouts have no place for the target adapter (export the heads as Medusa-1)"

    def teacher_forced_draft_logits(self, drafter, input_ids, hidden_states, attention_mask, steps):
        (feats,) = drafter.select_target_features(hidden_states)
        return drafter.teacher_forced_logits(feats, steps)


def test_adapter_round_trip_and_generation_with_the_adapted_target(tmp_path):
    target = make_target("llama", seed=2, sharpen=20.0)
    data = self_distilled(target, 8)
    torch.manual_seed(0)
    drafter = AutoModelForDrafting.from_config(Medusa2Config.for_target(target.config, num_heads=3, lora_r=2))
    run = args(tmp_path, max_steps=4, save_steps=4, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0)
    trainer = DrafterTrainer(drafter, target, run, data)
    trainer.train()
    ramp = [h["loss_kwargs"]["medusa_weight"] for h in trainer.history]
    assert ramp == pytest.approx([0.0, 0.1, 0.2, 0.2])  # lambda ramps to lambda_max over half of training
    lrs = sorted({g["lr"] for g in trainer.optimizer.param_groups})
    assert lrs == pytest.approx([1e-2 / 4, 1e-2])  # heads at the run's rate, the adapter at a quarter of it
    out = tmp_path / "out"
    loaded = AutoModelForDrafting.from_pretrained(out).eval()
    assert isinstance(loaded, Medusa2ForDrafting) and loaded.config.target_adapter["subfolder"] == "target_adapter"

    plain = make_target("llama", seed=2, sharpen=20.0)
    ids, mask = ragged_batch(2)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    with pytest.raises(ValueError, match="adapt_target"):
        plain.generate(ids, assistant_model=loaded, **kw)
    adapted = loaded.adapt_target(plain)
    with torch.no_grad():
        base_logits = make_target("llama", seed=2, sharpen=20.0)(ids, attention_mask=mask).logits
        assert (adapted(input_ids=ids, attention_mask=mask).logits - base_logits).abs().max() > 1e-4
    # speculative decoding with the adapted target is that target's own greedy decoding, token for token
    assert torch.equal(adapted.generate(ids, assistant_model=loaded, **kw), adapted.generate(ids, **kw))
    assert torch.equal(
        adapted.generate(
            ids, assistant_model=loaded, tree="static", tree_choices=[(0,), (1,), (0, 0), (0, 0, 0)], **kw
        ),
        adapted.generate(ids, **kw),
    )

    # The benchmark runs the drafter's rows on the adapted target (a copy: peft adapts the model it wraps in place),
    # checks them against that target's own plain decoding, and times them against the unadapted target's.
    from helpers import char_tokenizer

    from hf_specdec.bench.prompts import PromptItem
    from hf_specdec.bench.runner import (
        BenchMethod,
        adapted_target_methods,
        drafter_method,
        plain_method,
        run_benchmark,
    )
    from hf_specdec.cpu_kernels import linear_kernels_for

    bench_target = make_target("llama", seed=2, sharpen=20.0)
    with pytest.raises(ValueError, match="adapt_target"):  # the unadapted copy is refused as the rows' target
        adapted_target_methods(loaded, bench_target, [drafter_method(loaded, name="heads")])
    prompts = [PromptItem(id=str(i), category="c", text=t) for i, t in enumerate(["abcab", "hello", "01230"])]
    rows = adapted_target_methods(loaded, adapted, [drafter_method(loaded, name="heads", lookup_tokens=0)])
    report = run_benchmark(
        bench_target, char_tokenizer(), [plain_method(), *rows], prompts, max_new_tokens=10, warmup=0, progress=False
    )
    rec = {r["method"]: r for r in report["records"] if r["category"] == "all"}
    reference = "plain:adapted(out)"
    assert set(rec) == {"plain", reference, "heads"}
    assert rec["heads"]["reference"] == reference and rec["heads"]["identical"] is True
    # ... which has teeth: the adapter changes the greedy outputs, so checked against plain they would differ
    tok = char_tokenizer()
    encoded = [tok(p.text, return_tensors="pt").input_ids for p in prompts]
    assert any(
        not torch.equal(
            adapted.generate(x, max_new_tokens=10, do_sample=False),
            bench_target.generate(x, max_new_tokens=10, do_sample=False),
        )
        for x in encoded
    )
    assert rec[reference]["mean_accepted_length"] == 1.0 and rec[reference]["identical"] is True
    assert rec["heads"]["target_forwards"] > 0 and rec["heads"]["mean_accepted_length"] >= 1.0
    assert {m["name"]: m.get("reference") for m in report["config"]["methods"]}["heads"] == reference
    # The adapted target (its adapter merged: a plain model) takes the packed kernels as the benchmark's target does.
    with linear_kernels_for(make_target("llama", seed=2, sharpen=20.0), "packed") as one:
        assert report["config"]["linear_kernels"] == (f"packed ({2 * len(one)} layers)" if len(one) else "stock")
    with pytest.raises(ValueError, match="same model"):  # a row on the adapted target checked against the plain one
        run_benchmark(
            bench_target,
            char_tokenizer(),
            [plain_method(), BenchMethod(name="x", kind="drafter", model=loaded, target=adapted, reference="plain")],
            prompts,
            max_new_tokens=4,
            warmup=0,
            progress=False,
        )
