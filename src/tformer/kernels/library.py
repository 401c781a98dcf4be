"""The kernels' C library: how it is built and loaded, which instruction set it uses, and
the one table (SIGNATURES, with the structures beside it) from which every binding to it is
made. tformer.h declares the same functions and structures for the C files.

The C sources ship with the package and are compiled on first use with the system's C
compiler (`$CC`, else `cc`), into `$XDG_CACHE_HOME/tformer` (`~/.cache/tformer`), keyed by
a hash of the sources and the command. Loading a library runs its constructors before any
check can, so the kernel is built and loaded only from a directory that this user owns and
nobody else may write to, and only a library file with the same properties; where the
cache directory fails that test, a private temporary directory serves this process (and is
removed once the library is loaded). Where none of this can happen (no compiler, not x86-64
Linux with AVX2 and FMA, `TFORMER_ISA=torch` in the environment) `load()` returns None, with
one warning: fp32 decoding keeps to oneDNN, with the same results up to float rounding, and
int8 to torch's integer product, with the same results bit for bit, dropout to torch's
(with other masks) and the loss to F.cross_entropy.

Each wrapper module checks its own kernels against torch once per process (`checked`):
one whose check fails runs on torch, the others on.

The instruction set is decided once per process (`isa()`), from the CPU and the
environment variable `TFORMER_ISA`:

    avx512   the default where the CPU has AVX-512 VNNI: the int8 products use it
    avxvnni  the default where the CPU has AVX-VNNI and not AVX-512 (Intel's consumer chips
             since Alder Lake): AVX2 and the VEX-encoded byte dot product (int8_bytes.h)
    avx2     AVX2 and FMA only, even where the CPU has more: what AVX2-only CPUs (AMD before
             Zen 4, Intel's before Alder Lake) run, to test and time it anywhere
    torch    no C kernels: everything runs on torch, as where they cannot be built (Arm, no
             compiler). `TFORMER_NATIVE=0` means the same.

Every choice gives the same int8 bits (int8.py's check sets the level back to AVX2 where a
higher one computes wrong). Only the kernels' own instructions follow the switch: torch's,
oneDNN's and MKL's pick theirs (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS set them; benchmarks/README.md uses all four).

The kernels thread with OpenMP. Linked after torch (whose Linux builds use GNU OpenMP), the
library resolves to the runtime torch already loaded and shares its threads; each call
uses `torch.get_num_threads()` of them.
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
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from tformer.errors import TformerError

log = logging.getLogger(__name__)

ISAS = ("avx512", "avxvnni", "avx2", "torch")
"""TFORMER_ISA's values (see the module's text)."""
ISA_NAMES = {"avx512": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2", "torch": "torch"}
"""How tables name them."""
SOURCES = [Path(__file__).with_name(name)
           for name in ("fp32.c", "int8.c", "int8_packed.c", "quantize.c", "kinds.c", "search.c",
                        "attend.c", "step.c", "dropout.c", "xent.c", "glu.c", "rmsnorm.c",
                        "blocks.c", "kquants.c", "experts.c")]
"""Built into one library: the weight formats' products (fp32.c, int8.c, int8_packed.c,
quantize.c, blocks.c and kquants.c for llama.cpp's blocks, and kinds.c's table of them),
beam search's candidates (search.py), a decoding step's attention (attend.py) and whole
decoder layer (step.py), and for training, dropout (dropout.py), the cross-entropy
(xent.py), SwiGLU's gate (glu.py) and RMSNorm (rmsnorm.py); a mixture of experts' feed-forward
for a few rows (experts.py)."""
HEADERS = [Path(__file__).with_name(name)
           for name in ("tformer.h", "vecmath.h", "int8.h", "int8_bytes.h", "int8_bytes_rows.h",
                        "int8_bytes_packed.h", "blocks_isa.h", "kquants_isa.h",
                        "kquants_rows.h", "attend_tile.h")]
"""Included by the sources: part of the key the built library is cached under."""
PRIVATE_PREFIX = "tformer-kernel-"
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
         "-Werror=missing-prototypes", "-Werror=implicit-function-declaration"]
"""The build's flags; the last two make a function defined without tformer.h's declaration,
or called without one, an error of the build itself."""


class Unavailable(Exception):
    """The library cannot be built or loaded here; the message says why."""


def requested_isa() -> str | None:
    """TFORMER_ISA's value (TFORMER_NATIVE=0: "torch"), or None where it is not set."""
    if os.environ.get("TFORMER_NATIVE", "1") == "0":
        return "torch"
    want = os.environ.get("TFORMER_ISA", "").strip().lower() or None
    if want is not None and want not in ISAS:
        raise TformerError(f"TFORMER_ISA={want!r}: use one of {', '.join(ISAS)}")
    return want


