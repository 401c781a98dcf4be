"""TensorBoard's own reader gives back what metrics.csv holds."""

import csv

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tformer.training.trainer import train
from tformer.viz.tensorboard import LOG_DIR

from .conftest import gpt_config


def csv_scalars(run):
    """{tag: [(step, value)]} from metrics.csv, tagged as the writer tags them."""
    scalars = {}
    with open(run / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "split") and value:
                    scalars.setdefault(f"{row['split']}/{key}", []).append(
                        (int(row["step"]), float(value)))
    return scalars


def event_scalars(run):
    events = EventAccumulator(str(run / LOG_DIR))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("name", ["a", "seq2seq"])
def test_event_files_equal_metrics_csv(runs, name):
    expected, got = csv_scalars(runs[name]), event_scalars(runs[name])
    assert set(got) == set(expected)
    assert {"train/loss", "train/lr", "train/tokens_per_s", "val/loss"} <= set(got)
    if name == "seq2seq":
        assert {"val/bleu", "val/chrf"} <= set(got)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        # Event files store float32.
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6)


def test_a_resumed_run_drops_the_events_it_redoes(tiny_corpus, tmp_path):
    from tformer import loading

    run = tmp_path / "run"
    train(gpt_config(tiny_corpus, "train.steps=8", "train.checkpoint_every=4",
                     "train.keep_checkpoints=3"), run)
    # Resume from step 4 as if the run had died after it: steps 5-8 are logged again.
    resume_from = loading.step_dir(run, 4)
    cfg = loading.read_config(resume_from)
    train(cfg, run, resume_from=resume_from)
    got = event_scalars(run)
    expected = csv_scalars(run)
    assert set(got) == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6)
    assert [s for s, _ in got["train/loss"]] == [2, 4, 6, 8]


def test_without_the_package_the_error_says_what_to_install(monkeypatch, tmp_path):
    import sys

    from tformer.errors import TformerError
    from tformer.viz.tensorboard import TensorBoardLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TformerError, match=r"needs the tensorboard package: pip install "
                       r"'tformer\[viz\]'"):
        TensorBoardLog(tmp_path, None)
