"""`tformer train CONFIG --out RUN --resume`, the one line a requeued job runs again and
again: killed (SIGKILL) before the run wrote its config, after it, and killed again while
restarting, the run finishes with the metrics and weights of a run never interrupted; a
CONFIG that contradicts the run's own is refused in one line."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tformer import loading
from tformer.cli import main
from tformer.training import checkpoint as ckpt
from tformer.training import trainer


def kill_at(where):
    """Make this process SIGKILL itself at `where`: "before-config" (the run's config.json
    cut short as it is written), "checkpoint-N" (as it would save its N-th step checkpoint)."""
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if where == "before-config":
        write = ckpt.write_json

        def write_json(path, data):
            if Path(path).name == loading.CONFIG:
                Path(path).with_name(".config.json.tmp").write_text('{"model": {"fam')
                die()
            write(path, data)

        ckpt.write_json = write_json
        return
    n, saves, save = int(where.split("-")[1]), [], trainer.save_step_checkpoint

    def save_then_die(run):
        saves.append(run.step)
        if len(saves) == n:
            die()
        save(run)

    trainer.save_step_checkpoint = save_then_die


KILLED = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("restart", sys.argv[1])
restart = importlib.util.module_from_spec(spec)
spec.loader.exec_module(restart)
restart.kill_at(sys.argv[2])
from tformer.cli import main
main(sys.argv[3:])
"""


def killed(where, *args):
    """`tformer ARGS` in a process of its own that SIGKILLs itself at `where`. (Not a fork of
    this one: a fork of a process with threads can inherit a lock another thread held, and
    wait on it for ever.) It computes with as many threads as this one: another count sums
    a matrix product in another order, and the weights would differ in their last bits."""
    threads = str(torch.get_num_threads())
    proc = subprocess.run([sys.executable, "-c", KILLED, __file__, where, *args],
                          env={**os.environ, "OMP_NUM_THREADS": threads}, capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


KILLABLE = {"model": {"dropout": 0.1}, "steps": 9, "log_every": 1, "eval_every": 3,
            "checkpoint_every": 3}
"""Dropout, so that a resumed run's random streams matter; every step logged."""


def curve(run):
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["split"], r["loss"], r["lr"], r["grad_norm"])
                for r in csv.DictReader(f)]


def assert_same_run(run, straight):
    assert curve(run) == curve(straight)
    for checkpoint in ("best", "checkpoints/step-000009"):
        ours = load_file(str(run / checkpoint / loading.WEIGHTS))
        theirs = load_file(str(straight / checkpoint / loading.WEIGHTS))
        assert ours.keys() == theirs.keys()
        assert all(ours[k].equal(theirs[k]) for k in ours), checkpoint


@pytest.fixture
def config(tiny_config):
    return tiny_config("config.toml", **KILLABLE)


@pytest.fixture
def straight(config, tmp_path):
    out = tmp_path / "straight"
    assert main(["train", str(config), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("kills,resume", [
    (["before-config"], ["--resume"]),
    (["checkpoint-1"], ["--resume", "auto"]),  # after the config, before any checkpoint
    (["checkpoint-2"], ["--resume"]),  # after the first checkpoint
    (["before-config", "checkpoint-2"], ["--resume"]),  # the restart killed too
])
def test_one_command_restarts_a_killed_run_as_if_never_killed(kills, resume, config, straight,
                                                              tmp_path):
    run = tmp_path / "run"
    command = ["train", str(config), "--out", str(run), *resume]
    killed(kills[0], "train", str(config), "--out", str(run))
    if kills[0] == "before-config":
        assert not (run / loading.CONFIG).exists() and (run / ".config.json.tmp").exists()
    for where in kills[1:]:
        killed(where, *command)
    assert main(command) == 0
    assert_same_run(run, straight)
    assert not (run / ".config.json.tmp").exists()


def test_a_contradicting_config_is_refused_in_one_line(config, tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), "train.steps=6"]) == 0
    other = tiny_config("other.toml", **{**KILLABLE, "model": {"d_model": 32}, "lr": 3e-3})
    before = sorted(p.name for p in run.rglob("*"))
    capsys.readouterr()
    assert main(["train", str(other), "--out", str(run), "--resume", "train.steps=9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "contradicts" in err, err
    assert "model.d_model = 32 (the run: 16)" in err and "train.lr = 0.003 (the run: 0.001)" in err
    assert sorted(p.name for p in run.rglob("*")) == before
    # The same config continues, the overrides as with --resume alone.
    assert main(["train", str(config), "--out", str(run), "--resume", "train.steps=9"]) == 0
    assert loading.step_checkpoints(run)[-1].name == "step-000009"


def test_checkpoints_none_can_continue_are_never_discarded(config, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), "train.steps=6"]) == 0
    for checkpoint in loading.step_checkpoints(run):
        (checkpoint / loading.TRAINER_STATE).unlink()
    capsys.readouterr()
    assert main(["train", str(config), "--out", str(run), "--resume"]) == 2
    assert "none of the checkpoints" in capsys.readouterr().err
    assert len(loading.step_checkpoints(run)) == 2 and (run / loading.CONFIG).is_file()
