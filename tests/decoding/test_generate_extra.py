"""min_p, repetition_penalty, min_tokens and ignore_eos where tformer.load(...).generate and
`tformer generate` decode (decoding/lm.py): the penalised greedy text against a full pass
per token with the rule in float64, the lengths the end-of-text settings make on a model
that wants to end at once, and bad values refused before the model loads."""

from __future__ import annotations

import pytest
import torch

import tformer
from tformer.cli import main
from tformer.config import config_from_dict
from tformer.data.tokenizers import CharTokenizer
from tformer.decoding.speculative import SpeculationStats
from tformer.errors import TformerError
from tformer.registry import get_family
from tformer.training.checkpoint import save_checkpoint


def checkpoint(dest, *, eos_bias: float = 0.0):
    tokenizer = CharTokenizer("abcdefgh ", specials=True)
    cfg = config_from_dict({"model": {"family": "gpt", "n_layer": 1, "n_head": 2,
                                      "d_model": 16, "context": 32, "output_bias": True,
                                      "vocab_size": tokenizer.vocab_size},
                            "train": {"device": "cpu"}})
    torch.manual_seed(0)
    net = get_family("gpt").model(cfg.model)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.5)
        net.lm_head.bias[tokenizer.eos_id] = eos_bias
    return save_checkpoint(dest, cfg, net.eval(), tokenizer)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return tformer.load(checkpoint(tmp_path_factory.mktemp("lm") / "plain"), threads=1)


@pytest.fixture(scope="module")
def ending_path(tmp_path_factory):
    """A model whose likeliest token is always the end of text."""
    return checkpoint(tmp_path_factory.mktemp("lm") / "ending", eos_bias=60.0)


@pytest.fixture(scope="module")
def ending(ending_path):
    return tformer.load(ending_path, threads=1)


def test_the_repetition_penalty_draws_the_argmax_of_the_penalised_logits(plain):
    ids = plain.prompt_ids("abcab")
    penalty = 2.5
    expected: list[int] = []
    for _ in range(20):
        with torch.no_grad():
            logits = plain.module(torch.tensor([ids + expected])).double()[0, -1]
        for t in set(ids + expected):
            logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
        token = int(logits.argmax())
        if token in plain.tokenizer.eos_ids:
            break
        expected.append(token)
    text = plain.generate("abcab", max_new_tokens=20, temperature=0,
                          repetition_penalty=penalty)
    assert text == plain.tokenizer.decode(expected)
    assert text != plain.generate("abcab", max_new_tokens=20, temperature=0)


def test_min_p_of_one_is_greedy(plain):
    greedy = plain.generate("abc", max_new_tokens=15, temperature=0)
    assert plain.generate("abc", max_new_tokens=15, temperature=1.0, min_p=1.0,
                          seed=3) == greedy


def tokens_drawn(model, **options) -> int:
    stats = SpeculationStats()
    "".join(model.stream("ab", max_new_tokens=6, temperature=0, stats=stats, **options))
    return stats.tokens


def test_min_tokens_and_ignore_eos_set_the_length(ending):
    assert tokens_drawn(ending) == 1  # the end of text at once
    assert tokens_drawn(ending, min_tokens=4) == 5  # four held back, then the end
    assert tokens_drawn(ending, ignore_eos=True) == 6  # to max_new_tokens
    assert ending.generate("ab", max_new_tokens=6, temperature=0, min_tokens=4) != ""


def test_the_command_line_takes_them(ending_path, capsys):
    import json

    def tokens(*flags: str) -> int:
        assert main(["generate", str(ending_path), "--prompt", "ab", "--greedy", "--json",
                     "--max-new-tokens", "6", "--threads", "1", *flags]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    assert tokens() == 1
    assert tokens("--min-tokens", "3") == 4
    assert tokens("--ignore-eos") == 6


def test_bad_values_are_refused_naming_them(plain, capsys):
    with pytest.raises(TformerError, match="min_p 2.0 must be between 0 and 1"):
        plain.generate("ab", min_p=2.0)
    with pytest.raises(TformerError, match="without speculation"):
        plain.generate("ab", repetition_penalty=1.2, prompt_lookup=2)
    assert main(["generate", "nowhere", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty 0.0 must be more than 0" in capsys.readouterr().err
