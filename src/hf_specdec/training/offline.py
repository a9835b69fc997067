"""Offline target features: run the frozen target once, store what the drafter reads, train many times.

:func:`dump_features` writes, for every training example, the token ids, the loss mask, the target hidden states
named by the drafter's ``target_layer_ids`` and the target's final hidden state (from which target logits are
recomputed, see :func:`~hf_specdec.training.features.target_logits_from_last_hidden`) into sharded safetensors files
plus an ``index.json``. :class:`OfflineFeatureDataset` reads them back memory-mapped, and :func:`collate_offline`
batches them into the same layout as :class:`~hf_specdec.training.features.TargetFeatures`.

Layout of a dump directory::

    index.json                    # metadata + list of completed shards with their example ids
    features-00000.safetensors    # keys "{i}.input_ids" (int32), "{i}.loss_mask" (uint8),
    features-00001.safetensors    #      "{i}.layers" (num_layers, seq, hidden), "{i}.last_hidden" (seq, hidden)

Shards are streamed to disk (a shard is never held in memory as a whole) and published atomically, so a crash
loses at most the shard being written; ``resume=True`` continues from the completed shards.

The index records a fingerprint of the target (:func:`target_fingerprint`: a hash of its config, of its tokenizer's
vocabulary, and checksums of a few weight tensors). Training with features dumped from another target -- even one of
the same shape -- is refused (:meth:`OfflineFeatureDataset.check_target`), since the soft labels would be wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..configuration_utils import get_text_config
from .features import capture_target_features

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_NAME",
    "estimate_feature_bytes",
    "target_fingerprint",
    "record_target_fingerprint",
    "dump_features",
    "OfflineFeatureDataset",
    "collate_offline",
]

FORMAT_NAME = "hf_specdec.offline_features"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
_SHARD_PATTERN = "features-{:05d}.safetensors"

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}
_FEATURE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = _FEATURE_DTYPES.get(str(dtype).removeprefix("torch."))
    if resolved not in _FEATURE_DTYPES.values():
        raise ValueError(f"Unsupported feature dtype {dtype!r}; use one of {sorted(_FEATURE_DTYPES)}.")
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def estimate_feature_bytes(num_tokens: int, hidden_size: int, num_layers: int, dtype) -> int:
    """Bytes needed to store offline features for ``num_tokens`` tokens (excluding small file headers).

    Per token: ``num_layers`` selected hidden states plus the final hidden state, each ``hidden_size`` values of
    ``dtype``, plus the token id (int32) and the loss mask (uint8).

    Args:
        num_tokens: total number of tokens over all examples.
        hidden_size: the target's hidden size.
        num_layers: number of stored target layers (``len(layer_ids)``).
        dtype: feature dtype (``torch.bfloat16``, ``torch.float16``, ``torch.float32`` or their names).

    Returns:
        The estimated size in bytes.
    """
    itemsize = torch.empty((), dtype=_resolve_dtype(dtype)).element_size()
    per_token = (int(num_layers) + 1) * int(hidden_size) * itemsize + 4 + 1
    return int(num_tokens) * per_token


def _format_bytes(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.3g} MB"


def _as_long_list(value, name: str, i: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"Example {i}: {name} must be 1-D, got shape {tuple(value.shape)}.")
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def _normalize_example(example: dict, i: int) -> tuple[list[int], list[int]]:
    if "input_ids" not in example:
        raise ValueError(f"Example {i} has no 'input_ids'.")
    ids = _as_long_list(example["input_ids"], "input_ids", i)
    if not ids:
        raise ValueError(f"Example {i} has no tokens.")
    mask = example.get("loss_mask")
    mask = [1] * len(ids) if mask is None else _as_long_list(mask, "loss_mask", i)
    if len(mask) != len(ids):
        raise ValueError(f"Example {i}: loss_mask has {len(mask)} entries for {len(ids)} input_ids.")
    return ids, mask


def _atomic_write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Config keys that name a copy of the target or set runtime switches, not the function it computes.
_CONFIG_KEYS_IGNORED = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "architectures",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "attn_implementation",
    }
)
_FULL_HASH_ELEMENTS = 1 << 22  # weight tensors up to this size are hashed whole, larger ones on sampled rows
_SAMPLED_ROWS = 4096


def _config_for_hash(value):
    if isinstance(value, dict):
        return {
            str(k): _config_for_hash(v)
            for k, v in value.items()
            if not str(k).startswith("_") and str(k) not in _CONFIG_KEYS_IGNORED
        }
    if isinstance(value, (list, tuple)):
        return [_config_for_hash(v) for v in value]
    return value


def _config_hash(config) -> str:
    data = _config_for_hash(config.to_dict())
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _tokenizer_hash(tokenizer) -> str | None:
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    vocab = sorted((str(k), int(v)) for k, v in tokenizer.get_vocab().items())
    raw = json.dumps(vocab, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _tensor_checksum(weight) -> str | None:
    """sha256 of the tensor's bytes, taken in bfloat16 (so the same weights loaded in float32 or bfloat16 agree).

    Tensors over ``_FULL_HASH_ELEMENTS`` elements are hashed on ``_SAMPLED_ROWS`` evenly spaced rows (their shape is
    hashed too). Weights that are not materialised (meta device) or not floating point (quantised) give ``None``.
    """
    if not isinstance(weight, torch.Tensor) or weight.is_meta or not weight.is_floating_point():
        return None
    w = weight.detach()
    if w.dim() == 0:
        w = w.reshape(1)
    w = w.reshape(w.shape[0], -1)
    sampled = w.numel() > _FULL_HASH_ELEMENTS and w.shape[0] > _SAMPLED_ROWS
    if sampled:
        rows = torch.linspace(0, w.shape[0] - 1, _SAMPLED_ROWS, device=w.device).long()
        w = w.index_select(0, rows)
    data = w.to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.uint8)
    digest = hashlib.sha256()
    digest.update(json.dumps([list(weight.shape), sampled]).encode())
    digest.update(data.numpy().tobytes())
    return digest.hexdigest()


def _layer_weight(target: nn.Module):
    """The first matrix of the target's first decoder layer (the first 2-D parameter after the input embeddings)."""
    embeddings = target.get_input_embeddings()
    skip = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    output = target.get_output_embeddings()
    if output is not None:
        skip |= {id(p) for p in output.parameters()}
    for _name, param in target.named_parameters():
        if param.dim() == 2 and id(param) not in skip:
            return param
    return None


