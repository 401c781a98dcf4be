"""Instruction data for language models: JSONL files of {"prompt", "completion"} rows and of
{"messages": [{"role", "content"}, ...]} rows (chat), either kind on any line.

A prompt/completion row becomes the tokens of its prompt, then of its completion, then the
end token where the tokenizer has one. A chat row is rendered with the checkpoint's chat
template, or data/chat.py's plain DEFAULT_TEMPLATE where it has none (the run then keeps
that template, so that `serve` renders its prompts as it was trained); each assistant reply
is the text the template adds after the generation prompt, up to its end of turn.

The loss counts the completions' and the replies' tokens (and the end tokens) only, so the
model learns to answer, not to write prompts. A row longer than model.context + 1 tokens
keeps its first context + 1; one left with nothing to predict inside the context is
dropped. Either is counted, and said in one warning per file.

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
Pair = tuple[str, str]
"""A prompt and its completion."""
Chat = list[dict[str, str]]
"""A conversation: messages with a role and a content."""


def is_instruct_path(path: str | None) -> bool:
    return path is not None and Path(path).suffix == SUFFIX


@dataclass(frozen=True)
class Row:
    ids: list[int]
    """The row's token ids, at most context + 1."""
    counted: tuple[tuple[int, int], ...]
    """The [start, end) ranges of ids that the loss predicts: completions and replies."""


def _pair(row: dict[str, Any], where: str) -> Pair:
    if set(row) != {"prompt", "completion"}:
        raise TformerError(f'{where}: expected {{"prompt": ..., "completion": ...}} or '
                           f'{{"messages": [...]}}, got {sorted(row)}')
    if not all(isinstance(row[k], str) for k in ("prompt", "completion")):
        raise TformerError(f"{where}: prompt and completion must be strings")
    if not row["completion"]:
        raise TformerError(f"{where}: the completion is empty (there is nothing to learn)")
    return row["prompt"], row["completion"]


def _chat(row: dict[str, Any], where: str) -> Chat:
    messages = row["messages"]
    if set(row) != {"messages"} or not isinstance(messages, list) or not messages:
        raise TformerError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, '
                           f'...]}} and nothing else')
    for i, message in enumerate(messages, 1):
        if (not isinstance(message, dict) or set(message) != {"role", "content"}
                or not all(isinstance(v, str) for v in message.values())):
            raise TformerError(f"{where}: message {i} must be {{\"role\": ..., \"content\": "
                               f"...}} with string values")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise TformerError(f"{where}: no assistant message with content (there is nothing to "
                           f"learn)")
    return messages


