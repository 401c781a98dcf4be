"""BLEU and chrF on the validation split during training, and best/ and early stopping
that follow them."""

import csv
import json

import pytest

from tformer import loading
from tformer.config import config_from_dict
from tformer.data.parallel import read_lines
from tformer.errors import TformerError
from tformer.loading import load_checkpoint
from tformer.tasks.seq2seq import Seq2SeqTask
from tformer.training import checkpoint as ckpt
from tformer.training.trainer import train


def config(*extra):
    return config_from_dict({"model": {"family": "seq2seq"}}, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
        "model.max_len=40", "data.tokenizer=char", "data.builtin_pairs=300",
        "data.builtin_max=999", "data.max_tokens=600", "data.max_len=40",
        "data.max_ratio=12.0", "train.steps=8", "train.eval_every=2",
        "train.checkpoint_every=8", "train.warmup_steps=1", "train.log_every=2",
        "train.lr=1e-2", "train.device=cpu", *extra,
    ])


def val_rows(run):
    with open(run / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r["split"] == "val"]


def test_bleu_is_logged_every_n_evaluations_and_equals_evaluate(tmp_path, capsys):
    run = tmp_path / "run"
    train(config("data.val_bleu_every=2", "data.val_bleu_sentences=6"), run)
    rows = val_rows(run)
    assert [r["step"] for r in rows] == ["2", "4", "6", "8"]
    assert [bool(r["bleu"]) for r in rows] == [False, True, False, True]
    assert [bool(r["chrf"]) for r in rows] == [False, True, False, True]

    # The last logged scores are those of greedy search by `tformer evaluate` on the
    # same sentences with the final weights.
    from tformer.cli import main

    loaded = load_checkpoint(loading.step_dir(run, 8))
    sources, references = Seq2SeqTask(loaded.cfg, loaded.tokenizer).data.val_text
    (tmp_path / "src.txt").write_text("\n".join(sources[:6]) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(references[:6]) + "\n", encoding="utf-8")
    assert len(read_lines(tmp_path / "ref.txt")) == 6
    capsys.readouterr()
    assert main(["evaluate", str(loading.step_dir(run, 8)), str(tmp_path / "src.txt"),
                 str(tmp_path / "ref.txt"), "--beam", "1", "--alpha", "0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["chrf"] > 0  # a real comparison, not of two empty outputs
    assert float(rows[-1]["chrf"]) == pytest.approx(result["chrf"], abs=1e-4)
    assert float(rows[-1]["bleu"]) == pytest.approx(result["bleu"], abs=1e-4)


def test_a_resumed_run_measures_bleu_at_the_same_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(Seq2SeqTask, "translation_scores",
                        lambda self, model, shard=None: {"bleu": 1.0, "chrf": 1.0})
    run = tmp_path / "run"
    # Stopped after the third evaluation (step 6), then resumed to step 8.
    train(config("data.val_bleu_every=2", "train.steps=6", "train.checkpoint_every=6"), run)
    resume_from = loading.step_dir(run, 6)
    train(loading.read_config(resume_from).replace("train", steps=8), run,
          resume_from=resume_from)
    rows = val_rows(run)
    assert [r["step"] for r in rows] == ["2", "4", "6", "8"]
    assert [bool(r["bleu"]) for r in rows] == [False, True, False, True]


def test_best_and_early_stopping_follow_bleu(tmp_path, monkeypatch):
    """With scripted BLEU scores (a tiny model's are all 0), best/ is the evaluation with
    the highest, and training stops once `patience` evaluations have not beaten it."""
    scripted = iter([10.0, 30.0, 20.0, 25.0, 50.0])
    monkeypatch.setattr(Seq2SeqTask, "translation_scores",
                        lambda self, model, shard=None: {"bleu": next(scripted), "chrf": 0.0})
    run = tmp_path / "run"
    result = train(config("data.val_bleu_every=1", "train.best_metric=bleu",
                          "train.patience=2", "train.steps=20"), run)
    assert result.stopped_early and result.step == 8 and result.best_val == 30.0
    assert [float(r["bleu"]) for r in val_rows(run)] == [10.0, 30.0, 20.0, 25.0]
    assert ckpt.load_trainer_state(run / loading.BEST)["step"] == 4
    assert loading.step_dir(run, 8).is_dir()  # the stopping point is saved to resume from


def test_best_by_loss_is_unchanged_by_bleu(tmp_path):
    result = train(config("data.val_bleu_every=1", "data.val_bleu_sentences=4"), tmp_path / "r")
    losses = [float(r["loss"]) for r in val_rows(tmp_path / "r")]
    assert result.best_val == pytest.approx(min(losses), abs=1e-6)


def test_bleu_as_best_metric_needs_it_measured():
    with pytest.raises(TformerError, match="needs data.val_bleu_every"):
        Seq2SeqTask(config("train.best_metric=bleu"))
    with pytest.raises(TformerError, match="train.best_metric = 'bleuu' is not allowed"):
        config("train.best_metric=bleuu")


def test_a_language_model_cannot_pick_best_by_bleu(tiny_corpus, tmp_path):
    cfg = config_from_dict({}, [f"data.path={tiny_corpus}", "train.best_metric=bleu",
                                "train.device=cpu"])
    with pytest.raises(TformerError, match="the gpt family measures loss"):
        train(cfg, tmp_path / "run")


def test_resuming_with_another_best_metric_starts_best_afresh(tmp_path, monkeypatch):
    scripted = iter([5.0, 7.0, 0.5])
    monkeypatch.setattr(Seq2SeqTask, "translation_scores",
                        lambda self, model, shard=None: {"bleu": next(scripted), "chrf": 0.0})
    run = tmp_path / "run"
    train(config("data.val_bleu_every=1", "train.steps=4", "train.checkpoint_every=4"), run)
    assert ckpt.load_trainer_state(run / loading.BEST)["best_metric"] == "loss"
    resume_from = loading.step_dir(run, 4)
    cfg = loading.read_config(resume_from)
    cfg = cfg.replace("train", steps=6, best_metric="bleu")
    result = train(cfg, run, resume_from=resume_from)
    # The loss of the first part (above 0.5) is no BLEU to beat: the first BLEU after
    # resuming becomes best, however low.
    assert result.best_val == 0.5
    assert ckpt.load_trainer_state(run / loading.BEST)["step"] == 6
