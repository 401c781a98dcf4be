"""Building blocks that every family shares."""

from tformer.layers.attention import (
    DecoderCache,
    KVCache,
    MultiHeadAttention,
    StaticKV,
    attention_bias,
    causal_mask,
    lm_mask,
    padding_mask,
)
from tformer.layers.feedforward import FeedForward
from tformer.layers.position import POSITIONS, LearnedPositions, SinusoidalPositions, sinusoids
from tformer.layers.residual import Residual

__all__ = [
    "DecoderCache",
    "POSITIONS",
    "FeedForward",
    "KVCache",
    "LearnedPositions",
    "MultiHeadAttention",
    "Residual",
    "SinusoidalPositions",
    "StaticKV",
    "attention_bias",
    "causal_mask",
    "lm_mask",
    "padding_mask",
    "sinusoids",
]
