"""GPT: a decoder-only Transformer language model (Radford et al. 2018, 2019), and the
layouts that grew from it (Llama, Qwen, Mistral, Gemma 2 and 3, Phi-3) as choices of its
config.

Shapes: B batch, T new tokens, S tokens attended (cached + new), D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tformer.checks import check_choice, check_range
from tformer.errors import TformerError
from tformer.evaluation.loss import Targets
from tformer.layers import (
    EXPERT_GLUS,
    POSITIONS,
    ROTARY_LAYOUTS,
    ROTARY_SCALINGS,
    ROUTER_SOFTMAX,
    DecoderCache,
    Dropout,
    Experts,
    GatedFeedForward,
    KVCache,
    MixtureOfExperts,
    MultiHeadAttention,
    Residual,
    Rotary,
    RotaryScaling,
    Router,
    lm_mask,
    make_feedforward,
    make_glu,
    make_norm,
    window_mask,
)
from tformer.models.base import Model, StackConfig

ROPE_LLAMA3 = frozenset({"rope_low_freq_factor", "rope_high_freq_factor"})
ROPE_YARN = frozenset({"rope_beta_fast", "rope_beta_slow", "rope_truncate",
                       "rope_attention_factor"})
ROPE_SCALED = frozenset({"rope_factor", "rope_original_context", *ROPE_LLAMA3, *ROPE_YARN})
"""The fields of rotary scalings: linear reads the factor alone, llama3 and yarn the factor,
the original context and their own."""
EXPERT_FIELDS = ("n_expert_active", "router_softmax", "router_renormalise", "d_shared_expert",
                 "expert_glu", "glu_limit", "glu_alpha", "expert_bias", "router_bias",
                 "router_balance")
"""The fields a mixture of experts reads, moot without experts."""


@dataclass(frozen=True)
class GPTConfig(StackConfig):
    weight_free: ClassVar[frozenset[str]] = frozenset({"dropout", "router_balance"})
    """Fields a run that starts from a checkpoint's weights may change (train.init_from)."""

    context: int = 64
    position: str = "learned"
    """Absolute positions added to the embeddings: learned, sinusoidal, or none (with
    rotary embeddings, which place tokens inside attention)."""
    n_kv_head: int | None = None
    """Key/value heads, shared by groups of query heads; none means n_head (1: multi-query)."""
    qkv_bias: bool | None = None
    """Biases on the q/k/v projections alone (Qwen2); none means attn_bias."""
    qk_norm: bool = False
    """A norm (of norm_kind) over each query and key head before rotary (Qwen3)."""
    attn_sinks: bool = False
    """A learned logit per head in every attention softmax's denominator (gpt-oss)."""
    window: int | None = None
    """Sliding-window attention: each token sees itself and the window - 1 before it."""
    rotary: bool = False
    """Rotary position embeddings on queries and keys (Su et al. 2021)."""
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0
    """The part of each head that rotates (the first dimensions)."""
    rope_layout: str = "halves"
    """halves (rotate-half: Llama's Hugging Face code) or interleaved (RoFormer, GPT-J)."""
    rope_scaling: str = "none"
    """none, linear, or llama3 (see layers.rotary.RotaryScaling)."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    rope_local_theta: float | None = None
    """The rotary base of the sliding-window layers, unscaled (Gemma 3's local layers);
    none: they rotate as the others do."""
    global_every: int = 0
    """With a window: every global_every-th layer (the last of each group) attends over the
    whole context instead (Gemma 2: 2, Gemma 3: 6); 0: every layer slides."""
    sandwich_norm: bool = False
    """A norm on each sublayer's output too, before it joins the residual (Gemma 2, 3)."""
    attn_scale: float | None = None
    """The factor on q . k; none means 1 / sqrt(d_head) (Gemma: query_pre_attn_scalar^-1/2)."""
    attn_softcap: float | None = None
    """Attention scores bounded by cap * tanh(s / cap) before the mask (Gemma 2)."""
    logit_softcap: float | None = None
    """Logits bounded by cap * tanh(z / cap) (Gemma 2's final soft-capping)."""
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float | None = None
    """yarn's (see layers.rotary.RotaryScaling); none: 0.1 ln(rope_factor) + 1."""
    n_expert: int = 0
    """Experts in each feed-forward layer, each a gated feed-forward of d_ff (a mixture of
    experts, layers.experts); 0: one dense feed-forward of `feedforward`'s kind."""
    n_expert_active: int = 2
    """The experts each token goes through (the router's top k)."""
    router_softmax: str = "before"
    """before top-k, over every expert (Qwen), or after, over the k chosen (Mixtral)."""
    router_renormalise: bool = False
    """Scale the chosen experts' weights to sum to 1 (Qwen3-MoE's norm_topk_prob)."""
    d_shared_expert: int = 0
    """The width of an expert every token goes through, under a sigmoid gate (Qwen2-MoE);
    0: none."""
    expert_glu: str = "gated"
    """An expert's gate: gated, activation(gate) * up; clamped, gpt-oss's
    gate * sigmoid(glu_alpha * gate) * (up + 1) with both clamped by glu_limit."""
    glu_limit: float = 7.0
    glu_alpha: float = 1.702
    expert_bias: bool = False
    """Biases on the experts' projections (gpt-oss)."""
    router_bias: bool = False
    """A bias on the router's scores (gpt-oss)."""
    router_balance: float = 0.0
    """In training, the weight of Switch Transformer's load-balancing loss, added to what
    the backward pass minimises (Qwen-MoE's router_aux_loss_coef, 0.001); 0: none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("model.context", self.context, low=1)
        check_choice("model.position", self.position, tuple(POSITIONS))
        if self.n_kv_head is not None:
            check_range("model.n_kv_head", self.n_kv_head, low=1, high=self.n_head)
            if self.n_head % self.n_kv_head:
                raise TformerError(f"model.n_kv_head = {self.n_kv_head} must divide "
                                   f"model.n_head = {self.n_head}")
        if self.window is not None:
            check_range("model.window", self.window, low=1)
        check_range("model.rope_theta", self.rope_theta, low=1.0)
        check_range("model.rope_fraction", self.rope_fraction, low=0.0, high=1.0)
        check_choice("model.rope_layout", self.rope_layout, ROTARY_LAYOUTS)
        check_choice("model.rope_scaling", self.rope_scaling, ROTARY_SCALINGS)
        check_range("model.rope_factor", self.rope_factor, low=1.0)
        check_range("model.global_every", self.global_every, low=0)
        for key in ("rope_local_theta", "attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(self, key) is not None:
                check_range(f"model.{key}", getattr(self, key), low=1e-9)
        if self.sandwich_norm and self.norm != "pre":
            raise TformerError("model.sandwich_norm = true needs model.norm = 'pre'")
        if self.rope_attention_factor is not None:
            check_range("model.rope_attention_factor", self.rope_attention_factor, low=0.0)
        if self.rope_beta_fast <= self.rope_beta_slow or self.rope_beta_slow <= 0:
            raise TformerError(f"model.rope_beta_fast = {self.rope_beta_fast} must exceed "
                               f"model.rope_beta_slow = {self.rope_beta_slow} > 0")
        check_range("model.n_expert", self.n_expert, low=0)
        if self.n_expert:
            check_range("model.n_expert_active", self.n_expert_active, low=1,
                        high=self.n_expert)
            check_choice("model.router_softmax", self.router_softmax, ROUTER_SOFTMAX)
            check_range("model.d_shared_expert", self.d_shared_expert, low=0)
            check_choice("model.expert_glu", self.expert_glu, EXPERT_GLUS)
            check_range("model.glu_limit", self.glu_limit, low=0.0)
            check_range("model.router_balance", self.router_balance, low=0.0)
            if self.feedforward != "gated":
                raise TformerError(f"model.n_expert = {self.n_expert} needs model.feedforward "
                                   f"= 'gated' (experts are gated feed-forwards), not "
                                   f"{self.feedforward!r}")
        if self.rotary and 2 * int(self.head_size * self.rope_fraction // 2) < 2:
            raise TformerError(f"model.rope_fraction = {self.rope_fraction} rotates nothing "
                               f"of a head of {self.head_size}")

    def unused_fields(self) -> frozenset[str]:
        unused = set(super().unused_fields())
        if self.position != "sinusoidal":
            unused.add("sinusoid_layout")
        if self.norm != "pre":
            unused.add("final_norm")
        scaled = {"none": ROPE_SCALED, "linear": ROPE_SCALED - {"rope_factor"},
                  "llama3": ROPE_YARN, "yarn": ROPE_LLAMA3}
        if not self.n_expert:
            unused |= set(EXPERT_FIELDS)
        elif self.expert_glu != "clamped":
            unused |= {"glu_limit", "glu_alpha"}
        unused |= ({"rope_theta", "rope_fraction", "rope_layout", "rope_scaling", *ROPE_SCALED}
                   if not self.rotary else scaled.get(self.rope_scaling, set()))
        if self.window is None:
            unused |= {"global_every", "rope_local_theta"}
        if not self.rotary:
            unused.add("rope_local_theta")
        return frozenset(unused)

    def slides(self, layer: int) -> bool:
        """Whether layer `layer` attends through the sliding window."""
        return self.window is not None and (
            self.global_every == 0 or (layer + 1) % self.global_every != 0)

    @property
    def cache_window(self) -> int | None:
        """The window behind which no layer reads the cache (every layer slides), or None."""
        return self.window if all(self.slides(i) for i in range(self.n_layer)) else None

    def feedforward_module(self) -> nn.Module:
        """A block's feed-forward: the mixture of experts where n_expert says so, else the
        dense one `feedforward` names."""
        if self.n_expert:
            router = Router(self.d_model, self.n_expert, self.n_expert_active,
                            softmax=self.router_softmax, renormalise=self.router_renormalise,
                            bias=self.router_bias)
            glu = make_glu(self.expert_glu, self.activation, self.glu_limit, self.glu_alpha)
            experts = Experts(self.d_model, self.ff_width, self.n_expert, glu=glu,
                              dropout=self.dropout, bias=self.expert_bias)
            shared = None
            if self.d_shared_expert:
                shared = GatedFeedForward(self.d_model, self.d_shared_expert,
                                          activation=self.activation, dropout=self.dropout,
                                          bias=False)
            return MixtureOfExperts(router, experts, shared, balance=self.router_balance)
        return make_feedforward(self.feedforward, self.d_model, self.ff_width,
                                activation=self.activation, dropout=self.dropout,
                                bias=self.bias)

    def rotary_module(self, *, local: bool = False) -> Rotary | None:
        """The rotary embeddings of the global layers, or of the sliding ones (`local`)."""
        if not self.rotary:
            return None
        if local and self.rope_local_theta is not None:
            return Rotary(self.head_size, theta=self.rope_local_theta,
                          fraction=self.rope_fraction, layout=self.rope_layout)
        scaling = RotaryScaling(self.rope_scaling, self.rope_factor, self.rope_low_freq_factor,
                                self.rope_high_freq_factor, self.rope_original_context,
                                self.rope_beta_fast, self.rope_beta_slow, self.rope_truncate,
                                self.rope_attention_factor)
        return Rotary(self.head_size, theta=self.rope_theta, fraction=self.rope_fraction,
                      layout=self.rope_layout, scaling=scaling)


CACHE_COLUMNS = 64
"""Positions a new KV cache makes room for; it grows as a prompt and its continuation need."""


@dataclass
class StackInput:
    """What the blocks read (GPT.inputs)."""

    x: Tensor
    """(B, T, D) embedded tokens."""
    mask: Tensor | None
    """May-attend, broadcastable to (B, 1, T, S); None: causal among the new tokens and
    every cached key."""
    positions: Tensor
    """(B, T) or (T,) positions, for rotary embeddings."""
    uniform: bool
    """Whether the last token's mask row covers every other new token's."""
    full_mask: Tensor | None = None
    """Where the window slides past some tokens and some layers do not slide: those
    layers' mask (`mask` without the window; None: causal, as for `mask`)."""
    mixed: bool = False
    """Whether the layers that do not slide read `full_mask`."""


class GPTBlock(nn.Module):
    """Causal self-attention then feed-forward, each inside a residual connection.
    `slides`: whether it attends through the window (the mask it reads: GPT.stack)."""

    def __init__(self, cfg: GPTConfig, rotary: Rotary | None, *, slides: bool = True) -> None:
        super().__init__()
        self.slides = slides
        qkv_bias = cfg.attention_bias if cfg.qkv_bias is None else cfg.qkv_bias

        def head_norm(d: int) -> nn.Module:
            return make_norm(cfg.norm_kind, d, eps=cfg.norm_eps, bias=cfg.bias)

        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.n_head, d_head=cfg.d_head, d_value=cfg.d_value,
            n_kv_head=cfg.n_kv_head, dropout=cfg.dropout, bias=qkv_bias,
            out_bias=cfg.attention_bias, qk_norm=head_norm if cfg.qk_norm else None,
            rotary=rotary, scale=cfg.attn_scale, softcap=cfg.attn_softcap, sinks=cfg.attn_sinks,
        )
        self.ff = cfg.feedforward_module()
        self.attn_residual, self.ff_residual = (
            Residual(cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias,
                     kind=cfg.norm_kind, eps=cfg.norm_eps, out_norm=cfg.sandwich_norm)
            for _ in range(2)
        )

    def forward(
        self, x: Tensor, mask: Tensor | None, cache: KVCache | None, positions: Tensor
    ) -> Tensor:
        # Without a mask, T > 1 new tokens are a prompt with nothing cached before it (the
        # model builds a mask otherwise), and a single new token may see every cached key.
        is_causal = mask is None and x.shape[1] > 1
        x = self.attn_residual(
            x, lambda h: self.attn(h, mask=mask, is_causal=is_causal, cache=cache,
                                   positions=positions)
        )
        return self.ff_residual(x, self.ff)


