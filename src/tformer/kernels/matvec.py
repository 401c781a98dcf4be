"""Hand-written kernels for the products of a few rows that decoding makes, in fp32 or
int8.

At batch 1 a GPT decoding step multiplies one row by every weight matrix, and beam search
at batch 1 multiplies four. The library kernels are built for larger products: oneDNN's
prepacked one (prepack.py) streams a 768 x 3072 matrix at some 21 GB/s against the 28-31
GB/s that a plain sum reads, and every call costs it ~30 us however small the matrix, a
third of a beam step at d_model 256. `matvec.c` streams the weights at about the sum's rate
and costs ~5 us a call (benchmarks/speed.py measures both effects end to end). Its int8
product (quantize.py) reads a quarter of the bytes and sums in exact 32-bit integers; on
CPUs with AVX-512 VNNI, products of two to eight rows use its 8-bit dot-product
instruction, with the same sums. With AVX2 alone there are two exact ways, timed once per
process (AVX2_WIDEN, AVX2_SIGN): 16-bit multiply-adds over widened bytes, or the byte
multiply-add with x's sign moved onto the weights. Products of more rows run over a copy
of the weight packed once (pack_int8) for the chosen way (never torch._int_mm, which on
CPUs without VNNI can be many times slower than fp32's product). The same library holds
beam search's choice of candidates (`search.c`, see search.py) and, for training, dropout
(`dropout.c`, see dropout.py) and the label-smoothed cross-entropy (`xent.c`, see xent.py).

The C sources ship with the package and are compiled on first use, into a private cache
directory (kernels/build.py). Where that cannot happen (no compiler, not x86-64
Linux with AVX2 and FMA, `TFORMER_ISA=torch` in the environment) `load()` returns None, with
one warning: fp32 decoding keeps to oneDNN, with the same results up to float rounding, and
int8 to torch's integer product, with the same results bit for bit, dropout to torch's
(with other masks) and the loss to F.cross_entropy.

The instruction set is decided once per process (`isa()`), from the CPU and the
environment variable `TFORMER_ISA`:

    avx512   the default where the CPU has AVX-512 VNNI: the int8 products use it
    avxvnni  the default where the CPU has AVX-VNNI and not AVX-512 (Intel's consumer chips
             since Alder Lake): AVX2 and the VEX-encoded byte dot product (int8_bytes.h)
    avx2     AVX2 and FMA only, even where the CPU has more: what AVX2-only CPUs (AMD before
             Zen 4, Intel's before Alder Lake) run, to test and time it anywhere
    torch    no C kernels: everything runs on torch, as where they cannot be built (Arm, no
             compiler). `TFORMER_NATIVE=0` means the same.

Every choice gives the same int8 bits. Only the kernels' own instructions follow the
switch: torch's, oneDNN's and MKL's pick theirs (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS set them; benchmarks/README.md uses all four).

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
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.kernels import build
from tformer.kernels.build import ISA_NAMES

log = logging.getLogger(__name__)

MAX_ROWS = 4
"""PackedLinear sends products of up to this many rows here. The kernel takes any number,
four at a time, but from about eight rows on oneDNN's matrix-matrix kernels catch up."""
INT8_MAX_ROWS = 8
"""The few-row int8 kernel is the fast one up to about this many rows; from there the
product over packed weights (pack_int8, PACKED_MIN_ROWS) or oneDNN's int8 matrix product
(torch._int_mm, with VNNI) is faster (benchmarks/int8_rows.py). step.py gives int8 layers
without packed weights no more rows than this."""
LAYOUT_AVX2, LAYOUT_VNNI, LAYOUT_AVX2_BYTES, ISA_AVX_VNNI = 1, 2, 3, 4
"""matvec.c's ISA_AVX2 and ISA_AVX512_VNNI: the instruction set the int8 products use, and
the layout pack_int8 packs a weight in for it; AVX2_BYTES, AVX2's layout of int8 weights for
the byte products (AVX-VNNI's, and AVX2's AVX2_SIGN where load() chose it); and
ISA_AVX_VNNI, the instruction set of AVX2 with the VEX-encoded byte dot product, which packs
in AVX2_BYTES. LAYOUT_AVX2's weights are 16-bit."""
ISA_LEVELS = {"avx512": LAYOUT_VNNI, "avxvnni": ISA_AVX_VNNI, "avx2": LAYOUT_AVX2}
"""TFORMER_ISA's kernel instruction sets: matvec.c's level for each."""
AVX2_WIDEN, AVX2_SIGN = 0, 1
"""matvec.c's two AVX2 products of a few int8 rows (i8_rows_of_w; rows_of_w_sign in
int8_bytes.h): the same exact sums, by 16-bit multiply-adds over widened bytes or by the
byte multiply-add with x's sign moved onto w. Which is faster depends on the CPU's
execution ports: on an Intel Xeon with AVX-512 held to AVX2, the byte one multiplied four
rows 1.1-1.2x faster. load() times both once (_faster_avx2_method) and keeps the faster."""
PACKED_MIN_ROWS = {LAYOUT_VNNI: 2, LAYOUT_AVX2: 8, LAYOUT_AVX2_BYTES: 2}
"""linear_int8 sends products of this many rows and more to the product over packed weights
(by their layout): one row reads the weights at about the memory's rate through either
kernel; with VNNI the packed product is the faster from two rows on, as is AVX2's over
packed bytes (1.0-1.3x at two rows, 1.0-1.5x at three to eight on OPUS-MT's shapes); AVX2's
16-bit packed weights are twice the bytes the few-row kernel streams, and that product
catches up at about eight (benchmarks/int8_rows.py)."""
@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with the reason logged) where it is not available.

    The checks at load time draw random tensors, from a fork of torch's generator: training
    loads the library at its first dropout, and a run resumed from a checkpoint must draw the
    same random numbers as one that never stopped. They compare with torch in fp32, whatever
    autocast a caller has on: the first load may come in a bf16 training step."""
    try:
        with torch.random.fork_rng(devices=[]), torch.autocast("cpu", enabled=False):
            return _load(build.requested_isa())
    except build.Unavailable as e:
        log.warning("tformer's C kernels are not in use (%s): everything runs on torch", e)
        return None


def isa() -> str:
    """The instruction set this process's kernels use, one of ISAS: decided by load(), once."""
    lib = load()
    if lib is None:
        return "torch"
    level = lib.tformer_isa(-1)
    return next(name for name, value in ISA_LEVELS.items() if value == level)