def compiler() -> str | None:
    """The C compiler the kernels are built with: `$CC`, else `cc`, else `gcc`; None where
    there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(base) / "tformer"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(path)
        return path
    except (OSError, Unavailable) as e:
        log.info("not building the kernel in %s (%s): using a private temporary directory",
                 path, e)
    # mkdtemp makes a new directory only this user can enter, under a name nobody can guess.
    return Path(tempfile.mkdtemp(prefix=PRIVATE_PREFIX))


def check_private(path: Path, *, directory: bool = True) -> None:
    """Raise Unavailable unless `path` is a real directory (or file) owned by this user that
    neither its group nor others may write."""
    info = os.lstat(path)
    kind = stat.S_ISDIR if directory else stat.S_ISREG
    if not kind(info.st_mode):
        raise Unavailable(f"{path} is not a plain {'directory' if directory else 'file'}")
    if info.st_uid != os.geteuid():
        raise Unavailable(f"{path} belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unavailable(f"others may write to {path}")


BUILD_SECONDS = 300
"""How long a whole build (every source and the link) may take: about 20 s on two idle
cores, many times that on busy ones."""


def compile_library(compiler: str, library: Path) -> None:
    """Build the library at `library`: each source compiled to an object file on its own
    (`-c`, FLAGS without -shared), several at a time, then the objects linked with FLAGS.

    Every user's first run waits for this. One `cc` call for all the sources compiled
    them one after another, about 40 s of one core (blocks.c and kquants.c about 10 s each,
    int8.c 8 s); a thread pool of min(sources, CPUs) compilers, the largest sources first
    (so that the slow ones do not start last), takes about half that on two cores. Measured
    as `library.load()` in an empty cache, under `nice` on a busy two-core machine (so only
    indicative): 32 to 44 s in one call, 20 to 32 s so."""
    # Everything is written in a private temporary folder beside the library, and the
    # library renamed out of it: a process that finds the library finds all of it, even
    # while another one is compiling, and the folder goes whatever happens.
    deadline = time.monotonic() + BUILD_SECONDS
    work = Path(tempfile.mkdtemp(dir=library.parent, prefix=".build-", suffix=".tmp"))
    tmp = work / library.name

    def run(cmd: list[str]) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(cmd, BUILD_SECONDS)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except OSError as e:
            raise Unavailable(f"{' '.join(cmd)} failed: {e}") from None
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed: {done.stderr.strip()[:500]}")

    flags = [flag for flag in FLAGS if flag != "-shared"]
    sources = sorted(SOURCES, key=lambda path: path.stat().st_size, reverse=True)
    objects = [str(work / f"{source.stem}.o") for source in sources]
    try:
        with ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1)) as pool:
            builds = [pool.submit(run, [compiler, *flags, "-c", str(source), "-o", obj])
                      for source, obj in zip(sources, objects, strict=True)]
            wait(builds, return_when=FIRST_EXCEPTION)
            for build in builds:  # after a failure, the sources not yet started never are
                build.cancel()
        for build in builds:
            if not build.cancelled():
                build.result()  # the first failure, if any
        run([compiler, *FLAGS, *objects, "-o", str(tmp)])
        os.chmod(tmp, 0o755)  # whatever the umask: nobody else may write it
        os.replace(tmp, library)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"compiling took over {BUILD_SECONDS} s (a machine this busy "
                          f"builds them at the next start)") from None
    except OSError as e:
        raise Unavailable(f"building {library} failed: {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def library_name(compiler: str) -> str:
    """The file a build of these sources with `compiler` is cached as: keyed by a hash of
    the sources, the compiler and its flags."""
    source = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    return f"tformer-{key}.so"


# --- The structures of tformer.h, field for field ------------------------------------------

(KIND_FP32, KIND_INT8, KIND_Q8_0, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q4_K,
 KIND_Q5_K, KIND_Q6_K, KIND_STACK, KIND_IQ4_XS) = range(12)
"""tformer.h's enum tformer_kind: a weight format's tag (formats.py's `kind`)."""

_p, _long, _i32, _int, _float = (ctypes.c_void_p, ctypes.c_long, ctypes.c_int32, ctypes.c_int,
                                 ctypes.c_float)


class Linear(ctypes.Structure):
    """struct tformer_linear: a linear layer in one of the weight formats (its `kind`)."""

    _fields_ = [("kind", _i32), ("n_out", _i32), ("n_in", _i32), ("data", _p), ("scales", _p),
                ("bias", _p), ("packed", _p), ("packed_sums", _p), ("layout", _i32),
                ("packed_min_rows", _i32)]


class BoundLinear(NamedTuple):
    """A linear layer as step.c reads it: the structure, the most rows the step gives it
    (beyond that the layer's own kernels do better), and the tensors the structure points
    into, held for as long as it is used. A weight format's module makes it
    (`tformer_linear()`; fp32.bound_linear for plain fp32 weights)."""

    struct: Linear
    max_rows: int
    tensors: tuple[Tensor, ...]


class Norm(ctypes.Structure):
    """struct tformer_norm: a LayerNorm (kind 0) or an RMSNorm (1)."""

    _fields_ = [("weight", _p), ("bias", _p), ("eps", _float), ("kind", _int)]


class DecoderLayer(ctypes.Structure):
    """struct tformer_decoder_layer."""

    _fields_ = [*((name, Linear) for name in
                  ("qkv", "self_out", "cross_q", "cross_out", "up", "down")),
                *((name, Norm) for name in ("self_norm", "cross_norm", "ff_norm")),
                ("heads", _long), ("d_head", _long), ("d_value", _long),
                ("scale", _float), ("pre_norm", _int), ("activation", _int)]


class LMLayer(ctypes.Structure):
    """struct tformer_lm_layer."""

    _fields_ = [*((name, Linear) for name in ("qkv", "out", "gate", "up", "down")),
                *((name, Norm) for name in ("attn_norm", "ff_norm", "q_norm", "k_norm")),
                *((name, _long) for name in ("heads", "kv_heads", "d_head", "d_value",
                                             "rotated")),
                ("interleaved", _int), ("scale", _float), ("pre_norm", _int),
                ("activation", _int), ("moe", _p)]


class Activations(ctypes.Structure):
    """struct tformer_activations: rows rounded once for a kind's products of row ranges."""

    _fields_ = [("x", _p), ("m", _long), ("k", _long), ("activation", _i32), ("data", _p)]


class Experts(ctypes.Structure):
    """struct tformer_experts: a mixture's experts, each projection a Linear of its own."""

    _fields_ = [("gate", _p), ("up", _p), ("down", _p), ("n_expert", ctypes.c_int64),
                ("glu", _i32), ("limit", _float), ("alpha", _float),
                *((name, Linear) for name in ("shared_gate", "shared_up", "shared_down")),
                ("shared_scale", _p)]


class Router(ctypes.Structure):
    """struct tformer_router: a mixture's fp32 scores and how it picks and weights k."""

    _fields_ = [("scores", Linear), ("k", _i32), ("after", _i32), ("renormalise", _i32)]


class Moe(ctypes.Structure):
    """struct tformer_moe: a mixture's router and experts."""

    _fields_ = [("router", Router), ("experts", Experts)]


class KV(ctypes.Structure):
    """struct tformer_kv: keys and values with their strides in floats (the keys' components
    k_comp apart, the values' contiguous)."""

    _fields_ = [("k", _p), ("v", _p), ("rows", _long),
                *((f"k_{axis}", _long) for axis in ("row", "head", "pos", "comp")),
                *((f"v_{axis}", _long) for axis in ("row", "head", "pos"))]

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> KV:
        """The structure for (rows, heads, positions, ·) keys and values, the values' last
        axis contiguous."""
        return cls(k.data_ptr(), v.data_ptr(), k.shape[0], *k.stride(), *v.stride()[:3])


# --- Every function of tformer.h: its result and its arguments ------------------------------

_u32p = ctypes.POINTER(ctypes.c_uint32)
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    # the formats' table (kinds.c)
    "tformer_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    "tformer_kind_name": (ctypes.c_char_p, [_int]),
    "tformer_kind_geometry": (_int, [_int, _p]),
    "tformer_quantize": (_int, [_int, _p, _long, _p, _int]),
    "tformer_repacked_size": (_long, [_int, _long, _long]),
    "tformer_repack": (_int, [_int, _p, _long, _long, _p]),
    "tformer_repack_call_rows": (_long, []),
    "tformer_repack_slice_bytes": (_long, [_long]),
    "tformer_stack_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    # fp32 (fp32.c)
    "tformer_matvec": (None, [_p] * 4 + [_long] * 3 + [_int]),
    "tformer_fp32_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    # int8 (int8.c, int8_packed.c, quantize.c)
    "tformer_isa": (_int, [_int]),
    "tformer_avx2_method": (_int, [_int]),
    "tformer_matvec_int8": (_int, [_p] * 6 + [_long] * 3 + [_int]),
    "tformer_linear_int8": (_int, [_p] * 5 + [_long] * 3 + [_int]),
    "tformer_int8_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    "tformer_pack_layout": (_int, []),
    "tformer_packed_int8_size": (_long, [_long] * 2 + [_int]),
    "tformer_pack_int8": (None, [_p, _long, _long, _p, _p, _int]),
    "tformer_gemm_int8": (_int, [_p] * 7 + [_long] * 3 + [_int] * 2),
    "tformer_linear_int8_packed": (_int, [_p] * 6 + [_long] * 3 + [_int] * 2),
    "tformer_quantize_rows": (None, [_p] * 3 + [_long] * 2),
    "tformer_scale_int8": (None, [_p] * 4 + [_long] * 2 + [_int]),
    # llama.cpp's blocks (blocks.c)
    "tformer_blocks_isa": (_int, [_int]),
    "tformer_blocks_linear": (_int, [_int, _p, _long, _p, _long, _long, _p, _p, _int]),
    "tformer_blocks_kind_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    "tformer_quantize_blocks": (_int, [_int, _p, _long, _p, _int]),
    "tformer_blocks_repacked_size": (_long, [_int, _long, _long]),
    "tformer_blocks_repack": (_int, [_int, _p, _long, _long, _p]),
    "tformer_kquants_repacked_size": (_long, [_int, _long, _long]),
    "tformer_kquants_repack": (_int, [_int, _p, _long, _long, _p]),
    "tformer_blocks_repacked_linear": (_int, [_int, _p, _long, _p, _long, _long, _p, _p, _int]),
    # llama.cpp's K super-blocks (kquants.c)
    "tformer_kquants_linear": (_int, [ctypes.POINTER(Linear), _p, _p, _long, _int]),
    "tformer_quantize_k": (_int, [_int, _p, _long, _p, _int]),
    # decoding (attend.c, search.c, step.c)
    "tformer_attend_step": (_int, [_p, _long] + ([_p] + [_long] * 3) * 2 + [_p] + [_long] * 2
                            + [_p, _long, _p] + [_long] * 8 + [_float, _int]),
    "tformer_attend_paged": (_int, [_p, _long, ctypes.POINTER(KV), _p, _long, _long, _p, _p,
                                    _long, _p] + [_long] * 6 + [_float, _float, _p, _int]),
    "tformer_top_logprobs": (None, [_p] * 3 + [_int] + [_p] * 2 + [_long] * 2 + [_int] * 2),
    "tformer_decoder_layer_scratch": (_long, [ctypes.POINTER(DecoderLayer)]),
    "tformer_decoder_layer_step": (_int, [ctypes.POINTER(DecoderLayer), _p, _long,
                                          ctypes.POINTER(KV), _long, _p, _long,
                                          ctypes.POINTER(KV), _long, _p, _long, _p, _int]),
    "tformer_decoder_layer_step_paged": (_int, [ctypes.POINTER(DecoderLayer), _p, _long,
                                                ctypes.POINTER(KV), _p, _long, _long, _p,
                                                ctypes.POINTER(KV), _long, _p, _long, _p,
                                                _int]),
    "tformer_lm_layer_scratch": (_long, [ctypes.POINTER(LMLayer)]),
    "tformer_lm_step": (_int, [ctypes.POINTER(ctypes.POINTER(LMLayer)),
                               ctypes.POINTER(ctypes.POINTER(KV)), _long, _p, _long, _long,
                               _long, _p, _p, _p, _long, _p, _int]),
    "tformer_lm_layer_step": (_int, [ctypes.POINTER(LMLayer), _p, _long, _long,
                                     ctypes.POINTER(KV), _long, _p, _p, _p, _long, _p, _int]),
    "tformer_lm_step_paged": (_int, [ctypes.POINTER(ctypes.POINTER(LMLayer)),
                                     ctypes.POINTER(ctypes.POINTER(KV)), _long, _p, _long,
                                     _long, _p, _long, _long, _p, _long, _p, _p, _p, _int]),
    # row ranges over activations rounded once (kinds.c, blocks.c), a mixture's experts
    # (experts.c)
    "tformer_round_activations": (_int, [ctypes.POINTER(Activations), _int, _p, _long, _long,
                                         _int]),
    "tformer_free_activations": (None, [ctypes.POINTER(Activations)]),
    "tformer_linear_rows": (_int, [ctypes.POINTER(Linear), ctypes.POINTER(Activations)]
                            + [_long] * 2 + [_p]
                            + [_long] * 3),
    "tformer_blocks_round": (_p, [_p, _long, _long, _int]),
    "tformer_blocks_round_free": (None, [_p]),
    "tformer_blocks_rows": (_int, [ctypes.POINTER(Linear), _p] + [_long] * 2 + [_p]
                            + [_long] * 3),
    "tformer_experts_step": (_int, [ctypes.POINTER(Experts), _p, _long, _p, _p, _long, _p,
                                    _int]),
    "tformer_route": (_int, [ctypes.POINTER(Router), _p, _long, _p, _p, _int]),
    "tformer_moe_step": (_int, [ctypes.POINTER(Moe), _p, _long, _p, _int]),
    # training (dropout.c, xent.c, glu.c, rmsnorm.c)
    "tformer_philox4x32": (None, [_u32p] * 3),
    "tformer_dropout": (None, [_p] * 2 + [_long, ctypes.c_uint64, ctypes.c_uint32, _float,
                                          _int]),
    "tformer_xent_forward": (None, [_p] * 2 + [_long, _long, _float, ctypes.c_int64]
                             + [_p] * 2 + [_int]),
    "tformer_xent_backward": (None, [_p] * 4 + [_long, _long, _float, ctypes.c_int64, _p,
                                     _int]),
    "tformer_silu_mul_forward": (None, [_p] * 3 + [_long, _int]),
    "tformer_silu_mul_backward": (None, [_p] * 5 + [_long, _int]),
    "tformer_rms_norm_forward": (None, [_p, _p, _long, _long, _float, _p, _p, _int]),
    "tformer_rms_norm_backward": (None, [_p] * 4 + [_long, _long, _p, _p, _int]),
}
"""tformer.h's functions as ctypes calls them (tests/kernels/test_library.py checks that
the two name the same functions)."""

