"""Two versions of the decoding kernels' products (tformer_matvec, tformer_matvec_int8, and
the block formats' through tformer_linear) side by side: each version's C library built with
the flags tformer builds it with, both timed in alternation on decoding's shapes.

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py c3e96b9~1 c3e96b9 [--repeats 7] [--tiny]
    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py main HEAD --kinds q4_k q6_k q5_0

--kinds picks the products (fp32 and int8 by default, on OPUS-MT's and GPT-2's shapes;
the block kinds, q4_k, q5_k, q6_k and the 32-value ones, on a Llama-3.2-1B's: d 2048, FF
8192, keys and values 512), --isa the block kinds' path (tformer_blocks_isa; a library
loaded here starts on AVX2 where tformer picks the best the CPU has: avx512 by default,
falling back as the CPU requires). A block kind's weights are random bytes with finite
fp16 scales (the product's speed does not depend on the values), ~600 MB of them (a
server's L3 cache holds some hundreds of MB), and the product goes through kinds.c's table
with no repacked copy, so every row count runs the few-row product, as a decoding step's
does; both versions must share struct tformer_linear's layout. --many times the products of
many rows instead (a prompt's, a batch's), as a model runs them by default: each version's
own kinds.c decides how (over W repacked for the call, or anything else it does), one copy
of W (the product is bound by arithmetic, not by memory), and each cell is in billions of
multiply-adds a second (rows x n x k / time).

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

from tformer.kernels.library import FLAGS, Linear
from tformer.kernels.library import compiler as find_compiler

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [  # (out_features n, in_features k): OPUS-MT's products, and GPT-2's FFN
    (58101, 512), (1536, 512), (512, 512), (2048, 512), (512, 2048), (3072, 768),
]
TINY_SHAPES = [(72, 40)]
LLAMA_SHAPES = [  # a Llama-3.2-1B's: q and o, k and v, gate and up, down
    (2048, 2048), (512, 2048), (8192, 2048), (2048, 8192),
]
TINY_BLOCK_SHAPES = [(72, 512)]
BLOCK_KINDS = {  # name: (values a block, bytes a block, the fp16 scales' offsets in it)
    "q4_k": (256, 144, (0, 2)), "q5_k": (256, 176, (0, 2)), "q6_k": (256, 210, (208,)),
    "q8_0": (32, 34, (0,)), "q4_0": (32, 18, (0,)), "q4_1": (32, 20, (0, 2)),
    "q5_0": (32, 22, (0,)), "q5_1": (32, 24, (0, 2)), "iq4_xs": (256, 136, (0,)),
}
KIND_NUMBERS = {"q8_0": 2, "q4_0": 3, "q4_1": 4, "q5_0": 5, "q5_1": 6, "q4_k": 7, "q5_k": 8,
                "q6_k": 9, "iq4_xs": 11}
"""tformer.h's enum tformer_kind (library.py's KIND_*)."""


BLOCK_PATHS = {"avx512": 3, "avxvnni": 2, "avx2": 1, "generic": 0}
"""tformer_blocks_isa's levels (blocks.py's ISA_*): the block kinds' path."""


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
    # The flags that make code (older revisions declare fewer prototypes than -Werror wants).
    flags = [flag for flag in FLAGS if not flag.startswith("-Werror")]
    subprocess.run([compiler, *flags, f"-I{folder}", *map(str, sorted(folder.glob("*.c"))),
                    "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.tformer_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec_int8.argtypes = (
        [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int])
    lib.tformer_linear.argtypes = [ctypes.POINTER(Linear), ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_long, ctypes.c_int]
    lib.tformer_blocks_isa.argtypes = [ctypes.c_int]
    return lib


def block_weights(kind: str, n: int, k: int, nbytes: int) -> torch.Tensor:
    """Copies of a random W (n x k) of `kind`'s blocks, [copies, n, row bytes], enough for
    `nbytes` bytes."""
    values, size, halves = BLOCK_KINDS[kind]
    row = k // values * size
    copies = max(1, nbytes // (n * row))
    g = torch.Generator().manual_seed(0)
    weights = torch.randint(0, 256, (copies * n * (k // values), size), dtype=torch.uint8,
                            generator=g)
    for at in halves:  # finite scales, of a trained model's size
        weights[:, at:at + 2] = (torch.rand(weights.shape[0], 1, generator=g) * 0.01).half() \
            .view(torch.uint8)
    return weights.view(copies, n, row)


def block_rates(libs: dict, kind: str, weights: torch.Tensor, rows: int, repeats: int,
                many: bool = False) -> dict[str, float]:
    """GB/s of `kind`'s blocks read by each version's product of `rows` rows, in
    alternation, through every copy of W in `weights` (block_weights'); `many`: billions of
    multiply-adds a second instead, the product free to repack W for the call."""
    _, n, row = weights.shape
    k = row // BLOCK_KINDS[kind][1] * BLOCK_KINDS[kind][0]
    g = torch.Generator().manual_seed(1)
    repack_rows = 5 if many else 1 << 30  # blocks.py's REPACK_MIN_ROWS, or never
    structs = [Linear(KIND_NUMBERS[kind], n, k, w.data_ptr(), None, None, None, None, 0,
                      repack_rows) for w in weights]
    x = torch.randn(rows, k, generator=g)
    y = torch.empty(rows, n)
    gigabytes = rows * n * k * len(structs) / 1e9 if many else weights.numel() / 1e9
    measured: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(repeats):
        for name, lib in libs.items():
            start = time.perf_counter()
            for struct in structs:
                if lib.tformer_linear(ctypes.byref(struct), x.data_ptr(), y.data_ptr(), rows,
                                      torch.get_num_threads()):
                    raise RuntimeError(f"{name}'s product of {kind} failed")
            measured[name].append(gigabytes / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in measured.items()}


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
    parser.add_argument("--kinds", nargs="+", default=["fp32", "int8"],
                        choices=["fp32", "int8", *BLOCK_KINDS])
    parser.add_argument("--isa", choices=list(BLOCK_PATHS), default="avx512",
                        help="the block kinds' path (tformer_blocks_isa; the best the CPU has "
                             "at most this one), as tformer picks it; avx512 by default")
    parser.add_argument("--many", action="store_true",
                        help="the block kinds' products of many rows, as a model runs them "
                             "(repacked for the call where the version does): G multiply-adds/s")
    parser.add_argument("--tiny", action="store_true", help="one small matrix, to check the script")
    args = parser.parse_args()
    shapes, elements = (TINY_SHAPES, 10**4) if args.tiny else (SHAPES, 10**8)
    block_shapes, nbytes = (TINY_BLOCK_SHAPES, 10**5) if args.tiny else (LLAMA_SHAPES, 6 * 10**8)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = args.versions
        libs = {a: build(a, Path(tmp)), b: build(b, Path(tmp))}
        paths = {name: lib.tformer_blocks_isa(BLOCK_PATHS[args.isa]) for name, lib in libs.items()}
        names = {level: name for name, level in BLOCK_PATHS.items()}
        print(f"block kinds' path: {', '.join(f'{n} {names[p]}' for n, p in paths.items())}")
        unit = "GB/s of weights" + ("; the block kinds' G multiply-adds/s" if args.many else "")
        print(f"{torch.get_num_threads()} thread(s), median of {args.repeats}, {unit}"
              f"\n\n| product | W (n x k) | rows | {a} | {b} | ratio |\n"
              "| --- | --- | ---: | ---: | ---: | ---: |")
        for kind in args.kinds:
            for n, k in (shapes if kind in ("fp32", "int8") else block_shapes):
                weights = None if kind in ("fp32", "int8") else block_weights(
                    kind, n, k, 1 if args.many else nbytes)
                for rows in args.rows:
                    if weights is None:
                        r = rates(libs, n, k, rows, kind == "int8", args.repeats, elements)
                    else:
                        r = block_rates(libs, kind, weights, rows, args.repeats, args.many)
                    print(f"| {kind} | {n} x {k} | {rows} | {r[a]:.1f} | {r[b]:.1f} | "
                          f"{r[b] / r[a]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
