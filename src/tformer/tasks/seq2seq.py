"""The translation family's task: parallel pairs in token-count batches, label-smoothed
loss for training, plain cross-entropy for validation, and (every data.val_bleu_every
evaluations) BLEU and chrF of greedy translations of the validation sources."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from tformer.data.parallel import ParallelData, Seq2SeqBatch, TokenBatches, read_pairs
from tformer.data.tokenizers import Tokenizer
from tformer.decoding.beam import PENALTIES
from tformer.decoding.translate import (
    SearchOptions,
    Translation,
    best_translations,
    check_search_args,
    translate,
)
from tformer.errors import TformerError
from tformer.evaluation.loss import Targets
from tformer.evaluation.shard import WHOLE, Shard
from tformer.evaluation.translation import corpus_scores, evaluate_loss, evaluate_translation

if TYPE_CHECKING:  # the config module reads configs through the registry, which imports tasks
    from tformer.config import RunConfig


class Seq2SeqTask:
    """`cache` is accepted like the other families' tasks but unused: the pairs are
    tokenized in memory, which takes seconds for Multi30k."""

    def __init__(
        self, cfg: RunConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        self.cfg = cfg
        self.data = ParallelData(cfg.data, tokenizer)
        self.tokenizer = self.data.tokenizer
        if cfg.data.max_len > cfg.model.max_len:
            raise TformerError(
                f"data.max_len = {cfg.data.max_len} is longer than model.max_len = "
                f"{cfg.model.max_len}, the positions the model has; lower data.max_len"
            )
        if cfg.train.best_metric != "loss" and cfg.data.val_bleu_every == 0:
            raise TformerError(
                f"train.best_metric = {cfg.train.best_metric!r} needs data.val_bleu_every of "
                f"1 or more, to measure it during training"
            )

    def model_fields(self) -> dict[str, Any]:
        return self.data.model_fields()

    def train_batches(self, seed: int) -> TokenBatches:
        return TokenBatches(
            self.data.train_src, self.data.train_tgt, self.tokenizer,
            max_tokens=self.cfg.data.max_tokens, seed=seed,
            resegment=None if self.data.dropout is None else self.data.resegment,
        )

    def loss(
        self, model: nn.Module, batch: Seq2SeqBatch, carry: None
    ) -> tuple[Tensor, int, None]:
        """Pairs are independent: nothing is carried from one step to the next."""
        targets = Targets(batch.tgt_out, self.cfg.model.label_smoothing)
        loss = model(batch.src, batch.src_real, batch.tgt_in, targets=targets)
        return loss, batch.num_tokens, None

    def summary(self) -> dict[str, str]:
        """What training reads, and which loss it shows, for the start-up summary."""
        data, cfg = self.data, self.cfg.data
        segmentation = ""
        if data.dropout is not None:
            sides = "both sides" if cfg.bpe_dropout_sides == "both" else "the sources"
            segmentation = f", BPE-dropout {cfg.bpe_dropout:g} on {sides} in training"
        return {
            "data": f"{len(data.train_src):,} training pairs "
            f"({sum(map(len, data.train_tgt)):,} target tokens), {len(data.val_src):,} "
            f"validation pairs ({self.tokenizer.kind}{segmentation})",
            "loss": f"training: cross-entropy with label smoothing "
            f"{self.cfg.model.label_smoothing:g}; validation: without",
        }

    def new_carry(self) -> None:
        return None

    def save_carry(self, carry: None) -> None:
        return None

    def load_carry(self, saved: Any) -> None:
        return None

    def evaluate(
        self, model: nn.Module, max_batches: int = 0, shard: Shard = WHOLE, index: int = 0
    ) -> dict[str, float]:
        result = evaluate_loss(
            model, self.data.val_src, self.data.val_tgt, self.tokenizer,
            self.cfg.data.max_tokens, max_batches, shard,
        )
        every = self.cfg.data.val_bleu_every
        if every and index and index % every == 0:
            result.update(self.translation_scores(model, shard))
        return result

    def translation_scores(self, model: nn.Module, shard: Shard = WHOLE) -> dict[str, float]:
        """BLEU and chrF (sacreBLEU's defaults) of greedy translations of the validation
        sources: cheaper than beam search, and it moves with it. The shards split the
        sentences where they can (Shard.map), and every one gets the same scores."""
        sources, references = self.data.val_text
        n = self.cfg.data.val_bleu_sentences or len(sources)
        was_training = model.training
        model.eval()
        options = SearchOptions(beam=1, alpha=0.0, max_len_a=self.cfg.data.max_ratio)
        hypotheses = shard.map(
            lambda part: best_translations(model, self.tokenizer, part, options), sources[:n]
        )
        model.train(was_training)
        scores = corpus_scores(hypotheses, references[:n])
        return {"bleu": scores["bleu"], "chrf": scores["chrf"]}


def translate_lines(
    checkpoint: Any, lines: Sequence[str], *, beam: int = 4, alpha: float = 0.6,
    max_len_a: float | None = None, max_len_b: int = 10, n_best: int = 1,
    early_stopping: bool = False, batch_size: int = 32,
    progress: Callable[[int], None] | None = None, length_penalty: str = "gnmt",
) -> list[list[Translation]]:
    """The registry's translate. max_len_a None: an output may be as long, relative to its
    source, as the training pairs were (data.max_ratio)."""
    if max_len_a is None:
        max_len_a = checkpoint.cfg.data.max_ratio
    check_search_args(beam, alpha, n_best, batch_size, max_len_a, max_len_b)
    options = SearchOptions(beam=beam, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b,
                            n_best=n_best, early_stopping=early_stopping,
                            length_penalty=length_penalty)
    return translate(checkpoint.model, checkpoint.tokenizer, lines, options,
                     batch_size=batch_size, progress=progress,
                     trained_len=checkpoint.cfg.data.max_len)


def reference_language(reference_path: str) -> str:
    """The language the Moses tokenizer of the literature-style BLEU follows: the
    reference's, read from a file name like test2016.de; English rules otherwise."""
    suffix = Path(reference_path).suffix[1:]
    return suffix if suffix.isalpha() and len(suffix) == 2 else "en"


def evaluate_checkpoint(
    checkpoint: Any, data: list[str], options: dict[str, Any], *, batch_size: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The registry's evaluate: BLEU, chrF and loss on SRC REF files, or with no data on
    the run's validation pairs. options: beam (default 4), alpha (default 0.6) and
    length_penalty (default gnmt)."""
    cfg = checkpoint.cfg
    penalty = options.get("length_penalty", "gnmt")
    if penalty not in PENALTIES:
        raise TformerError(
            f"--length-penalty {penalty} is not known; choose one of: {' | '.join(PENALTIES)}"
        )
    search = SearchOptions(beam=options.get("beam", 4), alpha=options.get("alpha", 0.6),
                           max_len_a=cfg.data.max_ratio, length_penalty=penalty)
    batch_size = batch_size or 32
    check_search_args(search.beam, search.alpha, 1, batch_size, search.max_len_a, 10)
    if len(data) not in (0, 2):
        raise TformerError(
            "a translation model is evaluated on SRC REF (two line-aligned files), or with "
            "no DATA on its run's validation pairs"
        )
    if data:
        sources, references = read_pairs(data[0], data[1])
        reference_path = data[1]
    else:
        sources, references = ParallelData(cfg.data, checkpoint.tokenizer).val_text
        reference_path = cfg.data.val_tgt or cfg.data.train_tgt or ""
    result, _ = evaluate_translation(
        checkpoint.model, checkpoint.tokenizer, sources, references, search,
        batch_size=batch_size, max_tokens=cfg.data.max_tokens, progress=progress,
        lang=reference_language(reference_path),
    )
    return {**result, "beam": search.beam, "alpha": search.alpha}
