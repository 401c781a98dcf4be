"""Tiny random Hugging Face models, saved into temporary directories; nothing downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

# Text with what byte-level BPE must get right: accents, emoji, tabs, runs of spaces, and
# blank lines.
TRICKY = [
    "Héllo wörld, ça va? Ünïcödé façade naïve",
    "emoji 🙂🚀 and 👩‍👩‍👧 family",
    "\ttabbed\tline\t\t end",
    "runs   of    spaces     here  ",
    "new\nlines\n\n\nand\r\nreturns",
    "  leading spaces and trailing \n",
    "日本語のテキスト and ελληνικά",
]


def generated_text(lines: int, seed: int = 0) -> list[str]:
    """Lines of made-up words (and the tricky strings), to train tiny tokenizers on."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ré", "tu", "sha", "ön", "pe", "di", "ça", "vo", "ne"]
    out = []
    for _ in range(lines):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(8)]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return out + TRICKY


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random, LayerNorm weights and biases included, so a tensor put in
    the wrong place cannot hide behind ones and zeros."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.rand(p.shape, generator=generator) - 0.5
            if "ln" in name.split(".")[-2] and name.endswith("weight"):
                p.copy_(1.0 + 0.4 * noise)
            else:
                p.copy_(0.4 * noise)


def gpt2_tokenizer(vocab_size: int = 320):
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(generated_text(300), vocab_size=vocab_size,
                                special_tokens=["<|endoftext|>"], show_progress=False)
    model = json.loads(trainer._tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return transformers.GPT2TokenizerFast(vocab=model["vocab"], merges=merges)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A tiny random GPT2LMHeadModel and its tokenizer, saved with save_pretrained."""
    path = tmp_path_factory.mktemp("gpt2")
    tokenizer = gpt2_tokenizer()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    randomise(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def made_up_language(lines: int, seed: int, syllables: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 3)))
                 for _ in range(rng.randint(2, 9))]
        out.append(" ".join(words).capitalize() + rng.choice([".", "!", "?"]))
    return out


SOURCE_SYLLABLES = ["ka", "lo", "mi", "ré", "tu", "sha", "ön", "pe", "di", "ça", "vo", "ne"]
TARGET_SYLLABLES = ["ba", "ki", "ul", "zé", "mo", "tra", "ïn", "so", "fa", "gu", "ler", "ax"]


def train_sentencepiece(lines: list[str], path: Path, vocab_size: int) -> list[str]:
    """A tiny unigram SentencePiece model trained on `lines`, written to `path`; its pieces."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size,
        character_coverage=1.0, model_type="unigram", minloglevel=2,
    )
    path.write_bytes(proto.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())
            if not (processor.is_control(i) or processor.is_unknown(i))]


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    """A tiny random MarianMTModel with SentencePiece models trained here, saved with
    save_pretrained; EOS gets a bias so that outputs end at different lengths."""
    pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("marian")
    source = made_up_language(400, 1, SOURCE_SYLLABLES) + TRICKY
    target = made_up_language(400, 2, TARGET_SYLLABLES)
    pieces = train_sentencepiece(source, path / "source.spm", 150)
    pieces += train_sentencepiece(target, path / "target.spm", 150)
    vocab = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = pad = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    tokenizer = transformers.MarianTokenizer(
        str(path / "source.spm"), str(path / "target.spm"), str(path / "vocab.json")
    )
    tokenizer.save_pretrained(path)
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64, activation_function="swish",
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True,
        pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
        bad_words_ids=[[pad]], num_beams=4, max_length=40, length_penalty=1.0,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.rand(p.shape, generator=generator) - 0.5
            p.copy_(1.0 + 0.4 * noise if "layer_norm.weight" in name else 0.8 * noise)
        bias = model.final_logits_bias
        bias.copy_(torch.rand(bias.shape, generator=generator) - 0.5)
        bias[0, 0] += 1.0
    model.save_pretrained(path)
    return path
