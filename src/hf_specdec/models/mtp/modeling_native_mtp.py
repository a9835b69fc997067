"""A target's own MTP layer (configs with ``num_mtp_layers``: DeepSeek-V3, GLM-4.5-MoE, ...) as an hf_specdec drafter.

The layer is transformers' ``MtpLayer`` around the target's own decoder-layer class (MLA attention, mixture-of-experts
MLP), built and loaded as ``MtpModel`` builds and loads it, so what it computes is transformers' code. hf_specdec adds
what ``MTPCandidateGenerator`` (batch 1, one token per layer) lacks: a slot cache whose rejected or padded slots are
masked out (batch > 1 with ragged rows), tree masks, and reuse of the layer on its own output for longer drafts.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.modeling_layers import MtpLayer, MtpModel

from ...feature_drafting import FeatureAutoregressiveMixin
from ...layers import compaction_index
from ...modeling_utils import DrafterPreTrainedModel
from .configuration_mtp import NativeMtpConfig

__all__ = ["NativeMtpForDrafting", "NativeMtpCache", "MtpPositionEmbedding"]


def target_skeleton(text_config) -> nn.Module:
    """The target built on the meta device (no memory): where the decoder-layer, norm and rotary classes come from."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(text_config)


def mtp_weight_conversions(text_config) -> list:
    """transformers' renamings (and expert fusions) from the checkpoint's ``model.layers.{L + k}.*`` to
    ``layers.{k}.*``, exactly as ``MtpModel.from_pretrained`` applies them."""
    skeleton = target_skeleton(text_config)
    with torch.device("meta"):
        mtp = MtpModel(skeleton, int(text_config.num_mtp_layers))
    return mtp.get_weight_conversions(skeleton)


class MtpPositionEmbedding(nn.Module):
    """The target's rotary embedding at the MTP layer's positions: the layer reads the token at ``p + 1`` next to the
    target state at ``p`` and sits at ``p + 1``, as ``MTPCandidateGenerator`` places it. The rotary module is built
    lazily per device (kept out of the module tree: its tables are not weights, and survive meta-device init)."""

    def __init__(self, rotary_cls: type, config):
        super().__init__()
        self.__dict__["_make"] = lambda: rotary_cls(config=config)
        self.__dict__["_built"] = {}

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        rotary = self._built.get(position_ids.device)
        if rotary is None:
            with torch.device(position_ids.device):
                rotary = self._built[position_ids.device] = self._make()
        anchor = position_ids.new_empty(0, dtype=dtype)  # rotary modules read the dtype and device off it
        return rotary(anchor, position_ids=position_ids + 1)


