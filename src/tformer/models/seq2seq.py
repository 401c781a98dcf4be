"""The encoder-decoder Transformer for translation (Vaswani et al. 2017, "Attention Is All
You Need").

Shapes: B batch, S source length, T target length, D d_model, V vocabulary (shared by the
source and the target).

The model reads in the paper's order: embeddings scaled by sqrt(D) plus sinusoidal
positions (sec. 3.4, 3.5), N encoder layers (self-attention, FFN), N decoder layers (causal
self-attention, cross-attention over the encoder's output, FFN), and a projection to the
vocabulary tied to the embeddings (sec. 3.4). `encode` and `decode` are apart so that
decoding runs the encoder once per sentence and the decoder one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tformer.checks import check_range
from tformer.evaluation.loss import Targets
from tformer.layers import (
    DecoderCache,
    Dropout,
    KVCache,
    Lineage,
    MultiHeadAttention,
    Residual,
    SinusoidalPositions,
    StaticKV,
    attention_bias,
    lm_mask,
    make_feedforward,
    padding_mask,
)
from tformer.models.base import Model, StackConfig


@dataclass(frozen=True)
class Seq2SeqConfig(StackConfig):
    weight_free: ClassVar[frozenset[str]] = frozenset(
        {"dropout", "attn_dropout", "ff_dropout", "label_smoothing"}
    )
    """Fields a run that starts from a checkpoint's weights may change (train.init_from)."""

    n_layer: int = 6
    """Encoder layers; the decoder has as many unless n_decoder_layer says otherwise."""
    n_head: int = 8
    d_model: int = 512
    dropout: float = 0.1
    activation: str = "relu"
    tie_embeddings: bool = True
    """One matrix for the encoder embedding, the decoder embedding and the output
    projection (sec. 3.4); needs the shared source/target vocabulary."""
    scale_embeddings: bool = True
    max_len: int = 256
    """Longest source or target (in tokens) the position table covers."""
    n_decoder_layer: int | None = None
    attn_dropout: float = 0.0
    """Dropout on attention weights (the paper uses none)."""
    ff_dropout: float = 0.0
    """Dropout inside the FFN, after the activation (the paper uses none; `dropout` already
    covers every sublayer's output)."""
    label_smoothing: float = 0.1
    """epsilon_ls of sec. 5.4."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("model.max_len", self.max_len, low=1)
        if self.n_decoder_layer is not None:
            check_range("model.n_decoder_layer", self.n_decoder_layer, low=1)
        check_range("model.attn_dropout", self.attn_dropout, low=0.0, high=1.0)
        check_range("model.ff_dropout", self.ff_dropout, low=0.0, high=1.0)
        check_range("model.label_smoothing", self.label_smoothing, low=0.0, high=1.0)

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layer or self.n_layer


def _attention(cfg: Seq2SeqConfig, *, cross: bool) -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.d_model, cfg.n_head, d_head=cfg.d_head, d_value=cfg.d_value,
        dropout=cfg.attn_dropout, bias=cfg.attention_bias,
        cross=cross,
    )


def _residual(cfg: Seq2SeqConfig) -> Residual:
    return Residual(cfg.d_model, norm=cfg.norm, dropout=cfg.dropout, bias=cfg.bias,
                    kind=cfg.norm_kind, eps=cfg.norm_eps)


def _feedforward(cfg: Seq2SeqConfig) -> nn.Module:
    return make_feedforward(
        cfg.feedforward, cfg.d_model, cfg.ff_width, activation=cfg.activation,
        dropout=cfg.ff_dropout, bias=cfg.bias,
    )


class EncoderLayer(nn.Module):
    """Self-attention over the source, then the FFN (sec. 3.1)."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.attn = _attention(cfg, cross=False)
        self.ff = _feedforward(cfg)
        self.attn_residual = _residual(cfg)
        self.ff_residual = _residual(cfg)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attn_residual(x, lambda h: self.attn(h, mask=mask))
        return self.ff_residual(x, self.ff)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder's output, then the FFN."""

    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.self_attn = _attention(cfg, cross=False)
        self.cross_attn = _attention(cfg, cross=True)
        self.ff = _feedforward(cfg)
        self.self_residual = _residual(cfg)
        self.cross_residual = _residual(cfg)
        self.ff_residual = _residual(cfg)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_mask: Tensor,
        self_cache: KVCache | None,
        cross_cache: StaticKV | None,
        self_mask: Tensor | None = None,
    ) -> Tensor:
        # One new token sees every cached key, so it needs no mask; several tokens (a whole
        # right-padded target, or a first step with an empty cache) read under the causal
        # mask, and padding at the end is only ever seen by padding queries. `self_mask`
        # (causal and key padding) replaces the causal mask when the caller has one.
        is_causal = self_mask is None and x.shape[1] > 1
        x = self.self_residual(
            x, lambda h: self.self_attn(h, mask=self_mask, is_causal=is_causal, cache=self_cache)
        )
        x = self.cross_residual(
            x, lambda h: self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache)
        )
        return self.ff_residual(x, self.ff)