def library_name(compiler: str) -> str:
    """The file a build of these sources with `compiler` is cached as: keyed by a hash of
    the sources, the compiler and its flags."""
    source = b"".join(path.read_bytes() for path in [*build.SOURCES, *build.HEADERS])
    key = hashlib.sha256(source + " ".join([compiler, *build.FLAGS]).encode()).hexdigest()[:16]
    return f"matvec-{key}.so"


def _load(want: str | None) -> ctypes.CDLL:
    if want == "torch":
        off = os.environ.get("TFORMER_NATIVE") == "0"
        raise build.Unavailable("TFORMER_NATIVE=0" if off else "TFORMER_ISA=torch")
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise build.Unavailable(
            f"written for x86-64 Linux, not {sys.platform} {platform.machine()}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise build.Unavailable("the CPU lacks AVX2")
    compiler = build.compiler()
    if compiler is None:
        raise build.Unavailable("no C compiler (set $CC)")
    directory = build.cache_dir()
    library = directory / library_name(compiler)
    try:
        if not library.exists():
            build.compile_library(compiler, library)
        # Checked again right before loading: the directory may have changed since.
        build.check_private(directory)
        build.check_private(library, directory=False)
        lib = ctypes.CDLL(str(library))
    except OSError as e:
        raise build.Unavailable(f"cannot load {library}: {e}") from None
    finally:
        if directory.name.startswith(build.PRIVATE_PREFIX):
            shutil.rmtree(directory, ignore_errors=True)  # a loaded library stays mapped
    lib.tformer_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec.restype = None
    lib.tformer_matvec_int8.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_matvec_int8.restype = ctypes.c_int
    lib.tformer_quantize_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
    lib.tformer_quantize_rows.restype = None
    lib.tformer_linear_int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.tformer_linear_int8.restype = ctypes.c_int
    lib.tformer_scale_int8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.tformer_scale_int8.restype = None
    lib.tformer_top_logprobs.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        + [ctypes.c_int] * 2
    )
    lib.tformer_top_logprobs.restype = None
    lib.tformer_packed_int8_size.argtypes = [ctypes.c_long] * 2 + [ctypes.c_int]
    lib.tformer_packed_int8_size.restype = ctypes.c_long
    lib.tformer_pack_int8.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [
        ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.tformer_pack_int8.restype = None
    lib.tformer_gemm_int8.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_long] * 3 + [
        ctypes.c_int] * 2
    lib.tformer_gemm_int8.restype = ctypes.c_int
    lib.tformer_linear_int8_packed.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [
        ctypes.c_int] * 2
    lib.tformer_linear_int8_packed.restype = ctypes.c_int
    lib.tformer_isa.argtypes = [ctypes.c_int]
    lib.tformer_isa.restype = ctypes.c_int
    lib.tformer_avx2_method.argtypes = [ctypes.c_int]
    lib.tformer_avx2_method.restype = ctypes.c_int
    lib.tformer_pack_layout.argtypes = []
    lib.tformer_pack_layout.restype = ctypes.c_int
    lib.tformer_attend_step.argtypes = (
        [ctypes.c_void_p, ctypes.c_long] + ([ctypes.c_void_p] + [ctypes.c_long] * 3) * 2
        + [ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long]
        + [ctypes.c_void_p] + [ctypes.c_long] * 8 + [ctypes.c_float, ctypes.c_int]
    )
    lib.tformer_attend_step.restype = ctypes.c_int
    lib.tformer_dropout.argtypes = [ctypes.c_void_p] * 2 + [
        ctypes.c_long, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_float, ctypes.c_int]
    lib.tformer_dropout.restype = None
    lib.tformer_philox4x32.argtypes = [ctypes.POINTER(ctypes.c_uint32)] * 3
    lib.tformer_philox4x32.restype = None
    lib.tformer_xent_forward.argtypes = [ctypes.c_void_p] * 2 + [
        ctypes.c_long, ctypes.c_long, ctypes.c_float, ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int]
    lib.tformer_xent_forward.restype = None
    lib.tformer_xent_backward.argtypes = [ctypes.c_void_p] * 4 + [
        ctypes.c_long, ctypes.c_long, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int]
    lib.tformer_xent_backward.restype = None
    # The best instruction set the CPU has, at most the one asked for; each is checked, and
    # the AVX2 path first, as it is the one left if another's fails.
    order = ["avx512", "avxvnni", "avx2"]
    wanted = order[order.index(want):] if want in order else order
    best = next(name for name in wanted if lib.tformer_isa(ISA_LEVELS[name]) == ISA_LEVELS[name])
    if want not in (None, best):
        log.warning("TFORMER_ISA=%s: this CPU lacks %s; using %s", want, ISA_NAMES[want],
                    ISA_NAMES[best])
    lib.tformer_isa(LAYOUT_AVX2)
    lib.tformer_avx2_method(AVX2_SIGN)
    sign_right = _computes_right(lib) and _packs_right(lib)
    lib.tformer_avx2_method(AVX2_WIDEN)
    if not (_computes_right(lib) and _packs_right(lib) and _picks_right(lib)
            and _attends_right(lib) and _drops_right(lib) and _xent_right(lib)):
        raise build.Unavailable(f"{library} computed a wrong product")
    if sign_right:
        lib.tformer_avx2_method(_faster_avx2_method(lib))
    else:
        log.warning("the int8 products' AVX2 byte path computed a wrong product; not using it")
    if best != "avx2":
        lib.tformer_isa(ISA_LEVELS[best])
        if not (_computes_right(lib) and _packs_right(lib)):
            lib.tformer_isa(LAYOUT_AVX2)
            log.warning("the int8 products' %s path computed a wrong product; using AVX2",
                        ISA_NAMES[best])
    level = lib.tformer_isa(-1)
    log.info("tformer's C kernels use %s",
             ISA_NAMES[next(name for name, value in ISA_LEVELS.items() if value == level)])
    return lib


