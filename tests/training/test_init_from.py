"""Fine-tuning: a run that starts from another checkpoint's weights and tokenizer, for each
family, through the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tformer import loading
from tformer.cli import main
from tformer.config import config_from_dict, load_config
from tformer.training import checkpoint as ckpt

COMMON = ["train.steps=2", "train.eval_every=2", "train.checkpoint_every=2",
          "train.warmup_steps=1", "train.log_every=1", "train.device=cpu"]
FAMILIES = {
    "gpt": ['family = "gpt"', ["model.n_layer=1", "model.d_model=16", "model.n_head=2",
                               "model.context=8", "train.batch_size=2"]],
    "seq2seq": ['family = "seq2seq"', ["model.n_layer=1", "model.d_model=16", "model.n_head=2",
                                       "model.d_ff=32", "data.builtin_pairs=200",
                                       "data.builtin_max=999", "data.max_tokens=400",
                                       "data.tokenizer=char"]],
    "transformer-xl": ['family = "transformer-xl"', ["model.n_layer=1", "model.d_model=16",
                                                     "model.n_head=2", "model.context=8",
                                                     "model.mem_len=8", "train.batch_size=2"]],
}


def config(tmp_path: Path, family: str, corpus: Path) -> Path:
    path = tmp_path / f"{family}.toml"
    data = "" if family == "seq2seq" else f'[data]\npath = "{corpus}"\n'
    path.write_text(f"[model]\n{FAMILIES[family][0]}\n{data}")
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_starts_from_the_checkpoint_weights_and_tokenizer(family, tmp_path, tiny_corpus):
    cfg, tiny = config(tmp_path, family, tiny_corpus), FAMILIES[family][1]
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    assert main(["train", str(cfg), "--out", str(base), *tiny, *COMMON]) == 0
    start = loading.resolve_checkpoint(base)
    # With a learning rate of 0 the weights stay what they were loaded as. The config names
    # the model's sizes again (as a fine-tuning config may), and changes its dropout.
    assert main(["train", str(cfg), "--out", str(tuned), *tiny, *COMMON, "train.lr=0",
                 "train.min_lr=0", f"train.init_from={base}", "model.dropout=0.2"]) == 0
    before = load_file(start / loading.WEIGHTS)
    after = load_file(loading.step_dir(tuned, 2) / loading.WEIGHTS)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    tokenizer_file = loading.TOKENIZER
    assert (start / tokenizer_file).read_text() == (tuned / "best" / tokenizer_file).read_text()
    saved = loading.read_config(loading.step_dir(tuned, 2))
    assert saved.model.dropout == 0.2

    # And with a real learning rate it trains: the weights move.
    moved = tmp_path / "moved"
    assert main(["train", str(cfg), "--out", str(moved), *tiny, *COMMON, "train.lr=1e-2",
                 f"train.init_from={base}"]) == 0
    after = load_file(loading.step_dir(moved, 2) / loading.WEIGHTS)
    assert any(not torch.equal(after[n], t) for n, t in before.items())
    # The fine-tuned run resumes like any other (its config is complete).
    assert main(["train", "--resume", "--out", str(moved), "train.steps=3"]) == 0


def test_model_fields_that_contradict_the_checkpoint_are_an_error(tmp_path, tiny_corpus, capsys):
    cfg, tiny = config(tmp_path, "gpt", tiny_corpus), FAMILIES["gpt"][1]
    base = tmp_path / "base"
    assert main(["train", str(cfg), "--out", str(base), *tiny, *COMMON]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(tmp_path / "b"), *tiny, *COMMON,
                 f"train.init_from={base}", "model.n_layer=2", "model.activation=relu"]) == 2
    err = capsys.readouterr().err
    assert "model.n_layer = 2 (checkpoint: 1)" in err and "model.activation = 'relu'" in err
    assert err.count("\n") == 1
    txl = config(tmp_path, "transformer-xl", tiny_corpus)
    assert main(["train", str(txl), "--out", str(tmp_path / "c"), *COMMON,
                 f"train.init_from={base}"]) == 2
    assert "is a gpt model" in capsys.readouterr().err


def test_an_unstated_model_comes_whole_from_the_checkpoint(tmp_path, tiny_corpus):
    cfg, tiny = config(tmp_path, "gpt", tiny_corpus), FAMILIES["gpt"][1]
    base = tmp_path / "base"
    assert main(["train", str(cfg), "--out", str(base), *tiny, *COMMON]) == 0
    bare = tmp_path / "bare.toml"
    bare.write_text(f'[data]\npath = "{tiny_corpus}"\n[train]\ninit_from = "{base}"\n')
    inherited = load_config(bare, inherit=ckpt.inherit_model)
    assert inherited.model == loading.read_config(loading.resolve_checkpoint(base)).model
    # A saved config is complete: reading it never goes back to init_from.
    saved = inherited.to_dict()
    saved["train"]["init_from"] = str(tmp_path / "gone")
    assert config_from_dict(saved).model == inherited.model
