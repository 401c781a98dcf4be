"""Building blocks that every family shares."""

from tformer.kernels.dropout import Dropout, dropout
from tformer.layers.attention import MultiHeadAttention
from tformer.layers.cache import DecoderCache, KVCache, Lineage, StaticKV
from tformer.layers.experts import (
    EXPERT_GLUS,
    ROUTER_SOFTMAX,
    Experts,
    MixtureOfExperts,
    Router,
    make_glu,
)
from tformer.layers.feedforward import (
    ACTIVATIONS,
    FEEDFORWARDS,
    FeedForward,
    GatedFeedForward,
    make_feedforward,
)
from tformer.layers.masks import (
    attention_bias,
    causal_mask,
    lm_mask,
    padding_mask,
    window_mask,
)
from tformer.layers.norm import NORMS, RMSNorm, make_norm
from tformer.layers.position import (
    POSITIONS,
    SINUSOID_LAYOUTS,
    LearnedPositions,
    SinusoidalPositions,
    sinusoids,
)
from tformer.layers.residual import Residual
from tformer.layers.rotary import ROTARY_LAYOUTS, ROTARY_SCALINGS, Rotary, RotaryScaling

__all__ = [
    "ACTIVATIONS",
    "DecoderCache",
    "EXPERT_GLUS",
    "Experts",
    "Dropout",
    "FEEDFORWARDS",
    "FeedForward",
    "GatedFeedForward",
    "KVCache",
    "LearnedPositions",
    "Lineage",
    "MixtureOfExperts",
    "MultiHeadAttention",
    "NORMS",
    "POSITIONS",
    "RMSNorm",
    "ROTARY_LAYOUTS",
    "ROTARY_SCALINGS",
    "ROUTER_SOFTMAX",
    "Residual",
    "Router",
    "Rotary",
    "RotaryScaling",
    "SINUSOID_LAYOUTS",
    "SinusoidalPositions",
    "StaticKV",
    "attention_bias",
    "causal_mask",
    "dropout",
    "lm_mask",
    "make_feedforward",
    "make_glu",
    "make_norm",
    "padding_mask",
    "sinusoids",
    "window_mask",
]
