"""The command line with a Transformer-XL: train, resume, evaluate with other memory and
segment lengths, generate."""

import json
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.config import load_config
from tformer.registry import get_family

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.family=transformer-xl", "model.n_layer=2", "model.d_model=16", "model.n_head=2",
        "model.d_ff=32", "model.context=8", "model.mem_len=8", "train.batch_size=2",
        "train.eval_every=2", "train.checkpoint_every=2", "train.eval_batches=2",
        "train.warmup_steps=1", "train.log_every=1"]


def config_file(tmp_path: Path, corpus: Path) -> Path:
    path = tmp_path / "txl.toml"
    path.write_text(f'[model]\nfamily = "transformer-xl"\n[data]\npath = "{corpus}"\n')
    return path


def train(tmp_path, corpus, out, *extra) -> int:
    return main(["train", str(config_file(tmp_path, corpus)), "--out", str(out), *TINY, *extra])


def test_shipped_config_loads():
    cfg = load_config(ROOT / "configs" / "txl-shakespeare-char.toml")
    assert cfg.family == "transformer-xl"
    assert (cfg.model.context, cfg.model.mem_len, cfg.model.n_layer, cfg.model.d_model) == (
        64, 64, 4, 128)
    model = get_family(cfg.family).model(cfg.replace("model", vocab_size=65).model)
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 65)


def test_train_evaluate_generate(tmp_path, tiny_corpus, capsys):
    run = tmp_path / "run"
    assert train(tmp_path, tiny_corpus, run, "train.steps=2") == 0
    capsys.readouterr()

    assert main(["evaluate", str(run), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert set(trained) >= {"loss", "perplexity", "bpc"}
    assert main(["evaluate", str(run), str(tiny_corpus), "--json", "--mem-len", "0",
                 "--segment-len", "4"]) == 0
    other = json.loads(capsys.readouterr().out)
    assert other["loss"] != trained["loss"]

    assert main(["generate", str(run), "--prompt", "First", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.startswith("First")
    # 5 prompt + 4 new tokens fit in mem_len + 1 = 9: the memory and recomputing agree.
    outputs = []
    for extra in ([], ["--no-cache"]):
        assert main(["generate", str(run), "--prompt", "First", "--max-new-tokens", "4",
                     "--greedy", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--mem-len", "-1"], "--mem-len -1 must be 0 (no memory) or more"),
        (["--segment-len", "0"], "--segment-len 0 must be at least 1"),
    ],
)
def test_bad_memory_options(tmp_path, tiny_corpus, capsys, args, words):
    run = tmp_path / "run"
    assert train(tmp_path, tiny_corpus, run, "train.steps=2") == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), *args]) == 2
    assert words in capsys.readouterr().err


def test_memory_options_on_a_gpt_checkpoint_are_refused(tmp_path, tiny_corpus, capsys):
    run = tmp_path / "gpt"
    overrides = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.context=8",
                 "train.steps=1", "train.batch_size=2", "train.eval_batches=1"]
    config = tmp_path / "gpt.toml"
    config.write_text(f'[data]\npath = "{tiny_corpus}"\n')
    assert main(["train", str(config), "--out", str(run), *overrides]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(run), "--mem-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "--mem-len applies to transformer-xl checkpoints" in err and "gpt model" in err
