"""The kernel tests under every instruction-set path this CPU has: `make test-isa`.

Two things choose the instructions a computation runs: tformer's C kernels follow
TFORMER_ISA (avx512, avxvnni, avx2, torch; see kernels/library.py), and torch's own kernels
follow ATEN_CPU_CAPABILITY (the CPU's best, or avx2 on an AVX-512 CPU). Another host runs
another combination by default, so a test whose tolerance holds on one may fail on another.
This runs the chosen test folders once per combination the CPU can run, each in its own
pytest process, and prints one row per combination; it exits 1 where any row failed.

    python tests/isa_matrix.py                        # tests/kernels, decoding, layers, models
    python tests/isa_matrix.py tests/kernels -x       # other paths, and pytest's own options
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

DEFAULT_TESTS = ["tests/kernels", "tests/decoding", "tests/layers", "tests/models"]


def kernel_paths() -> list[str]:
    """The TFORMER_ISA values this CPU runs as asked (not a lower one in their place)."""
    import torch  # noqa: F401  (the kernels link against torch's OpenMP)

    from tformer.kernels import library

    lib = library.load()
    if lib is None:
        return ["torch"]
    have = [name for name, level in library.ISA_LEVELS.items()
            if lib.tformer_isa(level) == level]
    return [*have, "torch"]


def torch_paths() -> list[str]:
    """ATEN_CPU_CAPABILITY values: the CPU's own (unset), and avx2 where the CPU has more."""
    import torch

    best = torch.backends.cpu.get_cpu_capability()
    return ["", "avx2"] if best == "AVX512" else [""]


def run(tests: list[str], isa: str, aten: str) -> tuple[str, float, bool]:
    env = {**os.environ, "TFORMER_ISA": isa, "OMP_NUM_THREADS": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if aten:
        env["ATEN_CPU_CAPABILITY"] = aten
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "2", "--dist", "loadscope", *tests],
                          env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else done.stderr.strip()[-200:]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    for line in failed:
        print(f"    {line}", flush=True)
    return summary, seconds, done.returncode == 0


def main(argv: list[str]) -> int:
    tests = [a for a in argv if not a.startswith("-")] or DEFAULT_TESTS
    tests += [a for a in argv if a.startswith("-")]
    import torch

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"tests: {' '.join(tests)}", flush=True)
    print(f"{'TFORMER_ISA':<12} {'ATEN_CPU_CAPABILITY':<20} {'seconds':>8}  result", flush=True)
    ok = True
    for isa in kernel_paths():
        for aten in torch_paths():
            summary, seconds, passed = run(tests, isa, aten)
            summary = re.sub(r"\s+in [\d.]+s.*$", "", summary)
            print(f"{isa:<12} {aten or '(the CPU’s)':<20} {seconds:>8.0f}  {summary}", flush=True)
            ok &= passed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