def target_fingerprint(target: nn.Module, tokenizer=None) -> dict:
    """A fingerprint of ``target`` that tells apart two targets of the same shape.

    Holds ``config_sha256`` (sha256 of the config as sorted JSON, without paths, the dtype and runtime switches),
    ``tokenizer_sha256`` (of the tokenizer's vocabulary; ``None`` without a tokenizer), ``weights_sha256``
    (checksums of the input embeddings, the LM head and the first decoder-layer matrix, see :func:`_tensor_checksum`)
    and, for messages only, ``name_or_path`` and ``dtype``.
    """
    head = target.get_output_embeddings()
    embeddings = target.get_input_embeddings()
    weights = {
        "embed_tokens": _tensor_checksum(getattr(embeddings, "weight", None)),
        "lm_head": _tensor_checksum(getattr(head, "weight", None)),
        "layer": _tensor_checksum(_layer_weight(target)),
    }
    try:
        dtype = _dtype_name(next(target.parameters()).dtype)
    except StopIteration:
        dtype = None
    return {
        "name_or_path": getattr(target.config, "_name_or_path", None) or None,
        "dtype": dtype,
        "config_sha256": _config_hash(target.config),
        "tokenizer_sha256": _tokenizer_hash(tokenizer),
        "weights_sha256": weights,
    }


def _fingerprint_mismatch(recorded: dict, current: dict) -> list[str]:
    """What differs between two fingerprints (components missing on either side are not compared)."""
    diffs = []
    if recorded.get("config_sha256") != current.get("config_sha256"):
        diffs.append("config")
    a, b = recorded.get("tokenizer_sha256"), current.get("tokenizer_sha256")
    if a is not None and b is not None and a != b:
        diffs.append("tokenizer vocabulary")
    ra, rb = recorded.get("weights_sha256") or {}, current.get("weights_sha256") or {}
    weights = [k for k in sorted(set(ra) & set(rb)) if ra[k] is not None and rb[k] is not None and ra[k] != rb[k]]
    if weights:
        diffs.append(f"weights ({', '.join(weights)})")
    return diffs


def _describe_target(fingerprint: dict | None) -> str:
    name = (fingerprint or {}).get("name_or_path")
    return repr(name) if name else "an unnamed in-memory target"


