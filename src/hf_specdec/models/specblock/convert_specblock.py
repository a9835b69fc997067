"""The SpecBlock reference implementation's checkpoint layout (import / export), registered with
:mod:`hf_specdec.convert`.

``specblock-reference`` (shiweijiezero/SpecBlock, its SpecForge-based training and its inference model): a
``LlamaConfig`` ``config.json`` with ``diffspec_draft_token_num`` (``K``, 7 when absent), ``draft_vocab_size``,
``rank_classes`` (4), ``target_hidden_size`` and the draft layers' fields; weights ``input_layer.{condition_proj,
condition_norm, embed_tokens, token_norm, position_queries, query_norm, fuse}``, Llama decoder ``layers.{i}.*``,
``shift_proj.{i}`` (the layer-wise shift; absent in the model without it), ``norm``, ``lm_head``, the rank head
``rank_head.{0,2}`` (``H + 15 -> 256 -> 4``, no biases) and ``d2t`` / ``t2d``.

The reference reads the target states ``output_hidden_states[2], [L // 2], [L - 3]`` (EAGLE-3's layers, hard-coded),
keeps all ``K`` slots of every verified position in its draft cache (hence ``context_slots="all"`` on import; an
export needs a drafter trained that way), applies RoPE scaling of type ``llama3`` only (other types run unscaled there,
so they are dropped on import, and refused on export), and its ``input_layer.embed_tokens`` is a copy of the target's
(dropped on import; written on export when the target is known). A drafter without the shift exports identity shifts
(``W_s = [I 0]``, the same forward), since the reference serves the model with it.
"""

from __future__ import annotations

import torch

from ...configuration_utils import decoder_layer_fields
from ...convert import Layout, register_layout, write_checkpoint
from .configuration_specblock import SpecBlockConfig
from .modeling_specblock import SpecBlockForDrafting

__all__ = ["load_specblock_reference", "save_specblock_reference"]

_INPUT = {
    "input_layer.condition_proj.weight": "fc.weight",
    "input_layer.condition_norm.weight": "cond_norm.weight",
    "input_layer.token_norm.weight": "embed_norm.weight",
    "input_layer.position_queries.weight": "position_queries.weight",
    "input_layer.query_norm.weight": "query_norm.weight",
    "input_layer.fuse.weight": "fuse.weight",
}
_RANK_HEAD_SIZE = 256  # hard-coded in the reference


def _detect(config: dict, keys: set) -> bool:
    arch = " ".join(config.get("architectures") or [])
    return "input_layer.position_queries.weight" in keys or (
        "SpecBlock" in arch and "diffspec_draft_token_num" in config
    )


def _rope(config: dict) -> dict:
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    kind = (rope or {}).get("rope_type", (rope or {}).get("type"))
    out = dict(config)
    out.pop("rope_parameters", None)
    out["rope_scaling"] = rope if kind == "llama3" else None  # the reference runs every other type unscaled
    return out


