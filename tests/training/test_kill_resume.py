"""A training process killed with SIGKILL at random moments, resumed each time, must follow
the same loss curve as a run that was never interrupted; damaged checkpoints are skipped."""

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tformer import loading
from tformer.training import checkpoint as ckpt
from tformer.training.run import resume_point

CONFIG = """
[model]
family = "gpt"
n_layer = 1
n_head = 2
d_model = 16
context = 16
dropout = 0.1

[data]
path = "{corpus}"

[train]
steps = {steps}
batch_size = 4
log_every = 1
eval_every = 10
checkpoint_every = 3
keep_checkpoints = 3
device = "cpu"
"""


def tformer(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tformer", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


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


@pytest.fixture
def config(tmp_path, tiny_corpus):
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(corpus=tiny_corpus, steps=40))
    return path


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_matches_an_uninterrupted_run(config, tmp_path):
    straight = tmp_path / "straight"
    finish(tformer("train", str(config), "--out", str(straight)))

    killed = tmp_path / "killed"
    rng = random.Random(7)
    proc = tformer("train", str(config), "--out", str(killed))
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
        if loading.latest_good_checkpoint(killed) is None:  # killed before the first checkpoint
            proc = tformer("train", str(config), "--out", str(killed))
        else:
            proc = tformer("train", "--resume", "--out", str(killed))
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
def test_resume_falls_back_to_the_newest_good_checkpoint(tmp_path, tiny_corpus, damage):
    from tformer.cli import main

    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(corpus=tiny_corpus, steps=9))
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run)]) == 0
    newest = loading.step_checkpoints(run)[-1]
    assert newest.name == "step-000009"
    damage(newest)
    assert resume_point(run).name == "step-000006"
    assert main(["train", "--resume", "--out", str(run), "train.steps=12"]) == 0
    assert loading.step_checkpoints(run)[-1].name == "step-000012"


def test_leftovers_of_a_killed_save_are_cleaned_up(tmp_path, tiny_corpus):
    from tformer.cli import main

    config = tmp_path / "config.toml"
    config.write_text(CONFIG.format(corpus=tiny_corpus, steps=6))
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run)]) == 0
    # A save killed halfway, and a best checkpoint moved aside but not yet replaced.
    (run / "checkpoints" / ".tmp-step-000009-123").mkdir()
    os.replace(run / "best", run / ".old-best-456")
    ckpt.recover_run_dir(run)
    assert not (run / "checkpoints" / ".tmp-step-000009-123").exists()
    assert (run / "best").is_dir() and not (run / ".old-best-456").exists()
    loading.verify_checkpoint(run / "best")
