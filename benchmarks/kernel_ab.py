"""Two versions of the decoding kernel (tformer/kernels/matvec.c) side by side: each built
with the flags tformer builds it with, both timed in alternation on decoding's shapes.

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py c3e96b9~1 c3e96b9 [--repeats 7] [--tiny]

A version is a git revision (its matvec.c, and the headers it includes where the revision
has them) or a path to a .c file (the headers beside it). Each cell is the rate at
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
from tformer.kernels.build import FLAGS, HEADERS
from tformer.kernels.build import compiler as find_compiler

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [  # (out_features n, in_features k): OPUS-MT's products, and GPT-2's FFN
    (58101, 512), (1536, 512), (512, 512), (2048, 512), (512, 2048), (3072, 768),
]
TINY_SHAPES = [(72, 40)]


def build(version: str, out: Path) -> ctypes.CDLL:
    """The version's kernel, compiled into `out` as tformer compiles it."""
    name = version.replace("/", "_")
    folder = out / name  # the version's source and headers, apart from the other version's
    folder.mkdir()
    path = Path(version)
    if path.suffix == ".c" and path.is_file():
        source, headers = path.read_text(), path.resolve().parent
    else:
        def show(file: str) -> subprocess.CompletedProcess:
            return subprocess.run(["git", "show", f"{version}:src/tformer/kernels/{file}"],
                                  cwd=ROOT, capture_output=True, text=True)

        source, headers = show("matvec.c"), folder
        source.check_returncode()
        source = source.stdout
        for name in (path.name for path in HEADERS):  # older revisions lack some
            header = show(name)
            if header.returncode == 0:
                (folder / name).write_text(header.stdout)
    c_file, library = folder / "matvec.c", folder / "matvec.so"
    c_file.write_text(source)
    compiler = find_compiler() or "gcc"  # the compiler tformer builds with
    subprocess.run([compiler, *FLAGS, f"-I{headers}", str(c_file), "-o", str(library)],
                   check=True)
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
    parser.add_argument("versions", nargs=2, help="git revisions or .c files: A and B")
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
