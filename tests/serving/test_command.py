"""`tformer serve` before it serves: a missing extra, bad options, the model's name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tformer.cli import main
from tformer.errors import TformerError
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
