"""Configuration of the EAGLE-1 drafter."""

from __future__ import annotations

from ...configuration_utils import (
    DecoderDrafterConfig,
    validate_decoder_layer,
)

__all__ = ["Eagle1Config"]


class Eagle1Config(DecoderDrafterConfig):
    r"""Configuration of :class:`Eagle1ForDrafting` (EAGLE-1, Li et al. 2024, arXiv 2401.15077).

    Feature-level autoregression on the target's top feature ``f`` (its final hidden state, the LM head's input,
    ``output_hidden_states[L]``): ``f̂_{i+1} = DecoderLayer(FC([e_{i+1}; f_i]))`` with ``FC`` ``2 * hidden -> hidden``
    and one Llama decoder layer without input norm; the target's LM head (borrowed) turns ``f̂`` into draft logits.
    Drafted features are fed back for the next draft step; trees use EAGLE-2's dynamic policy (``tree="eagle2"``).

    Args:
        hidden_size / intermediate_size / num_attention_heads / num_key_value_heads / head_dim / hidden_act /
            rms_norm_eps / rope_theta / rope_scaling_parameters / max_position_embeddings / attention_bias: the
            decoder layer, shaped like one of the target's by :meth:`for_target`.
        fc_bias (`bool`, defaults to `True`): bias of ``FC`` (EAGLE's default).
        qkv_bias (`bool`, defaults to `False`): biases on the attention's q/k/v projections only, as Qwen2's
            attention has them (SafeAILab's ``cnets1.py`` ``qkv_bias``); ``attention_bias`` puts one on ``o_proj``
            too (Llama's flag).
        feature_loss_weight (`float`, defaults to 1.0) / token_loss_weight (`float`, defaults to 0.1): the loss
            ``SmoothL1(f, f̂) + 0.1 CE(p, p̂)``.
        feature_noise (`float`, defaults to 0.1): training adds uniform noise ``U(-a, a)`` to the target features the
            layer reads (EAGLE's data augmentation); 0 turns it off.
        ttt_steps (`int`, defaults to 1): draft steps unrolled in the loss (1: the paper's teacher-forced training;
            more feed the drafter's own features back, as EAGLE-3's training-time test), ttt_decay (`float`,
            defaults to 0.8): weight ``ttt_decay ** j`` of step ``j``.
        draft_vocab_size (`int`, *optional*): restrict the target's LM head to the most frequent tokens of the
            training data (cheaper drafting; ``init_from_data``).
    """

    model_type = "eagle1_drafter"

    fc_bias: bool = True
    qkv_bias: bool = False
    feature_loss_weight: float = 1.0
    token_loss_weight: float = 0.1
    feature_noise: float = 0.1
    ttt_steps: int = 1
    ttt_decay: float = 0.8
    num_draft_tokens: int = 5

    @classmethod
    def default_target_layer_ids(cls, num_layers: int) -> list[int]:
        return [num_layers]  # the top feature: the final hidden state, the LM head's input

    def validate_drafter(self, require_complete: bool = False) -> None:
        super().validate_drafter(require_complete)
        name = type(self).__name__
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"{name}.ttt_steps must be a positive integer, got {self.ttt_steps!r}.")
        for key in ("feature_loss_weight", "token_loss_weight", "feature_noise"):
            if float(getattr(self, key)) < 0:
                raise ValueError(f"{name}.{key} must be >= 0, got {getattr(self, key)!r}.")
        if not require_complete and not self.is_bound_to_target_facts:
            return
        validate_decoder_layer(self, "EAGLE-1 predicts the target's own features")
        if self.target_layer_ids is not None and len(self.target_layer_ids) != 1:
            raise ValueError(
                f"{name}.target_layer_ids must name one target state (the top feature), got {self.target_layer_ids}."
            )
