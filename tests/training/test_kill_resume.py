"""A training process killed with SIGKILL at random moments, resumed each time, must follow
the same loss curve as a run that was never interrupted; damaged checkpoints are skipped."""

import csv
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tformer import loading
from tformer.training import checkpoint as ckpt
from tformer.training.run import resume_point


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err


def curve(run_dir: Path) -> list[tuple[str, str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return [(r["step"], r["split"], r["loss"]) for r in csv.DictReader(f)]


def logged_steps(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.csv").read_text().count("\n") - 1
    except FileNotFoundError:
        return 0


KILLABLE = {"model": {"dropout": 0.1}, "log_every": 1, "eval_every": 10, "keep_checkpoints": 3}
"""The tiny run with dropout (so resumed random streams matter), logged every step."""


@pytest.fixture
def config(tiny_config):
    return tiny_config("config.toml", steps=40, **KILLABLE)


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_an_uninterrupted_run(config, tmp_path,
                                                                           start_tformer):
    straight = tmp_path / "straight"
    finish(start_tformer("train", str(config), "--out", str(straight)))

    killed = tmp_path / "killed"
    rng = random.Random(7)
    proc = start_tformer("train", str(config), "--out", str(killed))
    kills = 0
    while kills < 3:
        target = logged_steps(killed) + rng.randint(3, 10)
        deadline = time.monotonic() + 120
        while logged_steps(killed) < target and proc.poll() is None:
            assert time.monotonic() < deadline, "training made no progress"
            time.sleep(rng.uniform(0.0, 0.05))
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        # The one line a requeued job runs, whether or not a checkpoint was saved yet.
        proc = start_tformer("train", str(config), "--out", str(killed), "--resume")
    finish(proc)
    assert kills >= 1
    assert curve(killed) == curve(straight)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:-9]
        ),
        lambda p: flip_a_byte(p / "trainer_state.pt"),
        lambda p: (p / "tokenizer.json").unlink(),
    ],
    ids=["truncate", "flip", "delete"],
)
def test_resume_falls_back_to_the_newest_good_checkpoint(tmp_path, tiny_config, damage):
    from tformer.cli import main

    config = tiny_config("config.toml", steps=9, **KILLABLE)
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run)]) == 0
    newest = loading.step_checkpoints(run)[-1]
    assert newest.name == "step-000009"
    damage(newest)
    assert resume_point(run).name == "step-000006"
    assert main(["train", "--resume", "--out", str(run), "train.steps=12"]) == 0
    assert loading.step_checkpoints(run)[-1].name == "step-000012"


def test_leftovers_of_a_killed_save_are_cleaned_up(tmp_path, tiny_config):
    from tformer.cli import main

    config = tiny_config("config.toml", steps=6, **KILLABLE)
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run)]) == 0
    # A save killed halfway, and a best checkpoint moved aside but not yet replaced.
    (run / "checkpoints" / ".tmp-step-000009-123").mkdir()
    os.replace(run / "best", run / ".old-best-456")
    ckpt.recover_run_dir(run)
    assert not (run / "checkpoints" / ".tmp-step-000009-123").exists()
    assert (run / "best").is_dir() and not (run / ".old-best-456").exists()
    loading.verify_checkpoint(run / "best")
