"""Translating lines of text: encode, batch by length, decode, and give the outputs back in
input order.

Shapes: B sentences in a batch, S source length.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tformer.data.parallel import encode_source, pad_right
from tformer.data.tokenizers import Tokenizer
from tformer.decoding.beam import beam_search, greedy_search
from tformer.errors import TformerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchOptions:
    beam: int = 4
    """1 is greedy search."""
    alpha: float = 0.6
    """Length penalty exponent; 0 ranks by log-probability alone."""
    length_penalty: str = "gnmt"
    """gnmt: ((5 + length) / 6) ** alpha; hf: length ** alpha, with Hugging Face's rule for
    when a sentence is finished (to compare with its MarianMTModel.generate)."""
    max_len_a: float = 1.5
    max_len_b: int = 10
    """At most max_len_a * source tokens + max_len_b output tokens."""
    n_best: int = 1
    early_stopping: bool = False


def check_search_args(
    beam: int, alpha: float, n_best: int, batch_size: int, max_len_a: float | None,
    max_len_b: int,
) -> None:
    """Search options as a user gives them on the command line, checked by their flags.
    max_len_a None: the model's default, checked once it is known."""
    if beam < 1:
        raise TformerError(f"--beam {beam} must be at least 1 (1 is greedy search)")
    if not alpha >= 0:
        raise TformerError(f"--alpha {alpha} must be 0 (no length penalty) or more")
    if not 1 <= n_best <= beam:
        raise TformerError(f"--n-best {n_best} must be between 1 and --beam {beam}")
    if batch_size < 1:
        raise TformerError(f"--batch-size {batch_size} must be at least 1")
    a = 1.0 if max_len_a is None else max_len_a
    if not a >= 0 or max_len_b < 0 or (a == 0 and max_len_b == 0):
        raise TformerError(
            f"--max-len-a {max_len_a} and --max-len-b {max_len_b} must be 0 or more, and not "
            f"both 0"
        )


@dataclass
class Translation:
    text: str
    score: float


def source_ids(tokenizer: Tokenizer, lines: Sequence[str], limit: int,
               trained_len: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Each line's source ids (cut to the model's `limit` positions, with a warning; a
    warning too where longer than `trained_len`, the longest the training pairs had), and
    which lines are blank (their ids empty: they translate to an empty line, since a model
    asked to translate nothing invents a sentence)."""
    # Blank lines are not encoded (white space may not even be in the vocabulary).
    sources = encode_source(tokenizer, [line if line.strip() else "" for line in lines])
    too_long = []
    for i, ids in enumerate(sources):
        if len(ids) > limit:
            log.warning("line %d has %d tokens; the model reads the first %d", i + 1, len(ids),
                        limit)
            sources[i] = ids[: limit - 1] + [tokenizer.eos_id]
        elif trained_len is not None and len(ids) > trained_len:
            too_long.append(i + 1)
    if too_long:
        shown = ", ".join(str(n) for n in too_long[:5]) + (" ..." if len(too_long) > 5 else "")
        log.warning("%d line(s) are longer than any training source (%d tokens), so their "
                    "translations are likely poor: line %s", len(too_long), trained_len, shown)
    blank = [i for i, line in enumerate(lines) if not line.strip()]
    for i in blank:
        sources[i] = []
    return sources, blank


def translate(
    model: nn.Module,
    tokenizer: Tokenizer,
    lines: Sequence[str],
    options: SearchOptions | None = None,
    *,
    batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
    trained_len: int | None = None,
) -> list[list[Translation]]:
    """The n_best translations of each line, best first, in the order of `lines`.

    Lines are decoded in batches of up to `batch_size` sentences of similar length (least
    padding). An empty (or blank) line translates to an empty line: a model asked to
    translate nothing invents a sentence. A source longer than the model's positions is
    cut, with a warning; one longer than `trained_len` tokens (the longest the training
    pairs had) is translated with a warning that the model never saw one so long.
    progress: called with the number of lines done after each batch.
    """
    options = options or SearchOptions()
    device = next(model.parameters()).device
    sources, blank = source_ids(tokenizer, lines, model.cfg.max_len, trained_len)
    results: list[list[Translation]] = [[] for _ in sources]
    for i in blank:
        results[i] = [Translation("", 0.0)] * options.n_best
    if blank and progress is not None:
        progress(len(blank))
    order = sorted(set(range(len(sources))) - set(blank), key=lambda i: len(sources[i]))
    special = {"bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        src, src_real = pad_right([sources[i] for i in index], tokenizer.pad_id)
        src, src_real = src.to(device), src_real.to(device)
        if options.beam == 1:
            found = [[h] for h in greedy_search(
                model, src, src_real, alpha=options.alpha, max_len_a=options.max_len_a,
                max_len_b=options.max_len_b, penalty=options.length_penalty, **special,
            )]
        else:
            found = beam_search(
                model, src, src_real, beam=options.beam, alpha=options.alpha,
                max_len_a=options.max_len_a, max_len_b=options.max_len_b,
                n_best=options.n_best, early_stopping=options.early_stopping,
                penalty=options.length_penalty, **special,
            )
        for i, hyps in zip(index, found, strict=True):
            results[i] = [Translation(tokenizer.decode(h.tokens), h.score) for h in hyps]
        if progress is not None:
            progress(len(index))
    return results


def translate_stream(
    model: nn.Module,
    tokenizer: Tokenizer,
    lines: Iterable[str],
    options: SearchOptions | None = None,
    *,
    chunk: int = 256,
    **kwargs,
) -> Iterator[list[Translation]]:
    """translate() over lines as they come: each run of `chunk` lines (sorted by length
    within it, for little padding) is decoded and yielded in input order before the next
    is read, so output flows while input is still arriving. chunk=1 translates a line as
    soon as it is read (a person typing at a terminal)."""
    lines = iter(lines)
    while block := list(itertools.islice(lines, chunk)):
        yield from translate(model, tokenizer, block, options, **kwargs)


@torch.no_grad()
def best_translations(
    model: nn.Module, tokenizer: Tokenizer, lines: Sequence[str],
    options: SearchOptions | None = None, **kwargs,
) -> list[str]:
    """The best translation of each line, as text."""
    return [hyps[0].text for hyps in translate(model, tokenizer, lines, options, **kwargs)]
