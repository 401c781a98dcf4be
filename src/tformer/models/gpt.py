"""GPT: a decoder-only Transformer language model (Radford et al. 2018, 2019).

Shapes: B batch, T new tokens, S tokens attended (cached + new), D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tformer.checks import check_choice, check_heads, check_range
from tformer.layers import (
    ACTIVATIONS,
    POSITIONS,
    SINUSOID_LAYOUTS,
    DecoderCache,
    Dropout,
    FeedForward,
    KVCache,
    MultiHeadAttention,
    Residual,
    lm_mask,
)


@dataclass(frozen=True)
class GPTConfig:
    weight_free: ClassVar[frozenset[str]] = frozenset({"dropout"})
    """Fields a run that starts from a checkpoint's weights may change (train.init_from)."""

    vocab_size: int = 0
    """Set from the tokenizer when training starts; 0 in a config file means 'from data'."""
    context: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0
    """0 means 4 * d_model."""
    d_head: int | None = None
    """Query/key size per head; none means d_model / n_head."""
    d_value: int | None = None
    """Value size per head; none means d_head."""
    dropout: float = 0.0
    activation: str = "gelu"
    position: str = "learned"
    norm: str = "pre"
    tie_embeddings: bool = True
    bias: bool = True
    """Biases in every linear layer and LayerNorm (attention: unless attn_bias says)."""
    attn_bias: bool | None = None
    """Biases in the attention projections; none means the same as `bias`."""
    output_bias: bool = False
    """A bias on the projection to the vocabulary."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(d_model) before adding positions (Vaswani et al.
    2017, sec. 3.4)."""
    embed_norm: bool = False
    """A LayerNorm right after token + position embeddings (BERT, BLOOM)."""
    final_norm: bool = True
    """Pre-norm: the LayerNorm that closes the stack (GPT-2 has it)."""
    sinusoid_layout: str = "interleaved"
    """position = sinusoidal: interleaved sin/cos, or halves ([sin | cos])."""

    def __post_init__(self) -> None:
        check_range("model.vocab_size", self.vocab_size, low=0)
        for key in ("context", "n_layer", "n_head", "d_model"):
            check_range(f"model.{key}", getattr(self, key), low=1)
        check_range("model.d_ff", self.d_ff, low=0)
        for key in ("d_head", "d_value"):
            if getattr(self, key) is not None:
                check_range(f"model.{key}", getattr(self, key), low=1)
        check_heads("model", self.d_model, self.n_head, self.d_head)
        check_range("model.dropout", self.dropout, low=0.0, high=1.0)
        check_choice("model.activation", self.activation, tuple(ACTIVATIONS))
        check_choice("model.position", self.position, tuple(POSITIONS))
        check_choice("model.norm", self.norm, ("pre", "post"))
        check_choice("model.sinusoid_layout", self.sinusoid_layout, SINUSOID_LAYOUTS)

    @property
    def ff_width(self) -> int:
        return self.d_ff or 4 * self.d_model


class GPTBlock(nn.Module):
    """Causal self-attention then feed-forward, each inside a residual connection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(
            cfg.d_model,
            cfg.n_head,
            d_head=cfg.d_head,
            d_value=cfg.d_value,
            dropout=cfg.dropout,
            bias=cfg.bias if cfg.attn_bias is None else cfg.attn_bias,
        )
        self.ff = FeedForward(
            cfg.d_model,
            cfg.ff_width,
            activation=cfg.activation,
            dropout=cfg.dropout,
            bias=cfg.bias,
        )
        self.attn_residual = Residual(
            cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias
        )
        self.ff_residual = Residual(cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias)

    def forward(self, x: Tensor, mask: Tensor | None, cache: KVCache | None) -> Tensor:
        # Without a mask, T > 1 new tokens are a prompt with nothing cached before it (the
        # model builds a mask otherwise), and a single new token may see every cached key.
        is_causal = mask is None and x.shape[1] > 1
        x = self.attn_residual(
            x, lambda h: self.attn(h, mask=mask, is_causal=is_causal, cache=cache)
        )
        return self.ff_residual(x, self.ff)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError(
                "GPTConfig.vocab_size must be set (from the tokenizer) to build a model"
            )
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = POSITIONS[cfg.position](cfg.context, cfg.d_model, cfg.sinusoid_layout)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.embed_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias) if cfg.embed_norm else None
        self.dropout = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        # Pre-norm leaves the residual stream un-normalised: one LayerNorm closes the stack.
        closing_norm = cfg.norm == "pre" and cfg.final_norm
        self.final_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias) if closing_norm else None
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
            nn.init.normal_(block.ff.down.weight, mean=0.0, std=residual_std)

    def make_cache(
        self, batch: int, max_len: int | None = None, *, padded: bool = False
    ) -> DecoderCache:
        """An empty KV cache for `batch` sequences of up to `max_len` (default: context) tokens.
        `padded`: the prompts will come with a padding mask that the cache must remember."""
        cfg = self.cfg
        max_len = min(max_len or cfg.context, cfg.context)
        attn = self.blocks[0].attn
        param = self.embed.weight
        return DecoderCache(
            [
                KVCache(
                    batch,
                    cfg.n_head,
                    max_len,
                    attn.d_head,
                    attn.d_value,
                    dtype=param.dtype,
                    device=param.device,
                )
                for _ in range(cfg.n_layer)
            ],
            track_padding=padded,
        )

    def forward(
        self,
        tokens: Tensor,
        is_real: Tensor | None = None,
        *,
        cache: DecoderCache | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) with `last_only`.

        is_real: (B, T) True at real tokens, False at padding. Padding keys are never attended
            to, and positions count real tokens only, so a left-padded row gives the same
            outputs as the same row unpadded.
        cache: a DecoderCache from make_cache; the new tokens continue what it holds.
        """
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
            positions = torch.arange(past, past + T, device=tokens.device)
        else:
            # Position of each token = number of real tokens before it (in cache and input).
            positions = (keys_real.cumsum(1) - 1).clamp(min=0)[:, past:]

        mask = None
        if keys_real is not None or (past > 0 and T > 1):
            mask = lm_mask(keys_real, T, past + T, tokens.device)

        x = self.embed(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        x = x + self.positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, mask, cache.self_attn[i] if cache is not None else None)
        if last_only:
            x = x[:, -1:]
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.lm_head(x)

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())
