import json
import shutil

import pytest
import torch

from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.errors import TformerError
from tformer.loading import BEST, load_checkpoint, resolve_checkpoint, step_dir, verify_checkpoint
from tformer.registry import get_family
from tformer.training.checkpoint import save_checkpoint


@pytest.fixture
def saved(tmp_path):
    tok = CharTokenizer("abcdefgh")
    cfg = config_from_dict({}, ["model.n_layer=1", "model.d_model=16", "model.n_head=2",
                                "model.context=8", f"model.vocab_size={tok.vocab_size}"])
    model = get_family("gpt").model(cfg.model).eval()
    path = save_checkpoint(step_dir(tmp_path, 10), cfg, model, tok, {"step": 10})
    return tmp_path, path, model, cfg


def test_loaded_checkpoint_gives_identical_logits(saved):
    run_dir, path, model, cfg = saved
    loaded = load_checkpoint(path)
    tokens = torch.randint(0, 8, (2, 8))
    assert torch.equal(loaded.model(tokens), model(tokens))
    assert loaded.cfg == cfg
    assert loaded.tokenizer.encode("abc") == [0, 1, 2]
    assert loaded.model.lm_head.weight is loaded.model.embed.weight, "tying survives loading"
    assert not any(p.name.startswith(".") for p in path.parent.iterdir()), "no temporary left"


def test_overwriting_is_atomic_and_clean(saved):
    run_dir, path, model, cfg = saved
    save_checkpoint(path, cfg, model, load_checkpoint(path).tokenizer)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    verify_checkpoint(path)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda p: p.joinpath("model.safetensors").write_bytes(
            p.joinpath("model.safetensors").read_bytes()[:100]), "truncated"),
        (lambda p: flip_a_byte(p / "model.safetensors"), "checksum does not match"),
        (lambda p: p.joinpath("tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda p: p.joinpath("manifest.json").unlink(), "manifest.json is missing"),
        (lambda p: p.joinpath("manifest.json").write_text("{"), "manifest.json is damaged"),
    ],
)
def test_damage_is_detected_and_named(saved, damage, message):
    run_dir, path, model, cfg = saved
    damage(path)
    with pytest.raises(TformerError, match=message):
        load_checkpoint(path)


def test_run_dir_resolves_to_best_then_latest_good(saved):
    run_dir, path, model, cfg = saved
    tok = load_checkpoint(path).tokenizer
    newer = save_checkpoint(step_dir(run_dir, 20), cfg, model, tok)
    assert resolve_checkpoint(run_dir) == newer
    flip_a_byte(newer / "model.safetensors")
    assert resolve_checkpoint(run_dir) == path, "a damaged newest checkpoint is skipped"
    best = save_checkpoint(run_dir / BEST, cfg, model, tok)
    assert resolve_checkpoint(run_dir) == best.resolve(), "best/ links to its current version"


def test_family_mismatch_and_missing_dirs(saved, tmp_path):
    run_dir, path, model, cfg = saved
    with pytest.raises(TformerError, match="is a gpt model; this command needs a seq2seq model"):
        load_checkpoint(path, family="seq2seq")
    with pytest.raises(TformerError, match="not found"):
        load_checkpoint(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TformerError, match="holds no usable checkpoint"):
        load_checkpoint(empty)


def test_config_json_records_family_and_tokenizer(saved):
    run_dir, path, model, cfg = saved
    config = json.loads((path / "config.json").read_text())
    assert config["model"]["family"] == "gpt"
    assert config["tokenizer"] == {"kind": "char", "vocab_size": 8}
    shutil.rmtree(path)


SAVE_TWICE = """
import hashlib, json, sys
from pathlib import Path
import torch
from torch import nn
from tformer.config import config_from_dict
from tformer.data.tokenizers import BPETokenizer
from tformer.registry import get_family
from tformer.training.checkpoint import save_checkpoint, save_weights

out = Path(sys.argv[1])
out.mkdir()
torch.manual_seed(0)
shared = nn.Linear(4, 4)
many = nn.ModuleDict({name: shared for name in "qwertyuiop"})  # one tensor, ten names
save_weights(many, out / "many.safetensors")
tokenizer = BPETokenizer.train(["the quick brown fox jumps over the lazy dog"] * 9, 280)
cfg = config_from_dict({"model": {"family": "seq2seq", "vocab_size": tokenizer.vocab_size,
                                  "n_layer": 1, "n_head": 2, "d_model": 8, "d_ff": 16}})
save_checkpoint(out / "ckpt", cfg, get_family("seq2seq").model(cfg.model), tokenizer)
files = [out / "many.safetensors", *sorted((out / "ckpt").iterdir())]
print(json.dumps({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}))
"""


def test_the_same_weights_give_the_same_bytes_in_any_process(tmp_path):
    """safetensors writes its header's metadata (the tied tensors' other names) in an order
    that changes from process to process; the checkpoint sorts it."""
    import os
    import subprocess
    import sys

    digests = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        done = subprocess.run([sys.executable, "-c", SAVE_TWICE, str(out)], capture_output=True,
                              text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        digests.append(json.loads(done.stdout))
    assert digests[0] == digests[1]
    assert {"many.safetensors", "model.safetensors", "manifest.json"} <= digests[0].keys()

    def metadata(file):  # as the file holds it (safe_open's metadata() has its own order)
        data = file.read_bytes()
        return json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]

    aliases = metadata(tmp_path / "1" / "many.safetensors")
    assert len(aliases) == 18 and list(aliases) == sorted(aliases)  # weights and biases
    assert len(metadata(tmp_path / "1" / "ckpt" / "model.safetensors")) >= 2  # tied embeddings
    loaded = load_checkpoint(tmp_path / "1" / "ckpt")  # and the file reads as before
    assert loaded.model.tgt_embed.weight is loaded.model.src_embed.weight
