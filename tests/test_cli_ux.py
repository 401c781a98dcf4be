"""What a new user meets: argument order, --help, ordinary mistakes as one line, what the
commands say about themselves, translation line by line."""

import io
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tformer.cli import build_parser, main
from tformer.training.device import busy_cores, decoding_threads

ROOT = Path(__file__).resolve().parents[1]
SEQ2SEQ = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.d_ff=32",
           "data.builtin_pairs=200", "data.builtin_max=999", "data.max_tokens=400",
           "data.max_len=30", "train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
           "train.warmup_steps=1", "train.device=cpu"]
GPT = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=16",
       "train.steps=2", "train.batch_size=2", "train.eval_every=2", "train.checkpoint_every=2",
       "train.device=cpu"]


@pytest.fixture(scope="module")
def s2s(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ux") / "s2s"
    assert main(["train", str(ROOT / "configs" / "seq2seq-builtin.toml"), "--out", str(out),
                 *SEQ2SEQ]) == 0
    return out


@pytest.fixture
def lm(tmp_path, tiny_corpus) -> Path:
    out = tmp_path / "lm"
    assert main(["train", str(ROOT / "configs" / "gpt-builtin.toml"), "--out", str(out),
                 f"data.path={tiny_corpus}", *GPT]) == 0
    return out


def one_line_error(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tformer: error: "), err
    return err


def test_options_before_and_after_file_arguments():
    parser = build_parser()
    args, extra = parser.parse_known_args(["translate", "ck", "--int8", "in.en", "-o", "o"])
    assert not extra and (args.input, args.output, args.weights) == ("in.en", "o", "int8")
    args, extra = parser.parse_known_args(["evaluate", "ck", "--beam", "4", "s", "r"])
    assert not extra and args.data == ["s", "r"] and args.beam == 4
    args, extra = parser.parse_known_args(["evaluate", "ck", "--json", "f.txt"])
    assert not extra and args.data == ["f.txt"] and args.as_json
    args, extra = parser.parse_known_args(["train", "--out", "r", "c.toml", "a.b=1", "--resume"])
    assert not extra and (args.config, args.overrides, args.resume) == ("c.toml", ["a.b=1"], True)


@pytest.mark.parametrize("command, shown", [
    ("generate", ["(default: 0.8)", "(default: 200)", "(default: 1337)"]),
    ("translate", ["(default: 4)", "(default: 0.6)", "(default: 32)"]),
    ("evaluate", ["(default: 4)", "(default: 0.6)"]),
])
def test_help_shows_defaults(command, shown, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in shown:
        assert default in text


def test_mistakes_with_outputs_are_one_line(s2s, tmp_path, capsys):
    src = tmp_path / "in.en"
    src.write_text("12\n", encoding="utf-8")
    err = one_line_error(capsys, ["translate", str(s2s), str(src), "-o", "/missing/dir/out"])
    assert "the directory /missing/dir does not exist" in err
    err = one_line_error(capsys, ["translate", str(s2s), str(src), "-o", str(src)])
    assert "is the input file" in err
    existing = tmp_path / "file"
    existing.write_text("x")
    assert "is a file" in one_line_error(
        capsys, ["average", str(s2s), "--last", "1", "--out", str(existing)])
    assert "is a file" in one_line_error(
        capsys, ["train", str(ROOT / "configs" / "gpt-builtin.toml"), "--out", str(existing)])
    assert existing.read_text() == "x"


def test_resume_cannot_change_the_model_shape(lm, capsys):
    err = one_line_error(capsys, ["train", "--resume", "--out", str(lm), "model.n_layer=4",
                                  "train.steps=3"])
    assert "--resume cannot change the model's shape (model.n_layer 1 -> 4)" in err
    # What does not change the weights' shapes may change.
    assert main(["train", "--resume", "--out", str(lm), "model.dropout=0.1",
                 "train.steps=3"]) == 0


def test_evaluate_refuses_options_that_do_not_apply(lm, capsys):
    err = one_line_error(capsys, ["evaluate", str(lm), "--beam", "2"])
    assert "--beam applies to seq2seq checkpoints" in err
    assert "applies to transformer-xl" in one_line_error(
        capsys, ["evaluate", str(lm), "--mem-len", "8"])


def test_evaluate_says_what_it_reads_with(lm, capsys):
    capsys.readouterr()
    assert main(["evaluate", str(lm), "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert "cpu, 1 thread" in captured.err and "on the run's validation split" in (
        captured.err)
    assert "context" in captured.out  # the window it read with, beside the metrics


def test_empty_lines_translate_to_empty_lines(s2s, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("12\n\n  \n7\n"))
    capsys.readouterr()
    assert main(["translate", str(s2s), "--beam", "2"]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[1] == "" and lines[2] == "" and lines[0] and lines[3]


def test_a_source_longer_than_training_warns(s2s, caplog, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("1\n" + "9" * 40 + "\n"))
    assert main(["translate", str(s2s), "--beam", "1", "--max-len-b", "2"]) == 0
    assert "1 line(s) are longer than any training source (30 tokens)" in caplog.text
    assert "line 2" in caplog.text


def test_thread_rule(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr("tformer.training.device.busy_cores", lambda: 0)
    assert decoding_threads() == 4
    monkeypatch.setattr("tformer.training.device.busy_cores", lambda: 3)
    assert decoding_threads() == 1
    monkeypatch.setattr("tformer.training.device.busy_cores", lambda: 9)
    assert decoding_threads() == 1
    assert decoding_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert decoding_threads() == 2


def test_busy_cores_leaves_out_this_process_s_own_running_threads(tmp_path):
    """An OpenMP worker still spinning after the loading's last parallel operation is this
    process's, not another's: it must not make the default one thread fewer."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("2.00 1.50 1.00 3/120 4567\n")
    tasks = tmp_path / "task"
    for tid, state in ((10, "R"), (11, "S"), (12, "R")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (py (x) y) {state} 1 2 3\n")
    assert busy_cores(str(loadavg), str(tasks)) == 1  # 3 running, 2 of them ours
    assert busy_cores(str(loadavg), str(tmp_path / "none")) == 2  # the caller alone
    assert busy_cores(str(tmp_path / "none"), str(tasks)) == 0
    assert busy_cores() >= 0  # the real files


def test_translation_streams_through_a_pipe(s2s):
    """The first lines come back while the input is still open."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tformer", "translate", str(s2s), "--batch-size", "1",
         "--beam", "1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=env,
    )
    try:
        proc.stdin.write("1\n2\n3\n4\n")  # one chunk: 4 x --batch-size
        proc.stdin.flush()
        got = [proc.stdout.readline() for _ in range(4)]
        assert all(line.endswith("\n") for line in got)
        assert proc.poll() is None, "answered before its input ended"
        proc.stdin.write("5\n")
        proc.stdin.close()
        assert proc.stdout.read().count("\n") == 1
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_translation_at_a_terminal_answers_each_line(s2s):
    pty = pytest.importorskip("pty")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tformer", "translate", str(s2s), "--beam", "1"],
        stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    os.close(terminal)
    try:
        os.write(controller, b"12\n")
        start = time.monotonic()
        assert proc.stdout.readline().endswith("\n")
        assert time.monotonic() - start < 120
        os.write(controller, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)


def test_training_starts_with_a_summary_and_resumes_its_bar(lm, capsys):
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(lm), "train.steps=4"]) == 0
    err = capsys.readouterr().err
    head = err.split("\n")
    assert head[0] == f"training gpt into {lm}, resumed at step 2"
    summary = "\n".join(head[:8])
    for words in ("parameters, vocabulary", "training and", "validation tokens", "steps   4 (",
                  "loss    cross-entropy", "time    "):
        assert words in summary, summary
    # However many threads torch has in this process (earlier tests may have set them).
    assert re.search(r"device  cpu, \d+ threads?\n", summary), summary
    assert "2/4" in err and "0/4" not in err  # the bar goes on from the saved step
    assert "train_loss=" in err and "val_loss=" in err


def test_a_translation_run_names_its_two_losses(s2s, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(s2s, run)  # the module's run stays as the other tests expect it
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "train.steps=3"]) == 0
    err = capsys.readouterr().err
    assert "training: cross-entropy with label smoothing 0.1; validation: without" in err
