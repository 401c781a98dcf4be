import csv
import math
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from tformer.config import config_from_dict
from tformer.errors import TformerError
from tformer.tasks.gpt import GPTTask
from tformer.training import checkpoint as ckpt
from tformer.training.trainer import train


def tiny_config(corpus, *extra):
    return config_from_dict(
        {},
        [
            f"data.path={corpus}",
            "model.n_layer=2",
            "model.n_head=2",
            "model.d_model=32",
            "model.context=16",
            "model.dropout=0.1",
            "train.batch_size=4",
            "train.steps=12",
            "train.warmup_steps=2",
            "train.lr=3e-3",
            "train.min_lr=3e-4",
            "train.log_every=1",
            "train.eval_every=4",
            "train.checkpoint_every=4",
            "train.keep_checkpoints=5",
            "train.device=cpu",
            *extra,
        ],
    )


def train_losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), r["loss"]) for r in csv.DictReader(f) if r["split"] == "train"]


def test_training_lowers_the_loss_and_writes_a_run(tiny_corpus, tmp_path):
    cfg = tiny_config(
        tiny_corpus,
        "train.steps=40",
        "train.eval_every=20",
        "train.lr=1e-2",
        "train.checkpoint_every=20",
        "model.dropout=0.0",
    )
    result = train(cfg, tmp_path / "run")
    losses = [float(loss) for _, loss in train_losses(tmp_path / "run")]
    n_chars = len(set(tiny_corpus.read_text()))
    assert losses[0] == pytest.approx(math.log(n_chars), abs=0.1), "starts near uniform"
    # The text's unigram entropy is 3.09 nats: below it, the model uses context.
    assert result.val_loss < 2.7
    assert result.step == 40 and result.val_loss is not None and not result.interrupted
    assert (tmp_path / "run" / ckpt.BEST).is_dir()
    assert [p.name for p in ckpt.step_checkpoints(tmp_path / "run")] == [
        "step-000020",
        "step-000040",
    ]


def test_a_crashed_run_resumes_bit_identically(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus)
    train(cfg, tmp_path / "straight")

    def crash(info):
        if info["step"] == 6:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        train(cfg, tmp_path / "crashed", progress=crash)
    latest = ckpt.latest_good_checkpoint(tmp_path / "crashed")
    assert latest.name == "step-000004"
    train(cfg, tmp_path / "crashed", resume_from=latest)

    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "straight")
    final = "checkpoints/step-000012/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "crashed" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_steps_are_skipped_then_stop_training(tiny_corpus, tmp_path, monkeypatch):
    real_loss = GPTTask.loss
    calls = {"n": 0}

    def sometimes_nan(self, model, batch):
        calls["n"] += 1
        loss, n = real_loss(self, model, batch)
        return (loss * float("nan"), n) if calls["n"] in (3, 5) else (loss, n)

    monkeypatch.setattr(GPTTask, "loss", sometimes_nan)
    result = train(tiny_config(tiny_corpus), tmp_path / "run")
    assert result.skipped_steps == 2 and result.step == 12

    monkeypatch.setattr(
        GPTTask, "loss", lambda self, m, b: (real_loss(self, m, b)[0] * float("inf"), 1)
    )
    with pytest.raises(TformerError, match="3 steps in a row had a non-finite loss"):
        train(tiny_config(tiny_corpus, "train.max_bad_steps=3"), tmp_path / "bad")
    for path in ckpt.step_checkpoints(tmp_path / "run"):
        weights = load_file(path / ckpt.WEIGHTS)
        assert all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_save_and_stop(tiny_corpus, tmp_path, signum):
    def interrupt(info):
        if info.get("step") == 6 and "loss" in info:
            os.kill(os.getpid(), signum)

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = train(tiny_config(tiny_corpus), tmp_path / "run", progress=interrupt)
    # The signal came while step 6 was logged: step 7 is the first to see it.
    assert result.interrupted and result.step == 7
    assert ckpt.latest_good_checkpoint(tmp_path / "run").name == "step-000007"
    # The handlers training found are back (a shell's background job starts with SIGINT
    # ignored, so that is not always Python's default).
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_old_checkpoints_are_pruned(tiny_corpus, tmp_path):
    train(tiny_config(tiny_corpus, "train.keep_checkpoints=1"), tmp_path / "run")
    assert [p.name for p in ckpt.step_checkpoints(tmp_path / "run")] == ["step-000012"]
