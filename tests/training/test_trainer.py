import csv
import math
import os
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from tformer import loading
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
    assert (tmp_path / "run" / loading.BEST).is_dir()
    assert [p.name for p in loading.step_checkpoints(tmp_path / "run")] == [
        "step-000020",
        "step-000040",
    ]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_crashed_run_resumes_bit_identically(tiny_corpus, tmp_path, optimizer):
    cfg = tiny_config(tiny_corpus, f"train.optimizer={optimizer}")
    train(cfg, tmp_path / "straight")

    def crash(info):
        if info["step"] == 6:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        train(cfg, tmp_path / "crashed", progress=crash)
    latest = loading.latest_good_checkpoint(tmp_path / "crashed")
    assert latest.name == "step-000004"
    train(cfg, tmp_path / "crashed", resume_from=latest)

    assert train_losses(tmp_path / "crashed") == train_losses(tmp_path / "straight")
    final = "checkpoints/step-000012/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "crashed" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_steps_are_skipped_then_stop_training(tiny_corpus, tmp_path, monkeypatch):
    real_loss = GPTTask.loss
    calls = {"n": 0}

    def sometimes_nan(self, model, batch, carry):
        calls["n"] += 1
        loss, n, carry = real_loss(self, model, batch, carry)
        return (loss * float("nan") if calls["n"] in (3, 5) else loss), n, carry

    monkeypatch.setattr(GPTTask, "loss", sometimes_nan)
    result = train(tiny_config(tiny_corpus), tmp_path / "run")
    assert result.skipped_steps == 2 and result.step == 12

    monkeypatch.setattr(
        GPTTask, "loss", lambda self, m, b, c: (real_loss(self, m, b, c)[0] * float("inf"), 1, c)
    )
    with pytest.raises(TformerError, match="3 steps in a row had a non-finite loss"):
        train(tiny_config(tiny_corpus, "train.max_bad_steps=3"), tmp_path / "bad")
    for path in loading.step_checkpoints(tmp_path / "run"):
        weights = load_file(path / loading.WEIGHTS)
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
    assert loading.latest_good_checkpoint(tmp_path / "run").name == "step-000007"
    # The handlers training found are back (a shell's background job starts with SIGINT
    # ignored, so that is not always Python's default).
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_old_checkpoints_are_pruned(tiny_corpus, tmp_path):
    train(tiny_config(tiny_corpus, "train.keep_checkpoints=1"), tmp_path / "run")
    assert [p.name for p in loading.step_checkpoints(tmp_path / "run")] == ["step-000012"]


def test_weight_decay_falls_on_linear_maps_and_embeddings_only(tiny_corpus):
    from torch import nn

    from tformer.registry import get_family
    from tformer.training.optimizer import decay_groups, make_optimizer

    cfg = config_from_dict({}, [
        "model.family=transformer-xl", f"data.path={tiny_corpus}", "model.n_layer=2",
        "model.d_model=16", "model.n_head=2", "model.d_ff=32", "model.vocab_size=20",
    ])
    model = get_family("transformer-xl").model(cfg.model)
    decayed, kept = decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed}
    kept_names = {names[id(p)] for p in kept}
    # Written out by hand from the model's layout, not from the rule.
    assert "u" in kept_names and "v" in kept_names, "the global biases are 3-D, yet biases"
    assert {"embed.weight", "blocks.0.attn.qkv_proj.weight", "blocks.1.ff.down.weight"} <= (
        decayed_names)
    assert {"blocks.0.ff.up.bias", "blocks.0.attn_residual.norm.weight"} <= kept_names
    assert not decayed_names & kept_names
    assert len(decayed) + len(kept) == len(list(model.parameters()))
    for name in decayed_names:
        owner = model.get_submodule(name.rpartition(".")[0])
        assert isinstance(owner, (nn.Linear, nn.Embedding))
    optimizer = make_optimizer(model, cfg.train, torch.device("cpu"))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.train.weight_decay, 0.0]


def test_a_skipped_step_puts_the_transformer_xl_memory_back(tiny_corpus, tmp_path, monkeypatch):
    from tformer.tasks.transformer_xl import TransformerXLTask
    from tformer.training.trainer import optimizer_step, start_run

    cfg = config_from_dict({}, [
        "model.family=transformer-xl", f"data.path={tiny_corpus}", "model.n_layer=1",
        "model.n_head=2", "model.d_model=16", "model.d_ff=32", "model.context=8",
        "model.mem_len=8", "train.batch_size=3", "train.device=cpu",
    ])
    run = start_run(cfg, tmp_path / "run", None)
    stop = threading.Event()
    optimizer_step(run, stop)
    optimizer_step(run, stop)
    before = [m.clone() for m in run.carry.states]
    real_loss = TransformerXLTask.loss

    def nan_loss(self, model, batch, memory):
        loss, n, memory = real_loss(self, model, batch, memory)
        return loss * float("nan"), n, memory

    monkeypatch.setattr(TransformerXLTask, "loss", nan_loss)
    optimizer_step(run, stop)
    assert run.skipped_steps == 1
    # The skipped step's forward pass moved the memory on; the step is undone whole.
    assert all(torch.equal(a, b) for a, b in zip(run.carry.states, before, strict=True))
    monkeypatch.setattr(TransformerXLTask, "loss", real_loss)
    optimizer_step(run, stop)
    assert not all(torch.equal(a, b) for a, b in zip(run.carry.states, before, strict=True))


def test_resuming_with_more_steps_continues_the_decay_without_a_jump(tiny_corpus, tmp_path, caplog):
    cfg = tiny_config(tiny_corpus, "train.schedule=linear")
    train(cfg, tmp_path / "run")
    latest = loading.latest_good_checkpoint(tmp_path / "run")
    longer = tiny_config(tiny_corpus, "train.schedule=linear", "train.steps=24")
    with caplog.at_level("WARNING"):
        train(longer, tmp_path / "run", resume_from=latest)
    assert "train.steps changed from 12 to 24" in caplog.text
    with open(tmp_path / "run" / "metrics.csv") as f:
        rates = [float(r["lr"]) for r in csv.DictReader(f) if r["split"] == "train"]
    assert len(rates) == 24
    # Steps 1-12 decayed to min_lr; the resumed run stays there instead of climbing back.
    assert rates[11] == pytest.approx(3e-4)
    assert all(r == pytest.approx(3e-4) for r in rates[12:])
    state = ckpt.load_trainer_state(tmp_path / "run" / "checkpoints" / "step-000024")
    assert state["horizon"]["steps"] == 24


def test_resuming_midway_with_more_steps_decays_from_the_rate_reached(tiny_corpus, tmp_path):
    cfg = tiny_config(tiny_corpus, "train.schedule=linear")

    def crash(info):
        if info["step"] == 6:
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "run", progress=crash)
    latest = loading.latest_good_checkpoint(tmp_path / "run")
    assert latest.name == "step-000004"
    train(tiny_config(tiny_corpus, "train.schedule=linear", "train.steps=40"),
          tmp_path / "run", resume_from=latest)
    with open(tmp_path / "run" / "metrics.csv") as f:
        rates = [float(r["lr"]) for r in csv.DictReader(f) if r["split"] == "train"]
    assert len(rates) == 40
    falls = [a - b for a, b in zip(rates[4:], rates[5:], strict=False)]
    assert all(f > 0 for f in falls) and rates[-1] == pytest.approx(3e-4)
    assert max(falls) == pytest.approx(min(falls), rel=1e-3), "one straight line to min_lr"
    assert rates[4] < rates[3], "no jump back up"
