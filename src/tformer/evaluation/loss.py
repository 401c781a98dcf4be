"""The training and validation losses of every family, in one place.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

from torch import Tensor

from tformer.data.tokenizers import IGNORE_INDEX
from tformer.kernels.xent import cross_entropy


def lm_loss(logits: Tensor, targets: Tensor, *, reduction: str = "mean") -> Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets; IGNORE_INDEX targets
    (padding) count for nothing."""
    return label_smoothed_loss(logits, targets, 0.0, reduction=reduction)


def label_smoothed_loss(
    logits: Tensor, targets: Tensor, epsilon: float, *, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) targets with label smoothing
    (Szegedy et al. 2016; Vaswani et al. 2017, sec. 5.4): the target distribution puts
    1 - epsilon on the right token and spreads epsilon evenly over the vocabulary.
    IGNORE_INDEX targets (padding) count for nothing; "mean" averages over real tokens.
    The sum is taken in fp32 whatever the logits' dtype (bf16 autocast); on a CPU, through
    tformer's kernel (tformer.kernels.xent), which never writes out the log-probabilities."""
    return cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
        label_smoothing=epsilon, reduction=reduction,
    )
