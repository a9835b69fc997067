"""Configuration of the SpecBlock drafter."""

from __future__ import annotations

from ...configuration_utils import DecoderDrafterConfig, validate_decoder_layer

__all__ = ["SpecBlockConfig"]


class SpecBlockConfig(DecoderDrafterConfig):
    r"""Configuration of :class:`SpecBlockForDrafting` (SpecBlock, Shi et al., arXiv 2605.07243).

    One pass of ``num_hidden_layers`` decoder layers drafts a block of ``block_size`` positions. Slot ``k`` of the
    block after the verified position ``t`` reads ``fuse([c_t; e_t; q_k])`` (*prefix broadcast*): ``c_t`` the fused
    target states (``RMSNorm(fc([H_low; H_mid; H_high]))``, EAGLE-3's layers), ``e_t`` the normed embedding of the
    token at ``t + 1``, ``q_k`` a learned position query; it sits at position ``t + 1 + k`` and predicts the token at
    ``t + 2 + k``. Slot ``k`` attends to the verified context and to slots ``<= k`` of its own block. Between layers
    the *layer-wise shift* mixes each slot with the one before it: ``h_k <- W_s [h_k; h_{k-1}]`` (slot 0 with itself).
    A further block continues from slot ``M - 1`` of its parent block: ``c`` is that slot's draft state, ``e`` the
    embedding of the token drafted there, and the parent's slots ``< M`` stay visible (cross-block drafting).

    What a block sees of earlier positions (``context_slots``): ``"first"`` keeps one entry per verified position in
    the draft cache (slot 0 of its block; the default), ``"all"`` all ``K`` slots of every verified position's block,
    as the reference implementation trains and serves (``K`` times the draft cache and context work; the layout
    ``specblock-reference`` needs it). With ``"all"`` a block at the last verified position sees the blocks of the
    positions before it whole and its ancestors' slots ``< M``.

    A rank head reads each slot's state (detached) and 15 statistics of its draft distribution and predicts in which
    of 4 buckets the target's choice ranks (1, 2-4, 5-10, > 10); the rank tree uses it to set the branching width.

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling_parameters / max_position_embeddings / attention_bias: the draft
            layers (Llama-style), shaped like the target's by :meth:`for_target`.
        num_hidden_layers (`int`, defaults to 2): draft decoder layers.
        block_size (`int`, defaults to 4): positions ``K`` per block pass.
        layer_shift (`bool`, defaults to `True`): the layer-wise shift between layers (``False``: the ablation
            without it).
        context_slots (`str`, defaults to ``"first"``): ``"first"`` or ``"all"`` slots of each verified position's
            block in the draft cache (above).
        rank_head_size (`int`, defaults to 256): hidden width of the rank head's MLP.
        rank_branch_widths (`list[int]`, defaults to ``[1, 4, 10, 0]``): branching width of the rank tree at a slot
            per predicted bucket (0 for the last bucket: give up, start no further block).
        num_train_blocks (`int`, defaults to 3): blocks unrolled per anchor in training (cross-block training: each
            further block continues from a slot ``M - 1`` drawn uniformly in ``1..K``, with the true token there).
        slot_decay (`float`, defaults to 0.8): weight ``slot_decay**k`` of slot ``k``'s draft loss.
        rank_loss_weight (`float`, defaults to 1.0): weight of the rank head's loss.
        num_anchors (`int`, defaults to 64): anchors per training sequence whose further blocks are unrolled (block 1
            is trained at every anchor).
        num_draft_tokens (`int`, defaults to ``block_size``): chain length per pass (longer chains chain blocks).
        draft_vocab_size (`int`, *optional*): a reduced draft vocabulary (``d2t`` / ``t2d``, as EAGLE-3).
        Other arguments: see :class:`~hf_specdec.DrafterConfig`.
    """

    model_type = "specblock_drafter"
    num_default_target_features = 3

    num_hidden_layers: int = 2
    block_size: int = 4
    layer_shift: bool = True
    context_slots: str = "first"
    rank_head_size: int = 256
    rank_branch_widths: list | None = None
    num_train_blocks: int = 3
    slot_decay: float = 0.8
    rank_loss_weight: float = 1.0
    num_anchors: int = 64
    num_draft_tokens: int | None = None

    # Rank buckets: the target's choice is ranked 1, 2-4, 5-10 or > 10 in the draft distribution.
    rank_bucket_edges = (1, 4, 10)
    num_rank_features = 15  # top-10 log-probs, 3 gaps, top-1 probability, entropy of the top 20

    def __post_init__(self, **kwargs):
        if self.num_draft_tokens is None and isinstance(self.block_size, int):
            self.num_draft_tokens = self.block_size
        if self.rank_branch_widths is None:
            self.rank_branch_widths = [1, 4, 10, 0]
        super().__post_init__(**kwargs)

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        """EAGLE-3's low, mid and high layers (``output_hidden_states[2], [L // 2], [L - 3]``)."""
        return [min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3)]

    def validate_drafter(self, require_complete: bool = False) -> None:
        name = type(self).__name__
        for key, minimum in (
            ("num_hidden_layers", 1),
            ("block_size", 1),
            ("rank_head_size", 1),
            ("num_train_blocks", 1),
            ("num_anchors", 1),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name}.{key} must be an integer >= {minimum}, got {value!r}.")
        if not isinstance(self.layer_shift, bool):
            raise ValueError(f"{name}.layer_shift must be true or false, got {self.layer_shift!r}.")
        if self.context_slots not in ("first", "all"):
            raise ValueError(f"{name}.context_slots must be 'first' or 'all', got {self.context_slots!r}.")
        widths = self.rank_branch_widths
        if (
            not isinstance(widths, (list, tuple))
            or len(widths) != 4
            or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in widths)
            or widths[0] < 1
        ):
            raise ValueError(
                f"{name}.rank_branch_widths must give 4 integer widths (one per rank bucket; >= 1 for the first, 0 "
                f"means give up), got {widths!r}."
            )
        if not 0.0 < float(self.slot_decay) <= 1.0:
            raise ValueError(f"{name}.slot_decay must be in (0, 1], got {self.slot_decay!r}.")
        if float(self.rank_loss_weight) < 0:
            raise ValueError(f"{name}.rank_loss_weight must be >= 0, got {self.rank_loss_weight!r}.")
        super().validate_drafter(require_complete)
        if not require_complete and not self.is_bound_to_target_facts:
            return
        validate_decoder_layer(self, "the draft layers consume the target's token embeddings")
        if self.target_num_hidden_layers is not None and not self.target_layer_ids:
            raise ValueError(f"{name}.target_layer_ids must list the target hidden states to fuse.")
