"""The command line as a user meets it: the README's commands, and bad input."""

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tformer.cli import main
from tformer.loading import load_checkpoint


@pytest.fixture
def config(tiny_config):
    return tiny_config()


@pytest.fixture
def run_dir(tmp_path, config):
    out = tmp_path / "run"
    assert main(["train", str(config), "--out", str(out)]) == 0
    return out


def test_train_generate_evaluate(run_dir, capsys, tiny_corpus):
    capsys.readouterr()
    assert (
        main(
            ["generate", str(run_dir), "--prompt", "First", "--max-new-tokens", "20", "--seed", "1"]
        )
        == 0
    )
    first = capsys.readouterr().out
    assert first.startswith("First") and len(first) == len("First") + 20 + 1  # char tokens
    main(
        [
            "generate",
            str(run_dir),
            "--prompt",
            "First",
            "--max-new-tokens",
            "20",
            "--seed",
            "1",
            "--no-cache",
        ]
    )
    assert capsys.readouterr().out == first, "same seed, same text, cache or not"

    assert main(["evaluate", str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"loss", "perplexity", "bpc"}
    assert result["bpc"] == pytest.approx(result["loss"] / 0.6931471805599453)
    assert main(["evaluate", str(run_dir), "--json", "--int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["loss"] == pytest.approx(result["loss"], rel=0.02)
    # Greedy text is the argmax chain of the plain model, computed here a step at a time.
    loaded = load_checkpoint(run_dir)
    ids = loaded.tokenizer.encode("First")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(loaded.model(torch.tensor([ids[-16:]]))[0, -1].argmax()))
    want = loaded.tokenizer.decode(ids) + "\n"
    for int8 in ([], ["--int8"]):
        assert main(["generate", str(run_dir), "--prompt", "First", "--max-new-tokens", "12",
                     "--greedy", *int8]) == 0
        got = capsys.readouterr().out
        if not int8:
            assert got == want
        else:  # int8 weights may flip a close call, but not most of them
            assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(want) - 4

    assert main(["evaluate", str(run_dir), str(tiny_corpus)]) == 0
    table = capsys.readouterr().out
    rows = dict(line.split() for line in table.splitlines())
    assert list(rows)[:3] == ["loss", "perplexity", "bpc"]
    text_result = main(["evaluate", str(run_dir), str(tiny_corpus), "--json"])
    assert text_result == 0
    on_text = json.loads(capsys.readouterr().out)
    assert float(rows["loss"]) == pytest.approx(on_text["loss"], abs=1e-4)


def test_resume_continues_with_more_steps(run_dir, capsys):
    assert main(["train", "--resume", "--out", str(run_dir), "train.steps=9"]) == 0
    assert "done at step 9" in capsys.readouterr().out


def test_overrides_after_the_options(config, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["train", str(config), "--out", str(out), "train.steps=2", "model.n_layer=2"]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["n_layer"] == 2


def test_long_prompt_is_explained(run_dir, capsys):
    assert (
        main(["generate", str(run_dir), "--prompt", "Speak, " * 10, "--max-new-tokens", "2"]) == 0
    )
    assert "the prompt is 70 tokens and the model's context is 16; it reads the last 16" in (
        capsys.readouterr().err
    )


def errors(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2(config, run_dir, tmp_path, capsys):
    assert "config file not found" in errors(capsys, ["train", "nope.toml", "--out", "x"])
    assert 'did you mean "n_layer"' in errors(
        capsys, ["train", str(config), "--out", str(tmp_path / "a"), "model.n_layers=2"]
    )
    assert "already holds a training run" in errors(
        capsys, ["train", str(config), "--out", str(run_dir)]
    )
    assert "holds no usable checkpoint" in errors(
        capsys, ["train", "--resume", "--out", str(tmp_path)]
    )
    assert "run directory not found" in errors(
        capsys, ["train", "--resume", "--out", str(tmp_path / "z")]
    )
    assert "not found" in errors(capsys, ["generate", str(tmp_path / "missing"), "--prompt", "a"])
    assert "never saw" in errors(capsys, ["generate", str(run_dir), "--prompt", "Ωmega"])
    assert "--top-p 0.0 must be in (0, 1]" in errors(
        capsys, ["generate", str(run_dir), "--top-p", "0"]
    )
    assert "--max-new-tokens 0" in errors(
        capsys, ["generate", str(run_dir), "--max-new-tokens", "0"]
    )
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    assert "looks binary" in errors(capsys, ["evaluate", str(run_dir), str(binary)])
    assert "unrecognized arguments" in errors(
        capsys, ["generate", str(run_dir), "--tempreature", "1"]
    )


def test_module_entry_point_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tformer", "evaluate", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("tformer: error: checkpoint or run directory not found")


WORDS = [
    "train",
    "generate",
    "evaluate",
    "--out",
    "--resume",
    "--prompt",
    "--json",
    "--top-k",
    "-1",
    "0",
    "x",
    "/nonexistent",
    "model.n_layer=0",
    "train.lr=-1",
    "=",
    "--seed",
    "é",
    "--temperature",
    "nan",
    "--device",
    "cuda:7",
    "--batch-size",
    "-3",
]


@given(st.lists(st.sampled_from(WORDS), max_size=7))
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_no_command_line_gives_a_traceback(tmp_path_factory, monkeypatch, argv):
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    assert main(argv) in (0, 2)


def test_a_prompt_that_is_not_utf8_is_one_line(run_dir):
    # Arguments arrive as bytes; a Latin-1 terminal sends "café" as b"caf\xe9".
    proc = subprocess.run(
        [sys.executable, "-m", "tformer", "generate", str(run_dir).encode(), "--prompt",
         b"caf\xe9"],
        capture_output=True,
    )
    assert proc.returncode == 2
    assert proc.stderr == b"tformer: error: --prompt is not UTF-8 text (byte 0xe9 at character 3)\n"