class GPT(Model):
    tied_table: ClassVar[tuple[str, str]] = ("embed", "lm_head")
    """The embedding table and the output layer tie_embeddings ties: a weight format that
    makes the output layer blocks makes the table a lookup in them (kernels/formats.py)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        cfg.require_vocab()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = POSITIONS[cfg.position](cfg.context, cfg.d_model, cfg.sinusoid_layout)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.embed_norm = cfg.norm_module() if cfg.embed_norm else None
        self.dropout = Dropout(cfg.dropout)
        # One rotary table for every layer of a kind (its buffer is not saved).
        rotary = cfg.rotary_module()
        local = rotary if cfg.rope_local_theta is None else cfg.rotary_module(local=True)
        self.blocks = nn.ModuleList(
            GPTBlock(cfg, local if cfg.slides(i) else rotary, slides=cfg.slides(i))
            for i in range(cfg.n_layer))
        # Pre-norm leaves the residual stream un-normalised: one norm closes the stack.
        closing_norm = cfg.norm == "pre" and cfg.final_norm
        self.final_norm = cfg.norm_module() if closing_norm else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.output_bias)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) everywhere, and the projections that write into
        the residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow with
        depth (Radford et al. 2019, sec. 2.3)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            ff = block.ff
            if isinstance(ff, MixtureOfExperts):
                ff.experts.reset_parameters(std=0.02, down_std=residual_std)
                ff = ff.shared
            if ff is not None:
                nn.init.normal_(ff.down.weight, mean=0.0, std=residual_std)

    def make_cache(
        self, batch: int, max_len: int | None = None, *, padded: bool = False
    ) -> DecoderCache:
        """An empty KV cache for `batch` sequences of up to `max_len` (default: context) tokens,
        whose buffers grow with what they hold (`reserve` makes room ahead).
        `padded`: the prompts will come with a padding mask that the cache must remember."""
        cfg = self.cfg
        max_len = min(max_len or cfg.context, cfg.context)
        attn = self.blocks[0].attn
        dtype, device = self.state_kind()
        return DecoderCache(
            [
                KVCache(batch, attn.n_kv_head, max_len, attn.d_head, attn.d_value,
                        dtype=dtype, device=device, columns=CACHE_COLUMNS)
                for _ in range(cfg.n_layer)
            ],
            track_padding=padded,
        )

    def state_kind(self) -> tuple[torch.dtype, torch.device]:
        """The dtype and device of the states the blocks compute on: the embedding's, or,
        for a table held as blocks (kernels.blocks.BlockEmbedding, which looks rows up in
        fp32), fp32 on its blocks' device."""
        held = getattr(self.embed, "blocks", None)
        if held is not None:
            return torch.float32, held.device
        return self.embed.weight.dtype, self.embed.weight.device

    def forward(
        self,
        tokens: Tensor,
        is_real: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        last_only: bool = False,
        targets: Targets | None = None,
    ) -> Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) with `last_only`.

        is_real: (B, T) True at real tokens, False at padding. Padding keys are never attended
            to, and positions count real tokens only, so a left-padded row gives the same
            outputs as the same row unpadded.
        cache: a DecoderCache from make_cache; the new tokens continue what it holds.
        targets: (evaluation/loss.py) return their loss instead of the logits, never holding
            all of these at once.

        Its three steps (`inputs`, `stack`, `outputs`) are apart so that a decoding runner
        (tformer.decoding.runner) may compute the middle one another way.
        """
        inp = self.inputs(tokens, is_real, cache)
        return self.outputs(self.stack(inp, cache), last_only=last_only, targets=targets)

    def inputs(self, tokens: Tensor, is_real: Tensor | None = None,
               cache: DecoderCache | None = None) -> StackInput:
        """The embedded tokens and what the blocks attend with: the mask over cached and new
        keys and each token's position (the cache's padding record takes is_real)."""
        B, T = tokens.shape
        past = cache.length if cache is not None else 0
        if past + T > self.cfg.context:
            raise ValueError(f"{past + T} tokens exceed the model's context of {self.cfg.context}")

        keys_real = is_real
        if cache is not None and cache.is_real is not None:
            if is_real is not None:
                cache.is_real[:, past : past + T] = is_real
            keys_real = cache.is_real[:, : past + T]
        if keys_real is None:
            key_positions = torch.arange(past + T, device=tokens.device)[None]
        else:
            # Position of each token = number of real tokens before it (in cache and input).
            key_positions = (keys_real.cumsum(1) - 1).clamp(min=0)
        positions = key_positions[:, past:]
        window = self.cfg.window
        windowed = window is not None and past + T > window

        mask = full = None
        if keys_real is not None or (past > 0 and T > 1):
            mask = full = lm_mask(keys_real, T, past + T, tokens.device)
        if windowed:
            if mask is None:
                mask = lm_mask(keys_real, T, past + T, tokens.device)
            mask = mask & window_mask(key_positions, T, window)
        mixed = windowed and self.cfg.cache_window is None

        x = self.embed_at(tokens, positions if keys_real is not None else positions[0])
        # The last token's mask row covers the others' where no window slides between them
        # and no padding is among them (a padding query sees itself, lm_mask).
        uniform = T == 1 or not (windowed or (is_real is not None and not bool(is_real.all())))
        return StackInput(x, mask, positions if keys_real is not None else positions[0],
                          uniform, full, mixed)

    def embed_at(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """(B, T) tokens at (B, T) or (T,) positions -> the (B, T, D) states the first block
        reads (a paged cache's step embeds its rows at their own positions)."""
        x = self.embed(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        absolute = self.positions(positions)
        if absolute is not None:
            x = x + absolute
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return self.dropout(x)

    def stack(self, inp: StackInput, cache: DecoderCache | None = None) -> Tensor:
        """Every block in turn: the (B, T, D) states after them."""
        x = inp.x
        for i, block in enumerate(self.blocks):
            mask = inp.full_mask if inp.mixed and not block.slides else inp.mask
            x = block(x, mask, cache.self_attn[i] if cache is not None else None,
                      inp.positions)
        return x

    def outputs(self, x: Tensor, *, last_only: bool = False,
                targets: Targets | None = None) -> Tensor:
        """The closing norm and the vocabulary projection (or the loss of `targets`)."""
        if last_only:
            x = x[:, -1:]
        if self.final_norm is not None:
            x = self.final_norm(x)
        cap = self.cfg.logit_softcap
        if cap is None:
            return self.lm_head(x) if targets is None else targets.of_states(x, self.lm_head)
        logits = cap * torch.tanh(self.lm_head(x) / cap)
        return logits if targets is None else targets.of_logits(logits)
