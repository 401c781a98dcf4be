"""The families, by the name a config gives in `model.family`: the only module that knows
them all.

A family is a model, its task (data, loss, validation metrics) and one entry here that
carries what the trainer and the command line need from it: how to evaluate a checkpoint,
which metrics that reports and which options it takes, and how it decodes (`generate` for
language models, `translate` for sequence-to-sequence ones). Generic code asks the entry,
never the family's name. A fourth family is one more `register(Family(...))` call and its
own files; registering a name twice is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from tformer.config import FamilyTables, add_family, remove_family
from tformer.data.lm import LMDataConfig
from tformer.data.parallel import ParallelDataConfig
from tformer.decoding.beam import PENALTIES
from tformer.decoding.lm import generate as generate_in_windows
from tformer.decoding.transformer_xl import generate_with_memory
from tformer.errors import TformerError, did_you_mean
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from tformer.tasks import gpt as gpt_task
from tformer.tasks import seq2seq as seq2seq_task
from tformer.tasks import transformer_xl as txl_task
from tformer.viz import attention, cost

LM_METRICS = ("loss", "perplexity", "bpc", "tokens")


@dataclass(frozen=True)
class Option:
    """An option of `tformer evaluate` that some families take: `name` is the keyword its
    evaluate function receives, `--name-with-dashes` the flag."""

    name: str
    type: type
    help: str
    choices: tuple[Any, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def no_window(model: nn.Module) -> int | None:
    return None


def model_width(model_config: Any) -> int:
    return model_config.d_model


@dataclass(frozen=True)
class Family:
    name: str
    model_config: type
    """The [model] table's dataclass (validated on construction)."""
    data_config: type
    """The [data] table's dataclass."""
    model: Callable[[Any], nn.Module]
    """model_config -> the nn.Module, freshly initialized."""
    task: Callable[..., Any]
    """(cfg, tokenizer or None) -> the family's task (see tformer.tasks)."""
    evaluate: Callable[..., dict[str, Any]]
    """(checkpoint, data, options, *, batch_size, progress) -> metrics: a loaded checkpoint
    (tformer.training.checkpoint.Checkpoint) on the DATA paths of `tformer evaluate`, or
    with none on its run's validation split. options: the given `eval_options`, by name;
    batch_size 0: the run's; progress(n) is told of n more items done."""
    metrics: tuple[str, ...]
    """The keys `evaluate` reports, in the order a table shows them; "loss" among them."""
    eval_options: tuple[Option, ...] = ()
    generate: Callable[..., Iterator[Tensor]] | None = None
    """Language models: (model, (B, T) prompt, *, max_new_tokens, temperature, top_k, top_p,
    generator, use_cache, eos_id) yields (B,) new tokens (tformer.decoding.lm.generate);
    eos_id is None, an id, or a sequence of ids, any of which ends a row."""
    window: Callable[[nn.Module], int | None] = no_window
    """The most prompt tokens `generate` reads (a longer prompt loses its start), or None."""
    translate: Callable[..., list[Any]] | None = None
    """Sequence-to-sequence models: (checkpoint, lines, *, beam, alpha, max_len_a (None: the
    family's default), max_len_b, n_best, early_stopping, batch_size, progress) -> for each
    line its n_best Translations (tformer.decoding.translate)."""
    val_metrics: tuple[str, ...] = ("loss",)
    """What its task's validation during training may report, for train.best_metric."""
    progress_unit: str = "item"
    """What `evaluate` counts when it calls progress(n), for the bar `tformer evaluate`
    shows."""
    cost: Callable[[Any], Any] | None = None
    """FLOPs and activation memory of a RunConfig (tformer.viz.cost), for `tformer info`."""
    attention: Callable[..., Any] | None = None
    """(model, tokenizer, text) -> the attention maps `tformer attention` draws: text is the
    source sentence of a family with `translate`, the text read for the others."""
    noam_width: Callable[[Any], int] | None = None
    """(model_config) -> the width the noam schedule scales the rate by (d_model, Vaswani
    et al. 2017, eq. 3); None: the family has none, and train.schedule = noam is refused."""


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family; its name must be new."""
    if family.name in FAMILIES:
        raise TformerError(f"a family named {family.name!r} is already registered")
    if "loss" not in family.metrics:
        raise TformerError(f"family {family.name!r} must report a loss among its metrics")
    if "loss" not in family.val_metrics:
        raise TformerError(
            f"family {family.name!r} must report a loss among its validation metrics"
        )
    add_family(family.name, FamilyTables(family.model_config, family.data_config,
                                         family.noam_width))
    FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family added with `register` (for tests that add one of their own)."""
    del FAMILIES[name]
    remove_family(name)


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise TformerError(
            f"model.family = {name!r} is not known{did_you_mean(name, FAMILIES)}; "
            f"choose one of: {' | '.join(FAMILIES)}"
        ) from None


def families_with(what: str) -> list[str]:
    """The names of the families that offer `what` ("generate", "translate")."""
    return [f.name for f in FAMILIES.values() if getattr(f, what) is not None]


def evaluate_options() -> list[Option]:
    """Every family's evaluate options, each name once."""
    seen: dict[str, Option] = {}
    for family in FAMILIES.values():
        for option in family.eval_options:
            seen.setdefault(option.name, option)
    return list(seen.values())


register(Family(
    name="gpt",
    model_config=GPTConfig,
    data_config=LMDataConfig,
    model=GPT,
    task=gpt_task.GPTTask,
    evaluate=gpt_task.evaluate_checkpoint,
    metrics=LM_METRICS,
    generate=generate_in_windows,
    window=lambda model: model.cfg.context,
    progress_unit="tok",
    cost=cost.gpt_cost,
    attention=attention.gpt_attention,
    noam_width=model_width,
))
register(Family(
    name="seq2seq",
    model_config=Seq2SeqConfig,
    data_config=ParallelDataConfig,
    model=Seq2Seq,
    task=seq2seq_task.Seq2SeqTask,
    evaluate=seq2seq_task.evaluate_checkpoint,
    metrics=("bleu", "chrf", "bleu_tok", "loss", "exact_match", "sentences"),
    eval_options=(
        Option("beam", int, "seq2seq: beam size, 1 is greedy (default: 4)"),
        Option("alpha", float, "seq2seq: length penalty (default: 0.6)"),
        Option("length_penalty", str, "seq2seq: gnmt ((5 + length) / 6) ** alpha, or hf: "
               "length ** alpha with Hugging Face's stopping rule (default: gnmt)",
               choices=PENALTIES),
    ),
    translate=seq2seq_task.translate_lines,
    val_metrics=("loss", "bleu", "chrf"),
    progress_unit="line",
    cost=cost.seq2seq_cost,
    attention=attention.seq2seq_attention,
    noam_width=model_width,
))
register(Family(
    name="transformer-xl",
    model_config=TransformerXLConfig,
    data_config=LMDataConfig,
    model=TransformerXL,
    task=txl_task.TransformerXLTask,
    evaluate=txl_task.evaluate_checkpoint,
    metrics=LM_METRICS,
    eval_options=(
        Option("mem_len", int, "transformer-xl: memory positions per layer (default: the "
               "trained one)"),
        Option("segment_len", int, "transformer-xl: tokens per segment (default: "
               "model.context)"),
    ),
    generate=generate_with_memory,
    progress_unit="tok",
    cost=cost.transformer_xl_cost,
    attention=attention.transformer_xl_attention,
    noam_width=model_width,
))
