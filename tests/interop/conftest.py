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
