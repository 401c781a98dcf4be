"""`tformer serve` before it serves: a missing extra, bad options, the model's name."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from tformer.cli import main
from tformer.errors import TformerError
from tformer.loading import run_name
from tformer.serving import command
from tformer.serving.command import require_serving_packages


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
    assert run_name(Path("/runs/shakespeare/best")) == "shakespeare"
    assert run_name(Path("/runs/shakespeare/checkpoints/step-000250")) == "shakespeare"
    assert run_name(Path("/models/tiny-gpt")) == "tiny-gpt"
    # What resolve_checkpoint gives for a run's best/: never the name shown.
    assert run_name(Path("/runs/shakespeare/.best-18a2f3c9d0e")) == "shakespeare"
    assert run_name("runs/shakespeare/") == "shakespeare"


def test_the_serve_options_reach_serve_command(monkeypatch):
    """The serve options are serve_command's own parameters (tformer.arguments)."""
    seen = {}

    @functools.wraps(command.serve_command)  # the same parameters, so the same options
    def fake(checkpoint, **options):
        seen.update(options, checkpoint=checkpoint)
        return 0

    monkeypatch.setattr(command, "serve_command", fake)
    assert main(["serve", "ckpt", "--port", "8123", "--int8", "--name", "x",
                 "--chat-template", "t.jinja"]) == 0
    assert seen["checkpoint"] == "ckpt" and seen["port"] == 8123 and seen["weights"] == "int8"
    assert seen["name"] == "x" and seen["chat_template"] == "t.jinja"
    assert seen["host"] == "127.0.0.1" and seen["max_batch"] == 16
