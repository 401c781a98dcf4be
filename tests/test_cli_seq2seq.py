"""The command line with a translation model: train, translate, evaluate, average."""

import io
import json
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.config import load_config
from tformer.data.parallel import ParallelData
from tformer.registry import get_family

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.d_ff=32",
        "data.builtin_pairs=200", "data.builtin_max=999",
        "data.max_tokens=400", "train.steps=4", "train.eval_every=2",
        "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.warmup_steps=1",
        "train.log_every=1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", str(ROOT / "configs" / "seq2seq-builtin.toml"), "--out", str(out),
                 *TINY]) == 0
    return out


@pytest.mark.parametrize("name", ["seq2seq-builtin.toml", "seq2seq-multi30k.toml"])
def test_shipped_configs_load_and_build(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.family == "seq2seq"
    model = get_family(cfg.family).model(cfg.replace("model", vocab_size=300).model)
    src = torch.randint(3, 300, (2, 5))
    logits = model(src, torch.ones_like(src, dtype=torch.bool), src[:, :3])
    assert logits.shape == (2, 3, 300)


def test_the_multi30k_config_reads_its_data():
    cfg = load_config(ROOT / "configs" / "seq2seq-multi30k.toml")
    if not Path(cfg.data.train_src).exists():
        pytest.skip("../shared/data/multi30k is not here")
    assert Path(cfg.data.val_tgt).exists()


def test_translate_stdin_and_files(run, tmp_path, capsys, monkeypatch):
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("12\n347\n\n5\n"))
    assert main(["translate", str(run), "--beam", "2"]) == 0
    assert len(capsys.readouterr().out.split("\n")) == 5  # 4 lines and the final newline

    src = tmp_path / "in.txt"
    src.write_text("1\n22\n333\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", str(run), str(src), "-o", str(out), "--beam", "1"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    assert main(["translate", str(run), str(src), "-o", str(out), "--int8"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    assert main(["translate", str(run), str(src), "--beam", "3", "--n-best", "2"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["0", "0", "1", "1", "2", "2"]
    assert float(rows[0][1]) >= float(rows[1][1])


def test_evaluate_reports_bleu_chrf_and_loss(run, tmp_path, capsys):
    src, ref = tmp_path / "s.txt", tmp_path / "r.txt"
    src.write_text("347\n12\n", encoding="utf-8")
    ref.write_text("dreihundertsiebenundvierzig\nzwölf\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["evaluate", str(run), str(src), str(ref), "--json", "--beam", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"bleu", "chrf", "loss", "exact_match", "bleu_signature"} <= set(result)
    assert result["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    assert main(["evaluate", str(run), "--json"]) == 0  # the run's own validation pairs
    assert json.loads(capsys.readouterr().out)["sentences"] == 10


def test_an_ensemble_translates_and_evaluates(run, tmp_path, capsys):
    src, ref = tmp_path / "s.txt", tmp_path / "r.txt"
    src.write_text("347\n12\n5\n", encoding="utf-8")
    ref.write_text("dreihundertsiebenundvierzig\nzwölf\nfünf\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(run), str(src), "--beam", "3"]) == 0
    alone = capsys.readouterr().out
    # The mean of a distribution and itself is that distribution.
    assert main(["translate", str(run), str(src), "--beam", "3", "--ensemble", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.out == alone and "+ 1 more as an ensemble" in captured.err
    step2 = run / "checkpoints" / "step-000002"
    assert main(["evaluate", str(run), str(src), str(ref), "--json", "--ensemble", str(step2),
                 "--ensemble", str(run)]) == 0
    assert {"bleu", "chrf", "loss"} <= set(json.loads(capsys.readouterr().out))
    assert main(["translate", str(run), str(src), "--int8", "--ensemble", str(step2)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_an_ensemble_needs_one_tokenizer(run, tmp_path, capsys):
    other = tmp_path / "bpe"
    assert main(["train", str(ROOT / "configs" / "seq2seq-builtin.toml"), "--out", str(other),
                 *TINY, "train.steps=2", "data.tokenizer=bpe", "data.vocab_size=280"]) == 0
    (tmp_path / "s.txt").write_text("1\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(run), str(tmp_path / "s.txt"), "--ensemble", str(other)]) == 2
    err = capsys.readouterr().err
    assert "its tokenizer is not" in err and err.count("\n") == 1


def test_average_of_two_checkpoints_is_their_mean(run, tmp_path, capsys):
    out = tmp_path / "avg"
    assert main(["average", str(run), "--last", "2", "--out", str(out)]) == 0
    from tformer.loading import load_checkpoint, step_checkpoints

    a, b = (load_checkpoint(p).model.state_dict() for p in step_checkpoints(run)[-2:])
    mean = load_checkpoint(out).model
    for name, tensor in mean.state_dict().items():
        torch.testing.assert_close(tensor, (a[name] + b[name]) / 2)
    assert mean.src_embed.weight is mean.out_proj.weight
    (tmp_path / "in.txt").write_text("7\n", encoding="utf-8")
    assert main(["translate", str(out), str(tmp_path / "in.txt")]) == 0


@pytest.mark.parametrize(
    "args, message",
    [(["translate", "{run}", "--beam", "0"], "--beam 0 must be at least 1"),
     (["translate", "{run}", "--beam", "2", "--n-best", "3"], "--n-best 3 must be between"),
     (["evaluate", "{run}", "{tmp}/s.txt"], "evaluated on SRC REF"),
     (["evaluate", "{run}", "{tmp}/s.txt", "{tmp}/short.txt"], "differ in length"),
     (["average", "{run}/checkpoints/step-000004", "--out", "{tmp}/x"], "at least two"),
     (["average", "{run}", "--last", "9", "--out", "{tmp}/x"], "holds 2 step checkpoints")],
)
def test_user_errors_are_one_line_and_exit_2(run, tmp_path, capsys, args, message):
    (tmp_path / "s.txt").write_text("1\n2\n", encoding="utf-8")
    (tmp_path / "short.txt").write_text("eins\n", encoding="utf-8")
    argv = [a.format(run=run, tmp=tmp_path) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_data_of_a_trained_run_round_trips_its_tokenizer(run):
    from tformer.loading import load_checkpoint

    loaded = load_checkpoint(run)
    data = ParallelData(loaded.cfg.data, loaded.tokenizer)
    assert data.tokenizer is loaded.tokenizer
    assert loaded.tokenizer.decode(data.val_src[0][:-1]).isdigit()


def test_translate_stdin_that_is_not_utf8_is_one_line(run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"12\n3\xff4\n")))
    capsys.readouterr()
    assert main(["translate", str(run)]) == 2
    err = capsys.readouterr().err
    # Input is read as it arrives, so the error names the line (after the start-up line).
    assert err.splitlines()[-1] == (
        "tformer: error: standard input (line 2) is not UTF-8 text (byte 0xff at offset 1)"
    )
    assert "Traceback" not in err
