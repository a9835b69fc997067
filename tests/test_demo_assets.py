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
    drafter = AutoModelForDrafting.from_pretrained(os.path.join(ASSETS, "demo-eagle3")).eval()
    assert isinstance(drafter, Eagle3ForDrafting)
    assert os.path.getsize(os.path.join(ASSETS, "demo-target", "model.safetensors")) <= 64 * 2**20
    assert os.path.getsize(os.path.join(ASSETS, "demo-eagle3", "model.safetensors")) <= 16 * 2**20
    prompt = "import os\n\n\ndef read_config(path):\n    with open(path) as fh:\n"
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=24, do_sample=False)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=drafter, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, ref)
    assert out.mean_accepted_length > 1.5  # the trained drafter is accepted
    record = json.load(open(os.path.join(ASSETS, "demo-eagle3", "training_record.json")))
    assert record["family"] == "eagle3_drafter" and record["steps"] > 0