class Seq2Seq(Model):
    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        cfg.require_vocab()
        self.cfg = cfg
        self.src_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = SinusoidalPositions(cfg.max_len, cfg.d_model, cfg.sinusoid_layout)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.src_embed_norm = cfg.norm_module() if cfg.embed_norm else None
        self.tgt_embed_norm = cfg.norm_module() if cfg.embed_norm else None
        self.dropout = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layer))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Pre-norm leaves each stack's residual stream un-normalised: one norm closes it.
        pre = cfg.norm == "pre" and cfg.final_norm
        self.encoder_norm = cfg.norm_module() if pre else None
        self.decoder_norm = cfg.norm_module() if pre else None
        self.out_proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.output_bias)
        self._init_weights()
        if cfg.tie_embeddings:
            self.tgt_embed.weight = self.src_embed.weight
            self.out_proj.weight = self.src_embed.weight

    def _init_weights(self) -> None:
        """Xavier-uniform matrices, as the reference tensor2tensor and fairseq code does.
        Embeddings get N(0, D^-0.5), so that after the sqrt(D) scaling of sec. 3.4 they have
        unit variance, like the sinusoids they are added to."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for embed in (self.src_embed, self.tgt_embed):
            nn.init.normal_(embed.weight, mean=0.0, std=self.cfg.d_model**-0.5)
        nn.init.normal_(self.out_proj.weight, mean=0.0, std=self.cfg.d_model**-0.5)

    def _embed(
        self,
        embed: nn.Embedding,
        norm: nn.Module | None,
        tokens: Tensor,
        start: int = 0,
        is_real: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Scaled embeddings plus positions: start, start + 1, ... or, given is_real, the
        number of real tokens before each one (so padding shifts nothing), or given
        `positions` (B, T), those."""
        end = start + tokens.shape[1] if positions is None else int(positions.max()) + 1
        if end > self.cfg.max_len:
            raise ValueError(f"{end} tokens exceed the model's max_len of {self.cfg.max_len}")
        if positions is None and is_real is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        elif positions is None:
            positions = (is_real.cumsum(1) - 1).clamp(min=0)
        x = embed(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        x = x + self.positions(positions)
        if norm is not None:
            x = norm(x)
        return self.dropout(x)

    def encode(self, src: Tensor, src_real: Tensor) -> Tensor:
        """src (B, S) token ids, src_real (B, S) True at real tokens -> memory (B, S, D).

        Padding keys are masked out, so a real position's output does not depend on how
        much padding follows it; outputs at padding positions are meaningless.
        """
        x = self._embed(self.src_embed, self.src_embed_norm, src)
        # As a float bias, made once here rather than by SDPA in every layer.
        mask = attention_bias(padding_mask(src_real), x.dtype)
        for layer in self.encoder:
            x = layer(x, mask)
        return self.encoder_norm(x) if self.encoder_norm is not None else x

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        src_real: Tensor,
        *,
        cache: DecoderCache | None = None,
        tgt_real: Tensor | None = None,
        targets: Targets | None = None,
    ) -> Tensor:
        """tgt (B, T) target ids so far (starting with BOS) -> logits (B, T, V).

        memory (B', S, D), src_real (B', S): the encoder's output and its padding; B' may
            divide B (beams of one sentence share their source, as a view).
        cache: from make_cache; tgt then holds only the new tokens after the cached ones,
            and the cross-attention keys/values are computed on the first call only.
        tgt_real: (B, T) True at real target tokens: self-attention then also skips padding
            keys and positions count real tokens only, so a padded target gives the outputs
            of the same target unpadded at every real position, wherever the padding is
            (without it, only right padding is safe).
        targets: (evaluation/loss.py) return their loss instead of the logits, never holding
            all of these at once.
        """
        x, memory_mask, self_mask = self.decoder_inputs(tgt, src_real, cache=cache,
                                                        tgt_real=tgt_real)
        x = self.decoder_stack(x, memory, memory_mask, self_mask, cache)
        return self.decoder_outputs(x, targets=targets)

    def embed_targets(self, tgt: Tensor, positions: Tensor) -> Tensor:
        """(B, T) target ids at (B, T) positions -> the decoder's inputs (B, T, D): rows at
        different steps (decoding/beam_pool.py)."""
        return self._embed(self.tgt_embed, self.tgt_embed_norm, tgt, positions=positions)

    def decoder_inputs(
        self, tgt: Tensor, src_real: Tensor, *, cache: DecoderCache | None = None,
        tgt_real: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """`decode`'s first step (apart, so that a decoding runner, tformer.decoding.runner,
        may compute the layers another way): the embedded targets (B, T, D), the memory's
        padding as a float bias (B', 1, 1, S), and the targets' own mask (None: causal)."""
        start = cache.length if cache is not None else 0
        if start > 0 and tgt.shape[1] > 1:
            raise ValueError("after the first cached step, decode one token at a time")
        if tgt_real is not None and start > 0:
            raise ValueError("tgt_real is for whole targets, not cached steps")
        x = self._embed(self.tgt_embed, self.tgt_embed_norm, tgt, start, tgt_real)
        # As float biases, made once here rather than by SDPA in every layer.
        memory_mask = attention_bias(padding_mask(src_real), x.dtype)
        self_mask = None
        if tgt_real is not None:
            self_mask = attention_bias(lm_mask(tgt_real, tgt.shape[1], tgt.shape[1], tgt.device),
                                       x.dtype)
        return x, memory_mask, self_mask

    def decoder_stack(self, x: Tensor, memory: Tensor, memory_mask: Tensor,
                      self_mask: Tensor | None, cache: DecoderCache | None = None) -> Tensor:
        """Every decoder layer in turn: the (B, T, D) states after them."""
        for i, layer in enumerate(self.decoder):
            self_cache = cache.self_attn[i] if cache is not None else None
            cross_cache = cache.cross_attn[i] if cache is not None else None
            x = layer(x, memory, memory_mask, self_cache, cross_cache, self_mask)
        return x

    def decoder_outputs(self, x: Tensor, *, targets: Targets | None = None) -> Tensor:
        """The closing norm and the vocabulary projection (or the loss of `targets`)."""
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        if targets is not None:
            return targets.of_states(x, self.out_proj)
        return self.out_proj(x)

    def forward(
        self, src: Tensor, src_real: Tensor, tgt: Tensor, tgt_real: Tensor | None = None, *,
        targets: Targets | None = None,
    ) -> Tensor:
        """Teacher forcing: (B, S) source, (B, S) its mask, (B, T) target inputs (and
        optionally their mask, see `decode`) -> (B, T, V) logits, or the loss of `targets`."""
        return self.decode(tgt, self.encode(src, src_real), src_real, tgt_real=tgt_real,
                           targets=targets)

    def make_cache(self, batch: int, max_len: int, *, lineage: bool = False) -> DecoderCache:
        """An empty cache for `batch` target sequences of up to `max_len` tokens: a KV cache
        per decoder layer and a slot per layer for the encoder's keys/values. lineage: beam
        search's reorders go through a Lineage instead of copying the caches (for an
        attention kernel that reads keys where it says: tformer.decoding.runner asks for
        one where the kernel serves)."""
        attn = self.decoder[0].self_attn
        param = self.src_embed.weight
        layers = range(len(self.decoder))
        shared = Lineage(batch, max_len, param.device) if lineage else None
        return DecoderCache(
            [
                KVCache(batch, self.cfg.n_head, max_len, attn.d_head, attn.d_value,
                        dtype=param.dtype, device=param.device, lineage=shared)
                for _ in layers
            ],
            [StaticKV() for _ in layers],
        )
