"""Offline target features: dump, resume, read back, collate."""

import json
import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from hf_specdec.models.eagle3.configuration_eagle3 import Eagle3Config
from hf_specdec.testing import tiny_target
from hf_specdec.training.features import capture_target_features
from hf_specdec.training.offline import (
    OfflineFeatureDataset,
    collate_offline,
    dump_features,
    estimate_feature_bytes,
)

LAYERS = [1, 2, 4]
HIDDEN = 32


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=0, vocab=96, layers=4)


def make_examples(lengths, seed=0, tensors=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(6, 96, (n,), generator=g)
        mask = (torch.rand(n, generator=g) > 0.3).long()
        out.append({"input_ids": ids if tensors else ids.tolist(), "loss_mask": mask if tensors else mask.tolist()})
    return out


LENGTHS = [5, 12, 3, 9, 7, 11, 4, 8]


def reference_batch(target, examples, batch, layer_ids):
    """Features of ``examples[batch]`` computed exactly as dump_features batches them (right padding + mask)."""
    width = max(len(examples[i]["input_ids"]) for i in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, i in enumerate(batch):
        n = len(examples[i]["input_ids"])
        ids[row, :n] = torch.as_tensor(examples[i]["input_ids"])
        mask[row, :n] = 1
    return capture_target_features(target, ids, mask, layer_ids)


def shard_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


class ForwardCounter:
    def __init__(self, model, fail_at=None):
        self.calls = 0
        self.fail_at = fail_at
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("simulated crash")

    def remove(self):
        self.handle.remove()


@pytest.mark.parametrize("tensors", [False, True])
def test_dump_float32_equals_capture_exactly(target, tmp_path, tensors):
    examples = make_examples(LENGTHS, tensors=tensors)
    index = dump_features(
        target, examples, LAYERS, tmp_path, dtype=torch.float32, batch_size=3, progress=False, log=None
    )
    assert index["num_examples"] == len(LENGTHS) and index["total_tokens"] == sum(LENGTHS)
    assert index["layer_ids"] == LAYERS and index["dtype"] == "float32" and index["hidden_size"] == HIDDEN
    assert index["target_model_type"] == "llama" and index["format_version"] == 1 and index["complete"]
    assert "target_name_or_path" in index
    assert len(index["shards"]) == 1 and index["shards"][0]["example_ids"] == list(range(len(LENGTHS)))

    ds = OfflineFeatureDataset(tmp_path)
    assert len(ds) == len(LENGTHS) and ds.layer_ids == LAYERS
    assert ds.metadata["total_tokens"] == sum(LENGTHS) and "shards" not in ds.metadata
    by_length = sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i])  # a shard batches similar lengths together
    for start in range(0, len(LENGTHS), 3):
        batch = by_length[start : start + 3]
        ref = reference_batch(target, examples, batch, LAYERS)
        for row, i in enumerate(batch):
            n = LENGTHS[i]
            item = ds[i]
            assert item["index"] == i
            assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long
            assert item["input_ids"].tolist() == list(torch.as_tensor(examples[i]["input_ids"]).tolist())
            assert item["loss_mask"].tolist() == list(torch.as_tensor(examples[i]["loss_mask"]).tolist())
            assert item["target_hidden_states"].shape == (len(LAYERS), n, HIDDEN)
            assert item["target_hidden_states"].dtype == torch.float32
            expected = torch.stack([h[row, :n] for h in ref.hidden_states])
            assert torch.equal(item["target_hidden_states"], expected)
            assert torch.equal(item["target_last_hidden"], ref.last_hidden[row, :n])


