"""Marian / OPUS-MT import against Hugging Face's MarianMTModel and MarianTokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tformer.data.parallel import encode_source, pad_right
from tformer.decoding.translate import SearchOptions, translate
from tformer.interop.command import import_checkpoint
from tformer.loading import load_checkpoint

from .conftest import SOURCE_SYLLABLES, TRICKY, made_up_language

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

MAX_LENGTH = 24
"""Hugging Face's max_length: the decoder's start token and at most 23 outputs, EOS included."""


@pytest.fixture(scope="module")
def imported(marian_dir, tmp_path_factory) -> Path:
    return import_checkpoint(marian_dir, tmp_path_factory.mktemp("imported") / "ckpt")


@pytest.fixture(scope="module")
def hf(marian_dir):
    model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    return model, transformers.MarianTokenizer.from_pretrained(marian_dir)


def sentences(n: int = 50) -> list[str]:
    return made_up_language(n, 7, SOURCE_SYLLABLES)


def test_token_ids_match_marian_tokenizer(imported, hf):
    ours, (_, tokenizer) = load_checkpoint(imported).tokenizer, hf
    for text in sentences(30) + TRICKY + [">>de<< Kalo miré tu.", "unseen zzz qqq"]:
        assert encode_source(ours, [text])[0] == tokenizer(text)["input_ids"], text
    targets = ["Bakizé mo trafa.", "Ulso gu lerax ïn!"]
    from tformer.data.parallel import encode_target

    # Given only targets, MarianTokenizer encodes them (target model) as input_ids.
    assert encode_target(ours, targets) == tokenizer(text_target=targets)["input_ids"]
    assert encode_target(ours, targets) != encode_source(ours, targets)
    ids = tokenizer(sentences(5))["input_ids"]
    for row in ids:
        assert ours.decode(row) == tokenizer.decode(row, skip_special_tokens=True)


def test_logits_match_marian_mt_model(imported, hf):
    ours, (model, tokenizer) = load_checkpoint(imported), hf
    batch = tokenizer(sentences(4), return_tensors="pt", padding=True)
    target = torch.randint(2, 100, (4, 9))
    target[:, 0] = model.config.decoder_start_token_id
    with torch.no_grad():
        expected = model(**batch, decoder_input_ids=target).logits
        got = ours.model(batch["input_ids"], batch["attention_mask"].bool(), target)
    assert (got - expected).abs().max() <= 1e-5, float((got - expected).abs().max())


def hf_outputs(model, tokenizer, lines, beam, batch_size):
    out = []
    for start in range(0, len(lines), batch_size):
        batch = tokenizer(lines[start : start + batch_size], return_tensors="pt", padding=True)
        generated = model.generate(
            **batch, num_beams=beam, max_length=MAX_LENGTH, length_penalty=1.0,
            early_stopping=False, do_sample=False,
        )
        out += tokenizer.batch_decode(generated, skip_special_tokens=True)
    return out


@pytest.mark.parametrize("beam", [1, 4])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_translations_match_marian_generate(imported, hf, beam, batch_size):
    ours, (model, tokenizer) = load_checkpoint(imported), hf
    lines = sentences(50)
    options = SearchOptions(beam=beam, alpha=1.0, length_penalty="hf", max_len_a=0.0,
                            max_len_b=MAX_LENGTH - 1)
    with torch.no_grad():
        got = [h[0].text for h in translate(ours.model, ours.tokenizer, lines, options,
                                            batch_size=batch_size)]
    expected = hf_outputs(model, tokenizer, lines, beam, batch_size)
    assert got == expected
    lengths = {len(tokenizer(t)["input_ids"]) for t in expected}
    assert len(lengths) > 3, "outputs of several lengths, some ending early"


def test_beam_token_ids_match(imported, hf):
    """Ids, not just text: the detokenizer could hide a difference."""
    from tformer.decoding.beam import beam_search

    ours, (model, _) = load_checkpoint(imported), hf
    lines = sentences(16)
    src, src_real = pad_right(encode_source(ours.tokenizer, lines), ours.tokenizer.pad_id)
    tok = ours.tokenizer
    found = beam_search(ours.model, src, src_real, beam=4, alpha=1.0, penalty="hf",
                        max_len_a=0.0, max_len_b=MAX_LENGTH - 1, bos_id=tok.bos_id,
                        eos_id=tok.eos_id, pad_id=tok.pad_id)
    generated = model.generate(src, attention_mask=src_real.long(), num_beams=4,
                               max_length=MAX_LENGTH, length_penalty=1.0, early_stopping=False)
    for hyps, row in zip(found, generated, strict=True):
        expected = [int(t) for t in row[1:] if int(t) not in (tok.pad_id, tok.eos_id)]
        assert hyps[0].tokens == expected


def test_cli_import_translate_evaluate(marian_dir, hf, tmp_path, capsys):
    from tformer.cli import main

    model, tokenizer = hf
    ckpt = tmp_path / "ckpt"
    assert main(["import", str(marian_dir), "--out", str(ckpt)]) == 0
    lines = sentences(8)
    (tmp_path / "src.txt").write_text("\n".join(lines) + "\n")
    args = ["--beam", "4", "--alpha", "1.0", "--length-penalty", "hf", "--max-len-a", "0",
            "--max-len-b", str(MAX_LENGTH - 1)]
    capsys.readouterr()
    assert main(["translate", str(ckpt), str(tmp_path / "src.txt"), *args]) == 0
    assert capsys.readouterr().out.splitlines() == hf_outputs(model, tokenizer, lines, 4, 8)
    assert main(["translate", str(ckpt), str(tmp_path / "src.txt"), "--int8", *args]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(lines)
    (tmp_path / "ref.txt").write_text("\n".join(lines) + "\n")
    assert main(["evaluate", str(ckpt), str(tmp_path / "src.txt"), str(tmp_path / "ref.txt"),
                 "--json", "--int8", "--length-penalty", "hf", "--alpha", "1.0"]) == 0
    assert "bleu" in capsys.readouterr().out


def test_missing_sentencepiece_and_odd_configs_are_one_line_errors(marian_dir, tmp_path,
                                                                   monkeypatch):
    import json
    import shutil
    import sys

    from tformer.data.tokenizers import require_sentencepiece
    from tformer.errors import TformerError

    src = tmp_path / "odd"
    shutil.copytree(marian_dir, src)
    config = json.loads((src / "config.json").read_text())
    config.update(normalize_before=True, decoder_ffn_dim=64)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(TformerError, match="normalize_before = True.*|decoder_ffn_dim"):
        import_checkpoint(src, tmp_path / "a")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(TformerError, match=r"pip install 'tformer\[interop\]'"):
        require_sentencepiece()


def test_an_imported_marian_model_fine_tunes(imported, tmp_path):
    """train.init_from with an imported model: its SentencePiece tokenizer encodes the
    targets with the target model, and training moves the weights."""
    from safetensors.torch import load_file

    from tformer import loading
    from tformer.cli import main

    from .conftest import TARGET_SYLLABLES

    src, tgt = sentences(60), made_up_language(60, 9, TARGET_SYLLABLES)
    (tmp_path / "train.src").write_text("\n".join(src) + "\n")
    (tmp_path / "train.tgt").write_text("\n".join(tgt) + "\n")
    config = tmp_path / "ft.toml"
    config.write_text(
        f'[data]\ntrain_src = "{tmp_path / "train.src"}"\ntrain_tgt = "{tmp_path / "train.tgt"}"\n'
        f'max_len = 60\nmax_tokens = 300\n[train]\ninit_from = "{imported}"\nsteps = 2\n'
        f'eval_every = 2\ncheckpoint_every = 2\nwarmup_steps = 1\nlr = 1e-3\n'
        f'device = "cpu"\n'
    )
    assert main(["train", str(config), "--out", str(tmp_path / "run")]) == 0
    before = load_file(imported / loading.WEIGHTS)
    after = load_file(loading.step_dir(tmp_path / "run", 2) / loading.WEIGHTS)
    assert any(not torch.equal(after[n], t) for n, t in before.items())
