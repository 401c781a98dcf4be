"""`tformer export` without --format: the family the model's config is exactly (GPT-2, Llama
and its kin), named in the output line, and loaded back by transformers with our logits."""

from __future__ import annotations

import re

import pytest
import torch

from tformer.cli import main
from tformer.errors import TformerError
from tformer.interop.command import EXPORTERS, choose_format, import_checkpoint
from tformer.loading import load_checkpoint

from .test_llama import COMMON, FAMILIES, bpe_tokenizer, randomise

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[5, 17, 3, 88, 41, 9, 62, 23, 7, 1, 54]])


def llama_layout_dir(name, path):
    config_class, model_class, fields = FAMILIES[name]
    config = getattr(transformers, config_class)(**COMMON, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    randomise(model)
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("source,family,architecture", [
    ("gpt2", "gpt2", "GPT2LMHeadModel"),
    ("llama3", "llama", "LlamaForCausalLM"),
    ("qwen3-head-dim", "qwen3", "Qwen3ForCausalLM"),
])
def test_export_without_a_format_writes_the_family_the_config_is(
        source, family, architecture, gpt2_dir, tmp_path, capsys):
    src = gpt2_dir if source == "gpt2" else llama_layout_dir(source, tmp_path / "hf")
    ours = import_checkpoint(src, tmp_path / "ours")
    back = tmp_path / "back"
    assert main(["export", str(ours), "--out", str(back)]) == 0
    line = capsys.readouterr().out
    assert f"as {family}" in line and "chosen by its config" in line, line
    model = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(model).__name__ == architecture
    loaded = load_checkpoint(ours)
    with torch.no_grad():
        expected = loaded.model(TOKENS)
        got = model(TOKENS).logits
    assert (got - expected).abs().max() <= 1e-5


def test_a_model_no_family_expresses_is_one_error_naming_each_reason(tmp_path):
    from tformer.config import RunConfig, TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.data.tokenizers import CharTokenizer
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training.checkpoint import save_checkpoint

    cfg = GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, context=8,
                    norm_kind="rmsnorm")  # GPT-2 has LayerNorm, Llama no learned positions
    save_checkpoint(tmp_path / "odd", RunConfig("gpt", cfg, LMDataConfig(), TrainConfig()),
                    GPT(cfg), CharTokenizer("abcdefghij"))
    with pytest.raises(TformerError) as e:
        choose_format(tmp_path / "odd", tmp_path / "out")
    message = str(e.value)
    assert "gpt2: " in message and "llama: " in message and "--format tformer" in message
    assert "\n" not in message
    assert choose_format(tmp_path / "odd", tmp_path / "out", "tformer") == ("tformer", "tformer")
    assert list(EXPORTERS)[:2] == ["gpt2", "llama"]

    # GPT-2's layout exactly, but characters for tokens: no format is chosen that would
    # refuse the tokenizer only once the weights are written.
    cfg = GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, context=8)
    save_checkpoint(tmp_path / "chars", RunConfig("gpt", cfg, LMDataConfig(), TrainConfig()),
                    GPT(cfg), CharTokenizer("abcdefghij"))
    with pytest.raises(TformerError) as e:
        choose_format(tmp_path / "chars", tmp_path / "out")
    checked = sum(exporter.fits is not None for exporter in EXPORTERS.values())
    assert str(e.value).count("the tokenizer is 'char'") == checked, str(e.value)
    with pytest.raises(TformerError, match="the tokenizer is 'char'"):
        choose_format(tmp_path / "chars", tmp_path / "out.gguf")


def shown_rows(out):
    """`tformer info`'s table rows as {key: value}."""
    rows = [line.split(None, 1) for line in out.splitlines() if line.startswith("  ")]
    return {row[0]: row[1].strip() if len(row) > 1 else "" for row in rows}


@pytest.mark.parametrize("source", ["qwen3-head-dim", "llama3"])
def test_info_on_an_imported_model_shows_its_tokenizer_and_the_fields_that_apply(
        source, tmp_path, capsys):
    src = llama_layout_dir(source, tmp_path / "hf")
    tokenizer = bpe_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer.save_pretrained(src)
    ours = import_checkpoint(src, tmp_path / "ours")
    assert main(["info", str(ours)]) == 0
    out = capsys.readouterr().out
    rows = shown_rows(out)
    assert rows["model.rotary"] == "True" and rows["model.rope_theta"]
    assert "model.sinusoid_layout" not in rows  # no sinusoidal positions
    scaling = {"model.rope_factor", "model.rope_low_freq_factor",
               "model.rope_high_freq_factor", "model.rope_original_context"}
    if source == "llama3":
        assert rows["model.rope_scaling"] == "llama3" and scaling <= rows.keys()
    else:
        assert rows["model.rope_scaling"] == "none" and not scaling & rows.keys()
        assert rows["model.qk_norm"] == "True"
    # Nothing of a training run here: no [data] or [train] field was set.
    assert not [key for key in rows if key.startswith(("data.", "train."))]
    assert rows["kind"] == "gpt2 (byte-level BPE, pretrained)"
    assert rows["vocabulary"] == f"{len(tokenizer)} tokens"
    assert (rows["bos"], rows["eos"]) == ("<s> (0)", "</s> (1)")
    assert re.search(r"^  chat template +chat_template.jinja$", out, re.M), out


def test_a_damaged_config_is_one_line_when_choosing_the_format(tmp_path):
    from tformer.config import RunConfig, TrainConfig
    from tformer.data.lm import LMDataConfig
    from tformer.data.tokenizers import CharTokenizer
    from tformer.models.gpt import GPT, GPTConfig
    from tformer.training.checkpoint import save_checkpoint

    cfg = GPTConfig(vocab_size=11, n_layer=1, n_head=2, d_model=8, context=8)
    run = save_checkpoint(tmp_path / "run", RunConfig("gpt", cfg, LMDataConfig(),
                                                      TrainConfig()), GPT(cfg),
                          CharTokenizer("abcdefghij"))
    (run / "config.json").write_text('{"model": ')
    with pytest.raises(TformerError, match="config.json is damaged"):
        choose_format(run, tmp_path / "out")
