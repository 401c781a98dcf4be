"""The registry is the only place that knows the families: a fourth one, written here and
registered from this file alone, trains, evaluates and generates through the command line
with no edit anywhere else."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.checks import check_range
from tformer.cli import main
from tformer.data.corpus import cached_token_ids, read_corpus
from tformer.data.lm import LMData, LMDataConfig, RandomWindows
from tformer.decoding.sampling import next_token
from tformer.errors import TformerError
from tformer.evaluation.lm import evaluate_stream
from tformer.evaluation.loss import lm_loss
from tformer.evaluation.shard import WHOLE
from tformer.loading import load_checkpoint
from tformer.registry import FAMILIES, Family, Option, get_family, register, unregister

# --- a bigram language model: each token predicts the next from a table ------------------


@dataclass(frozen=True)
class BigramConfig:
    vocab_size: int = 0
    context: int = 8
    """Tokens per training window."""

    def __post_init__(self) -> None:
        check_range("model.context", self.context, low=1)


class Bigram(nn.Module):
    def __init__(self, cfg: BigramConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(max(cfg.vocab_size, 1), max(cfg.vocab_size, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


class BigramTask:
    def __init__(self, cfg: Any, tokenizer=None, *, cache=None) -> None:
        self.cfg = cfg
        self.data = LMData(cfg.data, tokenizer, cache=cache)
        self.tokenizer = self.data.tokenizer

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> RandomWindows:
        return RandomWindows(
            self.data.train_ids, self.cfg.train.batch_size, self.cfg.model.context, seed
        )

    def new_carry(self) -> None:  # windows are independent: nothing goes from step to step
        return None

    def save_carry(self, carry: None) -> None:
        return None

    def load_carry(self, saved: Any) -> None:
        return None

    def loss(self, model: nn.Module, batch: Any, carry: None) -> tuple[torch.Tensor, int, None]:
        return lm_loss(model(batch.tokens), batch.targets), batch.num_tokens, None

    def evaluate(self, model: nn.Module, max_batches: int = 0, shard=WHOLE,
                 index: int = 0) -> dict[str, float]:
        return evaluate_stream(model, self.data.val_ids, self.tokenizer,
                               context=self.cfg.model.context,
                               batch_size=self.cfg.train.batch_size, max_batches=max_batches,
                               shard=shard)


def evaluate_bigram(checkpoint, data, options, *, batch_size=0, progress=None):
    cfg = checkpoint.cfg
    if data:
        ids = cached_token_ids(read_corpus(data[0]), checkpoint.tokenizer)
    else:
        ids = LMData(cfg.data, checkpoint.tokenizer).val_ids
    if options.get("first_tokens"):
        ids = ids[: options["first_tokens"]]
    return evaluate_stream(checkpoint.model, ids, checkpoint.tokenizer, context=cfg.model.context,
                           batch_size=batch_size or cfg.train.batch_size)


@torch.no_grad()
def generate_bigram(model, prompt, *, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
                    generator=None, use_cache=True, eos_id=None):
    last = prompt[:, -1]
    for _ in range(max_new_tokens):
        last = next_token(model(last[:, None])[:, -1], temperature=temperature, top_k=top_k,
                          top_p=top_p, generator=generator)
        yield last


BIGRAM = Family(
    name="bigram",
    model_config=BigramConfig,
    data_config=LMDataConfig,
    model=Bigram,
    task=BigramTask,
    evaluate=evaluate_bigram,
    metrics=("loss", "perplexity", "bpc", "tokens"),
    eval_options=(Option("first_tokens", int, "bigram: evaluate on the first N tokens"),),
    generate=generate_bigram,
)


@pytest.fixture
def bigram():
    register(BIGRAM)
    yield BIGRAM
    unregister("bigram")


# --- the proof ---------------------------------------------------------------------------


def test_a_fourth_family_trains_evaluates_and_generates_through_the_cli(
    bigram, tmp_path, tiny_corpus, capsys
):
    config = tmp_path / "bigram.toml"
    config.write_text(
        f'[model]\nfamily = "bigram"\ncontext = 8\n[data]\npath = "{tiny_corpus}"\n'
        f'[train]\nsteps = 30\nbatch_size = 8\nlr = 0.1\nmin_lr = 0.01\nwarmup_steps = 0\n'
        f'eval_every = 15\ncheckpoint_every = 15\ndevice = "cpu"\n'
    )
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run)]) == 0
    loaded = load_checkpoint(run)
    assert isinstance(loaded.model, Bigram)
    table = loaded.model.table.weight.detach()

    # Evaluate: every token of the file but the first, predicted from the one before it.
    capsys.readouterr()
    assert main(["evaluate", str(run), str(tiny_corpus), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ids = torch.tensor(loaded.tokenizer.encode(tiny_corpus.read_text(encoding="utf-8")))
    want = F.cross_entropy(table[ids[:-1]], ids[1:])
    assert list(result)[:4] == list(BIGRAM.metrics)
    assert result["loss"] == pytest.approx(float(want), rel=1e-5)
    assert result["tokens"] == len(ids) - 1
    untrained = F.cross_entropy(torch.zeros(len(ids) - 1, table.shape[0]), ids[1:])
    assert result["loss"] < float(untrained) - 0.5, "training lowered the loss"

    # The family's own option reaches its evaluate function, and only its.
    assert main(["evaluate", str(run), str(tiny_corpus), "--json", "--first-tokens", "11"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 10
    assert main(["evaluate", str(run), "--mem-len", "4"]) == 2
    assert "--mem-len applies to transformer-xl checkpoints" in capsys.readouterr().err

    # Generate greedily: the chain of the table's row-wise argmax after the prompt.
    assert main(["generate", str(run), "--prompt", "Fi", "--max-new-tokens", "12",
                 "--greedy"]) == 0
    token, chain = loaded.tokenizer.encode("Fi")[-1], []
    for _ in range(12):
        token = int(table[token].argmax())
        chain.append(token)
    assert capsys.readouterr().out == "Fi" + loaded.tokenizer.decode(chain) + "\n"

    # It does not translate, and says so in one line.
    assert main(["translate", str(run)]) == 2
    assert "bigram model; translate needs a sequence-to-sequence model (seq2seq)" in (
        capsys.readouterr().err)


def test_registering_a_name_twice_is_an_error(bigram):
    with pytest.raises(TformerError, match="'bigram' is already registered"):
        register(BIGRAM)
    with pytest.raises(TformerError, match="'gpt' is already registered"):
        register(get_family("gpt"))


def test_unregistered_families_are_gone(bigram):
    assert "bigram" in FAMILIES
    unregister("bigram")
    with pytest.raises(TformerError, match="not known"):
        get_family("bigram")
    register(BIGRAM)  # for the fixture's teardown


def test_every_shipped_family_offers_a_way_to_decode_and_a_loss():
    assert set(FAMILIES) >= {"gpt", "seq2seq", "transformer-xl"}
    for family in FAMILIES.values():
        assert (family.generate is None) != (family.translate is None), family.name
        assert "loss" in family.metrics