def read_rows(path: str | Path) -> list[Pair | Chat]:
    """Every row, a Pair or a Chat; a malformed row is an error naming the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TformerError(f"data file not found: {path}") from None
    except UnicodeDecodeError:
        raise TformerError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise TformerError(f"cannot read {path}: {e.strerror}") from None
    rows: list[Pair | Chat] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise TformerError(f"{where}: not a JSON object ({e})") from None
        if not isinstance(row, dict):
            raise TformerError(f'{where}: expected a JSON object ({{"prompt": ..., '
                               f'"completion": ...}} or {{"messages": [...]}}), got '
                               f"{type(row).__name__}")
        rows.append(_chat(row, where) if "messages" in row else _pair(row, where))
    if not rows:
        raise TformerError(f"{path} holds no rows")
    return rows


def _segments(rows: list[Pair | Chat], tokenizer: Tokenizer, source: str | Path
              ) -> list[list[tuple[list[int], bool]]]:
    """Each row as (token ids, counted) pieces."""
    from tformer.data.chat import ChatTemplateError, chat_segments, encode_text, template_of

    end = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    pairs = [row for row in rows if isinstance(row, tuple)]
    texts = iter(tokenizer.encode_batch([text for pair in pairs for text in pair]))
    template = template_of(tokenizer) if len(pairs) < len(rows) else None
    out = []
    for number, row in enumerate(rows, 1):
        if isinstance(row, tuple):
            out.append([(next(texts), False), (next(texts) + end, True)])
            continue
        try:
            pieces = chat_segments(template, row)
        except ChatTemplateError as e:
            raise TformerError(f"{source}, chat row {number}: {e}") from None
        out.append([(encode_text(tokenizer, text), reply) for text, reply in pieces])
    return out


def encode_rows(rows: list[Pair | Chat], tokenizer: Tokenizer, context: int,
                source: str | Path) -> list[Row]:
    """Token rows of at most context + 1 tokens, with one warning for those cut or dropped."""
    encoded, cut, dropped = [], 0, 0
    for pieces in _segments(rows, tokenizer, source):
        ids: list[int] = []
        counted = []
        for piece, reply in pieces:
            if reply:
                counted.append((len(ids), len(ids) + len(piece)))
            ids += piece
        if len(ids) > context + 1:
            ids = ids[: context + 1]
            # The first token is never predicted: nothing comes before it.
            counted = [(max(a, 1), min(b, len(ids))) for a, b in counted]
            counted = [(a, b) for a, b in counted if a < b]
            if not counted:
                dropped += 1
                continue
            cut += 1
        encoded.append(Row(ids, tuple(counted)))
    if cut or dropped:
        log.warning("%s: %d of %d rows are longer than model.context + 1 = %d tokens: %d cut "
                    "short, %d dropped (nothing they teach is inside the context)", source,
                    cut + dropped, len(rows), context + 1, cut, dropped)
    if not encoded:
        raise TformerError(f"{source}: every row's prompt fills model.context = {context}")
    return encoded


def batch_of(rows: list[Row]) -> LMBatch:
    """Rows padded on the right (a causal model never sees what follows a position); the
    targets of prompt tokens and of padding are IGNORE_INDEX."""
    width = max(len(r.ids) for r in rows) - 1
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, row in enumerate(rows):
        ids = torch.tensor(row.ids)
        tokens[i, : len(ids) - 1] = ids[:-1]
        # Target j is token j + 1: a counted range [a, b) is targets a - 1 to b - 2.
        for a, b in row.counted:
            a = max(a, 1)
            targets[i, a - 1 : b - 1] = ids[a:b]
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


def _texts(rows: list[Pair | Chat]) -> list[str]:
    """The text a tokenizer for these rows is fitted to: chat rows as the plain template
    writes them (without the special tokens, which the tokenizer has anyway)."""
    from tformer.data.chat import DEFAULT_TEMPLATE, ChatTemplate

    template = ChatTemplate(DEFAULT_TEMPLATE)
    return [text for row in rows for text in
            (row if isinstance(row, tuple) else [template.render(row)])]


class InstructData:
    """The rows of data.path (a .jsonl file) for a language model, its tokenizer, and its
    train / validation split: data.val_path's rows, or the last data.val_fraction of them."""

    def __init__(self, cfg: Any, tokenizer: Tokenizer | None, context: int) -> None:
        from tformer.data.tokenizers import train_tokenizer

        rows = read_rows(cfg.path)
        if cfg.val_path is not None:
            if not is_instruct_path(cfg.val_path):
                raise TformerError(f"data.val_path = {cfg.val_path}: the validation rows of "
                                   f"instruction data must be a {SUFFIX} file too")
            train, val = rows, read_rows(cfg.val_path)
        else:
            n_val = max(int(len(rows) * cfg.val_fraction), 1)
            if n_val >= len(rows):
                raise TformerError(f"{cfg.path} has {len(rows)} rows: too few to keep "
                                   f"{n_val} for validation; add rows or give data.val_path")
            train, val = rows[:-n_val], rows[-n_val:]
        self.n_chat = sum(isinstance(row, list) for row in train)
        if tokenizer is None:  # fitted to every text, as a text corpus's would be
            tokenizer = train_tokenizer(cfg.tokenizer, _texts([*train, *val]),
                                        vocab_size=cfg.vocab_size, specials=True)
        self.own_template = tokenizer.chat_template is not None
        if not self.own_template and any(isinstance(row, list) for row in (*train, *val)):
            from tformer.data.chat import DEFAULT_TEMPLATE

            tokenizer.chat_template = DEFAULT_TEMPLATE  # kept by the run, for serve
        self.tokenizer = tokenizer
        self.train_rows = encode_rows(train, tokenizer, context, cfg.path)
        self.val_rows = encode_rows(val, tokenizer, context, cfg.val_path or cfg.path)

    def summary(self) -> dict[str, str]:
        kinds = f"{len(self.train_rows) - self.n_chat:,} prompt/completion"
        if self.n_chat:
            template = "its chat template" if self.own_template else "the plain chat template"
            kinds += f", {self.n_chat:,} chat, rendered with {template}"
        return {
            "data": f"{len(self.train_rows):,} training rows ({kinds}) and "
            f"{len(self.val_rows):,} validation rows ({self.tokenizer.kind})",
            "loss": "cross-entropy per completion or reply token (prompts are not predicted)",
        }

    def model_fields(self) -> dict[str, Any]:
        return {"vocab_size": self.tokenizer.vocab_size}
