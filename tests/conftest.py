"""Shared fixtures: a private token cache and a tiny corpus, so tests touch nothing outside
their temporary directories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY_TEXT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
) * 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(TINY_TEXT, encoding="utf-8")
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu skip themselves where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY_GPT = {
    "model": {"family": "gpt", "n_layer": 1, "n_head": 2, "d_model": 16, "context": 16},
    "train": {"steps": 6, "batch_size": 4, "eval_every": 3, "checkpoint_every": 3,
              "keep_checkpoints": 3, "device": "cpu"},
}
"""The smallest GPT run the CLI and training tests train (a second or so)."""


def toml_text(tables: dict[str, dict[str, object]]) -> str:
    """Flat TOML tables of strings, numbers and booleans."""
    lines = []
    for table, fields in tables.items():
        lines.append(f"[{table}]")
        for key, value in fields.items():
            shown = (str(value).lower() if isinstance(value, bool)
                     else f'"{value}"' if isinstance(value, str) else repr(value))
            lines.append(f"{key} = {shown}")
        lines.append("")
    return "\n".join(lines)


@pytest.fixture
def tiny_config(tmp_path: Path, tiny_corpus: Path):
    """write(name="tiny.toml", model={...}, **train) -> the path of TINY_GPT's config on the
    tiny corpus, with those [model] and [train] fields changed."""

    def write(name: str = "tiny.toml", *, model: dict | None = None, **train: object) -> Path:
        path = tmp_path / name
        path.write_text(toml_text({
            "model": {**TINY_GPT["model"], **(model or {})},
            "data": {"path": str(tiny_corpus)},
            "train": {**TINY_GPT["train"], **train},
        }), encoding="utf-8")
        return path

    return write


@pytest.fixture
def start_tformer():
    """start(*args, stdin=None, preexec_fn=None) -> a `python -m tformer ARGS` process on
    one thread, its stdout and stderr piped (bytes)."""

    def start(*args: str, stdin=None, preexec_fn=None) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-m", "tformer", *args], env=env, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=preexec_fn)

    return start
