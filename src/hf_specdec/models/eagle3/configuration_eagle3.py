"""Configuration of the EAGLE-3 drafter."""

from __future__ import annotations

from ...configuration_utils import (
    DecoderDrafterConfig,
    validate_decoder_layer,
)

__all__ = ["Eagle3Config"]


class Eagle3Config(DecoderDrafterConfig):
    r"""Configuration of :class:`Eagle3ForDrafting` (EAGLE-3, Li et al. 2025, arXiv 2503.01840).

    The drafter fuses three target hidden states (low, mid, high) with ``fc`` (``3·target_hidden_size → hidden_size``),
    then runs one Llama-style decoder layer (or ``num_hidden_layers``) on ``[RMSNorm(embedding of the next token); RMSNorm(fused feature)]``
    and predicts the token after next through its own LM head over a (possibly reduced) draft vocabulary.

    ``target_layer_ids`` follow hf_specdec's convention (``output_hidden_states[j]``, 0 = embeddings, ``i + 1`` =
    output of decoder layer ``i``). The default, as in the reference implementation, is the *input* of decoder layers
    ``2``, ``L // 2`` and ``L - 3``, i.e. ``output_hidden_states[2], [L // 2], [L - 3]`` (for Llama-3.1-8B:
    ``[2, 16, 29]``; SpecForge writes the same layers as ``[1, L // 2 - 1, L - 4]`` in output-of-layer numbering).
    Ids are clamped to ``[1, L]`` for very shallow targets.

    Args:
        num_hidden_layers (`int`, defaults to 1): draft decoder layers. The first reads
            ``[embedding; feature]``; each further one is a plain pre-norm Llama layer on the output of the one
            before (vLLM's ``layers.{i}``, hf_specdec's ``upper_layers.{i - 1}``); the last one's output is what a
            draft step hands on. One layer is the published EAGLE-3 drafter.
        hidden_size (`int`): width of the draft layer; must equal ``target_hidden_size`` because the draft layer
            consumes the target's token embeddings.
        intermediate_size (`int`): MLP width of the draft layer.
        num_attention_heads / num_key_value_heads / head_dim: attention shape of the draft layer.
        hidden_act (`str`, defaults to ``"silu"``), rms_norm_eps (`float`), rope_theta (`float`),
        max_position_embeddings (`int`), attention_bias (`bool`), initializer_range (`float`).
        ttt_steps (`int`, *optional*): training-time-test steps unrolled in the loss (default ``num_draft_tokens``);
            ttt_decay (`float`, defaults to 0.8): weight ``ttt_decay**j`` of step ``j``. ``compute_loss``'s loss
            kwargs ``steps`` / ``decay`` override them for one run.
        rope_scaling_parameters (`dict`, *optional*): the target's RoPE scaling in transformers-5 form without
            ``rope_theta`` (e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``); ``None`` is plain RoPE.
            :meth:`for_target` copies it from the target; scalings hf_specdec does not implement are refused.
        norm_before_residual (`bool`, defaults to `False`): vLLM's flag: the residual of the draft layer is the
            *normalised* fused feature (``hidden_norm(h)``) instead of ``h`` itself.
        norm_output (`bool`, defaults to `True`): SpecForge's flag: ``False`` feeds the draft layer output to the
            LM head without the final ``norm``.
        norm_feedback (`bool`, defaults to `False`): EAGLE-3.1's post-norm feedback (what vLLM, speculators and
            SGLang call ``norm_output``): the state fed back to the next draft step is ``norm(h)``, the LM head's
            input, instead of the layer output ``h``. Needs ``norm_output``.
        fc_norm (`bool`, defaults to `False`): EAGLE-3.1 (SpecForge, speculators, vLLM): one RMSNorm per fused
            target state (``fc_norm.{i}``, ``target_hidden_size`` wide) before ``fc``.
        norm_before_fc (`bool`, defaults to `False`): speculators' / vLLM's single RMSNorm over the concatenated
            target states before ``fc`` (``input_norm``); exclusive with ``fc_norm``.
        context_vocabulary (`bool`, defaults to `False`): widen a reduced draft vocabulary, per request, with the
            sequence's own tokens outside it, scored through the target's LM-head rows mapped by ``context_vocab``
            (see :mod:`hf_specdec.context_vocab`). Needs a reduced draft vocabulary; hf_specdec's own format only.
        Other arguments: see :class:`~hf_specdec.DrafterConfig`.
    """

    model_type = "eagle3_drafter"
    num_default_target_features = 3  # low, mid, high: what `fc` fuses when target_layer_ids are left to defaults

    norm_before_residual: bool = False
    norm_output: bool = True
    norm_feedback: bool = False
    fc_norm: bool = False
    norm_before_fc: bool = False
    num_hidden_layers: int = 1
    num_draft_tokens: int = 5
    ttt_steps: int | None = None  # training: draft steps unrolled in the loss (None: num_draft_tokens)
    ttt_decay: float = 0.8  # training: weight ttt_decay**j of step j in the loss
    context_vocabulary: bool = False  # draft the sequence's own tokens outside the draft vocabulary too

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [min(max(i, 1), num_layers) for i in (2, num_layers // 2, num_layers - 3)]

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        self.validate_norm_flags()
        layers = self.num_hidden_layers
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(
                f"{type(self).__name__}.num_hidden_layers is the number of draft decoder layers: an integer >= 1, "
                f"got {layers!r}."
            )
        self.validate_context_vocabulary()
        if not require_complete and not self.is_bound_to_target_facts:
            return
        validate_decoder_layer(self, "the EAGLE-3 draft layer consumes the target's token embeddings")
        name = type(self).__name__
        if self.target_num_hidden_layers is None and self.target_layer_ids is None:
            pass  # resolved from the target by bind_target
        elif not self.target_layer_ids:
            raise ValueError(f"{name}.target_layer_ids must list the target hidden states to fuse.")

    def validate_norm_flags(self) -> None:
        """Refuses combinations of the optional norms that no project defines."""
        name = type(self).__name__
        if self.fc_norm and self.norm_before_fc:
            raise ValueError(
                f"{name}.fc_norm (one norm per target state) and norm_before_fc (one norm over their concatenation) "
                "are mutually exclusive: set one of them."
            )
        if self.norm_feedback and not self.norm_output:
            raise ValueError(
                f"{name}.norm_feedback feeds back the LM head's normed input, but norm_output=False leaves the LM "
                "head without the norm: set norm_output=True or norm_feedback=False."
            )

    def validate_context_vocabulary(self) -> None:
        """Refuses a context vocabulary that could add nothing: it widens a reduced draft vocabulary."""
        if not isinstance(self.context_vocabulary, bool):
            raise ValueError(
                f"{type(self).__name__}.context_vocabulary is a flag (true / false), got {self.context_vocabulary!r}."
            )
        full = self.target_vocab_size is not None and self.draft_vocab_size == self.target_vocab_size
        if self.context_vocabulary and full:
            raise ValueError(
                f"{type(self).__name__}.context_vocabulary widens a reduced draft vocabulary, but this drafter drafts "
                f"over the target's whole vocabulary ({self.target_vocab_size} tokens): set draft_vocab_size below "
                "it, or context_vocabulary=False."
            )
