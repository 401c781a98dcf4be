"""The training and validation losses of every family, in one place.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import Tensor, nn

from tformer.data.tokenizers import IGNORE_INDEX
from tformer.kernels.xent import cross_entropy, linear_cross_entropy


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


@dataclass(frozen=True)
class Targets:
    """What a forward pass is scored against. A model given Targets returns their loss in
    place of its logits (`model(tokens, targets=Targets(ids))`), computed from its last states
    and its output layer together (kernels/xent.py's linear_cross_entropy), so that the
    (B, T, V) logits, a step's largest tensor, are never held at once.

    ids: (B, T) target ids, IGNORE_INDEX where nothing is predicted; smoothing: label
    smoothing epsilon; reduction: "mean" over real targets, "sum", or "none" ((B * T,)).
    """

    ids: Tensor
    smoothing: float = 0.0
    reduction: str = "mean"

    def score(self, model: nn.Module, *args: object, **kwargs: object) -> Tensor:
        """The loss of the logits model(*args, **kwargs) gives: the model takes the targets
        itself where its forward has a `targets` parameter (tformer's families do), else
        they score its logits."""
        if takes_targets(model):
            return model(*args, targets=self, **kwargs)
        return self.of_logits(model(*args, **kwargs))

    def of_logits(self, logits: Tensor) -> Tensor:
        """The loss of (B, T, V) logits."""
        return label_smoothed_loss(logits, self.ids, self.smoothing, reduction=self.reduction)

    def of_states(self, states: Tensor, head: nn.Module) -> Tensor:
        """The loss of head(states) for (B, T, D) states; the same value as
        of_logits(head(states)) up to float rounding."""
        if type(head) is not nn.Linear:  # an adapted or quantized layer: through its logits
            return self.of_logits(head(states))
        return linear_cross_entropy(
            states.flatten(0, 1), head.weight, head.bias, self.ids.flatten(),
            ignore_index=IGNORE_INDEX, label_smoothing=self.smoothing, reduction=self.reduction,
        )


def takes_targets(model: nn.Module) -> bool:
    """Whether model.forward names a `targets` parameter (a wrapper that passes on any
    keyword, as DDP's does, does not)."""
    try:
        return "targets" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return False
