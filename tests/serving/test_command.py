"""`tformer serve` before it serves: a missing extra, bad options, the model's name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tformer.cli import build_parser, main
from tformer.errors import TformerError
from tformer.serving import command
from tformer.serving.command import model_name, require_serving_packages


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now fails
    with pytest.raises(TformerError, match=r"pip install 'tformer\[serve\]'"):
        require_serving_packages()


@pytest.mark.parametrize("args", [["--port", "70000"], ["--max-batch", "0"],
                                  ["--max-body-bytes", "10"], ["--api-key", ""]])
def test_bad_options_are_one_line_errors(gpt_checkpoint, capsys, args):
    assert main(["serve", str(gpt_checkpoint), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tformer: error: ") and err.count("\n") == 1


def test_a_checkpoint_that_is_not_there(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    assert "tformer: error:" in capsys.readouterr().err


def test_the_model_is_named_after_its_run():
    assert model_name(Path("/runs/shakespeare/best")) == "shakespeare"
    assert model_name(Path("/runs/shakespeare/checkpoints/step-000250")) == "shakespeare"
    assert model_name(Path("/models/tiny-gpt")) == "tiny-gpt"
    # What resolve_checkpoint gives for a run's best/: never the name shown.
    assert model_name(Path("/runs/shakespeare/.best-18a2f3c9d0e")) == "shakespeare"
    assert model_name("runs/shakespeare/") == "shakespeare"


def test_the_command_module_parses_as_the_cli_does(monkeypatch):
    """The serve options as serving/command.py declares them, with the CLI's defaults."""
    ours = argparse.ArgumentParser()
    command.add_arguments(ours)
    args = ["ckpt", "--port", "8123", "--int8", "--name", "x"]
    theirs = vars(build_parser().parse_args(["serve", *args]))
    mine = vars(ours.parse_args(args))
    assert {k: theirs[k] for k in mine if k in theirs} == {
        k: v for k, v in mine.items() if k in theirs}
    seen = {}
    monkeypatch.setattr(command, "serve_command", lambda ckpt, **kw: seen.update(kw) or 0)
    assert command.run(ours.parse_args(args)) == 0
    assert seen["port"] == 8123 and seen["int8"] and seen["name"] == "x"
    assert isinstance(command.HELP, str) and command.HELP