class NativeMtpCache:
    """The MTP layer's transformers ``DynamicCache`` plus a ``valid`` mask per slot (the interface of
    :class:`~hf_specdec.layers.SlotKVCache`: ``length``, ``valid``, ``crop(length)``, ``compact``): rejected and
    padding slots stay in the tensors and are masked out; trailing slots are cropped."""

    def __init__(self):
        self.kv = DynamicCache()
        self.valid: torch.Tensor | None = None  # (batch, slots) bool

    @property
    def length(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def key_valid(self, valid: torch.Tensor) -> torch.Tensor:
        """The slots' validity once ``valid`` (the new slots) is appended."""
        return valid if self.valid is None else torch.cat([self.valid, valid], dim=1)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.kv.crop(length - self.length)
            self.valid = self.valid[:, :length]

    def compact(self, min_waste: int = 16, min_share: float = 0.1) -> bool:
        if self.valid is None:
            return False
        plan = compaction_index(self.valid, min_waste, min_share)
        if plan is None:
            return False
        index, self.valid = plan
        for layer in self.kv.layers:
            layer.keys, layer.values = (_gather_slots(t, index) for t in (layer.keys, layer.values))
        return True


def _gather_slots(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``states[b, :, index[b], :]`` for ``(batch, heads, slots, dim)`` cache tensors."""
    idx = index.to(states.device)[:, None, :, None].expand(states.shape[0], states.shape[1], -1, states.shape[3])
    return states.gather(2, idx)


def slot_attention_mask(key_valid: torch.Tensor, new: int, attn_mask: torch.Tensor | None, dtype) -> torch.Tensor:
    """The additive ``(batch, 1, new, slots)`` mask transformers' attention functions take (eager and SDPA): valid
    slots, causal among the ``new`` last slots (or ``attn_mask``, e.g. a tree's ancestors), each slot seeing itself
    (so rows of pure padding never produce NaNs)."""
    slots = key_valid.shape[1]
    q_slot = torch.arange(slots - new, slots, device=key_valid.device)
    k_slot = torch.arange(slots, device=key_valid.device)
    allowed = key_valid[:, None, :].expand(-1, new, slots)
    if attn_mask is not None:
        allowed = allowed & attn_mask.to(device=key_valid.device, dtype=torch.bool)
    else:
        allowed = allowed & (k_slot[None, :] <= q_slot[:, None])[None]
    allowed = allowed | (k_slot[None, :] == q_slot[:, None])[None]
    zero = torch.zeros((), dtype=dtype, device=key_valid.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


class NativeMtpForDrafting(FeatureAutoregressiveMixin, DrafterPreTrainedModel):
    """The target's own MTP layer (transformers' ``MtpLayer``) drafting through hf_specdec's loop.

    Loaded from the target's checkpoint (only the MTP layer's tensors are read):
        >>> drafter = AutoModelForDrafting.from_pretrained("deepseek-ai/DeepSeek-V3")  # doctest: +SKIP
        >>> out = target.generate(**inputs, assistant_model=drafter)  # doctest: +SKIP

    Token 0 of a draft is what ``MTPCandidateGenerator`` drafts; draft token ``j >= 1`` runs the same layer on its
    previous output and the embedding of draft token ``j - 1`` at the next position (DeepSeek-V3's / SGLang's reuse).
    """

    config_class = NativeMtpConfig
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    borrows_target_lm_head = True
    _no_split_modules = ["MtpLayer"]

    def __init__(self, config: NativeMtpConfig):
        super().__init__(config)
        text = config.build_target_config()
        last = target_skeleton(text).get_decoder()
        mtp_config = text.get_mtp_config()
        # Slot caches need an explicit mask: flash / flex kernels take none, so those targets run SDPA here.
        mtp_config._attn_implementation = "eager" if text._attn_implementation == "eager" else "sdpa"
        norm_cls = next(type(m) for name, m in last.layers[-1].named_modules() if "norm" in name)
        post_norm = not hasattr(mtp_config, "chain_hidden_post_norm")
        self.layers = nn.ModuleList([MtpLayer(mtp_config, type(last.layers[-1]), norm_cls, 0, post_norm)])
        self.rotary_emb = MtpPositionEmbedding(type(last.rotary_emb), mtp_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the target's checkpoint; transformers' modules keep their own initialisation."""

    def load_checkpoint_tensors(self, state: dict) -> NativeMtpForDrafting:
        """Loads the MTP layer's tensors (checkpoint names, ``model.layers.{L}.*``) with transformers' conversions."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        dtype = next(iter(state.values())).dtype
        options = LoadStateDictConfig(
            weight_mapping=mtp_weight_conversions(self.config.build_target_config()),
            device_map={"": "cpu"},
            dtype=dtype,
        )
        convert_and_load_state_dict_in_model(model=self, state_dict=state, load_config=options)
        missing = sorted(n for n, t in (*self.named_parameters(), *self.named_buffers()) if t.is_meta)
        if missing:
            raise ValueError(f"The checkpoint's MTP layer lacks {missing[:6]} (transformers' MtpModel names).")
        return self.eval()

    # -- the pieces FeatureAutoregressiveMixin drafts with ------------------------------------------------------------
    def new_draft_cache(self) -> NativeMtpCache:
        return NativeMtpCache()

    def fuse_target_features(self, features) -> torch.Tensor:
        feats = features[0] if isinstance(features, (list, tuple)) else features
        return feats.to(device=self.device, dtype=self.dtype)

    def draft_layer(self, embeds, hidden, cos, sin, cache: NativeMtpCache, valid, attn_mask=None, step=None):
        """The MTP layer over new slots (verified context, a chain step or tree nodes), appending them to ``cache``."""
        key_valid = cache.key_valid(valid.to(embeds.device))
        mask = slot_attention_mask(key_valid, embeds.shape[1], attn_mask, hidden.dtype)
        out = self.layers[0](
            embeds.to(hidden.dtype), hidden, position_embeddings=(cos, sin), attention_mask=mask, position_ids=None,
            cache=cache.kv,
        )  # fmt: skip
        cache.valid = key_valid
        return out

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head (shared, as transformers' ``MtpModel.shared_head``)."""
        return self.target_lm_head(hidden).to(hidden.device)

    def check_target_compatibility(self, target: nn.Module) -> None:
        super().check_target_compatibility(target)
        own = self.config.target_text_config["model_type"]
        found = target.config.get_text_config().model_type
        if found != own:
            raise ValueError(f"{type(self).__name__} holds the MTP layer of a {own} target; this target is {found}.")
        if hasattr(target.get_input_embeddings(), "embed_norm"):
            raise ValueError(
                f"The {found} target's embeddings normalise their output (embed_norm), which its MTP layer reads "
                "without; hf_specdec does not strip it."
            )
