"""Two versions of the decoding kernels' products (tformer_matvec, tformer_matvec_int8)
side by side: each version's C library built with the flags tformer builds it with, both
timed in alternation on decoding's shapes.

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py c3e96b9~1 c3e96b9 [--repeats 7] [--tiny]

A version is a git revision (every .c and .h file of its src/tformer/kernels, as matvec.c
held the products before they were split by format) or a folder of such files. Each cell
is the rate at
which the product reads the weight matrix (GB/s; int8 weights are a quarter of fp32's
bytes), a median over the repeats; every repeat runs through enough copies of the matrix
(~400 MB of fp32, ~200 MB of int8) that it comes from memory, as a decoding step's does.
--tiny times one small matrix from cache, to check the script.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tformer.kernels.library import FLAGS
from tformer.kernels.library import compiler as find_compiler

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [  # (out_features n, in_features k): OPUS-MT's products, and GPT-2's FFN
    (58101, 512), (1536, 512), (512, 512), (2048, 512), (512, 2048), (3072, 768),
]
TINY_SHAPES = [(72, 40)]


def build(version: str, out: Path) -> ctypes.CDLL:
    """The version's kernel, compiled into `out` as tformer compiles it."""
    path = Path(version)
    if path.is_dir():
        folder = path.resolve()
    else:
        folder = out / version.replace("/", "_")  # apart from the other version's files
        folder.mkdir()
        kernels = "src/tformer/kernels/"
        names = subprocess.run(["git", "ls-tree", "--name-only", version, kernels], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        for name in names:
            if name.endswith((".c", ".h")):
                source = subprocess.run(["git", "show", f"{version}:{name}"], cwd=ROOT,
                                        capture_output=True, text=True, check=True).stdout
                (folder / Path(name).name).write_text(source)
    library = out / (version.replace("/", "_") + ".so")
    compiler = find_compiler() or "gcc"  # the compiler tformer builds with
    subprocess.run([compiler, *FLAGS, f"-I{folder}", *map(str, sorted(folder.glob("*.c"))),
                    "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.tformer_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec_int8.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int])
    return lib


def rates(libs: dict, n: int, k: int, rows: int, int8: bool, repeats: int,
          elements: int = 100_000_000) -> dict[str, float]:
    """GB/s of weights read by each version's product of `rows` rows, in alternation, over
    enough copies of the matrix for `elements` fp32 weights (twice as many int8 ones)."""
    copies = max(1, (2 * elements if int8 else elements) // (n * k))
    if int8:
        weights = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(copies)]
        x = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        xscale, wscale = torch.rand(rows), torch.rand(n)
    else:
        weights = [torch.randn(n, k) for _ in range(copies)]
        x = torch.randn(rows, k)
    y = torch.empty(rows, n)
    gigabytes = weights[0].numel() * weights[0].element_size() * copies / 1e9
    measured: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(repeats):
        for name, lib in libs.items():
            start = time.perf_counter()
            for w in weights:
                if int8:
                    lib.tformer_matvec_int8(x.data_ptr(), xscale.data_ptr(), w.data_ptr(),
                                            wscale.data_ptr(), None, y.data_ptr(), rows, n, k,
                                            torch.get_num_threads())
                else:
                    lib.tformer_matvec(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), rows, n,
                                       k, torch.get_num_threads())
            measured[name].append(gigabytes / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in measured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs=2, help="git revisions or folders: A and B")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tiny", action="store_true", help="one small matrix, to check the script")
    args = parser.parse_args()
    shapes, elements = (TINY_SHAPES, 10**4) if args.tiny else (SHAPES, 10**8)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = args.versions
        libs = {a: build(a, Path(tmp)), b: build(b, Path(tmp))}
        print(f"{torch.get_num_threads()} thread(s), median of {args.repeats}, GB/s of weights"
              f"\n\n| product | W (n x k) | rows | {a} | {b} | ratio |\n"
              "| --- | --- | ---: | ---: | ---: | ---: |")
        for int8 in (False, True):
            for n, k in shapes:
                for rows in args.rows:
                    r = rates(libs, n, k, rows, int8, args.repeats, elements)
                    print(f"| {'int8' if int8 else 'fp32'} | {n} x {k} | {rows} | {r[a]:.1f} | "
                          f"{r[b]:.1f} | {r[b] / r[a]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