def _faster_avx2_method(lib: ctypes.CDLL) -> int:
    """The faster of the AVX2 few-row int8 products on this CPU (AVX2_WIDEN or AVX2_SIGN),
    timed in alternation on what beam search at batch 1 multiplies: four rows, here by a
    1024 x 512 matrix that stays in the L2 cache. About 5 ms, once per process."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1024, 512), dtype=torch.int8, generator=g)
    xq = torch.randint(-127, 128, (4, 512), dtype=torch.int8, generator=g)
    xscale, wscale = torch.rand(4, generator=g), torch.rand(1024, generator=g)
    best = {AVX2_WIDEN: float("inf"), AVX2_SIGN: float("inf")}
    for _ in range(5):
        for method in best:
            lib.tformer_avx2_method(method)
            start = time.perf_counter()
            for _ in range(10):
                _call_int8(lib, xq, xscale, q, wscale, None)
            best[method] = min(best[method], time.perf_counter() - start)
    faster = min(best, key=best.get)
    log.info("AVX2 int8 products of a few rows: %s (%.2f against %.2f ms)",
             "bytes with the sign moved" if faster == AVX2_SIGN else "16-bit widening",
             best[faster] * 1e3, max(best.values()) * 1e3)
    return faster


def _computes_right(lib: ctypes.CDLL) -> bool:
    """A last check that the build computes what it should, on every path of the kernel:
    1 to 5 rows (one of them all zero), a remainder of rows of W, and a remainder of the
    inner dimension (of 8 for fp32, 16 or 32 for int8). Int8 rounding and products must
    equal torch's bit for bit."""
    w, b = torch.randn(11, 37), torch.randn(11)
    q, wscale = _torch_quantize_rows(w)
    for m in range(1, 6):
        x = torch.randn(m, 37)
        rows = x * torch.logspace(-3, 3, m)[:, None]  # rows of every size for the rounding
        rows[m // 2] = 0.0
        xq, xscale = _call_quantize(lib, rows)
        int8 = _call_int8(lib, xq, xscale, q, wscale, b)
        want_q = _torch_quantize_rows(rows)
        if not (torch.allclose(_call(lib, x, w, b), F.linear(x, w, b), atol=1e-4)
                and torch.equal(xq, want_q[0]) and torch.equal(xscale, want_q[1])
                and torch.equal(int8, int8_reference(xq, xscale, q, wscale, b))
                and torch.equal(_call_linear_int8(lib, rows, q, wscale, b), int8)
                and torch.equal(_int_mm_scaled(lib, xq, xscale, q, wscale, b), int8)
                and torch.equal(_int_mm_scaled(lib, xq, xscale, q, wscale, None),
                                int8_reference(xq, xscale, q, wscale, None))):
            return False
    return True


def _packs_right(lib: ctypes.CDLL) -> bool:
    """The same for the product over packed weights in the layout of the instruction set
    set now: blocks of rows and a remainder, a part panel, and k not a multiple of four."""
    w, b = torch.randn(45, 37), torch.randn(45)
    q, wscale = _torch_quantize_rows(w)
    packed = _call_pack(lib, q, lib.tformer_pack_layout())
    for m in (1, 13):
        x = torch.randn(m, 37)
        xq, xscale = _torch_quantize_rows(x)
        for bias in (b, None):
            want = int8_reference(xq, xscale, q, wscale, bias)
            if not (torch.equal(_call_gemm_int8(lib, xq, xscale, packed, wscale, bias), want)
                    and torch.equal(_call_linear_int8_packed(lib, x, packed, wscale, bias),
                                    want)):
                return False
    return True


def _picks_right(lib: ctypes.CDLL) -> bool:
    """The same for search.c: beam search's candidates as torch's log-softmax and top-k
    choose them, a vector's worth of columns and a remainder, two of them banned."""
    x, add, banned = torch.randn(3, 37), torch.randn(3), torch.tensor([0, 4])
    top, index = x.new_empty(3, 5), torch.empty(3, 5, dtype=torch.long)
    lib.tformer_top_logprobs(x.data_ptr(), add.data_ptr(), banned.data_ptr(), len(banned),
                             top.data_ptr(), index.data_ptr(), 3, 37, 5, 1)
    logprobs = F.log_softmax(x, dim=-1).index_fill_(1, banned, float("-inf"))
    want, want_index = logprobs.add_(add[:, None]).topk(5, dim=-1)
    return torch.equal(index, want_index) and torch.allclose(top, want, atol=1e-5)


def _attends_right(lib: ctypes.CDLL) -> bool:
    """The same for attend.c: three rows of four query heads sharing two key/value heads
    (d = 12: a vector's worth and a remainder) over 9 positions read through a table of
    buffer rows, against attention written out over the keys gathered in that order."""
    k, v, q = torch.randn(3, 2, 10, 12), torch.randn(3, 2, 10, 12), torch.randn(3, 4, 12)
    rows = torch.randint(0, 3, (3, 9))
    out = q.new_empty(3, 4, 12)
    lib.tformer_attend_step(q.data_ptr(), 48, k.data_ptr(), 240, 120, 12, v.data_ptr(), 240,
                            120, 12, rows.data_ptr(), 9, 1, None, 0, out.data_ptr(), 3, 3, 4,
                            2, 9, 1, 12, 12, 12**-0.5, 1)
    positions = torch.arange(9)
    keys, values = (t[rows, :, positions].transpose(1, 2).repeat_interleave(2, dim=1)
                    for t in (k, v))
    probs = ((keys @ q[..., None])[..., 0] * 12**-0.5).softmax(dim=-1)
    return torch.allclose(out, (probs[:, :, None] @ values)[:, :, 0], atol=1e-5)


def philox4x32(lib: ctypes.CDLL, counter: list[int], key: list[int]) -> list[int]:
    """dropout.c's generator on its own: the four words of Philox4x32-10 for one counter
    (four 32-bit words) and key (two), for known-answer tests and the check below."""
    out = (ctypes.c_uint32 * 4)()
    lib.tformer_philox4x32((ctypes.c_uint32 * 4)(*counter), (ctypes.c_uint32 * 2)(*key), out)
    return list(out)


def _drops_right(lib: ctypes.CDLL) -> bool:
    """The same for dropout.c: the generator's first known-answer vector (Random123's
    kat_vectors), and the mask at p = 0.5 over two blocks and a tail against the words the
    generator gives each element's counter (the layout of lanes, words and blocks)."""
    if philox4x32(lib, [0, 0, 0, 0], [0, 0]) != [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]:
        return False
    seed, n, half = 0x0123456789ABCDEF, 70, 2**31
    x, y = torch.ones(n), torch.empty(n)
    lib.tformer_dropout(x.data_ptr(), y.data_ptr(), n, seed, half, 2.0, 1)
    key = [seed & 0xFFFFFFFF, seed >> 32]
    words = [philox4x32(lib, [8 * (i // 32) + i % 8, 0, 0, 0], key)[(i % 32) // 8]
             for i in range(n)]
    return torch.equal(y, torch.tensor([2.0 if w >= half else 0.0 for w in words]))


def _xent_right(lib: ctypes.CDLL) -> bool:
    """The same for xent.c: the loss and gradient of three rows of 37 logits (a vector's
    worth and a remainder), one of them ignored, against F.cross_entropy's."""
    x, target = torch.randn(3, 37), torch.tensor([5, -100, 36])
    loss, stats = x.new_empty(3), x.new_empty(3, 2)
    lib.tformer_xent_forward(x.data_ptr(), target.data_ptr(), 3, 37, 0.1, -100, loss.data_ptr(),
                             stats.data_ptr(), 1)
    g, grad = torch.ones(3), torch.empty(3, 37)
    lib.tformer_xent_backward(x.data_ptr(), target.data_ptr(), stats.data_ptr(), g.data_ptr(), 3,
                              37, 0.1, -100, grad.data_ptr(), 1)
    want = F.cross_entropy(x, target, label_smoothing=0.1, reduction="none")
    # The gradient written out (the check may run where autograd is off).
    want_grad = x.softmax(dim=-1) - 0.1 / 37
    want_grad[[0, 2], [5, 36]] -= 0.9
    want_grad[1] = 0.0
    return torch.allclose(loss, want, atol=1e-5) and torch.allclose(grad, want_grad, atol=1e-6)


def _call(lib: ctypes.CDLL, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    m, (n, k) = x.shape[0], weight.shape
    y = x.new_empty(m, n)
    lib.tformer_matvec(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                       y.data_ptr(), m, n, k, torch.get_num_threads())
    return y


def _call_int8(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    m, (n, k) = xq.shape[0], q.shape
    y = xscale.new_empty(m, n)
    if lib.tformer_matvec_int8(xq.data_ptr(), xscale.data_ptr(), q.data_ptr(), wscale.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                               torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def _call_quantize(lib: ctypes.CDLL, x: Tensor) -> tuple[Tensor, Tensor]:
    m, k = x.shape
    xq, xscale = x.new_empty(m, k, dtype=torch.int8), x.new_empty(m)
    lib.tformer_quantize_rows(x.data_ptr(), xq.data_ptr(), xscale.data_ptr(), m, k)
    return xq, xscale


def _call_linear_int8(
    lib: ctypes.CDLL, x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    m, (n, k) = x.shape[0], q.shape
    y = x.new_empty(m, n)
    if lib.tformer_linear_int8(x.data_ptr(), q.data_ptr(), wscale.data_ptr(),
                               None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                               torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


class PackedInt8(NamedTuple):
    """An int8 weight (N x K) in the layout of the many-row product (tformer_pack_int8) for
    an instruction set (LAYOUT_AVX2 or LAYOUT_VNNI), with the sum of each of its rows, and
    the fewest rows linear_int8 gives that product."""

    data: Tensor
    row_sums: Tensor
    layout: int
    min_rows: int


def _call_pack(lib: ctypes.CDLL, q: Tensor, layout: int) -> PackedInt8:
    n, k = q.shape
    packed = PackedInt8(
        torch.empty(lib.tformer_packed_int8_size(n, k, layout), dtype=torch.int8),
        torch.empty(n, dtype=torch.int32), layout, PACKED_MIN_ROWS[layout])
    lib.tformer_pack_int8(q.data_ptr(), n, k, packed.data.data_ptr(), packed.row_sums.data_ptr(),
                          layout)
    return packed


def _call_gemm_int8(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, packed: PackedInt8, wscale: Tensor,
    bias: Tensor | None,
) -> Tensor:
    (m, k), n = xq.shape, wscale.shape[0]
    y = xscale.new_empty(m, n)
    if lib.tformer_gemm_int8(xq.data_ptr(), xscale.data_ptr(), packed.data.data_ptr(),
                             packed.row_sums.data_ptr(), wscale.data_ptr(),
                             None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
                             packed.layout, torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def _call_linear_int8_packed(
    lib: ctypes.CDLL, x: Tensor, packed: PackedInt8, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """_call_gemm_int8 over x's rows rounded by the kernel: one call, as _call_linear_int8."""
    (m, k), n = x.shape, wscale.shape[0]
    y = x.new_empty(m, n)
    if lib.tformer_linear_int8_packed(x.data_ptr(), packed.data.data_ptr(),
                                      packed.row_sums.data_ptr(), wscale.data_ptr(),
                                      None if bias is None else bias.data_ptr(), y.data_ptr(), m,
                                      n, k, packed.layout, torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} int8 rows")
    return y


def pack_int8(q: Tensor) -> PackedInt8 | None:
    """q (N x K int8, contiguous, on the CPU) packed for linear_int8's products of many rows
    with this process's instruction set, or None where there is no kernel."""
    lib = load()
    if lib is None:
        return None
    return _call_pack(lib, q.contiguous(), lib.tformer_pack_layout())


def _int_mm_scaled(
    lib: ctypes.CDLL, xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """int8_reference's product, the scaling done by the kernel: one pass over the sums,
    in place, instead of torch's four."""
    acc = integer_product(xq, q).contiguous()
    m, n = acc.shape
    lib.tformer_scale_int8(acc.data_ptr(), xscale.data_ptr(), wscale.data_ptr(),
                           None if bias is None else bias.data_ptr(), m, n,
                           torch.get_num_threads())
    return acc.view(torch.float32)


def _torch_quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    scale = x.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) fp32 as int8 rows with one fp32 scale per row, x[i] ~ xq[i] * scale[i]:
    scale = max |x[i]| / 127 (1 for an all-zero row), xq[i] = x[i] / scale rounded half to
    even. Through the kernel where it is built (one call instead of five torch operations),
    with the same bits as torch's formula."""
    lib = load()
    if lib is None or not (x.dtype == torch.float32 and x.device.type == "cpu"
                           and x.dim() == 2 and x.is_contiguous()):
        return _torch_quantize_rows(x)
    return _call_quantize(lib, x)


def int8_reference(
    xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """(xq q^T) * (xscale wscale^T) + bias through torch: the integer product exact
    (integer_product), then the same fp32 operations, in the same order, as the kernel's."""
    y = integer_product(xq, q).float().mul_(xscale[:, None] * wscale)
    return y if bias is None else y.add_(bias)


def scaled_integer_product(
    xq: Tensor, xscale: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None
) -> Tensor:
    """int8_reference's result, bit for bit, for q (N x K) int8 or a transposed view of
    one, the scaling done in place by the kernel where it is built (Int8Linear's training
    twin, quantize.FrozenInt8Linear, multiplies by W and by W^T)."""
    lib = load()
    if lib is None:
        return int8_reference(xq, xscale, q, wscale, bias)
    return _int_mm_scaled(lib, xq, xscale, q, wscale, bias)


EXACT_K = 1040
"""fp32 sums of this many int8 products are exact: every partial sum is an integer below
1040 * 127^2 < 2^24, which fp32 holds exactly, whatever order a matmul adds them in."""


def integer_product(xq: Tensor, q: Tensor) -> Tensor:
    """xq q^T (M x N int32) for int8 xq (M x K) and q (N x K), summed exactly, through torch:
    torch._int_mm where it is exact and the faster (_int_mm_serves), else fp32 products of
    slices of EXACT_K columns, each exact, added as integers."""
    if _int_mm_serves():
        return torch._int_mm(xq, q.t())
    return _float_integer_product(xq, q)


def _float_integer_product(xq: Tensor, q: Tensor) -> Tensor:
    k = xq.shape[1]
    total = None
    for start in range(0, max(k, 1), EXACT_K):
        part = F.linear(xq[:, start:start + EXACT_K].float(), q[:, start:start + EXACT_K].float())
        part = part.to(torch.int32)
        total = part if total is None else total.add_(part)
    return total


@functools.cache
def _int_mm_serves() -> bool:
    """Whether torch._int_mm sums exactly, and no slower than _float_integer_product, on
    this CPU: decided once, on a product of 64 rows with the largest terms int8 makes. Where
    the CPU lacks VNNI, oneDNN's int8 product can sum pairs of unsigned-by-signed products
    in saturating 16-bit lanes (vpmaddubsw), and off by millions; or be exact but many
    times slower than fp32's product."""
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=g)
    q = torch.randint(-127, 128, (256, 256), dtype=torch.int8, generator=g)
    xq[0], xq[1], q[0] = 127, -127, 127
    try:
        if not torch.equal(torch._int_mm(xq, q.t()).long(), xq.long() @ q.long().t()):
            log.info("torch._int_mm does not sum exactly here: int8 products through fp32")
            return False
    except RuntimeError:
        return False

    def fastest(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn(xq, q)
            times.append(time.perf_counter() - start)
        return min(times)

    return fastest(lambda a, b: torch._int_mm(a, b.t())) <= fastest(_float_integer_product)


def fits_kernel(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether the kernel can compute this product: it reads raw pointers as fp32 in
    row-major order, so any other dtype, device, layout or shape would give garbage or
    write past the output."""
    n, k = weight.shape if weight.dim() == 2 else (-1, -1)
    return (
        x.dtype == torch.float32
        and x.shape[-1:] == (k,)
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                              and bias.is_contiguous()))
        and all(t.device.type == "cpu" for t in (x, weight, bias) if t is not None)
    )


def matvec(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) through the kernel.

    x: (..., K) fp32; weight: (N, K) fp32, contiguous; bias: (N,) fp32, contiguous, or
    None; all on the CPU. Any number of rows, but fastest for 1 to MAX_ROWS. Inputs the
    kernel cannot read (another dtype, device or layout), or no kernel, get the same product
    from torch instead.
    """
    lib = load()
    if lib is None or not fits_kernel(x, weight, bias):
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _call(lib, rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def fits_int8_kernel(q: Tensor, wscale: Tensor, bias: Tensor | None) -> bool:
    """Whether linear_int8's kernels can read this weight side: q (N, K) int8, wscale (N,)
    fp32, bias (N,) fp32 or None, contiguous and on the CPU."""
    n = q.shape[0]
    return (q.dtype == torch.int8 and wscale.dtype == torch.float32 and wscale.shape == (n,)
            and q.is_contiguous() and wscale.is_contiguous() and q.device.type == "cpu"
            and wscale.device.type == "cpu"
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)
                                  and bias.is_contiguous() and bias.device.type == "cpu")))


def linear_int8(
    x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None, packed: PackedInt8 | None = None
) -> Tensor:
    """y = x W^T + b with x's rows and W rounded to int8 (quantize_rows; W as q and wscale):
    (xq q^T) * (xscale wscale^T) + bias, summed exactly. From `packed.min_rows` rows on
    (PACKED_MIN_ROWS), through the product over `packed` (pack_int8(q)) where it is given;
    else through the few-row kernel, rounding included (fast up to INT8_MAX_ROWS rows, a
    decoding step's); where there is no kernel, through torch (int8_reference). All give the
    same bits.

    x: (M, K) fp32; q: (N, K) int8 in [-127, 127] (as quantize_rows rounds) and wscale: (N,)
    fp32, contiguous; bias: (N,) fp32 or None; all on the CPU (Int8Linear holds its tensors
    so).
    """
    (m, k), k_q = x.shape, q.shape[1]
    # Checked on every call, so kept to a few comparisons: the kernel reads raw pointers.
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and k == k_q
            and fits_int8_kernel(q, wscale, bias)):
        raise ValueError(f"linear_int8 takes fp32 {m} x K rows and an int8 N x K matrix with "
                         f"fp32 scales and bias on the CPU; got {x.dtype} {tuple(x.shape)} and "
                         f"{q.dtype} {tuple(q.shape)}")
    return linear_int8_unchecked(x.contiguous(), q, wscale, bias, packed)


def linear_int8_unchecked(
    x: Tensor, q: Tensor, wscale: Tensor, bias: Tensor | None, packed: PackedInt8 | None
) -> Tensor:
    """linear_int8 with x (M, K) fp32, contiguous, on the CPU, and the rest already checked
    (fits_int8_kernel): for Int8Linear, which checks its own tensors once, when it is made.
    A decoding step makes ~40 products of a few rows, each a few microseconds of work, and
    Python's checks cost a noticeable part of that."""
    lib, m = load(), x.shape[0]
    if lib is None:
        return int8_reference(*_torch_quantize_rows(x), q, wscale, bias)
    if packed is not None and m >= packed.min_rows:
        return _call_linear_int8_packed(lib, x, packed, wscale, bias)
    return _call_linear_int8(lib, x, q, wscale, bias)
