"""GPT-2 import and export against Hugging Face's own implementation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tformer.cli import main
from tformer.decoding.lm import generate, left_pad
from tformer.errors import TformerError
from tformer.interop.command import export_checkpoint, import_checkpoint
from tformer.loading import load_checkpoint

from .conftest import TRICKY

transformers = pytest.importorskip("transformers")

PROMPTS = ["Kalo miré tu", "Sha", "Héllo wörld, ça va? Vo ne"]


@pytest.fixture(scope="module")
def imported(gpt2_dir, tmp_path_factory) -> Path:
    return import_checkpoint(gpt2_dir, tmp_path_factory.mktemp("imported") / "ckpt")


@pytest.fixture(scope="module")
def hf_model(gpt2_dir):
    return transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gpt2_dir):
    return transformers.GPT2TokenizerFast.from_pretrained(gpt2_dir)


def test_logits_match_hugging_face_on_a_left_padded_batch(imported, hf_model, hf_tokenizer):
    ours = load_checkpoint(imported)
    ids = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    tokens, is_real = left_pad(ids, pad_id=hf_tokenizer.eos_token_id)
    positions = (is_real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf_model(tokens, attention_mask=is_real.long(), position_ids=positions).logits
        got = ours.model(tokens, is_real)
    assert got.shape == expected.shape
    delta = (got - expected).abs()[is_real]
    assert delta.max() <= 1e-5, float(delta.max())


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_greedy_tokens_match_hugging_face_generate(imported, hf_model, hf_tokenizer, prompts):
    ours = load_checkpoint(imported)
    ids = [hf_tokenizer(p)["input_ids"] for p in prompts]
    eos = hf_tokenizer.eos_token_id
    tokens, is_real = left_pad(ids, pad_id=eos)
    expected = hf_model.generate(
        tokens, attention_mask=is_real.long(), max_new_tokens=20, do_sample=False,
        pad_token_id=eos, eos_token_id=None,
    )[:, tokens.shape[1]:]
    got = torch.stack(list(generate(
        ours.model, tokens, is_real=is_real if len(prompts) > 1 else None, max_new_tokens=20,
        temperature=0.0,
    )), dim=1)
    assert expected.shape == (len(prompts), 20)
    assert torch.equal(got, expected)


def test_token_ids_match_gpt2_tokenizer(imported, hf_tokenizer, gpt2_dir, tmp_path):
    ours = load_checkpoint(imported).tokenizer
    text = "\n".join(TRICKY) + "\t \t  mixed   \n\n"
    assert ours.encode(text) == hf_tokenizer(text)["input_ids"]
    documents = "one document.<|endoftext|>Another one."
    assert ours.encode(documents) == hf_tokenizer(documents)["input_ids"]
    assert ours.eos_id in ours.encode(documents)
    for line in TRICKY:
        assert ours.encode(line) == hf_tokenizer(line)["input_ids"]
        assert ours.decode(ours.encode(line)) == line
    # The same tokenizer built from vocab.json + merges.txt alone, as older directories
    # ship it.
    bare = tmp_path / "bare"
    shutil.copytree(gpt2_dir, bare)
    model = json.loads((gpt2_dir / "tokenizer.json").read_text())["model"]
    (bare / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (bare / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (bare / "tokenizer.json").unlink()
    from_files = load_checkpoint(import_checkpoint(bare, tmp_path / "ckpt")).tokenizer
    assert from_files.encode(text) == hf_tokenizer(text)["input_ids"]
    assert from_files.eos_id == hf_tokenizer.eos_token_id


def test_round_trip_gives_identical_tensors(imported, hf_model, hf_tokenizer, tmp_path):
    out = export_checkpoint(imported, tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    expected, got = hf_model.state_dict(), back.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "\n".join(TRICKY)
    assert tokenizer(text)["input_ids"] == hf_tokenizer(text)["input_ids"]
    prompt = torch.tensor([hf_tokenizer(PROMPTS[0])["input_ids"]])
    kwargs = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(back.generate(prompt, **kwargs), hf_model.generate(prompt, **kwargs))


def test_pytorch_model_bin_is_read_too(gpt2_dir, hf_model, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    # What older versions of transformers saved: a pickled state dict.
    torch.save(hf_model.state_dict(), src / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_dir / name, src / name)
    ours = load_checkpoint(import_checkpoint(src, tmp_path / "ckpt"))
    tokens = torch.tensor([[5, 9, 200, 3]])
    with torch.no_grad():
        assert (ours.model(tokens) - hf_model(tokens).logits).abs().max() <= 1e-5


def test_inexpressible_configs_are_named(gpt2_dir, imported, tmp_path):
    src = tmp_path / "odd"
    shutil.copytree(gpt2_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["scale_attn_by_inverse_layer_idx"] = True
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(TformerError, match="scale_attn_by_inverse_layer_idx"):
        import_checkpoint(src, tmp_path / "a")
    config["model_type"] = "gemma"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(TformerError, match="'gemma' cannot be imported"):
        import_checkpoint(src, tmp_path / "b")

    # Export: a GPT with sinusoidal positions and an output bias is no GPT-2.
    from tformer.loading import read_config
    from tformer.training.checkpoint import save_checkpoint

    loaded = load_checkpoint(imported)
    cfg = read_config(imported).replace("model", position="sinusoidal", output_bias=True)
    from tformer.models.gpt import GPT

    odd = save_checkpoint(tmp_path / "odd-ckpt", cfg, GPT(cfg.model), loaded.tokenizer)
    with pytest.raises(TformerError, match="position.*output_bias"):
        export_checkpoint(odd, tmp_path / "c")


def test_cli_import_generate_export(gpt2_dir, hf_model, hf_tokenizer, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["import", str(gpt2_dir), "--out", str(ckpt)]) == 0
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", PROMPTS[0], "--greedy",
                 "--max-new-tokens", "10"]) == 0
    text = capsys.readouterr().out
    prompt = torch.tensor([hf_tokenizer(PROMPTS[0])["input_ids"]])
    expected = hf_model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)
    assert text.startswith(hf_tokenizer.decode(expected[0], skip_special_tokens=True))
    assert main(["generate", str(ckpt), "--prompt", PROMPTS[0], "--int8",
                 "--max-new-tokens", "5"]) == 0
    capsys.readouterr()
    (tmp_path / "text.txt").write_text("\n".join(TRICKY * 20))
    assert main(["evaluate", str(ckpt), str(tmp_path / "text.txt"), "--json", "--int8"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    assert transformers.GPT2LMHeadModel.from_pretrained(out) is not None
    assert main(["import", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_readme_fine_tuning_example(gpt2_dir, tmp_path, capsys, monkeypatch):
    """The README's commands, on the tiny model: import, fine-tune on a text file, generate,
    export."""
    from .conftest import generated_text

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-text.txt").write_text("\n".join(generated_text(200, seed=1)))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    config = readme.split("cat > finetune.toml <<'END'\n")[1].split("END\n")[0]
    config = config.replace("steps = 500", "steps = 4").replace("warmup_steps = 50",
                                                                "warmup_steps = 1")
    (tmp_path / "finetune.toml").write_text(config + "eval_every = 2\ncheckpoint_every = 2\n")
    assert main(["import", str(gpt2_dir), "--out", "runs/gpt2"]) == 0
    assert main(["train", "finetune.toml", "--out", "runs/gpt2-mine"]) == 0
    assert main(["generate", "runs/gpt2-mine", "--prompt", "Once upon a time",
                 "--max-new-tokens", "10"]) == 0
    assert main(["export", "runs/gpt2-mine", "--out", "gpt2-mine-hf"]) == 0
    tuned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2-mine-hf")
    original = transformers.GPT2LMHeadModel.from_pretrained(gpt2_dir)
    assert not torch.equal(tuned.transformer.wte.weight, original.transformer.wte.weight)


def test_a_gpt_trained_here_exports_with_its_bpe_tokenizer(tmp_path):
    """A checkpoint of tformer's own (byte-level BPE with <pad>, <s>, </s>) becomes a
    directory transformers loads: same logits, same token ids."""
    from tformer.config import config_from_dict
    from tformer.data.tokenizers import BPETokenizer
    from tformer.models.gpt import GPT
    from tformer.training.checkpoint import save_checkpoint

    from .conftest import generated_text, randomise

    tokenizer = BPETokenizer.train(generated_text(200), vocab_size=300)
    cfg = config_from_dict({"model": {"n_layer": 1, "n_head": 2, "d_model": 16, "context": 128,
                                      "vocab_size": tokenizer.vocab_size,
                                      "activation": "gelu_tanh"}})
    model = GPT(cfg.model).eval()
    randomise(model)
    ckpt = save_checkpoint(tmp_path / "ckpt", cfg, model, tokenizer)
    out = export_checkpoint(ckpt, tmp_path / "hf")
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "\n".join(TRICKY)
    assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text)
    tokens = torch.tensor([tokenizer.encode(TRICKY[0])])
    with torch.no_grad():
        assert (hf_model(tokens).logits - model(tokens)).abs().max() <= 1e-5


def test_a_chat_template_in_tokenizer_config_is_kept_and_exported(gpt2_dir, tmp_path):
    """tokenizer_config.json's chat_template becomes the checkpoint's chat_template.jinja,
    and the export renders the same prompt through transformers."""
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
                "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    source = tmp_path / "source"
    shutil.copytree(gpt2_dir, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": template}))
    ckpt = import_checkpoint(source, tmp_path / "ckpt")
    assert (ckpt / "chat_template.jinja").read_text() == template
    out = export_checkpoint(ckpt, tmp_path / "out")
    messages = [{"role": "user", "content": "Kalo?"}]
    rendered = [transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True) for path in (source, out)]
    assert rendered[0] == rendered[1] == "user: Kalo?<|endoftext|>\nassistant:"
