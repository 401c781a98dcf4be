"""`tformer translate CKPT [FILE] [-o OUT]`: translate lines with a sequence-to-sequence
model, from a file or as they arrive on standard input."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import Annotated, Any

from tformer.api import Weights
from tformer.arguments import Help
from tformer.cli.common import (
    Checkpoint,
    Device,
    Ensemble,
    Threads,
    check_output_file,
    ensemble_note,
)
from tformer.decoding.beam import PENALTIES
from tformer.decoding.translate import SearchOptions

DEFAULT = SearchOptions()


def translate(
    checkpoint: Checkpoint,
    input: Annotated[str | None, Help("a file of lines (default: stdin)", nargs="?")] = None,
    *,
    output: Annotated[
        str | None, Help("write here (default: stdout)", flags=("-o", "--output"))
    ] = None,
    beam: Annotated[int, Help("beam size; 1 is greedy search")] = DEFAULT.beam,
    alpha: Annotated[
        float, Help("GNMT length penalty ((5 + length) / 6) ** alpha; 0 is off")
    ] = DEFAULT.alpha,
    length_penalty: Annotated[
        str, Help("hf: length ** alpha and Hugging Face's stopping rule, to reproduce "
                  "MarianMTModel.generate (with --alpha 1.0)", choices=PENALTIES)
    ] = DEFAULT.length_penalty,
    max_len_a: Annotated[
        float | None, Help("at most a * source tokens + b output tokens (default a: the "
                           "training data's data.max_ratio)")
    ] = None,
    max_len_b: Annotated[int, Help("see --max-len-a")] = DEFAULT.max_len_b,
    n_best: Annotated[int, Help("write the N best as 'line<TAB>score<TAB>text'")] = 1,
    early_stopping: Annotated[
        bool, Help("end a sentence once it has --beam finished hypotheses (faster)")
    ] = False,
    batch_size: Annotated[int, Help("sentences decoded at once")] = 32,
    weights: Weights = None,
    ensemble: Ensemble = None,
    device: Device = "auto",
    threads: Threads = None,
) -> int:
    from tqdm import tqdm

    from tformer.api import load
    from tformer.data.parallel import read_lines
    from tformer.decoding.translate import check_search_args

    # Everything that can fail on the user's arguments fails before any translating (the
    # default --max-len-a comes from the checkpoint, and is valid).
    check_search_args(beam, alpha, n_best, batch_size,
                      1.0 if max_len_a is None else max_len_a, max_len_b)
    if output is not None:
        check_output_file(output, "-o", input)
    lines: Any = read_lines(input) if input is not None else stdin_lines()
    model = load(checkpoint, weights=weights, device=device, threads=threads, needs="translate",
                 ensemble=ensemble or ())
    at_terminal = input is None and sys.stdin.isatty()
    print(
        f"translating with {model.label}{ensemble_note(ensemble)} (beam {beam}, "
        f"{model.description})" + ("; type a line and Enter, Ctrl-D to end" if at_terminal
                                   else ""),
        file=sys.stderr,
    )
    # At a terminal each line as it is typed; otherwise a few batches at a time, so output
    # flows while input still arrives and a long file shows its progress.
    chunk = 1 if at_terminal else 4 * batch_size
    # A bar for a file on a terminal; none for stdin (a pipe, or a person typing).
    bar = tqdm(total=len(lines) if input is not None else None, unit="line",
               disable=input is None or not sys.stderr.isatty(), file=sys.stderr)
    out = open(output, "w", encoding="utf-8") if output else sys.stdout
    try:
        index, pending = 0, iter(lines)
        for block in iter(lambda: list(itertools.islice(pending, chunk)), []):
            results = model.family.translate(
                model.checkpoint, block, beam=beam, alpha=alpha, max_len_a=max_len_a,
                max_len_b=max_len_b, n_best=n_best, early_stopping=early_stopping,
                batch_size=batch_size, progress=bar.update, length_penalty=length_penalty,
            )
            for hyps in results:
                for hyp in hyps:
                    # One line per translation, whatever the model produced.
                    text = hyp.text.replace("\n", " ")
                    out.write(f"{index}\t{hyp.score:.4f}\t{text}\n" if n_best > 1
                              else text + "\n")
                index += 1
            out.flush()
    finally:
        bar.close()
        if output:
            out.close()
    return 0


def stdin_lines() -> Iterator[str]:
    """Standard input line by line as it arrives, without line ends; bytes that are not
    UTF-8 are a one-line error naming the line."""
    from tformer.data.corpus import decode_utf8

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # already text, e.g. a StringIO put there by a caller
        yield from (line.rstrip("\n").removesuffix("\r") for line in sys.stdin)
        return
    for number, raw in enumerate(buffer, 1):
        line = decode_utf8(raw, f"standard input (line {number})")
        yield line.rstrip("\n").removesuffix("\r")
