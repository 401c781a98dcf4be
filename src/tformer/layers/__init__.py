"""Building blocks that every family shares."""

from tformer.kernels.dropout import Dropout, dropout
from tformer.layers.attention import (
    DecoderCache,
    KVCache,
    Lineage,
    MultiHeadAttention,
    StaticKV,
    attention_bias,
    causal_mask,
    lm_mask,
    padding_mask,
)
from tformer.layers.feedforward import ACTIVATIONS, FeedForward
from tformer.layers.position import (
    POSITIONS,
    SINUSOID_LAYOUTS,
    LearnedPositions,
    SinusoidalPositions,
    sinusoids,
)
from tformer.layers.residual import Residual

__all__ = [
    "ACTIVATIONS",
    "DecoderCache",
    "Dropout",
    "POSITIONS",
    "FeedForward",
    "KVCache",
    "LearnedPositions",
    "Lineage",
    "MultiHeadAttention",
    "Residual",
    "SINUSOID_LAYOUTS",
    "SinusoidalPositions",
    "StaticKV",
    "attention_bias",
    "causal_mask",
    "dropout",
    "lm_mask",
    "padding_mask",
    "sinusoids",
]
