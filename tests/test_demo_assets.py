"""The shipped demo target and EAGLE-3 drafter load offline, fit each other and decode losslessly."""

import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec import AutoModelForDrafting, Eagle3ForDrafting

ASSETS = os.path.join(os.path.dirname(hf_specdec.__file__), "assets")


def test_shipped_demo_target_and_drafter():
    target = AutoModelForCausalLM.from_pretrained(os.path.join(ASSETS, "demo-target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "demo-target"))
    drafter = AutoModelForDrafting.from_pretrained(os.path.join(ASSETS, "demo-drafter")).eval()
    assert isinstance(drafter, Eagle3ForDrafting)
    assert os.path.getsize(os.path.join(ASSETS, "demo-target", "model.safetensors")) <= 64 * 2**20
    assert os.path.getsize(os.path.join(ASSETS, "demo-drafter", "model.safetensors")) <= 16 * 2**20
    prompt = "import os\n\n\ndef read_config(path):\n    with open(path) as fh:\n"
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kw)
    # drafting every pass (the adaptive length reads the clock): the check is about the drafter alone
    out = target.generate(
        ids, assistant_model=drafter, return_dict_in_generate=True, draft_length="fixed", lookup_tokens=0, **kw
    )
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_length > 1.5  # the trained drafter is accepted
    record = json.load(open(os.path.join(ASSETS, "demo-drafter", "training_record.json")))
    assert record["family"] == "eagle3_drafter" and record["steps"] > 0


def test_shipped_assistant_and_prompts():
    """The assistant used as transformers' assisted-generation peer shares the target's tokenizer and works."""
    target = AutoModelForCausalLM.from_pretrained(os.path.join(ASSETS, "demo-target"), dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(os.path.join(ASSETS, "demo-assistant"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "demo-target"))
    tok_a = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "demo-assistant"))
    assert tok.get_vocab() == tok_a.get_vocab()
    assert assistant.config.vocab_size == target.config.vocab_size
    assert sum(p.numel() for p in assistant.parameters()) < sum(p.numel() for p in target.parameters()) / 5
    ids = tok("def parse(text):\n", return_tensors="pt").input_ids
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = target.generate(ids, assistant_model=assistant.eval(), max_new_tokens=16, do_sample=False)
    assert torch.equal(out, ref)

    from hf_specdec.bench.prompts import load_prompts

    prompts = load_prompts("demo")
    assert len(prompts) >= 24 and all(p.text and p.category == "code" for p in prompts)
    assert all(p.text.rstrip().split("\n")[-1].lstrip().startswith(("def ", "class ")) for p in prompts)


def test_demo_drafter_recipe_runs_end_to_end(tmp_path):
    """`hf-specdec demo --train`'s recipe: self-distillation on stdlib prompts, then EAGLE-3 training (tiny run)."""
    from hf_specdec.demo import load_demo_target, train_demo_drafter

    target, tok = load_demo_target()
    folder = train_demo_drafter(target, tok, str(tmp_path), max_steps=2, max_train_files=4, regen_tokens=8,
                                batch_size=2, draft_vocab_size=512)  # fmt: skip
    lines = (tmp_path / "regenerated.jsonl").read_text().splitlines()
    assert 1 <= len(lines) <= 4 and all(json.loads(line)["response"] for line in lines)  # <= 1 prompt per file
    drafter = AutoModelForDrafting.from_pretrained(folder)
    assert drafter.config.draft_vocab_size == 512 and drafter.config.num_draft_tokens == 5
    record = json.load(open(os.path.join(folder, "training_record.json")))
    assert record["steps"] == 2
    # `demo --train` run again retrains from scratch in the same folder (its earlier run is cleared, not refused)
    again = train_demo_drafter(target, tok, str(tmp_path), max_steps=3, max_train_files=4, regen_tokens=8,
                               batch_size=2, draft_vocab_size=512)  # fmt: skip
    assert json.load(open(os.path.join(again, "training_record.json")))["steps"] == 3
