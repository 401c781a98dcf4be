"""Hand-written kernels for the products of a few rows that decoding makes, with fp32 or
int8 weights.

At batch 1 a GPT decoding step multiplies one row by every weight matrix, and beam search
at batch 1 multiplies four. The library kernels are built for larger products: oneDNN's
prepacked one (prepack.py) streams a 768 x 3072 matrix at some 21 GB/s against the 28-31
GB/s that a plain sum reads, and every call costs it ~30 us however small the matrix, a
third of a beam step at d_model 256. `matvec.c` streams the weights at about the sum's rate
and costs ~5 us a call (benchmarks/speed.py measures both effects end to end). The same
kernel reads int8 weights with one scale per row (quantize.py), a quarter of the bytes.

The C source ships with the package and is compiled on first use with the system's C
compiler (`$CC`, else `cc`), into `$XDG_CACHE_HOME/tformer` (`~/.cache/tformer`), keyed by
a hash of the source and the command. Loading a library runs its constructors before any
check can, so the kernel is built and loaded only from a directory that this user owns and
nobody else may write to, and only a library file with the same properties; where the
cache directory fails that test, a private temporary directory serves this process (and is
removed once the library is loaded). Where none of this can happen (no compiler, not x86-64
Linux with AVX2 and FMA, `TFORMER_NATIVE=0` in the environment) `load()` returns None:
fp32 decoding keeps to oneDNN, with the same results up to float rounding, and `--int8`
to PyTorch's dynamic quantization.

The kernel threads with OpenMP. Linked after torch (whose Linux builds use GNU OpenMP), it
resolves to the runtime torch already loaded and shares its threads; it uses
`torch.get_num_threads()` of them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

MAX_ROWS = 4
"""PackedLinear sends products of up to this many rows here. The kernel takes any number,
four at a time, but from about eight rows on oneDNN's matrix-matrix kernels catch up."""
_SOURCE = Path(__file__).with_name("matvec.c")
_PRIVATE_PREFIX = "tformer-kernel-"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged) where it is not available."""
    try:
        return _load()
    except _Unavailable as e:
        log.info("decoding kernel not built: %s", e)
        return None


class _Unavailable(Exception):
    pass


def _load() -> ctypes.CDLL:
    if os.environ.get("TFORMER_NATIVE", "1") == "0":
        raise _Unavailable("TFORMER_NATIVE=0")
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise _Unavailable(f"written for x86-64 Linux, not {sys.platform} {platform.machine()}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise _Unavailable("the CPU lacks AVX2")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise _Unavailable("no C compiler (set $CC)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode()).hexdigest()[:16]
    directory = _cache_dir()
    library = directory / f"matvec-{key}.so"
    try:
        if not library.exists():
            _compile(compiler, library)
        # Checked again right before loading: the directory may have changed since.
        check_private(directory)
        check_private(library, directory=False)
        lib = ctypes.CDLL(str(library))
    except OSError as e:
        raise _Unavailable(f"cannot load {library}: {e}") from None
    finally:
        if directory.name.startswith(_PRIVATE_PREFIX):
            shutil.rmtree(directory, ignore_errors=True)  # a loaded library stays mapped
    lib.tformer_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec.restype = None
    lib.tformer_matvec_int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec_int8.restype = None
    # A last check that the build computes what it should, on every path of the kernel:
    # 1 to 5 rows, a remainder of rows of W, and a remainder of the inner dimension.
    w, b = torch.randint(-127, 128, (11, 21), dtype=torch.int8), torch.randn(11)
    scale = torch.rand(11) / 64  # products of order 1
    dequantized = w.float() * scale[:, None]
    for m in range(1, 6):
        x = torch.randn(m, 21)
        want = F.linear(x, dequantized, b)
        fp32, int8 = _call(lib, x, dequantized, None, b), _call(lib, x, w, scale, b)
        if not (torch.allclose(fp32, want, atol=1e-4) and torch.allclose(int8, want, atol=1e-4)):
            raise _Unavailable(f"{library} computed a wrong product")
    return lib


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "tformer"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(path)
        return path
    except (OSError, _Unavailable) as e:
        log.info("not building the kernel in %s (%s): using a private temporary directory",
                 path, e)
    # mkdtemp makes a new directory only this user can enter, under a name nobody can guess.
    return Path(tempfile.mkdtemp(prefix=_PRIVATE_PREFIX))


def check_private(path: Path, *, directory: bool = True) -> None:
    """Raise _Unavailable unless `path` is a real directory (or file) owned by this user that
    neither its group nor others may write."""
    info = os.lstat(path)
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(info.st_mode):
        raise _Unavailable(f"{path} is not a plain {'directory' if directory else 'file'}")
    if info.st_uid != os.geteuid():
        raise _Unavailable(f"{path} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Unavailable(f"others may write to {path}")


def _compile(compiler: str, library: Path) -> None:
    # Build under a temporary name and rename: a process that finds the library finds all
    # of it, even while another one is compiling.
    fd, tmp = tempfile.mkstemp(dir=library.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise _Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)  # whatever the umask: nobody else may write it
        os.replace(tmp, library)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _Unavailable(f"{' '.join(cmd)} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _call(
    lib: ctypes.CDLL, x: Tensor, weight: Tensor, scale: Tensor | None, bias: Tensor | None
) -> Tensor:
    m, (n, k) = x.shape[0], weight.shape
    y = x.new_empty(m, n)
    bias_ptr = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if scale is None:
        lib.tformer_matvec(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k,
                           threads)
    else:
        lib.tformer_matvec_int8(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), bias_ptr,
                                y.data_ptr(), m, n, k, threads)
    return y


def fits_kernel(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None) -> bool:
    """Whether the kernel can compute this product: it reads raw pointers as fp32 (int8
    weights with fp32 scales) in row-major order, so any other dtype, device, layout or shape
    would give garbage or write past the output."""
    n, k = weight.shape if weight.dim() == 2 else (-1, -1)
    vectors = [t for t in (bias, scale) if t is not None]
    return (
        x.dtype == torch.float32
        and x.shape[-1:] == (k,)
        and weight.dtype == (torch.float32 if scale is None else torch.int8)
        and weight.is_contiguous()
        and all(t.dtype == torch.float32 and t.shape == (n,) and t.is_contiguous()
                for t in vectors)
        and all(t.device.type == "cpu" for t in (x, weight, *vectors))
    )


def matvec(x: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias) through the kernel, or with int8 weights and `scale`,
    F.linear(x, weight * scale[:, None], bias).

    x: (..., K) fp32; weight: (N, K), fp32 or int8, contiguous; scale, bias: (N,) fp32,
    contiguous, or None; all on the CPU. Any number of rows, but fastest for 1 to MAX_ROWS.
    Inputs the kernel cannot read (another dtype, device or layout), or no kernel, get the
    same product from torch instead.
    """
    lib = load()
    if lib is None or not fits_kernel(x, weight, bias, scale):
        full = weight if scale is None else weight.to(scale.dtype) * scale[:, None]
        return F.linear(x, full.to(x.dtype), None if bias is None else bias.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _call(lib, rows, weight, scale, bias).view(*x.shape[:-1], weight.shape[0])
