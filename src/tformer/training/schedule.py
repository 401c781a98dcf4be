"""Learning-rate schedules as pure functions of the step (nothing to save for resume)."""

from __future__ import annotations

import math

from tformer.config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig, d_model: int) -> float:
    """The rate for optimizer step `step` (0-based).

    cosine:   linear warmup to lr, then half a cosine down to min_lr at the last step.
    linear:   linear warmup to lr, then a straight line down to min_lr at the last step
              (for short runs it often ends lower than the cosine: Bergsma et al. 2025,
              "Straight to Zero: Why Linearly Decaying the Learning Rate to Zero Works
              Best for LLMs").
    constant: linear warmup to lr, then lr.
    noam:     Vaswani et al. 2017, eq. 3: d_model^-0.5 * min(n^-0.5, n * warmup^-1.5) with
              n = step + 1, scaled by `lr` (lr = 1 gives the paper's schedule).
    """
    n = step + 1
    if cfg.schedule == "noam":
        warmup = max(cfg.warmup_steps, 1)
        return cfg.lr * d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)
    if n <= cfg.warmup_steps:
        return cfg.lr * n / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((n - cfg.warmup_steps) / decay_steps, 1.0)
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