def load_specblock_reference(config: dict, state: dict, target: dict) -> SpecBlockForDrafting:
    """Builds a :class:`SpecBlockForDrafting` (``context_slots="all"``) from a reference checkpoint."""
    k = int(config.get("diffspec_draft_token_num", 7))
    if int(config.get("rank_classes", 4)) != 4:
        raise ValueError(f"This SpecBlock checkpoint's rank head has {config['rank_classes']} classes; hf_specdec's 4.")
    weights = {_INPUT.get(key, key): value for key, value in state.items()}
    embed = weights.pop("input_layer.embed_tokens.weight", None)
    layers = int(config.get("num_hidden_layers", 1))
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    if config.get("head_dim") not in (None, hidden // heads):
        raise ValueError(f"The reference SpecBlock uses head_dim = hidden_size / heads = {hidden // heads}; this config "
                         f"sets {config['head_dim']}.")  # fmt: skip
    target_hidden = int(config.get("target_hidden_size") or hidden)
    vocab = int(config["vocab_size"])
    for what, mine, theirs in (("hidden size", target_hidden, target.get("hidden_size")),
                               ("vocabulary", vocab, target.get("vocab_size"))):  # fmt: skip
        if theirs not in (None, mine):
            raise ValueError(f"This SpecBlock drafter was trained for a target with {what} {mine}; yours has {theirs}.")
    if embed is not None and tuple(embed.shape) != (vocab, hidden):
        raise ValueError(f"input_layer.embed_tokens is {tuple(embed.shape)}, expected ({vocab}, {hidden}).")
    if hidden != target_hidden:
        raise ValueError("The reference SpecBlock embeds tokens with a copy of the target's embeddings, so its width "
                         f"must be the target's ({target_hidden}); this config has {hidden}.")  # fmt: skip
    shifts = sorted({key.split(".")[1] for key in weights if key.startswith("shift_proj.")})
    lm_rows = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else vocab
    draft_vocab = int(config.get("draft_vocab_size") or lm_rows)
    depth = target.get("num_hidden_layers")
    fields = decoder_layer_fields(_rope(config))
    fields.update(head_dim=hidden // heads, attention_bias=False)
    cfg = SpecBlockConfig(
        target_model_name_or_path=target.get("name_or_path"),
        target_model_type=target.get("model_type"),
        target_hidden_size=target_hidden,
        target_num_hidden_layers=None if depth is None else int(depth),
        target_vocab_size=vocab,
        target_layer_ids=None if depth is None else SpecBlockConfig.default_target_layer_ids(int(depth)),
        draft_vocab_size=draft_vocab if draft_vocab != vocab else None,
        **fields,
        num_hidden_layers=layers,
        block_size=k,
        layer_shift=bool(shifts) or layers == 1,
        context_slots="all",
        rank_head_size=_RANK_HEAD_SIZE,
        num_train_blocks=int(config.get("num_ttt_blocks", 3)),
    )
    drafter = SpecBlockForDrafting(cfg)
    own = drafter.state_dict()
    if "d2t" not in weights and draft_vocab == vocab:  # a full-vocabulary checkpoint may leave the maps out
        weights["d2t"], weights["t2d"] = own["d2t"], own["t2d"]
    if "t2d" not in weights and "d2t" in weights:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + weights["d2t"].long()] = True
        weights["t2d"] = t2d
    missing = sorted(set(own) - set(weights))
    unknown = sorted(set(weights) - set(own))
    if missing or unknown:
        raise ValueError(
            f"Not a SpecBlock reference checkpoint hf_specdec can load: missing {missing[:6]}, unexpected "
            f"{unknown[:6]} (K = {k}, {layers} layers, {'with' if shifts else 'without'} the layer-wise shift)."
        )
    for key, value in weights.items():
        if tuple(value.shape) != tuple(own[key].shape):
            raise ValueError(f"Tensor {key} has shape {tuple(value.shape)}, expected {tuple(own[key].shape)}.")
    drafter.load_state_dict({key: value.to(own[key].dtype) for key, value in weights.items()})
    drafter.check_draft_vocab()
    return drafter.eval()


def save_specblock_reference(drafter: SpecBlockForDrafting, out_dir: str, target=None) -> None:
    """Writes the reference layout (``LlamaForCausalLMSpecBlock``); refuses what the reference cannot run as this
    drafter does."""
    cfg = drafter.config
    problems = []
    if cfg.context_slots != "all":
        problems.append("context_slots='first' (the reference keeps all K slots per position: train with 'all')")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size or cfg.attention_bias:
        problems.append("head_dim other than hidden_size / heads, or attention biases")
    if cfg.hidden_size != cfg.target_hidden_size:
        problems.append(f"a draft width {cfg.hidden_size} other than the target's {cfg.target_hidden_size}")
    if cfg.rank_head_size != _RANK_HEAD_SIZE:
        problems.append(f"rank_head_size {cfg.rank_head_size} (the reference's is {_RANK_HEAD_SIZE})")
    depth = cfg.target_num_hidden_layers
    if depth is None or list(cfg.target_layer_ids or ()) != SpecBlockConfig.default_target_layer_ids(depth):
        problems.append(f"target_layer_ids {cfg.target_layer_ids} (the reference reads [2, L // 2, L - 3])")
    rope = cfg.rope_scaling_parameters
    if rope is not None and rope.get("rope_type") != "llama3":
        problems.append(f"RoPE scaling {rope} (the reference scales llama3 only)")
    if problems:
        raise ValueError("The SpecBlock reference would run this drafter differently: " + "; ".join(problems) + ".")
    back = {ours: theirs for theirs, ours in _INPUT.items()}
    tensors = {back.get(key, key): value for key, value in drafter.state_dict().items()}
    if not cfg.layer_shift:  # the reference serves the shift model: W_s = [I 0] is the model without the shift
        h = cfg.hidden_size
        for i in range(cfg.num_hidden_layers - 1):
            tensors[f"shift_proj.{i}.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1).to(drafter.dtype)
    if target is not None:
        emb = target.get_input_embeddings().weight
        tensors["input_layer.embed_tokens.weight"] = emb.detach().to(drafter.dtype)
    config = {
        "architectures": ["LlamaForCausalLMSpecBlock"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if rope is None else dict(rope),
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "diffspec_draft_token_num": cfg.block_size,
        "rank_classes": 4,
        "num_ttt_blocks": cfg.num_train_blocks,
        "tie_word_embeddings": False,
        "torch_dtype": str(drafter.dtype).removeprefix("torch."),
    }
    write_checkpoint(out_dir, config, tensors)


register_layout(
    Layout(
        name="specblock-reference",
        family=SpecBlockConfig.model_type,
        description="SpecBlock reference (input_layer.*, layers.*, shift_proj.*, rank_head.*, d2t/t2d; "
        "diffspec_draft_token_num); loads with context_slots='all'",
        detect=_detect,
        load=load_specblock_reference,
        save=save_specblock_reference,
    )
)
