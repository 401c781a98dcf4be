"""Translation speed: sentences/s for greedy search and beam 4, at batch 1 and batch 32.

    .venv/bin/python benchmarks/translation_speed.py CKPT [--sentences 64] [--json]
    # decoder rows: those run, and those a batch would run if finished sentences stayed in it
    .venv/bin/python benchmarks/translation_speed.py CKPT --sentences 256 --batches 32 --count-rows
    # one version of the code against another, in alternation (batch 32 only, say)
    for r in 1 2 3; do for tree in old new; do PYTHONPATH=$tree/src .venv/bin/python \
        benchmarks/translation_speed.py CKPT --batches 32 --repeats 1 --json; done; done

CKPT is a trained seq2seq run or checkpoint (a random model never says EOS, so its speed
says nothing about translation); the sentences are the first --sentences lines of
Multi30k's test2016.en, or --source FILE. Each setting translates the same sentences
(sorted by length, as `tformer translate` does) and reports sentences/s and the mean output
length; settings are interleaved over --repeats rounds and the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tformer.data.parallel import read_lines
from tformer.decoding.translate import SearchOptions, translate
from tformer.loading import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "multi30k" / "test2016.en"
SEARCHES = [("greedy", 1), ("beam 4", 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--source", default=str(SOURCE))
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32],
                        help="batch sizes to time each search at")
    parser.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty")
    parser.add_argument("--count-rows", action="store_true",
                        help="also count the decoder's rows, in one more (untimed) pass")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = [(name, batch) for name, _ in SEARCHES for batch in args.batches]
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_checkpoint(args.checkpoint)
    lines = read_lines(args.source)[: args.sentences]
    options = {name: SearchOptions(beam=beam, alpha=args.alpha,
                                   max_len_a=loaded.cfg.data.max_ratio)
               for name, beam in SEARCHES}
    rates: dict[tuple[str, int], list[float]] = {setting: [] for setting in settings}
    lengths: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):
        for name, batch in settings:
            start = time.perf_counter()
            with torch.no_grad():
                out = translate(loaded.model, loaded.tokenizer, lines, options[name],
                                batch_size=batch)
            rates[(name, batch)].append(len(lines) / (time.perf_counter() - start))
            ids = [loaded.tokenizer.encode(h[0].text) for h in out]
            lengths[(name, batch)] = sum(map(len, ids)) / len(ids)

    rows = [
        {"search": name, "batch": batch, "sentences_per_s": statistics.median(rates[(name, batch)]),
         "mean_output_tokens": lengths[(name, batch)]}
        for name, batch in settings
    ]
    if args.count_rows:
        for row in rows:
            row["decoder_rows"], row["rows_if_none_left"] = decoder_rows(
                loaded, lines, options[row["search"]], row["batch"])
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "sentences": len(lines),
                          "rows": rows}))
        return
    params = loaded.model.num_params()
    print(f"{args.checkpoint}: {params / 1e6:.1f}M parameters, {len(lines)} sentences, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'search':<8} {'batch':>5} {'sentences/s':>12} {'output tokens':>14}"
          + (f" {'decoder rows':>13} {'if none left':>13}" if args.count_rows else ""))
    for row in rows:
        print(f"{row['search']:<8} {row['batch']:>5} {row['sentences_per_s']:>12.1f} "
              f"{row['mean_output_tokens']:>14.1f}"
              + (f" {row['decoder_rows']:>13,} {row['rows_if_none_left']:>13,}"
                 if args.count_rows else ""))


def decoder_rows(loaded, lines: list[str], options: SearchOptions, batch: int) -> tuple[int, int]:
    """(rows the decoder ran, rows it would have run had every sentence of a batch stayed in
    it to the batch's last step): a batch's first step runs all of its rows."""
    model, steps = loaded.model, []  # each search's rows per step
    # Every decoding step begins here, whichever way its layers then run
    # (tformer.decoding.runner).
    inputs = model.decoder_inputs

    def counting(tgt, src_real, *, cache=None, **kwargs):
        if cache is None or cache.length == 0:
            steps.append([])
        steps[-1].append(tgt.shape[0])
        return inputs(tgt, src_real, cache=cache, **kwargs)

    model.decoder_inputs = counting
    try:
        with torch.no_grad():
            translate(model, loaded.tokenizer, lines, options, batch_size=batch)
    finally:
        del model.decoder_inputs
    return sum(map(sum, steps)), sum(rows[0] * len(rows) for rows in steps)


if __name__ == "__main__":
    main()
