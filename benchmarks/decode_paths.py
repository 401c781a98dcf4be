"""A decoding step, tformer's two ways, side by side on the OPUS-MT-shaped model (opus_mt.py).

--compare attention: the attention kernel reading caches that stay in place
    (kernels/attend.py, layers.cache.Lineage), against torch's fused attention over
    caches copied into the beams' order after every step (what runs where the kernel is not
    built); every decoder layer runs as modules on both sides.
--compare step: each decoder layer's step as one C call (kernels/step.py), against the
    layers run as modules (with the attention kernel and caches in place on both sides).

    OMP_NUM_THREADS=1 python benchmarks/decode_paths.py [--compare step] [--repeats 5]

Beam 4, 20-token random sources, `--len` output tokens, fp32 (prepacked, as `tformer
translate` runs it) and int8, batch 1 and 16; medians of the repeats, the two ways in
alternation. Both must find the same tokens before anything is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from opus_mt import Sides  # noqa: E402

from tformer.decoding import runner  # noqa: E402
from tformer.kernels import attend  # noqa: E402
from tformer.kernels.step import DecoderStep  # noqa: E402
from tformer.layers import cache  # noqa: E402

COLUMNS = {"attention": ("in place + kernel", "copied + torch"),
           "step": ("one call a layer", "modules")}


@contextmanager
def kernel(on: bool):
    """Decoding with the attention kernel and caches in place (on), or as without the
    kernel; the layers run as modules either way."""
    saved = cache.serves, runner.serves_cache, DecoderStep.of
    DecoderStep.of = lambda *args: None
    if not on:
        cache.serves = lambda x: False
        runner.serves_cache = lambda dtype, device: False
    try:
        yield
    finally:
        cache.serves, runner.serves_cache, DecoderStep.of = saved


@contextmanager
def layer_step(on: bool):
    """Decoding with each layer's step as one call (on), or the layers run as modules."""
    saved = DecoderStep.of
    if not on:
        DecoderStep.of = lambda *args: None
    try:
        yield
    finally:
        DecoderStep.of = saved


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--len", type=int, default=30, help="output tokens per sentence")
    parser.add_argument("--compare", choices=tuple(COLUMNS), default="attention")
    args = parser.parse_args()
    way = kernel if args.compare == "attention" else layer_step
    if not attend.serves_cache(torch.float32, torch.device("cpu")):
        raise SystemExit("the attention kernel is not built here: nothing to compare")
    sides = Sides(torch.get_num_threads())
    print(f"{torch.get_num_threads()} threads, beam 4, {args.len} output tokens, "
          f"medians of {args.repeats}\n")
    print("| batch | weights | {} | {} | ratio |".format(*COLUMNS[args.compare]))
    print("| ---: | --- | ---: | ---: | ---: |")
    with torch.no_grad():
        for batch in (1, 16):
            src = sides.sources(batch)
            for int8 in (False, True):
                run = partial(sides.tformer, src, args.len, int8=int8)
                with way(True):
                    fast = run()
                with way(False):
                    plain = run()
                if fast != plain:
                    raise SystemExit(f"batch {batch}: the two ways found different tokens")
                times = {True: [], False: []}
                for _ in range(args.repeats):
                    for on in (True, False):
                        with way(on):
                            times[on].append(seconds(run))
                a, b = (batch / statistics.median(times[on]) for on in (True, False))
                print(f"| {batch} | {'int8' if int8 else 'fp32'} | {a:.2f} sent/s | "
                      f"{b:.2f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