def record_target_fingerprint(path: str | os.PathLike, target: nn.Module, tokenizer=None) -> dict:
    """Stamps the fingerprint of ``target`` into the index of an existing dump that has none (an older dump).

    Only for dumps you know were made from ``target``: training then checks against it like a new dump. A dump that
    already has a fingerprint is left alone unless it matches (then nothing changes).

    Returns:
        The fingerprint written.

    Raises:
        ValueError: if ``path`` holds no dump, or its recorded fingerprint is of another target.
    """
    path = os.fspath(path)
    if os.path.basename(path) == INDEX_NAME:
        path = os.path.dirname(path) or "."
    index_path = os.path.join(path, INDEX_NAME)
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"No readable {INDEX_NAME} in {path!r}: {e}.") from e
    current = target_fingerprint(target, tokenizer)
    recorded = index.get("target_fingerprint")
    if recorded:
        diffs = _fingerprint_mismatch(recorded, current)
        if diffs:
            raise ValueError(
                f"The dump in {path!r} already records target {_describe_target(recorded)}, which differs from "
                f"{_describe_target(current)} in {', '.join(diffs)}; not overwriting it."
            )
        return recorded
    index["target_fingerprint"] = current
    _atomic_write_json(index_path, index)
    return current


class _ShardWriter:
    """Streams a safetensors file whose tensor names, dtypes and shapes are known up front.

    The header (offsets) is written first; tensors are then appended in exactly the declared order, so a shard is
    never materialised in memory. The file is written under a temporary name and published with ``os.replace``.
    """

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path = path
        self.tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{os.getpid()}")
        self.specs = specs
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                nbytes *= d
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.tmp, "wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        exp_name, exp_dtype, exp_shape = self.specs[self._next]
        if name != exp_name or tensor.dtype != exp_dtype or tuple(tensor.shape) != exp_shape:
            raise RuntimeError(
                f"Shard writer expected {exp_name} {exp_dtype} {exp_shape}, got {name} {tensor.dtype} "
                f"{tuple(tensor.shape)}."
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().tobytes())
        self._next += 1

    def commit(self) -> None:
        if self._next != len(self.specs):
            raise RuntimeError(f"Shard writer got {self._next} of {len(self.specs)} tensors.")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def _shard_readable(path: str) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception:
        return False
    return True


def _plan_shards(ids: list[int], lengths: list[int], shard_tokens: int) -> list[list[int]]:
    shards: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in ids:
        current.append(i)
        tokens += lengths[i]
        if tokens >= shard_tokens:
            shards.append(current)
            current, tokens = [], 0
    if current:
        shards.append(current)
    return shards


def _check_resumable(old: dict, metadata: dict, output_dir: str) -> None:
    """Refuses to resume the dump ``old`` (its ``index.json``) with other parameters or from another target; fills in
    this call's unknown tokenizer hash from the recorded one."""
    for key in ("layer_ids", "dtype"):
        if old.get(key) != metadata[key]:
            raise ValueError(
                f"Cannot resume the dump in {output_dir}: it has {key}={old.get(key)!r} but this call has "
                f"{key}={metadata[key]!r}. Use the same parameters, another output_dir, or resume=False."
            )
    recorded = old.get("target_fingerprint")
    diffs = (
        ["fingerprint (none recorded)"]
        if not recorded
        else _fingerprint_mismatch(recorded, metadata["target_fingerprint"])
    )
    if diffs and old.get("shards"):
        raise ValueError(
            f"Cannot resume the dump in {output_dir}: it was made from target "
            f"{_describe_target(recorded or {'name_or_path': old.get('target_name_or_path')})} "
            f"and this call uses {_describe_target(metadata['target_fingerprint'])}; they differ in "
            f"{', '.join(diffs)}. Dump the features again for this target (resume=False / --no-resume) or "
            "use another output_dir."
        )
    if metadata["target_fingerprint"]["tokenizer_sha256"] is None:
        metadata["target_fingerprint"]["tokenizer_sha256"] = (recorded or {}).get("tokenizer_sha256")


