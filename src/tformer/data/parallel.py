"""Parallel data for translation: line-aligned source/target files, a joint tokenizer,
length filtering, and batches by token count.

Shapes: B sentences in a batch, S source length, T target length (both with padding).

Every sentence is encoded as its tokens followed by EOS; the decoder reads BOS + target and
predicts target + EOS. `ending_in_eos` and `make_batch` are the only places that add these
special tokens.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tformer.checks import check_choice, check_range
from tformer.data.builtin import BUILTIN_PARALLEL, number_pairs
from tformer.data.corpus import read_text
from tformer.data.tokenizers import (
    IGNORE_INDEX,
    KINDS,
    BPEDropout,
    BPETokenizer,
    Tokenizer,
    train_tokenizer,
)
from tformer.errors import TformerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDataConfig:
    train_src: str | None = None
    """Source side of the training pairs, one sentence a line; none: the built-in task
    (numbers in digits -> spelled out in German)."""
    train_tgt: str | None = None
    val_src: str | None = None
    """Validation pairs; none: the last val_fraction of the training pairs."""
    val_tgt: str | None = None
    val_fraction: float = 0.05
    tokenizer: str = "bpe"
    """bpe: one byte-level BPE trained on both sides (the shared vocabulary that tied
    embeddings need); char: characters of both sides."""
    vocab_size: int = 8000
    """BPE only."""
    bpe_dropout: float = 0.0
    """BPE only: train on a fresh segmentation of the pairs every epoch, each merge skipped
    with this probability (BPE-dropout; Provilkov et al. 2020 use 0.1). Validation and
    decoding use the one deterministic segmentation. 0 segments once."""
    bpe_dropout_sides: str = "both"
    """Which sides of the training pairs BPE-dropout resegments: both, or the source alone
    (the decoder then learns the one segmentation that decoding produces)."""
    max_tokens: int = 4000
    """Tokens per training batch, padding included: sentences x the longest source or
    target in the batch (this replaces train.batch_size)."""
    max_len: int = 128
    """Training pairs with a longer source or target (in tokens, EOS included) are left out."""
    max_ratio: float = 3.0
    """Training pairs whose longer side has more than max_ratio times the tokens of the
    shorter side are left out (misaligned lines)."""
    builtin_pairs: int = 20000
    """Built-in task only: how many numbers."""
    builtin_max: int = 999999
    """Built-in task only: the largest number."""
    val_bleu_every: int = 0
    """During training, translate the validation sources greedily every this many
    evaluations and log BLEU and chrF beside the loss; 0 never does."""
    val_bleu_sentences: int = 0
    """How many validation sentences (the first ones) that translation reads; 0 all."""

    def __post_init__(self) -> None:
        for side in ("train", "val"):
            src, tgt = getattr(self, f"{side}_src"), getattr(self, f"{side}_tgt")
            if (src is None) != (tgt is None):
                given, missing = ("src", "tgt") if tgt is None else ("tgt", "src")
                raise TformerError(
                    f"data.{side}_{given} is set but data.{side}_{missing} is not; give both "
                    f"files of the pairs"
                )
        if self.val_src is not None and self.train_src is None:
            raise TformerError("data.val_src is set but data.train_src is not")
        check_range("data.val_fraction", self.val_fraction, low=0.0, high=0.5)
        check_choice("data.tokenizer", self.tokenizer, KINDS)
        check_range("data.vocab_size", self.vocab_size, low=260)
        check_range("data.bpe_dropout", self.bpe_dropout, low=0.0, high=0.99)
        check_choice("data.bpe_dropout_sides", self.bpe_dropout_sides, ("both", "source"))
        if self.bpe_dropout > 0 and self.tokenizer != "bpe":
            raise TformerError(
                f"data.bpe_dropout = {self.bpe_dropout} needs data.tokenizer = \"bpe\", "
                f"not {self.tokenizer!r}"
            )
        check_range("data.max_tokens", self.max_tokens, low=1)
        check_range("data.max_len", self.max_len, low=2)
        check_range("data.max_ratio", self.max_ratio, low=1.0)
        check_range("data.builtin_pairs", self.builtin_pairs, low=10)
        check_range("data.builtin_max", self.builtin_max, low=9, high=999999)
        check_range("data.val_bleu_every", self.val_bleu_every, low=0)
        check_range("data.val_bleu_sentences", self.val_bleu_sentences, low=0)

    @property
    def is_builtin(self) -> bool:
        return self.train_src is None or self.train_src == BUILTIN_PARALLEL


# --- reading ----------------------------------------------------------------------------


def read_lines(path: str | Path) -> list[str]:
    """A file's lines, split on "\\n" only: str.splitlines would also split on form feeds
    and Unicode line separators inside a sentence and misalign the pairs."""
    text = read_text(path)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def read_pairs(src: str | Path, tgt: str | Path) -> tuple[list[str], list[str]]:
    """Source and target sentences of two line-aligned files (with read_text's checks)."""
    src_lines, tgt_lines = read_lines(src), read_lines(tgt)
    if len(src_lines) != len(tgt_lines):
        raise TformerError(
            f"parallel files differ in length: {src} has {len(src_lines)} lines, "
            f"{tgt} has {len(tgt_lines)}; line i of one must translate line i of the other"
        )
    return src_lines, tgt_lines


def builtin_pairs(cfg: ParallelDataConfig) -> tuple[list[str], list[str]]:
    pairs = number_pairs(cfg.builtin_pairs, cfg.builtin_max)
    return [s for s, _ in pairs], [t for _, t in pairs]


# --- encoding and batching ----------------------------------------------------------------


def ending_in_eos(tokenizer: Tokenizer, sentences: list[list[int]]) -> list[list[int]]:
    """Each sentence's token ids + EOS (the form both sides take)."""
    return [ids + [tokenizer.eos_id] for ids in sentences]


def encode_source(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids + EOS for each text."""
    return ending_in_eos(tokenizer, tokenizer.encode_batch(list(texts)))


def encode_target(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """As encode_source, with the tokenizer's target side (Marian has one model per side)."""
    return ending_in_eos(tokenizer, tokenizer.encode_target_batch(list(texts)))


@dataclass
class Seq2SeqBatch:
    src: Tensor
    """(B, S) source ids + EOS, right-padded."""
    src_real: Tensor
    """(B, S) True at real source tokens."""
    tgt_in: Tensor
    """(B, T) BOS + target ids, right-padded."""
    tgt_out: Tensor
    """(B, T) target ids + EOS; IGNORE_INDEX at padding."""

    def to(self, device: torch.device) -> Seq2SeqBatch:
        return Seq2SeqBatch(
            self.src.to(device), self.src_real.to(device), self.tgt_in.to(device),
            self.tgt_out.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return int((self.tgt_out != IGNORE_INDEX).sum())


def pad_right(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Lists of ids -> (B, L) right-padded ids and their "is real" mask.

    Built with a few array operations whatever B is: the mask from the lengths, then every
    id at once into its real positions (a boolean index fills them row by row, in order).
    A row at a time cost two small tensor writes per sentence: 3 ms for a batch of 150
    sentences, 30 times this."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    is_real = np.arange(lengths.max())[None, :] < lengths[:, None]
    ids = np.full(is_real.shape, pad_id, dtype=np.int64)
    ids[is_real] = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64,
                               count=int(lengths.sum()))
    return torch.from_numpy(ids), torch.from_numpy(is_real)


def make_batch(
    src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]], tokenizer: Tokenizer
) -> Seq2SeqBatch:
    """Encoded pairs (each side ending in EOS) -> a padded batch for teacher forcing."""
    src_ids, src_real = pad_right(src, tokenizer.pad_id)
    tgt_in, _ = pad_right([[tokenizer.bos_id, *t[:-1]] for t in tgt], tokenizer.pad_id)
    tgt_out, tgt_real = pad_right(tgt, tokenizer.pad_id)
    return Seq2SeqBatch(src_ids, src_real, tgt_in, tgt_out.masked_fill(~tgt_real, IGNORE_INDEX))


def batch_by_tokens(order: np.ndarray, cost: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut `order` (indices, similar lengths next to each other) into consecutive batches
    whose padded size, sentences x longest cost, stays within max_tokens (a batch always
    holds at least one sentence)."""
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for i, index in enumerate(order):
        longest_with = max(longest, int(cost[index]))
        if i > start and longest_with * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, longest_with = i, int(cost[index])
        longest = longest_with
    if start < len(order):
        batches.append(order[start:])
    return batches


class TokenBatches:
    """Training batches by token count with length bucketing, reshuffled every epoch.

    Each epoch: a random permutation, a stable sort by (target, source) length so that
    equal lengths stay in random order, cut into batches of at most max_tokens, and the
    batches shuffled. The epoch's batches follow from (seed, epoch) alone, so the state is
    just (epoch, cursor) and resuming continues with the exact same batches.

    `resegment(seed, epoch)`, if given, encodes the pairs afresh for each epoch (BPE-dropout),
    also as a function of (seed, epoch) alone.
    """

    def __init__(
        self,
        src: list[list[int]],
        tgt: list[list[int]],
        tokenizer: Tokenizer,
        *,
        max_tokens: int,
        seed: int,
        resegment: Callable[[int, int], tuple[list[list[int]], list[list[int]]]] | None = None,
    ) -> None:
        if not src:
            raise TformerError("no training pairs are left after filtering by data.max_len "
                               "and data.max_ratio")
        self.fixed, self.resegment, self.tokenizer = (src, tgt), resegment, tokenizer
        self.max_tokens, self.seed = max_tokens, seed
        self._start_epoch(0)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.cursor = epoch, 0
        if self.resegment is None:
            self.src, self.tgt = self.fixed
        else:
            self.src, self.tgt = self.resegment(self.seed, epoch)
        self.src_len = np.array([len(s) for s in self.src])
        self.tgt_len = np.array([len(t) for t in self.tgt])
        self._batches = self._epoch_batches(epoch)

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.src))
        order = order[np.lexsort((self.src_len[order], self.tgt_len[order]))]
        batches = batch_by_tokens(order, np.maximum(self.src_len, self.tgt_len), self.max_tokens)
        return [batches[i] for i in rng.permutation(len(batches))]

    def __len__(self) -> int:
        """Batches in the current epoch."""
        return len(self._batches)

    def __iter__(self) -> Iterator[Seq2SeqBatch]:
        return self

    def __next__(self) -> Seq2SeqBatch:
        if self.cursor >= len(self._batches):
            self._start_epoch(self.epoch + 1)
        index = self._batches[self.cursor]
        self.cursor += 1
        return make_batch([self.src[i] for i in index], [self.tgt[i] for i in index],
                          self.tokenizer)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["epoch"]) != self.epoch:
            self._start_epoch(int(state["epoch"]))
        self.cursor = int(state["cursor"])


def sorted_batches(
    src: list[list[int]], tgt: list[list[int]], tokenizer: Tokenizer, max_tokens: int
) -> Iterator[Seq2SeqBatch]:
    """Evaluation batches: every pair once, in length order (least padding)."""
    src_len = np.array([len(s) for s in src])
    tgt_len = np.array([len(t) for t in tgt])
    order = np.lexsort((src_len, tgt_len))
    for index in batch_by_tokens(order, np.maximum(src_len, tgt_len), max_tokens):
        yield make_batch([src[i] for i in index], [tgt[i] for i in index], tokenizer)


# --- the data of one run ------------------------------------------------------------------


def keep_pair(src_len: int, tgt_len: int, max_len: int, max_ratio: float) -> bool:
    return (
        max(src_len, tgt_len) <= max_len
        and max(src_len, tgt_len) <= max_ratio * min(src_len, tgt_len)
    )


class ParallelData:
    """The training and validation pairs of a run, encoded with one joint tokenizer."""

    def __init__(self, cfg: ParallelDataConfig, tokenizer: Tokenizer | None = None) -> None:
        self.cfg = cfg
        if cfg.is_builtin:
            src, tgt = builtin_pairs(cfg)
        else:
            src, tgt = read_pairs(cfg.train_src, cfg.train_tgt)
        if cfg.val_src is not None:
            val_src, val_tgt = read_pairs(cfg.val_src, cfg.val_tgt)
        else:
            n_val = max(1, int(len(src) * cfg.val_fraction))
            if n_val >= len(src):
                raise TformerError(
                    f"{len(src)} training pairs are too few to split off a validation set"
                )
            val_src, val_tgt = src[-n_val:], tgt[-n_val:]
            src, tgt = src[:-n_val], tgt[:-n_val]
        if tokenizer is None:
            # One vocabulary for both languages, learnt from the training pairs only.
            tokenizer = train_tokenizer(
                cfg.tokenizer, [*src, *tgt], vocab_size=cfg.vocab_size, specials=True
            )
        if None in (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id):
            raise TformerError("a translation tokenizer needs <pad>, <s> and </s> tokens")
        self.tokenizer = tokenizer
        self.dropout: BPEDropout | None = None
        if cfg.bpe_dropout > 0:
            if not isinstance(tokenizer, BPETokenizer):
                raise TformerError(
                    f"data.bpe_dropout needs a byte-level BPE trained by tformer; this run's "
                    f"tokenizer is {tokenizer.kind!r}"
                )
            self.dropout = BPEDropout(tokenizer, cfg.bpe_dropout)
        self.train_src, self.train_tgt, kept = self._encode(src, tgt, "training", cfg.max_ratio)
        self.train_text = ([src[i] for i in kept], [tgt[i] for i in kept])
        # Validation keeps its odd pairs (its loss should be the loss on the real split);
        # only lengths the model cannot hold are left out.
        self.val_src, self.val_tgt, _ = self._encode(val_src, val_tgt, "validation",
                                                     float("inf"))
        self.val_text = (val_src, val_tgt)

    def resegment(self, seed: int, epoch: int) -> tuple[list[list[int]], list[list[int]]]:
        """The training pairs in the BPE-dropout segmentation of (seed, epoch). A sentence
        that comes out longer than data.max_len keeps its deterministic segmentation."""
        if self.dropout is None:
            raise TformerError("data.bpe_dropout is 0: the pairs have one segmentation")
        rng = random.Random(f"bpe-dropout {seed} {epoch}")
        limit, dropout = self.cfg.max_len, self.dropout

        def side(texts: list[str], fixed: list[list[int]]) -> list[list[int]]:
            sampled = ending_in_eos(self.tokenizer, dropout.encode_batch(texts, rng))
            return [s if len(s) <= limit else f for s, f in zip(sampled, fixed, strict=True)]

        src = side(self.train_text[0], self.train_src)
        if self.cfg.bpe_dropout_sides == "source":
            return src, self.train_tgt
        return src, side(self.train_text[1], self.train_tgt)

    def _encode(
        self, src: list[str], tgt: list[str], split: str, max_ratio: float
    ) -> tuple[list[list[int]], list[list[int]], list[int]]:
        src_ids, tgt_ids = encode_source(self.tokenizer, src), encode_target(self.tokenizer, tgt)
        keep = [
            i for i in range(len(src_ids))
            if keep_pair(len(src_ids[i]), len(tgt_ids[i]), self.cfg.max_len, max_ratio)
        ]
        if len(keep) < len(src_ids) / 2:
            log.warning("%s: %d of %d pairs left out by max_len %d and max_ratio %g; are the "
                        "limits right for this data?", split, len(src_ids) - len(keep),
                        len(src_ids), self.cfg.max_len, max_ratio)
        elif len(keep) < len(src_ids):
            log.info("%s: %d of %d pairs left out by max_len %d and max_ratio %g", split,
                     len(src_ids) - len(keep), len(src_ids), self.cfg.max_len, max_ratio)
        return [src_ids[i] for i in keep], [tgt_ids[i] for i in keep], keep

    def model_fields(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size}
