"""Where the int8 product should change kernels: one linear layer at 1 to 64 rows, fp32
beside int8, and int8 through each of its two kernels.

    OMP_NUM_THREADS=1 python benchmarks/int8_rows.py [--repeats 7] [--threads 1] [--tiny]

Columns, per shape and number of rows (a decoding step multiplies batch x beam rows):
- fp32: PackedLinear, what fp32 decoding runs (fp32.c's kernel up to 4 rows, oneDNN's
  prepacked product beyond);
- int8: Int8Linear as it dispatches (rounding the rows to int8 included);
- kernel / packed / _int_mm: the int8 product (rounding the rows included) through
  int8.c's kernel for a few rows, through its product over packed weights (in the layout
  this process packs in: AVX-512 VNNI's, or AVX2's 16-bit or byte one, int8.pack_int8)
  and through torch._int_mm (oneDNN), whatever the number of rows.
  They give the same bits, so the fastest should serve: int8.INT8_MAX_ROWS is where the
  few-row kernel hands over to the others.
All in alternation, median of the repeats; the ratios compare columns of one run. --tiny
times one small shape at a few rows, to check the script.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
from torch import nn

from tformer.kernels import int8 as kint8
from tformer.kernels import int8_packed as kpacked
from tformer.kernels import library, rounding
from tformer.kernels.prepack import PackedLinear
from tformer.kernels.quantize import Int8Linear
from tformer.kernels.rounding import quantize_rows

SHAPES = {  # name: (in_features, out_features)
    "opus-mt ffn in (512 -> 2048)": (512, 2048),
    "opus-mt ffn out (2048 -> 512)": (2048, 512),
    "opus-mt output (512 -> 58101)": (512, 58101),
    "gpt-2 ffn in (768 -> 3072)": (768, 3072),
}
ROWS = (1, 2, 4, 8, 12, 16, 32, 64)
TINY_SHAPES, TINY_ROWS = {"tiny (40 -> 72)": (40, 72)}, (1, 8, 32)


def int8_mm(lib, x, q, wscale, bias):
    """linear_int8's path for many rows without packed weights: rounding, torch._int_mm,
    scaling."""
    return rounding._int_mm_scaled(lib, *quantize_rows(x), q, wscale, bias)


def packed_product(lib, x, packed, wscale, bias):
    """linear_int8's path for many rows over packed weights."""
    return kpacked.call_gemm_int8(lib, *quantize_rows(x), packed, wscale, bias)


def timed(fn, calls: int) -> float:
    """Milliseconds a call, over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="one small shape, to check the script")
    args = parser.parse_args()
    # Enough calls for ~20 M weights' products a timing; --tiny: a few.
    shapes, rows_tried, elements = (
        (TINY_SHAPES, TINY_ROWS, 10**4) if args.tiny else (SHAPES, ROWS, 2 * 10**7))
    torch.set_num_threads(args.threads)
    lib = library.load() if kint8.available() else None
    if lib is None:
        raise SystemExit("the decoding kernel is not built here; nothing to compare")
    print(f"{args.threads} thread(s), median of {args.repeats} rounds in alternation; "
          f"INT8_MAX_ROWS = {kint8.INT8_MAX_ROWS}, "
          f"PACKED_MIN_ROWS = {kpacked.PACKED_MIN_ROWS}\n")
    print("| shape | rows | fp32 ms | int8 ms | fp32 / int8 | kernel ms | packed ms | _int_mm ms "
          "| _int_mm / kernel | _int_mm / packed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, (k, n) in shapes.items():
            linear = nn.Linear(k, n)
            fp32, int8 = PackedLinear(linear), Int8Linear(linear)
            calls = max(1, elements // (k * n))
            for rows in rows_tried:
                x = torch.randn(rows, k)
                weights = (int8.qweight, int8.scale, linear.bias)
                sides = {
                    "fp32": partial(fp32, x),
                    "int8": partial(int8, x),
                    "kernel": partial(kint8.call_linear_int8, lib, x, *weights),
                    "_int_mm": partial(int8_mm, lib, x, *weights),
                }
                if int8.packed is not None:
                    sides["packed"] = partial(packed_product, lib, x, int8.packed, *weights[1:])
                for fn in sides.values():  # warm-up
                    fn()
                times: dict[str, list[float]] = {side: [] for side in sides}
                for _ in range(args.repeats):  # alternate, so load hits every side alike
                    for side, fn in sides.items():
                        times[side].append(timed(fn, calls))
                t = {side: statistics.median(v) for side, v in times.items()}
                packed = ("-", "-")
                if "packed" in t:
                    packed = (f"{t['packed']:.3f}", f"{t['_int_mm'] / t['packed']:.2f}")
                print(f"| {name} | {rows} | {t['fp32']:.3f} | {t['int8']:.3f} "
                      f"| {t['fp32'] / t['int8']:.2f}x | {t['kernel']:.3f} | {packed[0]} "
                      f"| {t['_int_mm']:.3f} | {t['_int_mm'] / t['kernel']:.2f} "
                      f"| {packed[1]} |", flush=True)


if __name__ == "__main__":
    main()