def dump_features(
    target: nn.Module,
    examples: Sequence[dict],
    layer_ids: list[int],
    output_dir: str | os.PathLike,
    dtype=torch.bfloat16,
    batch_size: int = 8,
    shard_tokens: int = 100_000,
    resume: bool = True,
    progress: bool = True,
    log: Callable[[str], Any] | None = print,
    tokenizer=None,
) -> dict:
    """Runs the frozen target over ``examples`` and writes the drafter's target features to ``output_dir``.

    Examples are processed shard by shard, in right-padded batches of ``batch_size`` (with an attention mask; within a
    shard, examples of similar length are batched together) through
    :func:`~hf_specdec.training.features.capture_target_features`; padding is stripped before writing. Examples are
    grouped into shards of at least ``shard_tokens`` tokens (the last one may be smaller); each shard is streamed to a
    temporary file and renamed into place, then ``index.json`` is rewritten atomically.

    Args:
        target: the frozen target causal LM.
        examples: a sequence of ``{"input_ids": list[int] | LongTensor, "loss_mask": list[int] | LongTensor}``;
            position ``i`` is the example id. A missing ``loss_mask`` means all ones.
        layer_ids: target hidden states to store (``output_hidden_states`` indices; the drafter's
            ``config.target_layer_ids``).
        output_dir: directory of the dump (created if needed).
        dtype: storage dtype of the features (``torch.bfloat16`` by default, also float16/float32).
        batch_size: examples per target forward pass.
        shard_tokens: minimum number of tokens per shard file.
        resume: continue or extend an existing dump in ``output_dir``: examples in its completed shards are skipped
            (their stored token ids and loss masks are checked against ``examples``), examples appended after them
            are dumped, so a grown data set's dump grows with it. With ``False``, an existing dump there is replaced.
        progress: show a tqdm progress bar (in tokens).
        log: callable receiving human-readable messages (the size estimate, resume status); ``None`` silences.
        tokenizer: the target's tokenizer, whose vocabulary hash goes into the target fingerprint (optional).

    Returns:
        The index dictionary (also written to ``output_dir/index.json``). Its ``target_fingerprint``
        (:func:`target_fingerprint`) lets training refuse features of another target.

    Raises:
        ValueError: on malformed examples or invalid layer ids, or when resuming a dump made with different
            ``layer_ids`` or ``dtype``, from fewer or other examples, or from another target (or one without a
            fingerprint).
    """
    log = log or (lambda _msg: None)
    dtype = _resolve_dtype(dtype)
    layer_ids = [int(i) for i in layer_ids]
    if batch_size < 1 or shard_tokens < 1:
        raise ValueError("batch_size and shard_tokens must be positive.")
    text_config, hidden_size = _check_layer_ids(target, layer_ids)
    output_dir = os.fspath(output_dir)
    normalized = [_normalize_example(ex, i) for i, ex in enumerate(examples)]
    lengths = [len(ids) for ids, _ in normalized]
    metadata = _dump_metadata(target, text_config, tokenizer, layer_ids, dtype, hidden_size, lengths)
    os.makedirs(output_dir, exist_ok=True)
    index_path = os.path.join(output_dir, INDEX_NAME)
    _remove_interrupted_writes(output_dir)
    completed = _completed_shards(output_dir, index_path, metadata, normalized, resume, log)
    done = {int(i) for shard in completed for i in shard["example_ids"]}
    todo = [i for i in range(len(normalized)) if i not in done]
    _log_plan(log, metadata, dtype, completed, done, todo, lengths)
    index = _write_index(index_path, metadata, completed)
    if not todo:
        return index
    used = {s["file"] for s in completed}
    total_tokens = metadata["total_tokens"]
    bar = _token_bar(total_tokens, total_tokens - sum(lengths[i] for i in todo)) if progress else None
    pad_id, device = _pad_id_and_device(target, text_config)
    shard_meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "layer_ids": json.dumps(layer_ids)}
    try:
        for shard_ids in _plan_shards(todo, lengths, shard_tokens):
            # Within a shard, examples of similar length share a batch (less padding); ids keep them apart.
            shard_ids = sorted(shard_ids, key=lambda i: lengths[i])
            file_name = _next_shard_name(used)
            specs = _shard_specs(shard_ids, lengths, layer_ids, dtype, hidden_size)
            writer = _ShardWriter(os.path.join(output_dir, file_name), specs, shard_meta)
            try:
                for start in range(0, len(shard_ids), batch_size):
                    batch = shard_ids[start : start + batch_size]
                    _write_batch(writer, target, batch, normalized, lengths, layer_ids, dtype, pad_id, device)
                    if bar is not None:
                        bar.update(sum(lengths[i] for i in batch))
                writer.commit()
            except BaseException:
                writer.abort()
                raise
            completed.append(
                {"file": file_name, "example_ids": sorted(shard_ids), "num_tokens": sum(lengths[i] for i in shard_ids)}
            )
            used.add(file_name)
            index = _write_index(index_path, metadata, completed)
    finally:
        if bar is not None:
            bar.close()
    on_disk = sum(os.path.getsize(os.path.join(output_dir, s["file"])) for s in index["shards"])
    log(f"Offline features written to {output_dir}: {len(index['shards'])} shards, {_format_bytes(on_disk)}.")
    return index


def _token_bar(total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="tok", desc="target features")


