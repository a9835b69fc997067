"""EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840), written for hf_specdec's proposal interface.

Data flow for one slot: the target state at position ``p`` (three fused layers, see :class:`Eagle3Config`) and the
embedding of the token at ``p + 1`` go through one decoder layer; the layer output ``h_p`` predicts the token at
``p + 2`` and, for deeper draft steps, replaces the fused target feature (it is fed back through ``hidden_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from ...features import walk_metrics, walk_passes
from ...generation.proposals import DraftInputs, Proposal, TokenSelector
from ...layers import GatedMLP, RMSNorm, RotaryEmbedding, SlotKVCache, apply_rotary, slot_attention
from ...modeling_utils import DrafterPreTrainedModel, DraftLossOutput
from .configuration_eagle3 import Eagle3Config

__all__ = ["Eagle3ForDrafting", "Eagle3DraftState", "Eagle3Output"]


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        bias = config.attention_bias
        # q/k/v read the concatenation [norm(embedding); norm(feature)] (2H wide).
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)

    def forward(self, x, cos, sin, cache: SlotKVCache, valid: torch.Tensor, causal: bool = True, attn_mask=None):
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values, key_valid = cache.append(k, v, valid)
        out = slot_attention(q, keys, values, key_valid, causal=causal, attn_mask=attn_mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)  # on token embeddings
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)  # on fused target features / draft hidden states
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = GatedMLP(h, config.intermediate_size, config.hidden_act)
        self.norm_before_residual = config.norm_before_residual

    def attention_input(self, embeds, hidden):
        """``([norm(embeds); hidden_norm(hidden)], residual)``; the residual is the normalised feature when
        ``norm_before_residual`` is set (vLLM's flag), else the raw one (the reference EAGLE-3 layer)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def forward(self, embeds, hidden, cos, sin, cache, valid, attn_mask=None):
        x, residual = self.attention_input(embeds, hidden)
        hidden = residual + self.self_attn(x, cos, sin, cache, valid, attn_mask=attn_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass
class Eagle3Output(ModelOutput):
    """Output of :meth:`Eagle3ForDrafting.forward`.

    Attributes:
        logits: ``(batch, seq, draft_vocab_size)`` draft logits; slot ``t`` predicts the token at position ``t + 2``.
        hidden_states: ``(batch, seq, hidden_size)`` draft layer outputs (before the final norm), the feature fed
            back for the next draft step.
    """

    logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None


@dataclass
class Eagle3DraftState:
    """Per-``generate`` drafter state: the draft KV cache and the latest verified output per row."""

    cache: SlotKVCache
    committed_slots: int = 0
    last_hidden: torch.Tensor | None = None  # (batch, hidden)
    last_logits: torch.Tensor | None = None  # (batch, draft_vocab)
    last_position: torch.Tensor | None = None  # (batch,)
    tree_hidden: torch.Tensor | None = None  # (batch, expanded nodes, hidden) while a tree is being drafted
    confidence_threshold: float | None = None  # stop a row's chain when the draft's top probability falls below


class Eagle3ForDrafting(DrafterPreTrainedModel):
    """EAGLE-3 drafter: fused low/mid/high target features, one decoder layer, optional reduced vocabulary.

    The token embeddings are borrowed from the target at :meth:`bind_target` time and never saved. With a reduced
    draft vocabulary (``draft_vocab_size < target_vocab_size``), buffer ``d2t`` maps draft id ``i`` to target id
    ``i + d2t[i]`` and ``t2d`` marks the target ids that are in the draft vocabulary (the layout of the reference
    implementation).

    Example:
        >>> drafter = AutoModelForDrafting.from_config(Eagle3Config.for_target(target.config))
        >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)
    """

    config_class = Eagle3Config
    proposal_kind = "chain"
    requires_target_hidden_states = True
    borrows_target_embeddings = True
    supports_tree_drafting = True
    draft_options = {"draft_confidence_threshold": None}
    lora_target_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc")
    loss_kwargs = ("steps", "decay")  # TTT steps and their decay (defaults: config.ttt_steps / ttt_decay)
    _no_split_modules = ["Eagle3DecoderLayer"]

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        # Unresolved layer ids (a foreign checkpoint loaded without its target): the family's default count.
        n_feats = len(config.target_layer_ids or ()) or config.num_default_target_features
        self.fc = nn.Linear(n_feats * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling_parameters, config.max_position_embeddings
        )
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.reset_parameters()

    # ------------------------------------------------------------------------------------------------------------
    # vocabulary mapping
    # ------------------------------------------------------------------------------------------------------------
    @property
    def draft_token_ids(self) -> torch.LongTensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_token_ids: torch.LongTensor) -> None:
        """Sets the reduced draft vocabulary from sorted target ids (``draft_vocab_size`` of them)."""
        ids = torch.as_tensor(target_token_ids, dtype=torch.long).flatten().sort().values
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"set_draft_vocab needs {self.config.draft_vocab_size} distinct target ids, got {ids.numel()} "
                f"({ids.unique().numel()} distinct)."
            )
        if ids.min() < 0 or ids.max() >= self.config.target_vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {self.config.target_vocab_size}).")
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def check_loaded_weights(self) -> None:
        self.check_draft_vocab()

    def check_target_layer_ids(self) -> None:
        n_feats = self.fc.in_features // self.config.target_hidden_size
        if len(self.config.target_layer_ids or ()) != n_feats:
            raise ValueError(
                f"Eagle3ForDrafting fuses {n_feats} target states (fc), but target_layer_ids is "
                f"{self.config.target_layer_ids}: set target_layer_ids to {n_feats} ids."
            )

    def check_draft_vocab(self) -> None:
        """Raises if ``d2t`` / ``t2d`` are inconsistent (e.g. a checkpoint with an all-zero ``d2t`` but a reduced
        vocabulary that is not the first ids)."""
        ids = self.draft_token_ids
        if ids.max() >= self.config.target_vocab_size or ids.min() < 0:
            raise ValueError("Eagle3ForDrafting: d2t maps draft ids outside the target vocabulary.")
        if not bool(self.t2d[ids].all()) or int(self.t2d.sum()) != self.config.draft_vocab_size:
            raise ValueError(
                "Eagle3ForDrafting: d2t and t2d disagree (t2d must mark exactly the target ids i + d2t[i]). "
                "The checkpoint's vocabulary mapping is corrupt; rebuild it with `set_draft_vocab`."
            )

    # ------------------------------------------------------------------------------------------------------------
    # core computation
    # ------------------------------------------------------------------------------------------------------------
    def fuse_target_features(self, features: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated target states (list of ``(batch, seq, H)`` or one ``(batch, seq, n·H)``)."""
        if isinstance(features, (list, tuple)):
            features = torch.cat(list(features), dim=-1)
        return self.fc(features.to(self.fc.weight.dtype))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of draft layer outputs (through the final ``norm`` unless ``norm_output`` is off)."""
        return self.lm_head(self.norm(hidden) if self.config.norm_output else hidden)

    def _step(self, embeds, hidden, position_ids, valid, cache: SlotKVCache):
        cos, sin = self.rotary_emb(position_ids, hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, cache, valid)
        return out, self.draft_logits(out)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | list[torch.Tensor] | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: SlotKVCache | None = None,
        **kwargs,
    ) -> Eagle3Output:
        """Runs the draft layer over a sequence (causal).

        Args:
            input_ids: ``(batch, seq)`` the token at ``p + 1`` for each target position ``p``.
            target_hidden_states: the target states at ``config.target_layer_ids`` (list of ``(batch, seq, H)``
                or their concatenation); mutually exclusive with ``hidden_states``.
            hidden_states: ``(batch, seq, hidden)`` draft hidden states to use instead of fused target features
                (the deeper steps of drafting and of training-time test).
            position_ids: ``(batch, seq)``; defaults to ``0..seq-1``.
            attention_mask: ``(batch, seq)`` 1 for real tokens, 0 for padding.
            inputs_embeds: precomputed token embeddings instead of ``input_ids``.
            cache: a :class:`~hf_specdec.layers.SlotKVCache` to extend (a fresh one if ``None``).
        """
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError("Pass exactly one of `target_hidden_states` or `hidden_states`.")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("Pass `input_ids` or `inputs_embeds`.")
            inputs_embeds = self.embed_target_tokens(input_ids)
        hidden = self.fuse_target_features(target_hidden_states) if hidden_states is None else hidden_states
        bsz, seq = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device)[None].expand(bsz, seq)
        valid = (
            torch.ones(bsz, seq, dtype=torch.bool, device=hidden.device)
            if attention_mask is None
            else attention_mask.to(hidden.device).bool()
        )
        out, logits = self._step(inputs_embeds.to(hidden.dtype), hidden, position_ids, valid, cache or SlotKVCache())
        return Eagle3Output(logits=logits, hidden_states=out)

    # ------------------------------------------------------------------------------------------------------------
    # training: training-time test (TTT)
    # ------------------------------------------------------------------------------------------------------------
    def init_from_data(self, token_counts: torch.Tensor) -> None:
        """Builds the reduced draft vocabulary from token frequencies (the most frequent ids, sorted by id)."""
        if self.config.draft_vocab_size == self.config.target_vocab_size:
            return
        counts = token_counts.to(torch.float64).clone()
        # Ties (and never-seen ids) are broken by id, so the choice is deterministic.
        order = torch.argsort(-counts, stable=True)
        self.set_draft_vocab(order[: self.config.draft_vocab_size])

    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> None:
        """Starts the output side in the target's own output space: ``lm_head`` holds the target's LM-head rows of
        the draft vocabulary (set by :meth:`init_from_data`, which runs first) and ``norm`` the target's final norm.

        The norm's effective scale is read by applying the target's norm to a vector of ones, so norms that scale by
        ``1 + w`` (Gemma) map too. Each part is skipped where the shapes differ (a drafter narrower than its
        target). On small data this matters: every draft-vocabulary token starts with a meaningful output row
        instead of a random one."""
        head = target.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if weight is not None and weight.shape[1] == self.lm_head.in_features:
            rows = weight[self.draft_token_ids.to(weight.device)]
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
        norm = getattr(decoder, "norm", None)
        if isinstance(norm, nn.Module) and self.config.norm_output:
            param = next(norm.parameters(), None)
            if param is not None and param.numel() == self.norm.weight.numel():
                ones = torch.ones(1, self.norm.weight.numel(), device=param.device, dtype=torch.float32)
                scale = norm(ones.to(param.dtype)).float()[0]
                # RMS(ones) = 1, so the output is the norm's effective scale (up to its eps, irrelevant here).
                self.norm.weight.copy_(scale.to(self.norm.weight))

    def _ttt_attention(self, x, position_ids, key_valid, prev_kv):
        """Attention of one TTT step: causal over step-0 keys, plus this anchor's own keys of steps 1..j.

        ``prev_kv`` holds ``(k, v)`` of steps 0..j-1 (step 0 first); the new step's keys are appended to it.
        Mirrors inference, where the drafted slots of a chain sit after the verified context.
        """
        attn = self.midlayer.self_attn
        bsz, t, _ = x.shape
        h, kvh, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        q = apply_rotary(attn.q_proj(x).view(bsz, t, h, hd).transpose(1, 2), cos, sin)
        k = apply_rotary(attn.k_proj(x).view(bsz, t, kvh, hd).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(bsz, t, kvh, hd).transpose(1, 2)
        prev_kv.append((k, v))
        rep = h // kvh

        def expand(z):
            return z.repeat_interleave(rep, dim=1) if rep > 1 else z

        k0, v0 = expand(prev_kv[0][0]), expand(prev_kv[0][1])
        scale = hd**-0.5
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # (B, h, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & key_valid[:, None, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)[None, None]
        scores0 = scores0.masked_fill(~allowed, torch.finfo(scores0.dtype).min)
        if len(prev_kv) == 1:
            probs = torch.softmax(scores0.float(), dim=-1).to(q.dtype)
            out = probs @ v0
        else:
            diag_k = torch.stack([expand(kk) for kk, _ in prev_kv[1:]], dim=-2)  # (B, h, T, j, d)
            diag_v = torch.stack([expand(vv) for _, vv in prev_kv[1:]], dim=-2)
            scores_d = (q[..., None, :] * diag_k).sum(-1) * scale  # (B, h, T, j)
            probs = torch.softmax(torch.cat([scores0, scores_d], dim=-1).float(), dim=-1).to(q.dtype)
            out = probs[..., :t] @ v0 + (probs[..., t:, None] * diag_v).sum(-2)
        return attn.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))

    def ttt_forward(self, input_ids, target_hidden_states, attention_mask=None, steps: int | None = None):
        """Unrolls ``steps`` draft steps over a sequence (training-time test).

        Step 0 reads the fused target features; step ``j`` reads the draft's own step ``j - 1`` output at the same
        anchor and the teacher-forced token ``input_ids[t + 1 + j]``. Step ``j`` at anchor ``t`` predicts the token
        at ``t + 2 + j`` and sits at position ``t + j`` (as the ``j``-th drafted slot does at inference).

        Returns:
            list of ``(logits, hidden)`` per step, each ``(batch, seq, ·)``; positions whose teacher-forced token
            lies beyond the sequence hold garbage and must be masked by the caller.
        """
        steps = steps or self.config.num_draft_tokens
        bsz, t = input_ids.shape
        valid = (
            torch.ones(bsz, t, dtype=torch.bool, device=input_ids.device)
            if attention_mask is None
            else attention_mask.bool()
        )
        positions = torch.arange(t, device=input_ids.device)[None].expand(bsz, t)
        hidden = self.fuse_target_features(target_hidden_states)
        embeds_all = self.embed_target_tokens(input_ids).to(hidden.dtype)
        layer = self.midlayer
        prev_kv: list = []
        outputs = []
        for j in range(steps):
            # token at t + 1 + j, shifted left; the tail is padded with the last token (masked by the caller)
            shift = min(1 + j, t)
            emb = torch.cat([embeds_all[:, shift:], embeds_all[:, -1:].expand(bsz, shift, -1)], dim=1)
            x, residual = layer.attention_input(emb, hidden)
            hidden = residual + self._ttt_attention(x, positions + j, valid.to(x.device), prev_kv)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            outputs.append((self.draft_logits(hidden), hidden))
        return outputs

    def compute_loss(self, batch, features, target_head=None, **loss_kwargs):
        """EAGLE-3 objective: ``Σ_j decay^j · CE(target distribution, draft distribution)`` over TTT steps.

        Soft labels are the target's distribution over the draft vocabulary
        (:meth:`~hf_specdec.features.TargetFeatures.soft_labels`); anchor ``t`` at step ``j`` is scored when the
        predicted token ``t + 2 + j`` exists, is a loss token (``loss_mask``) and, with a reduced vocabulary, the
        target's argmax is in the draft vocabulary.

        Loss kwargs (``loss_kwargs``): ``steps`` (default ``config.ttt_steps``, else ``num_draft_tokens``) and
        ``decay`` (default ``config.ttt_decay``). Metrics: ``correct`` / ``valid`` per step, and the pass-by-pass
        walk of :func:`~hf_specdec.features.walk_metrics` with ``K = min(num_draft_tokens, steps)``.
        """
        unknown = sorted(set(loss_kwargs) - set(self.loss_kwargs))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.compute_loss got unknown loss kwargs {unknown}; it takes {list(self.loss_kwargs)}."
            )
        if target_head is None:
            raise ValueError("Eagle3ForDrafting.compute_loss needs the target's LM head for soft labels.")
        cfg = self.config
        steps = loss_kwargs.get("steps") or getattr(cfg, "ttt_steps", None) or cfg.num_draft_tokens
        decay = loss_kwargs.get("decay")
        decay = float(getattr(cfg, "ttt_decay", 0.8) if decay is None else decay)
        input_ids = batch["input_ids"]
        attn_mask = batch.get("attention_mask")
        loss_mask = batch["loss_mask"].bool()
        if attn_mask is not None:
            loss_mask = loss_mask & attn_mask.bool()
        loss_mask = loss_mask.to(self.device)
        bsz, t = input_ids.shape
        reduced = cfg.draft_vocab_size < cfg.target_vocab_size
        labels = features.soft_labels(target_head, self.draft_token_ids if reduced else None)
        target_p = labels.probs.to(self.device)  # (B, T, Vd): position s predicts token s + 1
        target_top = labels.argmax.to(self.device)  # draft-vocab index of the target's choice
        in_vocab = self.t2d[labels.full_argmax.to(self.device)] if reduced else torch.ones_like(loss_mask)
        outs = self.ttt_forward(input_ids, features.hidden_states, attn_mask, steps)
        loss = torch.zeros((), device=self.device)
        zero = torch.zeros((), device=self.device)
        correct, valid_n = [], []
        chain_ok = None
        accepted = torch.zeros(bsz, t, dtype=torch.long, device=self.device)
        for j, (logits, _) in enumerate(outs):
            width = t - 2 - j  # anchors whose predicted token (t + 2 + j) exists
            if width <= 0:
                correct.append(zero)
                valid_n.append(zero)
                continue
            pred_pos = slice(2 + j, 2 + j + width)  # token positions predicted
            lab_pos = slice(1 + j, 1 + j + width)  # target distribution positions
            valid = loss_mask[:, pred_pos] & in_vocab[:, lab_pos]
            logp = torch.log_softmax(logits[:, :width].float(), dim=-1)
            ce = -(target_p[:, lab_pos] * logp).sum(-1)
            n_valid = valid.sum()
            loss = loss + (decay**j) * (ce * valid).sum() / n_valid.clamp(min=1)
            hit = (logits[:, :width].argmax(-1) == target_top[:, lab_pos]) & valid
            chain_ok = hit if chain_ok is None else chain_ok[:, :width] & hit
            accepted[:, :width] += chain_ok.long()
            correct.append(hit.sum().float())
            valid_n.append(n_valid.float())
        metrics = {"correct": torch.stack(correct), "valid": torch.stack(valid_n)}
        passes = walk_passes(accepted, loss_mask, min(cfg.num_draft_tokens, steps))
        metrics.update(walk_metrics(passes, device=self.device))
        return DraftLossOutput(loss=loss, metrics=metrics, accepted=accepted)

    # ------------------------------------------------------------------------------------------------------------
    # proposal interface
    # ------------------------------------------------------------------------------------------------------------
    def init_draft_state(
        self, batch_size: int, max_length: int, draft_confidence_threshold: float | None = None
    ) -> Eagle3DraftState:
        if draft_confidence_threshold is not None and not 0.0 <= float(draft_confidence_threshold) <= 1.0:
            raise ValueError(
                f"draft_confidence_threshold must be a probability in [0, 1], got {draft_confidence_threshold!r}."
            )
        return Eagle3DraftState(cache=SlotKVCache(), confidence_threshold=draft_confidence_threshold)

    def observe(self, state: Eagle3DraftState, inputs: DraftInputs) -> None:
        # Drop the speculative slots of the last proposal; the verified slots below replace them.
        state.cache.crop(state.committed_slots)
        feats = self.select_target_features(inputs.hidden_states)
        hidden = self.fuse_target_features(feats)
        embeds = self.embed_target_tokens(inputs.next_token_ids)
        valid = inputs.valid.to(self.device)
        positions = inputs.position_ids.to(self.device)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        out = self.midlayer(embeds, hidden, cos, sin, state.cache, valid)
        state.cache.compact()  # batched rows leave dead slots (padding, rejected tokens): drop them now and then
        state.committed_slots = state.cache.length
        # Latest verified slot of each row: only its logits are needed (the first draft token).
        slot = torch.arange(valid.shape[1], device=valid.device)
        last = torch.where(valid, slot, -1).max(dim=1).values.clamp(min=0)
        rows = torch.arange(valid.shape[0], device=valid.device)
        state.last_hidden = out[rows, last]
        state.last_logits = self.draft_logits(state.last_hidden)
        state.last_position = positions[rows, last]

    def propose(self, state: Eagle3DraftState, num_tokens: int, select: TokenSelector) -> Proposal:
        """Drafts a chain; with ``draft_confidence_threshold`` (a ``generate`` option) a row stops before the first
        depth whose draft distribution has a top probability below the threshold, so rows propose different lengths.

        The stop is decided from the distribution *before* its token is drawn, so it never depends on the drawn
        token and lossless sampling stays exact."""
        tokens, probs = [], []
        logits, hidden = state.last_logits, state.last_hidden
        bsz = hidden.shape[0]
        ones = torch.ones(bsz, 1, dtype=torch.bool, device=hidden.device)
        reduced = self.config.draft_vocab_size != self.config.target_vocab_size
        vocab_ids = self.draft_token_ids if reduced else None
        threshold = state.confidence_threshold
        lengths = torch.zeros(bsz, dtype=torch.long, device=hidden.device)
        alive = torch.ones(bsz, dtype=torch.bool, device=hidden.device)
        for depth in range(num_tokens):
            if threshold is not None:
                alive &= torch.softmax(logits.float(), dim=-1).amax(dim=-1) >= threshold
                if depth > 0 and not bool(alive.any()):
                    break
                lengths += alive.long()
            tok, q = select(logits.float(), depth, vocab_ids)
            tokens.append(tok)
            probs.append(q)
            if depth == num_tokens - 1:
                break
            pos = (state.last_position + 1 + depth)[:, None]
            out, step_logits = self._step(
                self.embed_target_tokens(tok[:, None]), hidden[:, None], pos, ones, state.cache
            )
            hidden, logits = out[:, 0], step_logits[:, 0]
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            draft_probs=draft_probs,
            kind="chain",
            lengths=lengths if threshold is not None else None,
        )

    # ------------------------------------------------------------------------------------------------------------
    # tree drafting (EAGLE-2 dynamic trees and static trees; see hf_specdec.tree)
    # ------------------------------------------------------------------------------------------------------------
    def tree_start(self, state: Eagle3DraftState):
        """Root of a tree proposal: the draft distribution after the last verified token."""
        state.cache.crop(state.committed_slots)  # drop the slots of an earlier tree or chain proposal
        state.tree_hidden = None
        reduced = self.config.draft_vocab_size != self.config.target_vocab_size
        return state.last_logits, (self.draft_token_ids if reduced else None)

    def tree_expand(self, state: Eagle3DraftState, expansion) -> torch.Tensor:
        """One draft-layer step over ``M`` tree nodes of one depth: each reads its parent's draft hidden state (the
        last verified state for children of the root) and its own token, at position ``last + depth``, and attends
        to the verified slots plus the slots of its expanded ancestors. Returns ``(batch, M, draft_vocab)``."""
        bsz, m = expansion.tokens.shape
        dev = state.last_hidden.device
        parent = expansion.parent.to(dev)
        if state.tree_hidden is None:
            parent_hidden = state.last_hidden[:, None].expand(bsz, m, -1)
        else:
            idx = parent.clamp_min(0)[..., None].expand(-1, -1, state.tree_hidden.shape[-1])
            parent_hidden = torch.where(
                (parent >= 0)[..., None], state.tree_hidden.gather(1, idx), state.last_hidden[:, None]
            )
        committed = state.committed_slots
        expanded = 0 if state.tree_hidden is None else state.tree_hidden.shape[1]
        valid_prev = (
            state.cache.valid[:, :committed] if committed else torch.zeros(bsz, 0, dtype=torch.bool, device=dev)
        )
        mask = torch.cat(
            [
                valid_prev[:, None].expand(bsz, m, committed),
                expansion.ancestors.to(dev)[:, :, :expanded],
                torch.eye(m, dtype=torch.bool, device=dev)[None].expand(bsz, m, m),
            ],
            dim=2,
        )
        pos = (state.last_position + expansion.depth)[:, None].expand(bsz, m)
        cos, sin = self.rotary_emb(pos, parent_hidden.dtype)
        embeds = self.embed_target_tokens(expansion.tokens)
        ones = torch.ones(bsz, m, dtype=torch.bool, device=dev)
        out = self.midlayer(embeds, parent_hidden, cos, sin, state.cache, ones, attn_mask=mask)
        state.tree_hidden = out if state.tree_hidden is None else torch.cat([state.tree_hidden, out], dim=1)
        return self.draft_logits(out).float()