def test_dump_bf16_multi_shard_matches_unbatched(target, tmp_path):
    examples = make_examples(LENGTHS, seed=1)
    index = dump_features(target, examples, LAYERS, tmp_path, batch_size=2, shard_tokens=20, progress=False, log=None)
    assert index["dtype"] == "bfloat16" and len(index["shards"]) > 1
    assert sorted(i for s in index["shards"] for i in s["example_ids"]) == list(range(len(LENGTHS)))
    ds = OfflineFeatureDataset(tmp_path)
    for i, ex in enumerate(examples):
        ids = torch.tensor([ex["input_ids"]])
        ref = capture_target_features(target, ids, torch.ones_like(ids), LAYERS)
        item = ds[i]
        assert item["target_hidden_states"].dtype == torch.bfloat16
        assert item["target_last_hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(
            item["target_hidden_states"].float(), torch.cat(ref.hidden_states).float(), rtol=1.6e-2, atol=1e-2
        )
        torch.testing.assert_close(item["target_last_hidden"].float(), ref.last_hidden[0], rtol=1.6e-2, atol=1e-2)


def test_estimate_logged_and_close_to_disk(target, tmp_path):
    assert estimate_feature_bytes(10, 32, 3, torch.bfloat16) == 10 * (4 * 32 * 2 + 4 + 1)
    assert estimate_feature_bytes(10, 32, 3, "float32") == 10 * (4 * 32 * 4 + 5)
    messages = []
    examples = make_examples([40, 60, 30, 50])
    index = dump_features(target, examples, LAYERS, tmp_path, shard_tokens=100, progress=False, log=messages.append)
    estimate = estimate_feature_bytes(180, HIDDEN, len(LAYERS), torch.bfloat16)
    first = messages[0]
    assert "estimated disk size" in first and "MB" in first
    assert f"{estimate / 1e6:.3g} MB" in first
    on_disk = sum(os.path.getsize(tmp_path / s["file"]) for s in index["shards"])
    assert estimate / 2 <= on_disk <= estimate * 2


def test_resume_recreates_only_deleted_last_shard(target, tmp_path):
    examples = make_examples(LENGTHS, seed=2)
    index = dump_features(target, examples, LAYERS, tmp_path, batch_size=2, shard_tokens=15, progress=False, log=None)
    files = shard_files(tmp_path)
    assert files == [s["file"] for s in index["shards"]] and len(files) >= 3
    last = files[-1]
    original = (tmp_path / last).read_bytes()
    mtimes = {f: os.stat(tmp_path / f).st_mtime_ns for f in files}
    (tmp_path / last).unlink()

    counter = ForwardCounter(target)
    try:
        index2 = dump_features(
            target, examples, LAYERS, tmp_path, batch_size=2, shard_tokens=15, progress=False, log=None
        )
    finally:
        counter.remove()
    last_ids = index["shards"][-1]["example_ids"]
    assert counter.calls == (len(last_ids) + 1) // 2  # only the batches of the lost shard
    assert shard_files(tmp_path) == files
    for f in files[:-1]:
        assert os.stat(tmp_path / f).st_mtime_ns == mtimes[f]
    assert (tmp_path / last).read_bytes() == original
    assert index2["shards"] == index["shards"] and index2["complete"]

    counter = ForwardCounter(target)
    try:
        dump_features(target, examples, LAYERS, tmp_path, batch_size=2, shard_tokens=15, progress=False, log=None)
    finally:
        counter.remove()
    assert counter.calls == 0


def test_crash_mid_shard_loses_only_that_shard(target, tmp_path):
    examples = make_examples(LENGTHS, seed=3)
    kwargs = dict(batch_size=2, shard_tokens=15, progress=False, log=None)
    reference = dump_features(target, examples, LAYERS, tmp_path / "ref", **kwargs)
    counter = ForwardCounter(target, fail_at=4)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):
            dump_features(target, examples, LAYERS, tmp_path / "run", **kwargs)
    finally:
        counter.remove()
    assert not [f for f in os.listdir(tmp_path / "run") if ".tmp-" in f]
    with pytest.raises(ValueError, match="incomplete"):
        OfflineFeatureDataset(tmp_path / "run")
    partial = OfflineFeatureDataset(tmp_path / "run", allow_incomplete=True)
    assert 0 < len(partial) < len(LENGTHS)

    index = dump_features(target, examples, LAYERS, tmp_path / "run", **kwargs)
    assert index["complete"] and index["shards"] == reference["shards"]
    for s in index["shards"]:
        assert (tmp_path / "run" / s["file"]).read_bytes() == (tmp_path / "ref" / s["file"]).read_bytes()