def _pad_id_and_device(target, text_config):
    pad_id = getattr(text_config, "pad_token_id", None)
    pad_id = 0 if pad_id is None or isinstance(pad_id, (list, tuple)) else int(pad_id)
    try:
        return pad_id, next(target.parameters()).device
    except StopIteration:
        return pad_id, torch.device("cpu")


def _check_layer_ids(target, layer_ids: list[int]):
    """``(text config, hidden size)`` of the target, after checking that ``layer_ids`` index its hidden states."""
    if not layer_ids:
        raise ValueError("layer_ids must name at least one target hidden state.")
    text_config = get_text_config(target.config)
    num_hidden_layers = getattr(text_config, "num_hidden_layers", None)
    if num_hidden_layers is not None:
        bad = [i for i in layer_ids if not 0 <= i <= num_hidden_layers]
        if bad:
            raise ValueError(
                f"layer_ids {bad} are out of range: ids index output_hidden_states (0..{num_hidden_layers})."
            )
    return text_config, int(text_config.hidden_size)


def _dump_metadata(target, text_config, tokenizer, layer_ids, dtype, hidden_size, lengths) -> dict:
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layer_ids": layer_ids,
        "dtype": _dtype_name(dtype),
        "hidden_size": hidden_size,
        "num_layers": len(layer_ids),
        "target_name_or_path": getattr(target.config, "_name_or_path", None) or None,
        "target_model_type": getattr(text_config, "model_type", None) or getattr(target.config, "model_type", None),
        "num_examples": len(lengths),
        "total_tokens": sum(lengths),
        "target_fingerprint": target_fingerprint(target, tokenizer),
    }


def _remove_interrupted_writes(output_dir: str) -> None:
    for name in os.listdir(output_dir):
        if (name.startswith(".features-") or name.startswith(f"{INDEX_NAME}.tmp-")) and ".tmp-" in name:
            os.remove(os.path.join(output_dir, name))