# --- Instruction sets ------------------------------------------------------------------------

ISA_AVX2, ISA_AVX512_VNNI, ISA_AVX_VNNI = 1, 2, 4
"""tformer.h's TFORMER_ISA_*: the instruction set the int8 products use (and the layout
their packed weights have: int8_packed.py)."""
ISA_LEVELS = {"avx512": ISA_AVX512_VNNI, "avxvnni": ISA_AVX_VNNI, "avx2": ISA_AVX2}
"""TFORMER_ISA's kernel instruction sets: tformer_isa's level for each."""


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library with every function of SIGNATURES declared and the instruction
    set chosen, or None (with the reason logged) where it is not available. Its wrapper
    modules take it through `checked`, which runs their self-checks."""
    try:
        return _load(requested_isa())
    except Unavailable as e:
        log.warning("tformer's C kernels are not in use (%s): everything runs on torch", e)
        return None


def _load(want: str | None) -> ctypes.CDLL:
    if want == "torch":
        off = os.environ.get("TFORMER_NATIVE") == "0"
        raise Unavailable("TFORMER_NATIVE=0" if off else "TFORMER_ISA=torch")
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise Unavailable(f"written for x86-64 Linux, not {sys.platform} {platform.machine()}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise Unavailable("the CPU lacks AVX2")
    cc = compiler()
    if cc is None:
        raise Unavailable("no C compiler (set $CC)")
    directory = cache_dir()
    library = directory / library_name(cc)
    try:
        if not library.exists():
            compile_library(cc, library)
        # Checked again right before loading: the directory may have changed since.
        check_private(directory)
        check_private(library, directory=False)
        lib = ctypes.CDLL(str(library))
    except OSError as e:
        raise Unavailable(f"cannot load {library}: {e}") from None
    finally:
        if directory.name.startswith(PRIVATE_PREFIX):
            shutil.rmtree(directory, ignore_errors=True)  # a loaded library stays mapped
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    # The best instruction set the CPU has, at most the one asked for.
    order = ["avx512", "avxvnni", "avx2"]
    wanted = order[order.index(want):] if want in order else order
    best = next(name for name in wanted if lib.tformer_isa(ISA_LEVELS[name]) == ISA_LEVELS[name])
    if want not in (None, best):
        log.warning("TFORMER_ISA=%s: this CPU lacks %s; using %s", want, ISA_NAMES[want],
                    ISA_NAMES[best])
    return lib


SELF_CHECKS: list[Callable[[ctypes.CDLL], bool]] = []
"""Every wrapper module's check of its own kernels against torch (`self_check`), in the
order the modules were imported."""
_PASSED: dict[Callable[[ctypes.CDLL], bool], tuple[ctypes.CDLL, bool]] = {}


def self_check(check: Callable[[ctypes.CDLL], bool]) -> Callable[[ctypes.CDLL], bool]:
    """Decorator: `check` (True where the module's kernels compute what torch does) joins
    SELF_CHECKS, which `checked` runs."""
    SELF_CHECKS.append(check)
    return check


def checked(check: Callable[[ctypes.CDLL], bool]) -> ctypes.CDLL | None:
    """The library, where load() has one and the wrapper module's `check` passed on it;
    else None, and that module runs on torch. The first call for a library loaded runs
    every registered check at once (as a loaded library's first use, not amid a module's
    later work: a decoding step, a counted region), and one that joins later at its first
    call; after that, one dictionary lookup.

    The checks draw random tensors from a fork of torch's generator: training loads the
    library at its first dropout, and a run resumed from a checkpoint must draw the same
    random numbers as one that never stopped. They compare with torch in fp32, whatever
    autocast a caller has on: the first check may come in a bf16 training step."""
    lib = load()
    if lib is None:
        return None
    done = _PASSED.get(check)
    if done is None or done[0] is not lib:
        for each in dict.fromkeys([*SELF_CHECKS, check]):
            if _PASSED.get(each, (None,))[0] is not lib:
                _run(each, lib)
        done = _PASSED[check]
    return lib if done[1] else None


def check_all() -> ctypes.CDLL | None:
    """load(), and every registered self-check run on it now rather than at a module's
    first use (for a measurement that must not count them)."""
    lib = load()
    for check in SELF_CHECKS:
        checked(check)
    return lib


def _run(check: Callable[[ctypes.CDLL], bool], lib: ctypes.CDLL) -> None:
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False):
        passed = bool(check(lib))
    _PASSED[check] = (lib, passed)
    if not passed:
        log.warning("tformer's C kernels computed wrong in %s.%s: it runs on torch",
                    check.__module__, check.__qualname__)
