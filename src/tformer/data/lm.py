"""Language-model data: one token stream, split into train and validation, cut into windows.

Shapes: B batch, T context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tformer.checks import check_choice, check_range
from tformer.data.builtin import BUILTIN_LM, python_source
from tformer.data.corpus import corpus_chunks, text_files, token_ids
from tformer.data.tokenizers import LM_KINDS, Tokenizer, train_tokenizer
from tformer.errors import TformerError


@dataclass(frozen=True)
class LMDataConfig:
    path: str | None = None
    """A text file or a folder of them; none uses the built-in corpus."""
    tokenizer: str = "char"
    """char | bpe | word (white-space words and line ends, as the word-level corpora count
    them; unseen words become <unk>)."""
    vocab_size: int = 8000
    """BPE only."""
    val_fraction: float = 0.1
    """The last fraction of the token stream is the validation split (unless val_path)."""
    val_path: str | None = None
    """A validation text of its own (the standard corpora ship one): then all of `path`
    trains and val_fraction is not used."""

    def __post_init__(self) -> None:
        check_choice("data.tokenizer", self.tokenizer, LM_KINDS)
        check_range("data.vocab_size", self.vocab_size, low=260)
        check_range("data.val_fraction", self.val_fraction, low=0.0, high=0.5)


@dataclass
class LMBatch:
    tokens: Tensor
    """(B, T) inputs."""
    targets: Tensor
    """(B, T) the next token at each position."""

    def to(self, device: torch.device) -> LMBatch:
        return LMBatch(self.tokens.to(device), self.targets.to(device))

    @property
    def num_tokens(self) -> int:
        return self.targets.numel()


def lm_text_chunks(path: str | None) -> Callable[[], Iterable[str]]:
    """The corpus as pieces of text, read afresh on each call (it may not fit in memory)."""
    if path in (None, BUILTIN_LM):
        text = python_source()
        return lambda: [text]
    files = text_files(path)
    return lambda: corpus_chunks(files)


class LMData:
    """A corpus as token ids, its tokenizer, and its train / validation split."""

    def __init__(
        self, cfg: LMDataConfig, tokenizer: Tokenizer | None = None, *, cache: Path | None = None
    ) -> None:
        chunks = lm_text_chunks(cfg.path)
        val_chunks = lm_text_chunks(cfg.val_path) if cfg.val_path is not None else None
        if tokenizer is None:
            if cfg.tokenizer == "bpe":
                lines = (line for chunk in chunks() for line in chunk.splitlines(keepends=True))
                tokenizer = train_tokenizer("bpe", lines, vocab_size=cfg.vocab_size)
            elif cfg.tokenizer == "char":
                # Every character of both splits: one the training text lacks cannot be
                # given a probability at all.
                texts = chunks() if val_chunks is None else chain(chunks(), val_chunks())
                tokenizer = train_tokenizer("char", texts)
            else:  # words: the training text's alone; the others are <unk>
                tokenizer = train_tokenizer(cfg.tokenizer, chunks())
        self.tokenizer = tokenizer
        ids = token_ids(chunks, tokenizer, cache=cache)
        if val_chunks is not None:
            self.train_ids = ids
            self.val_ids = token_ids(val_chunks, tokenizer, cache=cache)
            where = f"data.val_path {cfg.val_path}"
        else:
            n_val = int(len(ids) * cfg.val_fraction)
            self.train_ids = ids[: len(ids) - n_val]
            self.val_ids = ids[len(ids) - n_val :]
            where = f"data.val_fraction = {cfg.val_fraction:g} of {len(ids):,} tokens"
        if len(self.val_ids) < 2:
            raise TformerError(
                f"the validation split has {len(self.val_ids)} tokens ({where}); it needs at "
                f"least 2: raise data.val_fraction, or give a validation text as data.val_path"
            )

    def summary(self) -> dict[str, str]:
        return {
            "data": f"{len(self.train_ids):,} training and {len(self.val_ids):,} validation "
            f"tokens ({self.tokenizer.kind})",
            "loss": "cross-entropy per token (training and validation alike)",
        }

    def model_fields(self) -> dict[str, Any]:
        """What the model config takes from the data."""
        return {"vocab_size": self.tokenizer.vocab_size}


def check_stream_length(ids: np.ndarray, context: int, split: str) -> None:
    if split == "evaluation" and len(ids) < 2:
        raise TformerError(
            f"the text to evaluate has {len(ids)} tokens; at least 2 are needed (one predicted)"
        )
    if len(ids) < context + 1:
        raise TformerError(
            f"the {split} split has {len(ids)} tokens, fewer than model.context + 1 = "
            f"{context + 1}; use more data, a shorter model.context or another "
            f"data.val_fraction"
        )


class RandomWindows:
    """Training batches of B windows of T+1 tokens at random offsets (with replacement).

    Its whole state is one torch.Generator, saved in checkpoints for exact resume.
    """

    def __init__(self, ids: np.ndarray, batch_size: int, context: int, seed: int) -> None:
        check_stream_length(ids, context, "training")
        self.ids = ids
        self.batch_size = batch_size
        self.context = context
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[LMBatch]:
        return self

    def __next__(self) -> LMBatch:
        starts = torch.randint(
            len(self.ids) - self.context, (self.batch_size,), generator=self.generator
        )
        offsets = starts[:, None].numpy() + np.arange(self.context + 1)
        windows = torch.from_numpy(self.ids[offsets].astype(np.int64))
        return LMBatch(windows[:, :-1], windows[:, 1:])

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def sequential_windows(ids: np.ndarray, batch_size: int, context: int) -> Iterator[LMBatch]:
    """Evaluation batches that cover the stream once: windows of T+1 tokens overlapping by
    one, so every token but the first is predicted exactly once. The last window may be
    shorter; it comes in a batch of its own."""
    check_stream_length(ids, 1, "evaluation")
    starts = list(range(0, len(ids) - 1, context))
    full = [s for s in starts if s + context + 1 <= len(ids)]
    for i in range(0, len(full), batch_size):
        offsets = np.asarray(full[i : i + batch_size])[:, None] + np.arange(context + 1)
        windows = torch.from_numpy(ids[offsets].astype(np.int64))
        yield LMBatch(windows[:, :-1], windows[:, 1:])
    if len(full) < len(starts):
        tail = torch.from_numpy(ids[starts[-1] :].astype(np.int64))[None]
        yield LMBatch(tail[:, :-1], tail[:, 1:])
