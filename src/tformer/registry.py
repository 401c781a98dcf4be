"""The families, by the name a config gives in `model.family`.

Adding a family means one entry here plus its own files: a model, its task (data, loss,
metrics) and its decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from tformer.data.lm import LMDataConfig
from tformer.data.parallel import ParallelDataConfig
from tformer.errors import TformerError, did_you_mean
from tformer.models.gpt import GPT, GPTConfig
from tformer.models.seq2seq import Seq2Seq, Seq2SeqConfig
from tformer.models.transformer_xl import TransformerXL, TransformerXLConfig
from tformer.tasks import gpt as gpt_task
from tformer.tasks import transformer_xl as txl_task
from tformer.tasks.gpt import GPTTask
from tformer.tasks.seq2seq import Seq2SeqTask
from tformer.tasks.transformer_xl import TransformerXLTask
from tformer.viz import attention, cost


@dataclass(frozen=True)
class Family:
    name: str
    kind: str
    """'lm' (generate, evaluate on text) or 'seq2seq' (translate, evaluate with BLEU)."""
    model_config: type
    data_config: type
    model: Callable[[Any], nn.Module]
    task: Callable[..., Any]
    evaluate_text: Callable[..., dict[str, float]] | None = None
    """Language models: metrics over a token stream (model, ids, tokenizer, cfg)."""
    metrics: tuple[str, ...] = ("loss",)
    """What its task's validation may report, for train.best_metric."""
    cost: Callable[[Any], Any] | None = None
    """FLOPs and activation memory of a RunConfig (tformer.viz.cost), for `tformer info`."""
    attention: Callable[..., Any] | None = None
    """(model, tokenizer, text) -> the attention maps `tformer attention` draws."""


FAMILIES: dict[str, Family] = {
    "gpt": Family(
        "gpt", "lm", GPTConfig, LMDataConfig, GPT, GPTTask, gpt_task.evaluate_text,
        cost=cost.gpt_cost, attention=attention.gpt_attention,
    ),
    "seq2seq": Family(
        "seq2seq", "seq2seq", Seq2SeqConfig, ParallelDataConfig, Seq2Seq, Seq2SeqTask,
        metrics=("loss", "bleu", "chrf"), cost=cost.seq2seq_cost,
        attention=attention.seq2seq_attention,
    ),
    "transformer-xl": Family(
        "transformer-xl", "lm", TransformerXLConfig, LMDataConfig, TransformerXL,
        TransformerXLTask, txl_task.evaluate_text, cost=cost.transformer_xl_cost,
        attention=attention.transformer_xl_attention,
    ),
}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise TformerError(
            f"model.family = {name!r} is not known{did_you_mean(name, FAMILIES)}; "
            f"choose one of: {' | '.join(FAMILIES)}"
        ) from None