def _completed_shards(output_dir: str, index_path: str, metadata: dict, normalized, resume: bool, log) -> list[dict]:
    """The shards of an earlier dump to keep (``resume``: those that are complete and readable, after checking the
    dump was made the same way and its stored examples are this call's); without ``resume`` an earlier dump is
    removed."""
    if not os.path.exists(index_path):
        return []
    try:
        with open(index_path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        if resume:
            raise ValueError(f"Cannot resume: {index_path} is unreadable ({e}). Use resume=False.") from e
        old = {}
    if not resume:
        for shard in old.get("shards", []):
            path = os.path.join(output_dir, str(shard.get("file", "")))
            if os.path.isfile(path):
                os.remove(path)
        os.remove(index_path)
        return []
    _check_resumable(old, metadata, output_dir)
    _check_example_count(old, len(normalized), output_dir)
    completed = []
    for shard in old.get("shards", []):
        path = os.path.join(output_dir, shard["file"])
        if os.path.exists(path) and _shard_readable(path):
            _check_stored_examples(path, shard["example_ids"], normalized, output_dir)
            completed.append(shard)
        else:
            log(f"Shard {shard['file']} is missing or unreadable; its examples will be recomputed.")
    return completed


def _check_example_count(old: dict, count: int, output_dir: str) -> None:
    """A dump grows with more examples (the stored ones first); it does not shrink."""
    stored = old.get("num_examples")
    if isinstance(stored, int) and stored > count:
        raise ValueError(
            f"Cannot resume the dump in {output_dir}: it was made for num_examples={stored} but this call has "
            f"{count}. A dump is extended by examples appended after its own, not shrunk: use another output_dir "
            "or resume=False."
        )


def _check_stored_examples(path: str, example_ids, normalized: list, output_dir: str) -> None:
    """Refuses to keep a shard whose stored token ids or loss mask differ from this call's example of the same id
    (the examples changed or were reordered: features of other text would be served under their ids)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        for i in example_ids:
            ids, mask = normalized[int(i)] if int(i) < len(normalized) else (None, None)
            stored_ids = f.get_tensor(f"{i}.input_ids").tolist()
            stored_mask = f.get_tensor(f"{i}.loss_mask").tolist()
            if ids is None or stored_ids != list(ids) or stored_mask != list(mask):
                raise ValueError(
                    f"Cannot resume the dump in {output_dir}: example {i} differs from the one stored in "
                    f"{os.path.basename(path)} (the examples changed or were reordered). Keep the stored examples "
                    "first and unchanged to extend a dump, or use another output_dir or resume=False."
                )


def _log_plan(log, metadata: dict, dtype, completed, done, todo, lengths) -> None:
    hidden_size, layers = metadata["hidden_size"], metadata["num_layers"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    estimate = estimate_feature_bytes(metadata["total_tokens"], hidden_size, layers, dtype)
    log(
        f"Offline features: {metadata['num_examples']} examples, {metadata['total_tokens']} tokens, {layers} layers "
        f"+ last hidden x {hidden_size} x {_dtype_name(dtype)} ({itemsize} B): estimated disk size "
        f"{_format_bytes(estimate)}."
    )
    if done:
        left = estimate_feature_bytes(sum(lengths[i] for i in todo), hidden_size, layers, dtype)
        log(
            f"Resuming: {len(done)} examples in {len(completed)} completed shards; {len(todo)} examples "
            f"({_format_bytes(left)}) left."
        )


def _write_index(index_path: str, metadata: dict, completed: list[dict]) -> dict:
    shards = sorted(completed, key=lambda s: s["file"])
    stored = sum(len(s["example_ids"]) for s in shards)
    index = dict(metadata)
    index["complete"] = stored == metadata["num_examples"]
    index["stored_examples"] = stored
    index["stored_tokens"] = sum(int(s["num_tokens"]) for s in shards)
    index["shards"] = shards
    _atomic_write_json(index_path, index)
    return index


def _next_shard_name(used: set[str]) -> str:
    """The first ``features-NNNNN`` name after every used one's number that no shard uses."""
    number = 0
    for name in used:
        try:
            number = max(number, int(name.removeprefix("features-").split(".")[0]) + 1)
        except ValueError:
            pass
    while _SHARD_PATTERN.format(number) in used:
        number += 1
    return _SHARD_PATTERN.format(number)


def _shard_specs(shard_ids, lengths, layer_ids, dtype, hidden_size) -> list[tuple]:
    specs = []
    for i in shard_ids:
        n = lengths[i]
        specs += [
            (f"{i}.input_ids", torch.int32, (n,)),
            (f"{i}.loss_mask", torch.uint8, (n,)),
            (f"{i}.layers", dtype, (len(layer_ids), n, hidden_size)),
            (f"{i}.last_hidden", dtype, (n, hidden_size)),
        ]
    return specs


def _write_batch(writer, target, batch, normalized, lengths, layer_ids, dtype, pad_id, device) -> None:
    """One right-padded target pass over ``batch``; each example's features, without the padding, into the shard."""
    max_len = max(lengths[i] for i in batch)
    input_ids = torch.full((len(batch), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), max_len), dtype=torch.long)
    for row, i in enumerate(batch):
        input_ids[row, : lengths[i]] = torch.tensor(normalized[i][0], dtype=torch.long)
        attention_mask[row, : lengths[i]] = 1
    feats = capture_target_features(target, input_ids.to(device), attention_mask.to(device), layer_ids)
    for row, i in enumerate(batch):
        n = lengths[i]
        ids, mask = normalized[i]
        writer.write(f"{i}.input_ids", torch.tensor(ids, dtype=torch.int32))
        writer.write(f"{i}.loss_mask", torch.tensor(mask, dtype=torch.uint8))
        writer.write(f"{i}.layers", torch.stack([h[row, :n] for h in feats.hidden_states]).to(dtype))
        writer.write(f"{i}.last_hidden", feats.last_hidden[row, :n].to(dtype))


