import math

import pytest

from tformer.config import TrainConfig
from tformer.training.schedule import learning_rate


def test_cosine_warms_up_then_decays_to_min_lr():
    cfg = TrainConfig(steps=1000, lr=1e-3, min_lr=1e-4, warmup_steps=100)
    assert learning_rate(0, cfg, 128) == pytest.approx(1e-5)
    assert learning_rate(99, cfg, 128) == pytest.approx(1e-3)
    assert learning_rate(549, cfg, 128) == pytest.approx(5.5e-4)  # halfway down the cosine
    assert learning_rate(999, cfg, 128) == pytest.approx(1e-4)
    rates = [learning_rate(s, cfg, 128) for s in range(100, 1000)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))


def test_linear_warms_up_then_falls_in_a_straight_line_to_min_lr():
    cfg = TrainConfig(steps=1000, lr=1e-3, min_lr=1e-4, warmup_steps=100, schedule="linear")
    assert learning_rate(99, cfg, 128) == pytest.approx(1e-3)
    assert learning_rate(549, cfg, 128) == pytest.approx(5.5e-4)
    assert learning_rate(999, cfg, 128) == pytest.approx(1e-4)
    steps = [learning_rate(s, cfg, 128) - learning_rate(s + 1, cfg, 128) for s in range(99, 998)]
    assert max(steps) == pytest.approx(min(steps))  # the same decrement at every step


def test_constant_after_warmup():
    cfg = TrainConfig(steps=100, lr=0.5, min_lr=0.0, warmup_steps=10, schedule="constant")
    assert learning_rate(4, cfg, 64) == pytest.approx(0.25)
    assert learning_rate(50, cfg, 64) == 0.5


def test_noam_is_the_papers_formula():
    cfg = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=4000, schedule="noam")
    for step in (1, 100, 3999, 4000, 20000):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert learning_rate(step - 1, cfg, 512) == pytest.approx(expected)
    peak = learning_rate(3999, cfg, 512)
    assert peak == pytest.approx(512**-0.5 / math.sqrt(4000))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_a_longer_horizon_continues_the_decay_from_the_current_rate(schedule):
    from tformer.training.schedule import Horizon, extend

    old = TrainConfig(steps=1000, lr=1e-3, min_lr=1e-4, warmup_steps=100, schedule=schedule)
    new = TrainConfig(steps=3000, lr=1e-3, min_lr=1e-4, warmup_steps=100, schedule=schedule)
    at = 600
    horizon = extend(Horizon(1000), at, new, 128)
    assert horizon == Horizon(3000, at, learning_rate(at, old, 128))
    rates = [learning_rate(s, new, 128, horizon) for s in range(at, 3000)]
    # No jump: the first rate is the one the old run would have used next ...
    assert rates[0] == learning_rate(at, old, 128)
    # ... then it only falls, and ends at min_lr on the new last step.
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] == pytest.approx(1e-4)
    # Stretching the old curve instead would have sent the rate back up:
    assert learning_rate(at, new, 128) > rates[0]


def test_a_shorter_horizon_ends_the_decay_sooner():
    from tformer.training.schedule import Horizon, extend

    cfg = TrainConfig(steps=500, lr=1e-3, min_lr=1e-4, warmup_steps=100, schedule="linear")
    horizon = extend(Horizon(1000), 300, cfg, 128)
    assert learning_rate(499, cfg, 128, horizon) == pytest.approx(1e-4)
    halfway = learning_rate(300, cfg, 128, horizon) + learning_rate(499, cfg, 128, horizon)
    assert learning_rate(399, cfg, 128, horizon) == pytest.approx(halfway / 2, rel=1e-2)


def test_a_horizon_changed_during_warmup_or_without_decay_is_simply_the_new_one():
    from tformer.training.schedule import Horizon, extend

    cfg = TrainConfig(steps=2000, lr=1e-3, min_lr=1e-4, warmup_steps=100)
    assert extend(Horizon(1000), 50, cfg, 128) == Horizon(2000)
    constant = TrainConfig(steps=2000, lr=1e-3, min_lr=0.0, warmup_steps=10, schedule="constant")
    assert extend(Horizon(1000), 500, constant, 128) == Horizon(2000)
