"""LoRA adapters in and out of PEFT, against peft's own PeftModel on a tiny random GPT-2;
merged export against GPT2LMHeadModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.config import LoRAConfig
from tformer.interop.command import import_checkpoint
from tformer.loading import base_reference, load_checkpoint, read_config, resolve_checkpoint
from tformer.training import lora
from tformer.training.checkpoint import save_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def imported(gpt2_dir, tmp_path_factory) -> Path:
    return import_checkpoint(gpt2_dir, tmp_path_factory.mktemp("imported") / "ckpt")


@pytest.fixture(scope="module")
def exported_base(imported, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "base"
    assert main(["export", str(imported), "--out", str(out)]) == 0
    return out


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


def random_b(parameters, seed: int = 5) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in parameters:
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


@pytest.fixture(scope="module")
def lora_checkpoint(imported, tmp_path_factory) -> Path:
    """A tformer LoRA checkpoint on the imported GPT-2, its B random (not a no-op)."""
    base = load_checkpoint(imported)
    cfg = LoRAConfig(r=4, alpha=8.0, targets=["qkv_proj", "out_proj", "up"])
    lora.add_adapters(base.model, cfg)
    random_b(base.model.named_parameters())
    run = base.cfg.replace("train", init_from=str(imported), lora=cfg)
    dest = tmp_path_factory.mktemp("lora") / "ckpt"
    return save_checkpoint(dest, run, base.model, base.tokenizer,
                           lora_base=base_reference(resolve_checkpoint(imported)))


def test_an_exported_adapter_on_the_exported_base_gives_tformers_logits(
    lora_checkpoint, exported_base, tmp_path
):
    out = tmp_path / "adapter"
    assert main(["export", str(lora_checkpoint), "--adapter", "--out", str(out)]) == 0
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["target_modules"] == ["attn.c_attn", "attn.c_proj", "mlp.c_fc"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported_base)
    model = peft.PeftModel.from_pretrained(hf, out).eval()
    ours = load_checkpoint(lora_checkpoint)
    ids = tokens(ours.tokenizer.vocab_size)
    with torch.no_grad():
        expected = model(ids).logits
        got = ours.model(ids)
        plain = transformers.GPT2LMHeadModel.from_pretrained(exported_base).eval()(ids).logits
    assert (got - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-2  # the adapter does change the outputs


def test_a_lora_run_exports_merged_weights(lora_checkpoint, tmp_path):
    out = tmp_path / "merged"
    assert main(["export", str(lora_checkpoint), "--out", str(out)]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    ours = load_checkpoint(lora_checkpoint)
    ids = tokens(ours.tokenizer.vocab_size)
    with torch.no_grad():
        assert (hf(ids).logits - ours.model(ids)).abs().max() <= 1e-5


def test_a_peft_adapter_brought_in_reproduces_peft(gpt2_dir, imported, tmp_path):
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    config = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["c_attn", "c_proj"],
                             fan_in_fan_out=True, lora_dropout=0.0)
    model = peft.get_peft_model(hf, config)
    random_b(model.named_parameters())
    model.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "ckpt"
    assert main(["import", str(tmp_path / "adapter"), "--base", str(imported),
                 "--out", str(out)]) == 0
    ours = load_checkpoint(out)
    assert read_config(out).train.lora.targets == ("down", "out_proj", "qkv_proj")
    ids = tokens(ours.tokenizer.vocab_size)
    with torch.no_grad():
        assert (model.eval()(ids).logits - ours.model(ids)).abs().max() <= 1e-5


def test_adapters_that_cannot_be_brought_in_are_one_line_errors(gpt2_dir, imported, tmp_path,
                                                                capsys):
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                    fan_in_fan_out=True, use_dora=True))
    model.save_pretrained(tmp_path / "dora")
    capsys.readouterr()
    assert main(["import", str(tmp_path / "dora"), "--out", str(tmp_path / "a")]) == 2
    assert "name the checkpoint it adapts with --base" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "dora"), "--base", str(imported),
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "cannot express use_dora = True" in err and err.count("\n") == 1
    assert main(["export", str(imported), "--adapter", "--out", str(tmp_path / "c")]) == 2
    assert "is not a LoRA run" in capsys.readouterr().err