class OfflineFeatureDataset(torch.utils.data.Dataset):
    """Memory-mapped reader of a :func:`dump_features` directory.

    Shard files are validated at construction (each must open with ``safetensors.safe_open`` and hold its listed
    examples) and then opened lazily, once per process, so the dataset can be used with ``DataLoader`` workers.

    Items are ``{"input_ids": LongTensor (seq,), "loss_mask": LongTensor (seq,), "index": int,
    "target_hidden_states": (num_layers, seq, hidden), "target_last_hidden": (seq, hidden)}`` with features in the
    stored dtype; ``index`` is the example id given to :func:`dump_features` (equal to the item position for a
    complete dump).

    Args:
        path: the dump directory (or its ``index.json``).
        allow_incomplete: accept a dump whose run did not finish (only the stored examples are served).

    Raises:
        ValueError: if ``index.json`` is missing or corrupt, a shard is missing, truncated or lacks examples, or the
            dump is incomplete and ``allow_incomplete`` is False.
    """

    def __init__(self, path: str | os.PathLike, allow_incomplete: bool = False):
        from safetensors import safe_open

        path = os.fspath(path)
        if os.path.basename(path) == INDEX_NAME and os.path.isfile(path):
            path = os.path.dirname(path) or "."
        self.path = path
        index_path = os.path.join(path, INDEX_NAME)
        if not os.path.isfile(index_path):
            raise ValueError(f"No {INDEX_NAME} in {path!r}: not an offline feature dump (run dump_features first).")
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"Corrupt {index_path}: {e}. Re-run dump_features.") from e
        required = ("layer_ids", "dtype", "hidden_size", "num_examples", "shards")
        if not isinstance(index, dict) or any(k not in index for k in required):
            raise ValueError(f"Corrupt {index_path}: expected keys {list(required)}. Re-run dump_features.")
        if index.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
            raise ValueError(
                f"{index_path} has format version {index['format_version']}, newer than this hf_specdec supports "
                f"({FORMAT_VERSION})."
            )
        self._index = index
        self._dtype = _resolve_dtype(index["dtype"])
        self._files: list[str] = []
        locations: dict[int, int] = {}
        for shard in index["shards"]:
            file_path = os.path.join(path, shard["file"])
            if not os.path.isfile(file_path):
                raise ValueError(f"Shard {file_path} listed in {INDEX_NAME} is missing; re-run dump_features.")
            try:
                with safe_open(file_path, framework="pt") as f:
                    keys = set(f.keys())
            except Exception as e:
                raise ValueError(
                    f"Shard {file_path} is corrupt or truncated ({e}); delete it and re-run dump_features "
                    "with resume=True."
                ) from e
            shard_no = len(self._files)
            self._files.append(file_path)
            for i in shard["example_ids"]:
                i = int(i)
                missing = [k for k in ("input_ids", "loss_mask", "layers", "last_hidden") if f"{i}.{k}" not in keys]
                if missing:
                    raise ValueError(f"Shard {file_path} lacks tensors {missing} of example {i}; re-run dump_features.")
                locations[i] = shard_no
        self._ids = sorted(locations)
        self._location = locations
        if len(self._ids) != int(index["num_examples"]) and not allow_incomplete:
            raise ValueError(
                f"The dump in {path!r} is incomplete ({len(self._ids)} of {index['num_examples']} examples); "
                "finish it with dump_features(..., resume=True) or pass allow_incomplete=True."
            )
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()
        self._select: list[int | None] | None = None  # served layers: stored row, or None for the last hidden

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    @property
    def layer_ids(self) -> list[int]:
        """The target layer ids the features were dumped with."""
        return list(self._index["layer_ids"])

    @property
    def metadata(self) -> dict:
        """The index metadata (everything in ``index.json`` except the shard list)."""
        return {k: v for k, v in self._index.items() if k != "shards"}

    @property
    def example_ids(self) -> list[int]:
        """The stored example ids, in item order."""
        return list(self._ids)

    def _handle(self, shard_no: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked DataLoader worker: do not share mmaps opened by the parent
            self._handles = {}
            self._pid = os.getpid()
        handle = self._handles.get(shard_no)
        if handle is None:
            handle = safe_open(self._files[shard_no], framework="pt")
            self._handles[shard_no] = handle
        return handle

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: int) -> dict:
        if not -len(self._ids) <= i < len(self._ids):
            raise IndexError(f"Index {i} out of range for {len(self._ids)} examples.")
        example_id = self._ids[i]
        f = self._handle(self._location[example_id])
        layers = f.get_tensor(f"{example_id}.layers")
        last = f.get_tensor(f"{example_id}.last_hidden")
        if self._select is not None:
            layers = torch.stack([last if row is None else layers[row] for row in self._select])
        return {
            "input_ids": f.get_tensor(f"{example_id}.input_ids").long(),
            "loss_mask": f.get_tensor(f"{example_id}.loss_mask").long(),
            "index": example_id,
            "target_hidden_states": layers,
            "target_last_hidden": last,
        }

    @property
    def target_fingerprint(self) -> dict | None:
        """The fingerprint of the target the features were dumped from (``None`` for older dumps without one)."""
        return self._index.get("target_fingerprint")

    def check_target(self, target: nn.Module, tokenizer=None) -> None:
        """Checks that these features were dumped from ``target`` (see :func:`target_fingerprint`).

        The config hash and the weight checksums must match; the tokenizer hash too when both sides know one.
        A dump without a fingerprint (made before fingerprints were recorded) is refused as well: nothing shows which
        target it came from, and features of another target of the same shape silently give wrong soft labels.
        If you know it was made from ``target``, stamp it with :func:`record_target_fingerprint`, or dump again.

        Raises:
            ValueError: naming both targets, if the fingerprints differ or the dump has none.
        """
        current = target_fingerprint(target, tokenizer)
        recorded = self.target_fingerprint
        if not recorded:
            raise ValueError(
                f"Offline features in {self.path!r} record no target fingerprint (dumped by an older hf_specdec, "
                f"target {self._index.get('target_name_or_path')!r}), so they cannot be checked against the training "
                f"target {_describe_target(current)}. Dump the features again for this target (hf-specdec "
                "dump-features --no-resume), or, if you know they come from this very target, stamp them with "
                "hf_specdec.training.offline.record_target_fingerprint(path, target, tokenizer)."
            )
        diffs = _fingerprint_mismatch(recorded, current)
        if diffs:
            raise ValueError(
                f"Offline features in {self.path!r} were dumped from target {_describe_target(recorded)}, but "
                f"training uses target {_describe_target(current)}; they differ in {', '.join(diffs)}, so the soft "
                "labels would be wrong. Dump the features again for this target (hf-specdec dump-features "
                "--target <this target> --no-resume), or train with the target they were dumped from."
            )

    def check_compatible(self, drafter_config) -> None:
        """Checks that these features fit ``drafter_config`` and serves the drafter's layers, in its order.

        A dump may hold more layers than one drafter reads (the union of several families' layers, dumped once): the
        items then carry only ``drafter_config.target_layer_ids``. The target's final state
        (``output_hidden_states[L]``, ``L = target_num_hidden_layers``) is always served, from the stored last
        hidden state.

        Raises:
            ValueError: if a layer the drafter reads is not in the dump, or ``target_hidden_size`` disagrees.
        """
        wanted = getattr(drafter_config, "target_layer_ids", None)
        wanted = None if wanted is None else [int(i) for i in wanted]
        top = getattr(drafter_config, "target_num_hidden_layers", None)
        stored = self.layer_ids
        missing = [i for i in (wanted or []) if i not in stored and i != top]
        if wanted is None or missing:
            raise ValueError(
                f"Offline features in {self.path!r} hold target layers {stored} (and the final state), but the "
                f"drafter reads target_layer_ids={wanted}. Re-dump the features with the drafter's layer ids, or with "
                "the union of the layers of every drafter you train (dump_features(..., layer_ids=...))."
            )
        hidden = getattr(drafter_config, "target_hidden_size", None)
        if hidden is not None and int(hidden) != int(self._index["hidden_size"]):
            raise ValueError(
                f"Offline features in {self.path!r} have hidden size {self._index['hidden_size']}, but the drafter "
                f"expects target_hidden_size={hidden}: they come from another target. Re-dump the features with "
                "the drafter's target and layer ids."
            )
        self._select = None if wanted == stored else [stored.index(i) if i in stored else None for i in wanted]


