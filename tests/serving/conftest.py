"""Tiny checkpoints, and the real server started on them as a subprocess on a free port of
127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.registry import get_family
from tformer.training.checkpoint import save_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
TEXT = "abcdefghijklmnopqrstuvwxyz ,.!?\n"


def tiny_checkpoint(dest: Path, model: dict, *, std: float = 0.3, specials: bool = False,
                    only_matrices: bool = False, text: str = TEXT) -> Path:
    """A model with random weights large enough that its logits have no near-ties (greedy
    results then compare decoding paths, not rounding), saved as a checkpoint.
    only_matrices: leave biases and norms as the model initialised them; text: the
    characters of its vocabulary."""
    tokenizer = CharTokenizer(text, specials=specials)
    cfg = config_from_dict({"model": {**model, "vocab_size": tokenizer.vocab_size},
                            "train": {"device": "cpu"}})
    torch.manual_seed(0)
    net = get_family(cfg.family).model(cfg.model)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() >= 2 or not only_matrices:
                p.normal_(0.0, std)
    return save_checkpoint(dest, cfg, net.eval(), tokenizer)


@pytest.fixture(scope="session")
def gpt_checkpoint(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("gpt") / "tiny-gpt", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "context": 64})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`tformer serve` in a subprocess; `url` once /health answers."""

    def __init__(self, checkpoint: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tformer", "serve", str(checkpoint), "--port",
             str(self.port), "--device", "cpu", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not answer /health within 60 s")
            time.sleep(0.1)

    def terminate(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture(scope="module")
def gpt_server(gpt_checkpoint):
    server = Server(gpt_checkpoint, "--max-batch", "8", "--max-body-bytes", "4096")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory) -> Path:
    """A model with room for long completions, to have requests in flight for a while."""
    return tiny_checkpoint(tmp_path_factory.mktemp("long") / "long-gpt", {
        "family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "context": 512})


@pytest.fixture(scope="session")
def gpt_run(tmp_path_factory) -> Path:
    """A run directory whose best/ is a link to a hidden `.best-<version>` checkpoint."""
    run = tmp_path_factory.mktemp("runs") / "tiny-run"
    tiny_checkpoint(run / "best", {"family": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32,
                                   "context": 128}, specials=True)
    assert (run / "best").is_symlink()
    return run


@pytest.fixture(scope="module")
def loaded(gpt_run):
    from tformer.loading import load_checkpoint

    return load_checkpoint(gpt_run)


@pytest.fixture(scope="module")
def app_client(loaded):
    """The app on gpt_run's model, in this process (fastapi's TestClient)."""
    from fastapi.testclient import TestClient

    from tformer.serving.app import create_app
    from tformer.serving.scheduler import LMEngine

    engine = LMEngine(loaded.model, eos_id=loaded.tokenizer.eos_id, max_batch=8,
                      max_waiting=32, batched=True)
    app = create_app(engine, loaded.tokenizer, model_name="tiny-run", kind="lm")
    with TestClient(app) as client:
        yield client


CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}. {{ m.content }} end!\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant.{% endif %}")
"""Written in the tiny model's characters; a turn ends with 'end!'."""


@pytest.fixture(scope="session")
def run_server(gpt_run, tmp_path_factory):
    """`tformer serve` on gpt_run with CHAT_TEMPLATE (--chat-template)."""
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    server = Server(gpt_run, "--max-batch", "8", "--chat-template", str(path))
    yield server
    server.stop()
