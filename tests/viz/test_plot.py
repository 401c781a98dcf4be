import csv

import pytest

from tformer.cli import main
from tformer.errors import TformerError
from tformer.viz.plot import plot_runs, read_curves


def panels(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def test_two_language_model_runs_overlay_with_one_line_per_run(runs):
    fig = plot_runs([runs["a"], runs["b"]])
    axes = panels(fig)
    assert set(axes) == {"loss", "loss against data", "learning rate", "speed"}
    assert axes["loss"].get_xlabel() == "step"
    assert axes["loss"].get_ylabel() == "loss (nats/token)"
    assert axes["loss against data"].get_xlabel() == "tokens seen"
    assert axes["learning rate"].get_ylabel() == "learning rate"
    assert axes["speed"].get_ylabel() == "training tokens/s"
    # Per run: training and validation loss; one learning-rate and one speed line.
    assert len(axes["loss"].lines) == 4 and len(axes["loss against data"].lines) == 4
    assert len(axes["learning rate"].lines) == 2 and len(axes["speed"].lines) == 2
    legend = [t.get_text() for t in axes["loss"].get_legend().get_texts()]
    assert legend[:2] == ["gpt-a", "gpt-b"]


def test_the_lines_are_the_runs_metrics(runs):
    fig = plot_runs([runs["a"]])
    axes = panels(fig)
    with open(runs["a"] / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    lr_line = axes["learning rate"].lines[0]
    assert list(lr_line.get_xdata()) == [float(r["step"]) for r in train]
    assert list(lr_line.get_ydata()) == pytest.approx([float(r["lr"]) for r in train])
    train_line, val_line = axes["loss"].lines
    assert list(val_line.get_ydata()) == pytest.approx([float(r["loss"]) for r in val])
    # Tokens seen grow by batch_size * context = 64 a step.
    tokens = axes["loss against data"].lines[0].get_xdata()
    assert list(tokens) == [64.0 * float(r["step"]) for r in train]
    assert list(axes["loss against data"].lines[1].get_xdata()) == [
        64.0 * float(r["step"]) for r in val]


def test_a_translation_run_shows_validation_bleu_and_chrf(runs):
    axes = panels(plot_runs([runs["seq2seq"], runs["a"]]))
    assert axes["validation BLEU (greedy)"].get_ylabel() == "BLEU"
    assert axes["validation chrF (greedy)"].get_ylabel() == "chrF"
    bleu = axes["validation BLEU (greedy)"].lines
    assert len(bleu) == 1  # the language model run measured none
    assert list(bleu[0].get_xdata()) == [3.0, 6.0]
    assert read_curves(runs["seq2seq"]).val["bleu"] == pytest.approx(list(bleu[0].get_ydata()))


def test_the_command_writes_a_png(runs, tmp_path, capsys):
    out = tmp_path / "plots" / "loss.png"
    assert main(["plot", str(runs["a"]), str(runs["seq2seq"]), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "holds no metrics.csv" in capsys.readouterr().err
    assert main(["plot", str(runs["a"]), "-o", str(tmp_path / "x.txt")]) == 2
    assert "write a .png" in capsys.readouterr().err
    with pytest.raises(TformerError, match="at least one run"):
        plot_runs([])


def test_without_matplotlib_the_error_says_what_to_install(runs, monkeypatch, capsys, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["plot", str(runs["a"]), "-o", str(tmp_path / "x.png")]) == 2
    assert "needs the matplotlib package: pip install 'tformer[viz]'" in capsys.readouterr().err


def test_the_time_axis_puts_each_row_at_the_hours_the_run_had_taken(runs):
    # Validation rows carry no time of their own: they sit where training was at their step.
    with open(runs["seq2seq"] / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["split"] == "train"]
    hours = {float(r["step"]): float(r["elapsed_s"]) / 3600 for r in train}
    axes = panels(plot_runs([runs["seq2seq"]], x="time"))
    assert axes["validation BLEU (greedy)"].get_xlabel() == "hours since the start"
    assert list(axes["learning rate"].lines[0].get_xdata()) == pytest.approx(
        [hours[float(r["step"])] for r in train])
    bleu_steps = [float(r["step"]) for r in rows if r["split"] == "val" and r["bleu"]]
    assert set(bleu_steps) <= set(hours)
    assert list(axes["validation BLEU (greedy)"].lines[0].get_xdata()) == pytest.approx(
        [hours[s] for s in bleu_steps])
    # The tokens-seen panel keeps its axis.
    assert axes["loss against data"].get_xlabel() == "tokens seen"
    with pytest.raises(TformerError, match="--x days is not known"):
        plot_runs([runs["seq2seq"]], x="days")