def test_resume_mismatch_raises(target, tmp_path):
    examples = make_examples(LENGTHS[:4])
    kwargs = dict(progress=False, log=None)
    dump_features(target, examples, LAYERS, tmp_path, **kwargs)
    with pytest.raises(ValueError, match="layer_ids"):
        dump_features(target, examples, [1, 2], tmp_path, **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        dump_features(target, examples, LAYERS, tmp_path, dtype=torch.float32, **kwargs)
    with pytest.raises(ValueError, match="num_examples=4 but this call has 3"):
        dump_features(target, examples[:3], LAYERS, tmp_path, **kwargs)
    # resume=False replaces the dump.
    index = dump_features(target, examples[:3], [1, 2], tmp_path, dtype=torch.float32, resume=False, **kwargs)
    assert index["num_examples"] == 3 and index["layer_ids"] == [1, 2]
    assert OfflineFeatureDataset(tmp_path).layer_ids == [1, 2]


def test_a_dump_grows_with_its_examples_and_only_the_new_ones_are_run(target, tmp_path):
    examples = make_examples(LENGTHS)
    kwargs = dict(dtype=torch.float32, batch_size=2, shard_tokens=15, progress=False, log=None)
    first = dump_features(target, examples[:5], LAYERS, tmp_path / "grown", **kwargs)
    counter = ForwardCounter(target)
    try:
        grown = dump_features(target, examples, LAYERS, tmp_path / "grown", **kwargs)
    finally:
        counter.remove()
    assert counter.calls == 2  # examples 5, 6, 7 in batches of two; the first five are not run again
    assert grown["complete"] and grown["num_examples"] == len(LENGTHS)
    assert grown["shards"][: len(first["shards"])] == first["shards"]
    dump_features(target, examples, LAYERS, tmp_path / "fresh", **kwargs)
    served, fresh = OfflineFeatureDataset(tmp_path / "grown"), OfflineFeatureDataset(tmp_path / "fresh")
    assert served.example_ids == fresh.example_ids == list(range(len(LENGTHS)))
    for a, b in zip(served, fresh):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        torch.testing.assert_close(a["target_hidden_states"], b["target_hidden_states"])


@pytest.mark.parametrize("change", ["input_ids", "loss_mask", "order"])
def test_resuming_with_changed_examples_is_refused_and_keeps_the_dump(target, tmp_path, change):
    examples = make_examples(LENGTHS[:4])
    kwargs = dict(progress=False, log=None)
    index = dump_features(target, examples, LAYERS, tmp_path, **kwargs)
    files = {f: (tmp_path / f).read_bytes() for f in shard_files(tmp_path)}
    changed = [dict(e) for e in examples] + make_examples([6], seed=9)
    if change == "order":
        changed[0], changed[1] = changed[1], changed[0]
    else:
        changed[2][change] = list(changed[2][change])
        changed[2][change][0] = 5 if change == "input_ids" else 1 - changed[2][change][0]
    with pytest.raises(ValueError, match="differs from the one stored"):
        dump_features(target, changed, LAYERS, tmp_path, **kwargs)
    assert {f: (tmp_path / f).read_bytes() for f in shard_files(tmp_path)} == files
    assert OfflineFeatureDataset(tmp_path).example_ids == sorted(i for s in index["shards"] for i in s["example_ids"])


def test_a_dump_whose_index_lost_its_count_still_refuses_fewer_examples(target, tmp_path):
    examples = make_examples(LENGTHS[:4])
    dump_features(target, examples, LAYERS, tmp_path, progress=False, log=None)
    index = json.loads((tmp_path / "index.json").read_text())
    del index["num_examples"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="example 3 differs from the one stored"):
        dump_features(target, examples[:3], LAYERS, tmp_path, progress=False, log=None)


def test_invalid_examples_and_layers(target, tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        dump_features(target, make_examples([3]), [5], tmp_path, progress=False, log=None)
    with pytest.raises(ValueError, match="loss_mask"):
        dump_features(target, [{"input_ids": [7, 8], "loss_mask": [1]}], LAYERS, tmp_path, progress=False, log=None)
    with pytest.raises(ValueError, match="no tokens"):
        dump_features(target, [{"input_ids": [], "loss_mask": []}], LAYERS, tmp_path, progress=False, log=None)


def test_missing_corrupt_index_and_shards(target, tmp_path):
    with pytest.raises(ValueError, match="No index.json"):
        OfflineFeatureDataset(tmp_path)
    index = dump_features(
        target, make_examples(LENGTHS[:4]), LAYERS, tmp_path, shard_tokens=10, progress=False, log=None
    )
    OfflineFeatureDataset(tmp_path)  # fine
    OfflineFeatureDataset(tmp_path / "index.json")  # the index path works too

    shard = tmp_path / index["shards"][-1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        OfflineFeatureDataset(tmp_path)
    shard.unlink()
    with pytest.raises(ValueError, match="missing"):
        OfflineFeatureDataset(tmp_path)
    shard.write_bytes(data)
    OfflineFeatureDataset(tmp_path)

    index_text = (tmp_path / "index.json").read_text()
    (tmp_path / "index.json").write_text(index_text[: len(index_text) // 2])
    with pytest.raises(ValueError, match="Corrupt"):
        OfflineFeatureDataset(tmp_path)
    (tmp_path / "index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="Corrupt"):
        OfflineFeatureDataset(tmp_path)


def test_resume_recomputes_truncated_shard(target, tmp_path):
    examples = make_examples(LENGTHS[:4])
    kwargs = dict(shard_tokens=10, progress=False, log=None)
    index = dump_features(target, examples, LAYERS, tmp_path, **kwargs)
    shard = tmp_path / index["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    messages = []
    dump_features(target, examples, LAYERS, tmp_path, **{**kwargs, "log": messages.append})
    assert any("missing or unreadable" in m for m in messages)
    ds = OfflineFeatureDataset(tmp_path)
    assert len(ds) == 4


def test_collate_pads(target, tmp_path):
    examples = make_examples([4, 9, 6])
    dump_features(target, examples, LAYERS, tmp_path, progress=False, log=None)
    ds = OfflineFeatureDataset(tmp_path)
    items = [ds[0], ds[1], ds[2]]
    batch = collate_offline(items, pad_token_id=77)
    assert batch["input_ids"].shape == (3, 9) and batch["input_ids"].dtype == torch.long
    assert batch["index"].tolist() == [0, 1, 2]
    assert isinstance(batch["target_hidden_states"], list) and len(batch["target_hidden_states"]) == len(LAYERS)
    assert batch["target_last_hidden"].shape == (3, 9, HIDDEN)
    for layer in batch["target_hidden_states"]:
        assert layer.shape == (3, 9, HIDDEN) and layer.dtype == torch.bfloat16
    for row, item in enumerate(items):
        n = item["input_ids"].shape[0]
        assert torch.equal(batch["input_ids"][row, :n], item["input_ids"])
        assert (batch["input_ids"][row, n:] == 77).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (9 - n)
        assert torch.equal(batch["loss_mask"][row, :n], item["loss_mask"])
        assert (batch["loss_mask"][row, n:] == 0).all()
        for k, layer in enumerate(batch["target_hidden_states"]):
            assert torch.equal(layer[row, :n], item["target_hidden_states"][k])
            assert (layer[row, n:] == 0).all()
        assert torch.equal(batch["target_last_hidden"][row, :n], item["target_last_hidden"])
        assert (batch["target_last_hidden"][row, n:] == 0).all()

    # Works with a DataLoader, and the dataset pickles (for worker processes) after its shards were opened.
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=lambda b: collate_offline(b, 0))
    assert [b["input_ids"].shape[0] for b in loader] == [2, 1]
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[1]["target_last_hidden"], ds[1]["target_last_hidden"])


def test_check_compatible(target, tmp_path):
    config = Eagle3Config.for_target(target.config)
    dump_features(target, make_examples([5, 6]), config.target_layer_ids, tmp_path, progress=False, log=None)
    ds = OfflineFeatureDataset(tmp_path)
    ds.check_compatible(config)
    other = Eagle3Config.for_target(target.config, target_layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="Re-dump"):
        ds.check_compatible(other)
    wrong_hidden = SimpleNamespace(target_layer_ids=list(config.target_layer_ids), target_hidden_size=64)
    with pytest.raises(ValueError, match="hidden size"):
        ds.check_compatible(wrong_hidden)


def test_one_dump_of_the_union_of_layers_serves_every_drafter(target, tmp_path):
    """Features dumped once for several families: each drafter gets its own layers, in its order, and the target's
    final state (output_hidden_states[L]) comes from the stored last hidden state."""
    from hf_specdec import MedusaConfig

    eagle = Eagle3Config.for_target(target.config)
    medusa = MedusaConfig.for_target(target.config)
    top = target.config.num_hidden_layers
    assert medusa.target_layer_ids == [top] and top not in eagle.target_layer_ids
    union = sorted(set(eagle.target_layer_ids) | {1})
    dump_features(target, make_examples([5, 6]), union, tmp_path, progress=False, log=None)
    full = OfflineFeatureDataset(tmp_path)
    raw = full[0]["target_hidden_states"]
    for config in (eagle, medusa):
        ds = OfflineFeatureDataset(tmp_path)
        ds.check_compatible(config)
        item = ds[0]
        want = [item["target_last_hidden"] if i == top else raw[union.index(i)] for i in config.target_layer_ids]
        assert torch.equal(item["target_hidden_states"], torch.stack(want))
    with torch.no_grad():  # and they are the target's own states
        ids = full[0]["input_ids"][None]
        hs = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(full[0]["target_last_hidden"].float(), hs[top][0].float(), rtol=1e-2, atol=1e-2)
    missing = MedusaConfig.for_target(target.config, target_layer_ids=[3])
    with pytest.raises(ValueError, match="union"):
        OfflineFeatureDataset(tmp_path).check_compatible(missing)


def test_the_trainer_serves_a_drafter_its_own_layers_from_a_dump_handed_to_it(target, tmp_path):
    """A dump handed to DrafterTrainer directly (a scoring script does so) is read with the drafter's layers, in its
    order, subsets included: before, a drafter of other layers was fed the layers the dump stores, without an error."""
    from hf_specdec import Eagle3ForDrafting
    from hf_specdec.training.trainer import DrafterTrainer, DrafterTrainingArguments

    stored, top = [1, 2, 3], target.config.num_hidden_layers
    dump_features(target, make_examples([5, 6, 7]), stored, tmp_path / "dump", progress=False, log=None)
    raw = OfflineFeatureDataset(tmp_path / "dump")[0]

    def trainer_over(layer_ids, dataset):
        drafter = Eagle3ForDrafting(Eagle3Config.for_target(target.config, target_layer_ids=layer_ids))
        targs = DrafterTrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none")
        subset = torch.utils.data.Subset(torch.utils.data.Subset(dataset, [0, 1, 2]), [0, 1])
        return DrafterTrainer(drafter, target, targs, subset, dataset, collate_fn=lambda b: collate_offline(b, 0))

    dataset = OfflineFeatureDataset(tmp_path / "dump")
    trainer_over([top, 1], dataset)
    assert torch.equal(
        dataset[0]["target_hidden_states"], torch.stack([raw["target_last_hidden"], raw["target_hidden_states"][0]])
    )
    with pytest.raises(ValueError, match="union"):
        trainer_over([0, 2], OfflineFeatureDataset(tmp_path / "dump"))
