"""Learning-rate schedules as pure functions of the step and a saved horizon."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tformer.config import TrainConfig


@dataclass(frozen=True)
class Horizon:
    """Where the decay ends, saved with the trainer state.

    A run resumed with another `train.steps` does not stretch the old curve (which would send
    the rate back up): it continues the decay from the rate it had reached, `from_lr` at
    `from_step`, down to min_lr at the new last step.
    """

    steps: int
    from_step: int = 0
    from_lr: float | None = None
    """None: the decay starts at lr when warmup ends, as the config says. Otherwise only
    steps from `from_step` on are asked for: the run is past the others."""


def learning_rate(
    step: int, cfg: TrainConfig, d_model: int, horizon: Horizon | None = None
) -> float:
    """The rate for optimizer step `step` (0-based).

    cosine:   linear warmup to lr, then half a cosine down to min_lr at the last step.
    linear:   linear warmup to lr, then a straight line down to min_lr at the last step
              (for short runs it often ends lower than the cosine: Bergsma et al. 2025,
              "Straight to Zero: Why Linearly Decaying the Learning Rate to Zero Works
              Best for LLMs").
    constant: linear warmup to lr, then lr.
    noam:     Vaswani et al. 2017, eq. 3: d_model^-0.5 * min(n^-0.5, n * warmup^-1.5) with
              n = step + 1, scaled by `lr` (lr = 1 gives the paper's schedule).

    horizon: the last step of the decay (default: cfg.steps), and where a changed horizon
        took over from the rate reached so far.
    """
    horizon = horizon or Horizon(cfg.steps)
    n = step + 1
    if cfg.schedule == "noam":
        warmup = max(cfg.warmup_steps, 1)
        return cfg.lr * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)
    if horizon.from_lr is None:
        if n <= cfg.warmup_steps:
            return cfg.lr * n / cfg.warmup_steps
        if cfg.schedule == "constant":
            return cfg.lr
        peak = cfg.lr
        progress = (n - cfg.warmup_steps) / max(horizon.steps - cfg.warmup_steps, 1)
    else:
        if cfg.schedule == "constant":
            return cfg.lr
        # from_lr at from_step, min_lr at the last step (horizon.steps - 1).
        peak = horizon.from_lr
        progress = (step - horizon.from_step) / max(horizon.steps - 1 - horizon.from_step, 1)
    progress = min(progress, 1.0)
    if cfg.schedule == "linear":
        return peak + (cfg.min_lr - peak) * progress
    return cfg.min_lr + 0.5 * (peak - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def extend(horizon: Horizon, step: int, cfg: TrainConfig, d_model: int) -> Horizon:
    """The horizon after `train.steps` changed on resume at `step`: the decay goes on from the
    rate of the next step under the old horizon, to min_lr at cfg.steps."""
    if cfg.steps == horizon.steps:
        return horizon
    if step < cfg.warmup_steps or cfg.schedule in ("noam", "constant"):
        return Horizon(cfg.steps)  # nothing has decayed yet, or nothing decays
    return Horizon(cfg.steps, step, learning_rate(step, cfg, d_model, horizon))
