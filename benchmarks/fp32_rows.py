"""Where fp32 decoding should change kernels: fp32.c's kernel against oneDNN's prepacked
product, at 1 to 16 rows, on the OPUS-MT shapes.

    OMP_NUM_THREADS=1 python benchmarks/fp32_rows.py [--repeats 5] [--threads 1] [--tiny]

PackedLinear sends up to fp32.MAX_ROWS rows to the kernel and more to oneDNN; this prints
the kernel's time over oneDNN's for each shape and number of rows (below 1: the kernel is
faster). Each timing runs through enough copies of the layer (~400 MB of weights) that they
come from memory, as in a decoding step, and the two sides alternate over the repeats.
--tiny runs one small shape from cache, to check the script.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from tformer.kernels import fp32, library
from tformer.kernels.prepack import PackedLinear

SHAPES = [(512, 58101), (512, 1536), (512, 2048), (2048, 512), (512, 512)]  # (in, out)
ROWS = (1, 2, 4, 5, 6, 8, 12, 16)
TINY_SHAPES, TINY_ROWS = [(40, 72)], (1, 5)


def seconds(fn, layers: list[PackedLinear], x: torch.Tensor) -> float:
    start = time.perf_counter()
    for layer in layers:
        fn(layer, x)
    return time.perf_counter() - start


def kernel(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return fp32.matvec(x, layer.weight, layer.bias)


def onednn(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="one small shape, to check the script")
    args = parser.parse_args()
    # Enough copies of each layer for ~400 MB of weights; --tiny: a few, from cache.
    shapes, rows_tried, elements = (
        (TINY_SHAPES, TINY_ROWS, 10**4) if args.tiny else (SHAPES, ROWS, 10**8))
    torch.set_num_threads(args.threads)
    if library.load() is None:
        raise SystemExit("the decoding kernel is not built here; nothing to compare")
    print(f"{args.threads} thread(s), median of {args.repeats}; kernel time / oneDNN time "
          f"(MAX_ROWS = {fp32.MAX_ROWS})\n")
    print("| W (in -> out) | " + " | ".join(f"{r} rows" for r in rows_tried) + " |")
    print("| --- |" + " ---: |" * len(rows_tried))
    torch.manual_seed(0)
    with torch.no_grad():
        for k, n in shapes:
            layers = [PackedLinear(nn.Linear(k, n)) for _ in range(max(1, elements // (k * n)))]
            cells = []
            for rows in rows_tried:
                x = torch.randn(rows, k)
                times: dict[str, list[float]] = {"kernel": [], "onednn": []}
                for _ in range(args.repeats):
                    times["kernel"].append(seconds(kernel, layers, x))
                    times["onednn"].append(seconds(onednn, layers, x))
                ratio = statistics.median(times["kernel"]) / statistics.median(times["onednn"])
                cells.append(f"{ratio:.2f}")
            print(f"| {k} -> {n} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