def collate_offline(items: Sequence[dict], pad_token_id: int) -> dict:
    """Right-pads :class:`OfflineFeatureDataset` items into a batch.

    Args:
        items: dataset items.
        pad_token_id: id written in padded ``input_ids`` positions.

    Returns:
        ``{"input_ids", "attention_mask", "loss_mask"}`` ``(batch, seq)`` LongTensors, ``"index"`` ``(batch,)``,
        ``"target_hidden_states"``: a list with one ``(batch, seq, hidden)`` tensor per stored layer (as
        :attr:`TargetFeatures.hidden_states`), and ``"target_last_hidden"`` ``(batch, seq, hidden)``; padded feature
        positions are zero.
    """
    if not items:
        raise ValueError("collate_offline needs at least one item.")
    batch = len(items)
    max_len = max(int(it["input_ids"].shape[0]) for it in items)
    first = items[0]["target_hidden_states"]
    num_layers, hidden = first.shape[0], first.shape[-1]
    input_ids = torch.full((batch, max_len), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)
    loss_mask = torch.zeros((batch, max_len), dtype=torch.long)
    layers = torch.zeros((num_layers, batch, max_len, hidden), dtype=first.dtype)
    last = torch.zeros((batch, max_len, hidden), dtype=items[0]["target_last_hidden"].dtype)
    for row, it in enumerate(items):
        n = int(it["input_ids"].shape[0])
        input_ids[row, :n] = it["input_ids"]
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = it["loss_mask"]
        layers[:, row, :n] = it["target_hidden_states"]
        last[row, :n] = it["target_last_hidden"]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
        "target_hidden_states": list(layers.unbind(0)),
        "target_last_hidden": last,
    }
