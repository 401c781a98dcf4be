"""Instruction data for language models: JSONL files of {"prompt", "completion"} rows.

Each row becomes the tokens of its prompt, then of its completion, then the end token where
the tokenizer has one; the loss counts the completion's tokens (and the end token) only, so
the model learns to answer, not to write prompts. A row longer than model.context + 1
tokens keeps its first context + 1 (its prompt, and as much of its completion as fits); a
row whose prompt leaves no completion token inside the context is dropped. Either is
counted, and said in one warning per file.

Shapes: B batch (rows), T the longest row of the batch (at most model.context).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tformer.data.lm import LMBatch
from tformer.data.tokenizers import IGNORE_INDEX, Tokenizer
from tformer.errors import TformerError

log = logging.getLogger(__name__)

SUFFIX = ".jsonl"


def is_instruct_path(path: str | None) -> bool:
    return path is not None and Path(path).suffix == SUFFIX


@dataclass(frozen=True)
class Row:
    ids: list[int]
    """prompt + completion (+ end) token ids, at most context + 1."""
    n_prompt: int
    """How many of them are the prompt's."""


def read_rows(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, completion) of every row; a malformed row is an error naming the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TformerError(f"data file not found: {path}") from None
    except UnicodeDecodeError:
        raise TformerError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise TformerError(f"cannot read {path}: {e.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise TformerError(f"{where}: not a JSON object ({e})") from None
        if isinstance(row, dict) and "messages" in row:
            raise TformerError(f"{where}: chat rows ({{\"messages\": ...}}) are not read yet; "
                               f"give {{\"prompt\": ..., \"completion\": ...}} rows")
        if not isinstance(row, dict) or set(row) != {"prompt", "completion"}:
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise TformerError(f'{where}: expected {{"prompt": ..., "completion": ...}}, got '
                               f"{keys}")
        if not all(isinstance(row[k], str) for k in ("prompt", "completion")):
            raise TformerError(f"{where}: prompt and completion must be strings")
        if not row["completion"]:
            raise TformerError(f"{where}: the completion is empty (there is nothing to learn)")
        rows.append((row["prompt"], row["completion"]))
    if not rows:
        raise TformerError(f"{path} holds no rows")
    return rows


def encode_rows(pairs: list[tuple[str, str]], tokenizer: Tokenizer, context: int,
                source: str | Path) -> list[Row]:
    """Token rows of at most context + 1 tokens, with one warning for those cut or dropped."""
    end = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    prompts = tokenizer.encode_batch([p for p, _ in pairs])
    completions = tokenizer.encode_batch([c for _, c in pairs])
    rows, cut, dropped = [], 0, 0
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = prompt + completion + end
        if len(ids) > context + 1:
            ids = ids[: context + 1]
            if len(prompt) >= len(ids):  # nothing of the completion is predicted
                dropped += 1
                continue
            cut += 1
        rows.append(Row(ids, len(prompt)))
    if cut or dropped:
        log.warning("%s: %d of %d rows are longer than model.context + 1 = %d tokens: %d cut "
                    "short, %d dropped (their prompt fills the context)", source, cut + dropped,
                    len(pairs), context + 1, cut, dropped)
    if not rows:
        raise TformerError(f"{source}: every row's prompt fills model.context = {context}")
    return rows


def batch_of(rows: list[Row]) -> LMBatch:
    """Rows padded on the right (a causal model never sees what follows a position); the
    targets of prompt tokens and of padding are IGNORE_INDEX."""
    width = max(len(r.ids) for r in rows) - 1
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        ids = torch.tensor(row.ids)
        tokens[i, : len(ids) - 1] = ids[:-1]
        # Target j is token j + 1: the completion's start at n_prompt is target n_prompt - 1.
        start = max(row.n_prompt - 1, 0)
        targets[i, start : len(ids) - 1] = ids[start + 1 :]
    return LMBatch(tokens, targets)


class RandomRows:
    """Training batches of B rows drawn at random (with replacement); its state is one
    torch.Generator, saved in checkpoints for exact resume."""

    def __init__(self, rows: list[Row], batch_size: int, seed: int) -> None:
        self.rows = rows
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[LMBatch]:
        return self

    def __next__(self) -> LMBatch:
        picks = torch.randint(len(self.rows), (self.batch_size,), generator=self.generator)
        return batch_of([self.rows[i] for i in picks.tolist()])

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def sequential_rows(rows: list[Row], batch_size: int) -> Iterator[LMBatch]:
    """Evaluation batches that cover every row once."""
    for i in range(0, len(rows), batch_size):
        yield batch_of(rows[i : i + batch_size])


class InstructData:
    """The rows of data.path (a .jsonl file) for a language model, its tokenizer, and its
    train / validation split: data.val_path's rows, or the last data.val_fraction of them."""

    def __init__(self, cfg: Any, tokenizer: Tokenizer | None, context: int) -> None:
        from tformer.data.tokenizers import train_tokenizer

        pairs = read_rows(cfg.path)
        if cfg.val_path is not None:
            if not is_instruct_path(cfg.val_path):
                raise TformerError(f"data.val_path = {cfg.val_path}: the validation rows of "
                                   f"instruction data must be a {SUFFIX} file too")
            train, val = pairs, read_rows(cfg.val_path)
        else:
            n_val = max(int(len(pairs) * cfg.val_fraction), 1)
            if n_val >= len(pairs):
                raise TformerError(f"{cfg.path} has {len(pairs)} rows: too few to keep "
                                   f"{n_val} for validation; add rows or give data.val_path")
            train, val = pairs[:-n_val], pairs[-n_val:]
        if tokenizer is None:  # fitted to every text, as a text corpus's would be
            texts = [text for pair in (*train, *val) for text in pair]
            tokenizer = train_tokenizer(cfg.tokenizer, texts, vocab_size=cfg.vocab_size,
                                        specials=True)
        self.tokenizer = tokenizer
        self.train_rows = encode_rows(train, tokenizer, context, cfg.path)
        self.val_rows = encode_rows(val, tokenizer, context, cfg.val_path or cfg.path)

    def summary(self) -> dict[str, str]:
        return {
            "data": f"{len(self.train_rows):,} training and {len(self.val_rows):,} validation "
            f"prompt/completion rows ({self.tokenizer.kind})",
            "loss": "cross-entropy per completion token (prompts are not predicted)",
        }

    def model_fields(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size}
