"""Block-quantized weights: llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 layouts, its K
super-blocks (Q4_K, Q5_K, Q6_K) and IQ4_XS (kquants.py), byte for byte.

A weight [N out, K in] is cut along K into blocks (LAYOUTS gives each format's values and
bytes a block), each stored with its own fp16 scale d (and an fp16 offset m for q4_1 and
q5_1), so an outlier costs the precision of a block, not of a whole row:

    q8_0  fp16 d; int8 qs[32]                                   x = d * q        34 bytes
    q4_0  fp16 d; uint8 qs[16]: q_j = (qs[j] & 15) - 8,
                               q_{j+16} = (qs[j] >> 4) - 8      x = d * q        18 bytes
    q4_1  fp16 d; fp16 m; uint8 qs[16]: q_j = qs[j] & 15,
                               q_{j+16} = qs[j] >> 4            x = d * q + m    20 bytes
    q5_0  fp16 d; uint32 qh; qs[16]: q4_0's nibbles, bit j of qh value j's fifth bit,
                               q = that 5-bit value - 16        x = d * q        22 bytes
    q5_1  fp16 d; fp16 m; uint32 qh; qs[16]: q = the 5-bit value x = d * q + m   24 bytes
    q4_k, q5_k, q6_k, iq4_xs: 256 values a block, 144, 176, 210 and 136 bytes (kquants.py)

held as a uint8 tensor [N, K / values * bytes], rows contiguous: the order a GGUF file
stores a 2-D tensor's data in, so a file's blocks are used as they are. quantize() rounds
as llama.cpp's reference quantizers do (q8_0: d = max|x| / 127, q = round(x / d), halves
away from zero; q4_0 (q5_0): d = (the value largest in size, with its sign) / -8 (-16),
q = min(15 (31), trunc(x / d + 8.5 (16.5))); q4_1 (q5_1): d = (max - min) / 15 (31),
m = min, q = min(15 (31), trunc((x - m) / d + 0.5))), in fp32 as they do, with the same
bits; the K formats as kquants.py says.

BlockLinear computes y = x W^T + b with the activations rounded to blocks (one fp32 scale
each, q = round(x / d), d = max|x| / 127) of the format's activation kind: 32 values (q8_0)
for the 32-value formats, 256 (llama.cpp's Q8_K, with the sums of each 16) for the K ones;
the products of a block summed exactly in integers, then scaled: blocks.c and kquants.c,
through kinds.c's table, on x86-64 with AVX2 (and AVX-VNNI or AVX-512 VNNI where the CPU
has them). Elsewhere (library.py's
TFORMER_ISA=torch, no compiler) it multiplies fp32 rows by the weight dequantized once and
kept: the same weights, the activations unrounded.

Products of many rows (a prompt, a batch, a speculative round's verification) read the
weight repacked (repack, llama.cpp's repack.cpp's idea): eight rows side by side, each
block's values a byte each and its scales unpacked, so that eight outputs share every
instruction: 40 bytes for 32 weights beside the 32-value formats' 18 to 34, 360 for 256
beside the K formats' 144 to 210. Where that copy lives is a choice of memory against
speed (`keep_repacked`):
- by default a layer keeps none: a product of REPACK_CALL_ROWS (64) rows and more repacks
  W for the call (kinds.c, a slice of rows at a time), which those rows pay for (at one
  thread a 8192 x 2048 q4_k layer took 10.5 ms to repack; 64 rows took 29 ms over its
  blocks and 36 repacked for the call, 512 rows 399 and 316), and fewer rows read the
  file's blocks. A model then holds its weights in their file's bytes, as llama.cpp does.
- a layer that keeps it (keep_repacked(model), or TFORMER_KEEP_REPACKED=1 for every
  layer) makes it at its first product of REPACK_MIN_ROWS (5) rows and more (or when
  step.c is given it) and reads it for every such product: for the 32-value formats
  1.3x faster at 8 rows and 1.8x at 64 (q4_1), but its weights take 2.2 (q4_0) to 1.2
  (q8_0) times their file's bytes more. Batched serving and speculative decoding, whose
  every step has many rows, keep it for those formats; the K formats' few-row product is
  as fast as the repacked one below 64 rows, so they keep none (pays_to_keep).
The file's blocks stay either way because one row, decoding's product, is a stream through
the weights, where the file's 4.5 bits a weight are read faster than the repacked 10. The
repacked product's results: the K formats' the few-row product's bit for bit; the
32-value formats' the plain C product's bit for bit, and on the SIMD paths within fp32
rounding of their few-row product's (which adds each block's products in eight lanes): a
row's result is the same in any product over repacked W, and may differ in its last bits
alone or in a few-row one.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.errors import TformerError
from tformer.kernels import kquants, library

log = logging.getLogger(__name__)

ACTIVATION_VALUES = {"q8_0": 32, "q8_k": 256}
"""The blocks activations are rounded to, by kind: values per block (one scale each)."""


@dataclass(frozen=True)
class Layout:
    """A block format's geometry: values a block holds along a row, bytes it takes, the
    kind of blocks the activations are rounded to (ACTIVATION_VALUES), its C tag
    (tformer.h's enum tformer_kind, whose row in kinds.c says the same geometry) and the
    GGUF tensor type whose blocks it holds as they are."""

    values: int
    size: int
    activation: str
    kind: int
    ggml_type: int


LAYOUTS = {
    "q8_0": Layout(32, 34, "q8_0", library.KIND_Q8_0, 8),
    "q4_0": Layout(32, 18, "q8_0", library.KIND_Q4_0, 2),
    "q4_1": Layout(32, 20, "q8_0", library.KIND_Q4_1, 3),
    "q5_0": Layout(32, 22, "q8_0", library.KIND_Q5_0, 6),
    "q5_1": Layout(32, 24, "q8_0", library.KIND_Q5_1, 7),
    "q4_k": Layout(256, 144, "q8_k", library.KIND_Q4_K, 12),
    "q5_k": Layout(256, 176, "q8_k", library.KIND_Q5_K, 13),
    "q6_k": Layout(256, 210, "q8_k", library.KIND_Q6_K, 14),
    "iq4_xs": Layout(256, 136, "q8_k", library.KIND_IQ4_XS, 23),
}
"""Every block format, by name."""
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "q5_0"}
"""The 32-value format a K format's layer takes where its rows are not whole super-blocks
(SmolLM2's 576 inputs): llama.cpp's quantizer does the same (llama-quant.cpp, the
"incompatible tensor" fallback: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0); its IQ4_XS
falls back to IQ4_NL, which tformer does not hold, so iq4_xs takes q4_k's q5_0."""
EXACTLY_AS = {("q4_0", "q8_0"): 8, ("q5_0", "q8_0"): 16}
"""(a format, a finer one) whose blocks say every value of the first exactly, with the first's
offset: a q4_0 or q5_0 block is d (q - offset), a q8_0 block the same d and q - offset as
int8. A layer made of file tensors of both (Q4_K_M's fallbacks: attn_q and attn_k in Q5_0,
attn_v in Q8_0, held as one qkv layer) is held in the finer one, its values unchanged."""
BLOCK_BYTES = {name: layout.size for name, layout in LAYOUTS.items()}
"""Bytes a block takes in each format."""
KINDS = {name: layout.kind for name, layout in LAYOUTS.items()}
"""The C tag of each format (tformer.h's enum tformer_kind)."""
GGML_TYPES = {name: layout.ggml_type for name, layout in LAYOUTS.items()}
"""The GGUF tensor type whose raw blocks each format holds as is."""
ISA_GENERIC, ISA_AVX2, ISA_AVX_VNNI, ISA_AVX512_VNNI = 0, 1, 2, 3
"""blocks.c's paths (tformer.h's TFORMER_BLOCKS_*): plain C, AVX2 (byte multiply-adds),
AVX-VNNI, AVX-512 VNNI."""
ISA_FOR = {"avx512": ISA_AVX512_VNNI, "avxvnni": ISA_AVX_VNNI, "avx2": ISA_AVX2}
"""library.ISAS's kernel instruction sets: the path blocks.c takes for each."""


def _check_format(fmt: str) -> Layout:
    if fmt not in LAYOUTS:
        raise TformerError(f"unknown block format {fmt!r}: use one of {', '.join(LAYOUTS)}")
    return LAYOUTS[fmt]


def roundf(v: Tensor) -> Tensor:
    """C's roundf (halves away from zero), elementwise, exact in fp32: torch.round rounds
    halves to even."""
    a = v.abs()
    floored = a.floor()
    return torch.sign(v) * (floored + (2 * (a - floored)).floor())


def _fp16_bytes(t: Tensor) -> Tensor:
    """fp32 [..., 1] -> the fp16 value's two bytes, little-endian, uint8 [..., 2]."""
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _pack_nibbles(q: Tensor) -> Tensor:
    """[..., 32] integers in [0, 15] -> [..., 16] bytes: q_j in the low half of byte j,
    q_{j+16} in its high half."""
    q = q.to(torch.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _q8_0(x: Tensor) -> list[Tensor]:
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return [_fp16_bytes(d), roundf(x * inv).to(torch.int8).view(torch.uint8)]


def _symmetric(x: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """q4_0's and q5_0's rounding: d = (the value largest in size) / -(levels / 2), q =
    min(levels - 1, trunc(x / d + levels / 2 + 0.5))."""
    big = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    d = big / -(levels // 2)
    inv = torch.where(d == 0, 0.0, 1 / d)
    return d, (x * inv + (levels // 2 + 0.5)).trunc().clamp(0, levels - 1)


def _offset(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
    """q4_1's and q5_1's: d = (max - min) / (levels - 1), m = min,
    q = min(levels - 1, trunc((x - m) / d + 0.5))."""
    lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    d = (hi - lo) / (levels - 1)
    inv = torch.where(d == 0, 0.0, 1 / d)
    return d, lo, ((x - lo) * inv + 0.5).trunc().clamp(0, levels - 1)


def _fifth_bits(q: Tensor) -> Tensor:
    """[..., 32] 5-bit values -> qh [..., 4]: bit j (little-endian) value j's fifth bit."""
    bits = (q.to(torch.int64) >> 4).reshape(*q.shape[:-1], 4, 8)
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def _q4_0(x: Tensor) -> list[Tensor]:
    d, q = _symmetric(x, 16)
    return [_fp16_bytes(d), _pack_nibbles(q)]


def _q4_1(x: Tensor) -> list[Tensor]:
    d, m, q = _offset(x, 16)
    return [_fp16_bytes(d), _fp16_bytes(m), _pack_nibbles(q)]


def _q5_0(x: Tensor) -> list[Tensor]:
    d, q = _symmetric(x, 32)
    return [_fp16_bytes(d), _fifth_bits(q), _pack_nibbles(q % 16)]


def _q5_1(x: Tensor) -> list[Tensor]:
    d, m, q = _offset(x, 32)
    return [_fp16_bytes(d), _fp16_bytes(m), _fifth_bits(q), _pack_nibbles(q % 16)]


def _super_blocks(fmt: str):
    """A K format's rounding over [..., 256] values, kquants.py's searches CHUNK blocks at
    a time."""
    fn = kquants.QUANTIZE[fmt]

    def run(x: Tensor) -> list[Tensor]:
        return [kquants.chunked(fn, x.reshape(-1, kquants.QK)).reshape(*x.shape[:-1], -1)]

    return run


QUANTIZE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1,
            **{name: _super_blocks(name) for name in kquants.QUANTIZE}}
"""Each format's rounding in torch: x [..., values] fp32 -> the parts of its blocks
[..., bytes]. kinds.c's tformer_quantize computes the same bytes (the tests compare them),
some ten to a hundred times faster: quantize() uses it where the kernels are built."""


def _values_32(b: Tensor, size: int) -> Tensor:
    """The 32 stored values of q4's and q5's blocks [..., size], 0..15 or 0..31."""
    qs = b[..., size - 16:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).long()
    if size in (22, 24):  # q5_0, q5_1: the fifth bits, the 4 bytes before qs
        qh = b[..., size - 20:size - 16].long()
        bits = (qh[..., :, None] >> torch.arange(8)) & 1
        q = q | (bits.reshape(*q.shape) << 4)
    return q.float()


def _super_blocks_decoded(fmt: str):
    """A K format's decoding over [..., bytes] blocks."""
    fn = kquants.DEQUANTIZE[fmt]

    def run(b: Tensor) -> Tensor:
        return fn(b.reshape(-1, b.shape[-1])).reshape(*b.shape[:-1], -1)

    return run


def _half(b: Tensor, at: int) -> Tensor:
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


DEQUANTIZE = {
    "q8_0": lambda b: _half(b, 0) * b[..., 2:].contiguous().view(torch.int8).float(),
    "q4_0": lambda b: _half(b, 0) * (_values_32(b, 18) - 8),
    "q4_1": lambda b: _half(b, 0) * _values_32(b, 20) + _half(b, 2),
    "q5_0": lambda b: _half(b, 0) * (_values_32(b, 22) - 16),
    "q5_1": lambda b: _half(b, 0) * _values_32(b, 24) + _half(b, 2),
    **{name: _super_blocks_decoded(name) for name in kquants.DEQUANTIZE},
}
"""Each format's decoding: blocks [..., bytes] uint8 -> x [..., values] fp32."""


def quantize(weight: Tensor, fmt: str, native: bool = True) -> Tensor:
    """weight [N, K] (K a multiple of the format's block) -> uint8 blocks [N, K / values *
    bytes], as llama.cpp's reference quantizer for the format writes them: through kinds.c's
    table where native and the kernels are built, else QUANTIZE's torch."""
    layout = _check_format(fmt)
    if weight.dim() != 2 or weight.shape[1] % layout.values:
        raise TformerError(f"{fmt} holds [N, K] weights with K a multiple of {layout.values}; "
                           f"got {tuple(weight.shape)}")
    n, k = weight.shape
    x = weight.detach().to("cpu", torch.float32).contiguous()
    # the library as built, not _lib(): its self-check quantizes with this function
    lib = library.load() if native else None
    if lib is None:
        x = x.reshape(n, k // layout.values, layout.values)
        return torch.cat(QUANTIZE[fmt](x), dim=-1).reshape(n, -1)
    out = torch.empty(n, k // layout.values * layout.size, dtype=torch.uint8)
    if n and lib.tformer_quantize(layout.kind, x.data_ptr(), n * k // layout.values,
                                  out.data_ptr(), torch.get_num_threads()):
        raise TformerError(f"this build's kernels have no quantizer for {fmt}")
    return out


def reencode(blocks: Tensor, fmt: str, finer: str) -> Tensor:
    """Blocks of `fmt` -> blocks of `finer` that decode to the same values, for EXACTLY_AS's
    pairs: each block's fp16 d as it is, its values less the offset as int8."""
    offset = EXACTLY_AS.get((fmt, finer))
    if offset is None:
        raise TformerError(f"{fmt} blocks have no exact {finer} form")
    size = LAYOUTS[fmt].size
    b = blocks.contiguous().reshape(blocks.shape[0], -1, size)
    q = (_values_32(b, size) - offset).to(torch.int8).view(torch.uint8)
    return torch.cat([b[..., :2], q], dim=-1).reshape(blocks.shape[0], -1)


def iq4_nl_as_q8_0(blocks: Tensor) -> Tensor:
    """llama.cpp's IQ4_NL blocks [N, B * 18] (fp16 d, then 16 bytes of 4-bit indices into
    kquants.IQ4_VALUES, values 0-15 in the low halves, 16-31 in the high) -> q8_0 blocks
    [N, B * 34] of the same values exactly: d as it is, each value as int8."""
    n = blocks.shape[0]
    b = blocks.contiguous().reshape(n, -1, 18)
    index = torch.cat([b[..., 2:] & 15, b[..., 2:] >> 4], dim=-1).long()
    values = kquants.IQ4_VALUES.to(torch.int8)[index].view(torch.uint8)
    return torch.cat([b[..., :2], values], dim=-1).reshape(n, -1)


def dequantize(blocks: Tensor, fmt: str) -> Tensor:
    """uint8 blocks [N, B * bytes] -> the fp32 weight [N, B * values]."""
    layout = _check_format(fmt)
    size = layout.size
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise TformerError(f"{fmt} blocks are uint8 [N, B * {size}]; got {blocks.dtype} "
                           f"{tuple(blocks.shape)}")
    n, width = blocks.shape[0], blocks.shape[1] // size * layout.values
    out = torch.empty(n, width, dtype=torch.float32, device=blocks.device)
    # A few million values at a time: the decoders' integer intermediates take 8 bytes a
    # value, which for a whole 128,256-row table would be gigabytes.
    step = max(1, DEQUANTIZE_VALUES // max(width, 1))
    for at in range(0, n, step):
        part = blocks[at:at + step].contiguous()
        out[at:at + step] = DEQUANTIZE[fmt](part.reshape(part.shape[0], -1, size)).reshape(
            part.shape[0], -1)
    return out


DEQUANTIZE_VALUES = 1 << 22
"""Values dequantize() decodes at a time."""


# The C kernels (blocks.c, built into library.py's library).

def check(lib: ctypes.CDLL) -> bool:
    """The block products' self-check (library.checked runs it once per library): the best
    path the CPU has, at most the instruction set load() chose (TFORMER_ISA), else AVX2,
    else plain C, whichever first computes right (computes_right)."""
    names = {value: name for name, value in library.ISA_LEVELS.items()}
    want = ISA_FOR[names[lib.tformer_isa(-1)]]
    for level in dict.fromkeys([want, ISA_AVX2, ISA_GENERIC]):
        if lib.tformer_blocks_isa(level) == level and computes_right(lib):
            if level != want:
                log.warning("the block products' faster path computed a wrong product; "
                            "using %s", "AVX2" if level == ISA_AVX2 else "plain C")
            return True
    return False


def _lib() -> ctypes.CDLL | None:
    return library.checked(check)


PATH_NAMES = {ISA_GENERIC: "plain C", ISA_AVX2: "AVX2", ISA_AVX_VNNI: "AVX-VNNI",
              ISA_AVX512_VNNI: "AVX-512 VNNI"}


def path() -> str:
    """How the block products run here: PATH_NAMES's name of blocks.c's path, or "torch"."""
    lib = _lib()
    return "torch" if lib is None else PATH_NAMES[lib.tformer_blocks_isa(-1)]


def available() -> bool:
    """Whether the block products run blocks.c here (else torch's fp32 products)."""
    return _lib() is not None


REPACK_MIN_ROWS = 5
"""Products of this many rows and more (a prompt, a batch of more than four, a speculative
round's verification) go through W repacked (repack), where a layer keeps it: up to four, the
product is a stream through the file's blocks, each read once whatever the layout."""
REPACK_CALL_ROWS = 64
"""Products of this many rows and more over a layer that keeps no repacked copy repack W for
the call (kinds.c's tformer_linear; tformer.h's TFORMER_REPACK_CALL_ROWS, which a test
compares)."""
KEEP_REPACKED = os.environ.get("TFORMER_KEEP_REPACKED", "0") not in ("", "0")
"""Whether a new block layer keeps W repacked beside its blocks (see the module's text);
keep_repacked sets it for a model's layers."""


def keep_repacked(model: nn.Module, keep: bool = True) -> None:
    """Make the block layers of `model` keep W repacked beside their blocks (or not), for
    decoding whose every step multiplies REPACK_MIN_ROWS rows or more (batched serving,
    speculative decoding): 1.3x to 2x faster products of 5 to 63 rows in the 32-value
    formats, for 1.2 (q8_0) to 2.2 (q4_0) times the blocks' bytes more. The K formats keep
    none (pays_to_keep). Set before a decoding step reads the layers (step.c's structures
    are made at the first cache)."""
    for module in model.modules():
        if isinstance(module, BlockLinear):
            module.keep_repacked = keep and pays_to_keep(module.fmt)
        elif isinstance(module, StackedLinear):
            module.keep_repacked = keep
            module._split()
            for part in module.parts:
                part.keep_repacked = keep and pays_to_keep(part.fmt)


def pays_to_keep(fmt: str) -> bool:
    """Whether a layer of `fmt` gains from keeping W repacked for products of a few rows
    more than four (keep_repacked). The K formats' product over the file's bytes
    (kquants_rows.h) runs as fast as over a repacked copy below REPACK_CALL_ROWS rows and
    reads 2.5x fewer bytes: on one 8192 x 2048 q4_k layer at one thread, 8 rows took 5.5 ms
    over the blocks and 8.2 over the copy, 64 rows 29 and 27; and greedy batch 8 of a
    Llama-3.2-1B-shaped Q4_K_M on two threads ran 41.0 tokens/s without the copy and 30.1
    with it (benchmarks/README.md). The 32-value formats' few-row product gains from it
    (q4_1: 7.9 against 6.0 ms at 8 rows, 62 against 34 at 64)."""
    return LAYOUTS[fmt].values == 32


def repack(lib: ctypes.CDLL, fmt: str, blocks: Tensor, k: int) -> Tensor | None:
    """W's blocks [N, K / values * bytes] -> uint8, repacked through kinds.c's table for
    products of REPACK_MIN_ROWS rows and more (blocks.c's struct repacked, kquants.c's
    struct krepacked: W's rows eight at a time side by side, the values a byte each, the
    scales unpacked; 40 bytes for every 32 weights beside the file's 18 to 34, 360 for 256
    beside the K formats' 144 to 210), or None where the kind has no repacked form."""
    n = blocks.shape[0]
    size = lib.tformer_repacked_size(KINDS[fmt], n, k)
    if size == 0:
        return None
    out = torch.empty(size, dtype=torch.uint8)
    if lib.tformer_repack(KINDS[fmt], blocks.data_ptr(), n, k, out.data_ptr()):
        raise TformerError(f"kinds.c's table repacks no {fmt}")
    return out


NEVER = 1 << 30
"""call's repack_rows for the product over the file's blocks alone, at any number of rows."""


def call(lib: ctypes.CDLL, fmt: str, x: Tensor, blocks: Tensor, n: int, k: int,
         bias: Tensor | None, repacked: Tensor | None = None,
         repack_rows: int = REPACK_MIN_ROWS) -> Tensor:
    """y = x W^T + b through kinds.c's table (blocks.c's or kquants.c's product), W as
    blocks, and for repack_rows rows and more repacked: `repacked`, repack's, where given,
    else repacked for the call from REPACK_CALL_ROWS rows (NEVER: the blocks alone); x
    (M, K) fp32 contiguous, all checked."""
    m = x.shape[0]
    y = x.new_empty(m, n)
    struct = library.Linear(KINDS[fmt], n, k, blocks.data_ptr(), None,
                            None if bias is None else bias.data_ptr(),
                            None if repacked is None else repacked.data_ptr(), None, 0,
                            repack_rows)
    if lib.tformer_linear(ctypes.byref(struct), x.data_ptr(), y.data_ptr(), m,
                          torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} activation blocks")
    return y


def quantize_activations(x: Tensor, values: int = 32) -> tuple[Tensor, Tensor]:
    """x (M, K) fp32 -> (q int8 [M, K/values, values], d fp32 [M, K/values, 1]): the
    kernels' rounding of the activations to blocks of `values` (a layout's
    ACTIVATION_VALUES), d = max|x| / 127 per block, q = roundf(x / d) (roundf(x * (1/d)) in
    fp32, as the kernels compute it; q = 0 where d = 0)."""
    m, k = x.shape
    v = x.float().reshape(m, k // values, values)
    d = v.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return roundf(v * inv).to(torch.int8), d


def computes_right(lib: ctypes.CDLL) -> bool:
    """A check that the block products compute what they should on the path chosen: every
    format, 1 to 9 rows (so the few-row products and the many-row ones, over repacked
    weights where the format has them), weight rows not a multiple
    of the kernels' step, against the block arithmetic in float64 (the activations rounded
    by quantize_activations, one block rounded to zero), within fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    n, k = 13, 512
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    for fmt, layout in LAYOUTS.items():
        blocks = quantize(w, fmt)
        values = ACTIVATION_VALUES[layout.activation]
        for m in (1, 2, 3, 4, 5, 9):
            x = torch.randn(m, k, generator=g)
            x[0, :values] = 0.0
            repacked = repack(lib, fmt, blocks, k)
            got = call(lib, fmt, x, blocks, n, k, bias if m % 2 else None, repacked)
            q, d = quantize_activations(x, values)
            want = (dequantize(blocks, fmt).double() @ (q.double() * d.double()).reshape(m, k).t()
                    ).t()
            if m % 2:
                want = want + bias.double()
            if not torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4):
                return False
    return True


FORMATS_KEY = "tformer.formats"
"""The safetensors header's metadata key that names the weights a checkpoint holds as
blocks: a JSON object {parameter name: format}."""


def formats_of(model: nn.Module) -> dict[str, str]:
    """{parameter name: format} of the model's weights held as blocks (FORMATS_KEY's; a
    StackedLinear's format is its parts', stack_format's string; an embedding table's and
    the output layer tied to it both, over the same bytes)."""
    return {f"{name}.weight": m.fmt for name, m in model.named_modules()
            if isinstance(m, (BlockLinear, StackedLinear, BlockEmbedding))}


def held_weights(model: nn.Module) -> int:
    """The weights `model` holds as blocks, counted as values (each tensor of blocks once: a
    tied table and its output layer share theirs), for the parameter counts people read."""
    seen, count = set(), 0
    for module in model.modules():
        if isinstance(module, StackedLinear):
            layers = module.parts
        elif isinstance(module, (BlockLinear, BlockEmbedding)):
            layers = [module]
        else:
            continue
        for layer in layers:
            key = (layer.blocks.data_ptr(), tuple(layer.blocks.shape))
            if key not in seen:
                seen.add(key)
                layout = LAYOUTS[layer.fmt]
                count += layer.blocks.numel() // layout.size * layout.values
    return count


def stack_format(parts: list[tuple[str, int]]) -> str:
    """[(format, rows)] of a StackedLinear's parts -> its format in a checkpoint, e.g.
    "q4_k:2048+q4_k:512+q6_k:512"."""
    return "+".join(f"{fmt}:{rows}" for fmt, rows in parts)


def format_names(fmt: str) -> list[str]:
    """The block formats a layer's format (formats_of's) holds: itself, or a stack's
    parts'."""
    return [name for name, _ in stack_parts(fmt)] if "+" in fmt else [fmt]


def stack_parts(fmt: str) -> list[tuple[str, int]]:
    """stack_format's string -> [(format, rows)]; a TformerError where it is not one."""
    parts = []
    for part in fmt.split("+"):
        name, _, rows = part.partition(":")
        _check_format(name)
        if not rows.isdigit() or int(rows) == 0:
            raise TformerError(f"block format {fmt!r}: {part!r} is not FORMAT:ROWS")
        parts.append((name, int(rows)))
    return parts


def hold_blocks(model: nn.Module, formats: dict[str, str]) -> None:
    """Make the linear layers and embedding tables whose weights `formats` names
    ({parameter name: format}, a checkpoint's FORMATS_KEY) BlockLinears and BlockEmbeddings
    of those formats, in place, their blocks uninitialised (untouched memory) until the
    checkpoint's are loaded into them. A linear layer whose weight is tied to an embedding
    held as blocks (a GPT's lm_head with tie_embeddings) reads the embedding's bytes, where
    `formats` gives it the same format: one tensor, as it was saved. A name that is neither
    an nn.Linear's nor an nn.Embedding's weight of a fitting shape is a TformerError."""
    modules = dict(model.named_modules())
    tables: dict[int, BlockEmbedding] = {}  # id(the fp32 weight it replaces) -> the table
    for param, fmt in sorted(formats.items(), key=lambda item: not _is_embedding(
            modules.get(item[0].removesuffix(".weight")))):
        path = param.removesuffix(".weight")
        if path not in modules and _split_owner(model, path):
            modules = dict(model.named_modules())
        layer = modules.get(path)
        parent, _, attr = path.rpartition(".")
        owner = modules[parent] if parent else model
        if param.endswith(".weight") and _is_embedding(layer):
            layout = _check_format(fmt)  # (a stack is no embedding's format)
            if layer.embedding_dim % layout.values:
                raise TformerError(f"{param} is held as {fmt} blocks, but its "
                                   f"{layer.embedding_dim} columns are not a multiple of "
                                   f"{layout.values}")
            empty = torch.empty(layer.num_embeddings,
                                layer.embedding_dim // layout.values * layout.size,
                                dtype=torch.uint8)
            table = BlockEmbedding(empty, fmt, layer.embedding_dim)
            tables[id(layer.weight)] = table
            setattr(owner, attr, table)
            continue
        if not param.endswith(".weight") or not isinstance(layer, nn.Linear):
            raise TformerError(f"{param} is held as {fmt} blocks, but the model has no linear "
                               f"layer or embedding of that name")
        linear = layer
        table = tables.get(id(linear.weight))
        if table is not None and table.fmt == fmt and tuple(linear.weight.shape) == (
                table.num_embeddings, table.embedding_dim):
            setattr(owner, attr, table.tied_output(linear.bias))
            continue
        if "+" in fmt:
            stacked = StackedLinear.empty(stack_parts(fmt), linear.in_features, linear.bias)
            if stacked.out_features != linear.out_features:
                raise TformerError(f"{param} is held as {fmt}, but the layer has "
                                   f"{linear.out_features} outputs")
            setattr(owner, attr, stacked)
            continue
        layout = _check_format(fmt)
        if linear.in_features % layout.values:
            raise TformerError(f"{param} is held as {fmt} blocks, but its {linear.in_features} "
                               f"inputs are not a multiple of {layout.values}")
        n, k = linear.out_features, linear.in_features
        empty = torch.empty(n, k // layout.values * layout.size, dtype=torch.uint8)
        setattr(owner, attr, BlockLinear(empty, fmt, k, linear.bias))


def _is_embedding(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Embedding) and module.weight is not None


def _split_owner(model: nn.Module, path: str) -> bool:
    """Where `path` lies inside a module that holds linear layers stacked (a mixture's
    experts: `experts.gate.3` inside `experts`), replace that module by its `as_linears()`
    in place, so that the layer exists to hold blocks; whether one was found."""
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        owner_path = ".".join(parts[:n])
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            continue
        if callable(getattr(owner, "as_linears", None)):  # new tensors, for the weights
            parent, _, attr = owner_path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    owner.as_linears(share=False))
            return True
        return False
    return False


def dequantize_model(model: nn.Module, keep: str | None = None) -> None:
    """Make every BlockLinear and StackedLinear of `model` (but BlockLinears in format
    `keep`) an fp32 nn.Linear of the same weight, and every BlockEmbedding (but those in
    `keep`) an fp32 nn.Embedding, in place; an output layer tied to an embedding's blocks
    stays tied to it (kept with it, or the fp32 embedding's weight itself)."""
    tables = {id(m.blocks): m for m in model.modules() if isinstance(m, BlockEmbedding)}
    made: dict[int, nn.Parameter] = {}  # id(blocks) -> the fp32 weight made of them
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockEmbedding) and child.fmt != keep:
                table = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
                if id(child.blocks) not in made:
                    made[id(child.blocks)] = nn.Parameter(child.weight, requires_grad=False)
                table.weight = made[id(child.blocks)]
                setattr(parent, name, table)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            tied = isinstance(child, BlockLinear) and id(child.blocks) in tables
            if tied and tables[id(child.blocks)].fmt == keep:
                continue
            if isinstance(child, StackedLinear) or (isinstance(child, BlockLinear)
                                                    and (child.fmt != keep or tied)):
                linear = nn.Linear(child.in_features, child.out_features,
                                   bias=child.bias is not None, device="meta")
                weight = made.get(id(child.blocks)) if tied else None
                linear.weight = weight if weight is not None else nn.Parameter(
                    child.weight, requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)


def quantizer(fmt: str):
    """How the weight-format registry makes an nn.Linear into `fmt`: a BlockLinear, in
    FALLBACK's format where its input size is not a multiple of the format's block, or the
    layer as it is where no such blocks exist."""
    _check_format(fmt)

    def make(linear: nn.Linear) -> nn.Module:
        fits = fitting(fmt, linear.in_features)
        if fits is None:
            return linear
        return BlockLinear.from_linear(linear, fits)

    return make


def fitting(fmt: str, width: int) -> str | None:
    """`fmt`, or its FALLBACK, whichever holds rows of `width` values; None if neither."""
    while fmt is not None and width % LAYOUTS[fmt].values:
        fmt = FALLBACK.get(fmt)
    return fmt


class HeldAsWeight(nn.Module):
    """A layer whose `blocks` buffer a checkpoint holds under the parameter's own name,
    `weight` (uint8), as an nn.Linear's weight would be: so a model saves and loads as its
    file names it."""

    blocks: Tensor
    bias: Tensor | None

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001, ANN202
        destination[prefix + "weight"] = self.blocks if keep_vars else self.blocks.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):  # noqa: ANN001, ANN202
        if prefix + "weight" in state_dict:
            state_dict[prefix + "blocks"] = state_dict.pop(prefix + "weight")
        super()._load_from_state_dict(state_dict, prefix, *args)


class BlockLinear(HeldAsWeight):
    """y = x W^T + b with W held as blocks of one of LAYOUTS's formats (see the
    module's text), for inference.

    x: (..., in_features) -> (..., out_features). Made from an nn.Linear (from_linear,
    which rounds its weight) or from blocks as a file holds them.
    """

    def __init__(self, blocks: Tensor, fmt: str, in_features: int,
                 bias: Tensor | nn.Parameter | None = None) -> None:
        super().__init__()
        layout = _check_format(fmt)
        out_features = blocks.shape[0] if blocks.dim() == 2 else -1
        want = (out_features, in_features // layout.values * layout.size)
        if (blocks.dtype != torch.uint8 or tuple(blocks.shape) != want
                or in_features % layout.values):
            raise TformerError(f"{fmt} blocks of a [N, {in_features}] weight are uint8 "
                               f"{want}; got {blocks.dtype} {tuple(blocks.shape)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = bias
        self._dense: Tensor | None = None
        self.__dict__["_repacked"] = None  # repacked(): made at the first many-row use
        self.keep_repacked = KEEP_REPACKED
        """Whether the layer keeps W repacked (the module's text, keep_repacked)."""
        self.repack_rows = REPACK_MIN_ROWS
        """Its products of this many rows and more read W repacked (kept, or from
        REPACK_CALL_ROWS rows repacked for the call); NEVER: the file's blocks alone."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> BlockLinear:
        return cls(quantize(linear.weight, fmt), fmt, linear.in_features, linear.bias)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's)
        super()._apply(fn, recurse)
        self._dense = None
        self.__dict__["_repacked"] = None
        return self

    def __getstate__(self) -> dict:
        # What the layer made of its blocks is not copied with it (swap_linears' deepcopy
        # shares the blocks): a copy makes its own when it needs them.
        return dict(self.__dict__) | {"_dense": None, "_repacked": None}

    def repacked(self) -> Tensor | None:
        """The blocks repacked for products of REPACK_MIN_ROWS rows and more (repack), made
        at the first call and kept beside the file's blocks, which export, checkpoints and
        the few-row products read; None where the layer keeps no such copy
        (keep_repacked) or the format has no repacked form here."""
        lib = _lib()
        if lib is None or self.blocks.device.type != "cpu" or not self.keep_repacked:
            self.__dict__["_repacked"] = None
            return None
        made = self.__dict__["_repacked"]
        if made is None or made[0] != self.blocks.data_ptr():
            made = (self.blocks.data_ptr(), repack(lib, self.fmt, self.blocks, self.in_features))
            self.__dict__["_repacked"] = made
        return made[1]

    @property
    def weight(self) -> Tensor:
        """The weight as the products see it, in fp32: for code that reads a linear's weight
        (Transformer-XL projects its memory with a slice of it)."""
        return dequantize(self.blocks, self.fmt)

    def _load_from_state_dict(self, state_dict, prefix, *args):  # noqa: ANN001, ANN202
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.__dict__["_repacked"] = None  # the blocks were copied in: repack them anew

    def _fits(self, x: Tensor) -> bool:
        b = self.bias
        return (x.dtype == torch.float32 and x.device.type == "cpu"
                and self.blocks.device.type == "cpu"
                and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu"
                                   and b.is_contiguous())))

    def tformer_linear(self) -> library.BoundLinear | None:
        """The layer as step.c reads it (tformer.h's TFORMER_Q8_0, ... _Q6_K), or None
        where blocks.c cannot read its tensors; any number of rows (W repacked where the
        layer keeps it, else for a call of REPACK_CALL_ROWS rows and more)."""
        if _lib() is None or not self._fits(torch.empty(0)):
            return None
        bias = None if self.bias is None else self.bias.detach()
        repacked = self.repacked()
        struct = library.Linear(KINDS[self.fmt], self.out_features, self.in_features,
                                self.blocks.data_ptr(), None,
                                None if bias is None else bias.data_ptr(),
                                None if repacked is None else repacked.data_ptr(), None, 0,
                                self.repack_rows)
        held = [t for t in (self.blocks, bias, repacked) if t is not None]
        return library.BoundLinear(struct, 1 << 30, tuple(held))

    def forward(self, x: Tensor) -> Tensor:
        lib = _lib()
        if lib is None or not self._fits(x):
            # The fallback: the weight dequantized once and kept (a call dequantizing anew
            # spends longer on it than on the product at a decoding step's few rows).
            if self._dense is None or self._dense.device != x.device:
                self._dense = self.weight.to(x.device)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self._dense.to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features).contiguous()
        repacked = self.repacked() if rows.shape[0] >= self.repack_rows else None
        y = call(lib, self.fmt, rows, self.blocks, self.out_features, self.in_features,
                 None if self.bias is None else self.bias.detach(), repacked, self.repack_rows)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class BlockEmbedding(HeldAsWeight):
    """An embedding table held as blocks of one of LAYOUTS's formats, for inference (a GGUF
    file's token_embd, kept as the file holds it, as llama.cpp keeps it): a lookup decodes
    the rows it selects, and only those, so that a 128,256-row table costs its blocks' bytes
    (210 MB in q6_k for a width of 2,048) where fp32 took 1 GB. A row looked up is that row
    of the whole table dequantized (`weight`), bit for bit. With tied embeddings the output
    layer is a BlockLinear over the same `blocks` tensor (`tied_output`): one copy for both,
    which a checkpoint saves once.

    tokens (...) -> (..., embedding_dim) fp32.
    """

    def __init__(self, blocks: Tensor, fmt: str, embedding_dim: int) -> None:
        super().__init__()
        layout = _check_format(fmt)
        rows = blocks.shape[0] if blocks.dim() == 2 else -1
        want = (rows, embedding_dim // layout.values * layout.size)
        if (blocks.dtype != torch.uint8 or tuple(blocks.shape) != want
                or embedding_dim % layout.values):
            raise TformerError(f"{fmt} blocks of a [N, {embedding_dim}] embedding are uint8 "
                               f"{want}; got {blocks.dtype} {tuple(blocks.shape)}")
        self.fmt, self.num_embeddings, self.embedding_dim = fmt, rows, embedding_dim
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None  # (HeldAsWeight saves a bias where a layer has one)

    def tied_output(self, bias: Tensor | nn.Parameter | None = None) -> BlockLinear:
        """The output layer onto the vocabulary over this table's bytes (tied embeddings):
        logits = x E^T (+ bias), as BlockLinear computes it."""
        return BlockLinear(self.blocks, self.fmt, self.embedding_dim, bias)

    @property
    def weight(self) -> Tensor:
        """The whole table in fp32: for code that reads an embedding's weight (a copy, made
        at each read)."""
        return dequantize(self.blocks, self.fmt)

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.blocks.index_select(0, tokens.reshape(-1).to(self.blocks.device))
        if rows.device.type != "cpu":  # the decoders' tables are made on the CPU
            return dequantize(rows.cpu(), self.fmt).to(rows.device).view(
                *tokens.shape, self.embedding_dim)
        return dequantize(rows, self.fmt).view(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"


class StackedLinear(HeldAsWeight):
    """y = x W^T + b with W's rows held in parts of different block formats, one after the
    other: a fused projection whose file tensors differ in type (Q4_K_M's attn_q and attn_k
    in q4_k beside attn_v in q6_k, held as one qkv layer). Each part is a BlockLinear over
    its rows' bytes, all views of one flat uint8 buffer, which a checkpoint holds under the
    layer's `weight` with stack_format's string as its format.

    x: (..., in_features) -> (..., out_features), the parts' outputs side by side.
    """

    def __init__(self, parts: list[tuple[str, Tensor]], in_features: int,
                 bias: Tensor | nn.Parameter | None = None) -> None:
        super().__init__()
        self.layout = [(fmt, blocks.shape[0]) for fmt, blocks in parts]
        self.fmt = stack_format(self.layout)
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in self.layout)
        self.register_buffer("blocks", torch.cat([b.contiguous().reshape(-1) for _, b in parts]))
        self.bias = bias
        self.keep_repacked = KEEP_REPACKED
        """Whether the parts keep W repacked (keep_repacked)."""
        self._split()

    @classmethod
    def empty(cls, layout: list[tuple[str, int]], in_features: int,
              bias: Tensor | nn.Parameter | None = None) -> StackedLinear:
        """A layer of `layout`'s parts [(format, rows)], its bytes untouched memory until a
        checkpoint's are loaded into them."""
        parts = []
        for fmt, rows in layout:
            size = LAYOUTS[fmt]
            if in_features % size.values:
                raise TformerError(f"{fmt} blocks hold rows of a multiple of {size.values} "
                                   f"values, not {in_features}")
            parts.append((fmt, torch.empty(rows, in_features // size.values * size.size,
                                           dtype=torch.uint8)))
        return cls(parts, in_features, bias)

    def _split(self) -> None:
        # the parts, kept out of the module tree (their bytes are this layer's buffer)
        parts, at = [], 0
        for fmt, rows in self.layout:
            size = LAYOUTS[fmt]
            n = rows * (self.in_features // size.values * size.size)
            view = self.blocks[at:at + n].view(rows, -1)
            parts.append(BlockLinear(view, fmt, self.in_features))
            parts[-1].keep_repacked = self.keep_repacked
            at += n
        self.__dict__["parts"] = parts
        self.__dict__["bound"] = None  # tformer_linear's, made at the first product

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's)
        super()._apply(fn, recurse)
        self._split()
        return self

    def __getstate__(self) -> dict:
        # The parts are views of `blocks`: a copy (swap_linears' deepcopy, which shares
        # the buffer) makes them anew over its own buffer rather than copying their bytes.
        state = dict(self.__dict__)
        state.pop("parts", None)
        state.pop("bound", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._split()

    @property
    def weight(self) -> Tensor:
        return torch.cat([part.weight for part in self.parts])


    def tformer_linear(self) -> library.BoundLinear | None:
        """The layer as step.c reads it: tformer.h's TFORMER_STACK, its parts' structures
        in a buffer of their own; None where a part's cannot be read."""
        bound = [part.tformer_linear() for part in self.parts]
        b = self.bias
        if any(p is None for p in bound) or not (
                b is None or (b.dtype == torch.float32 and b.device.type == "cpu")):
            return None
        table = (library.Linear * len(bound))(*(p.struct for p in bound))
        held = torch.frombuffer(bytearray(bytes(table)), dtype=torch.uint8)
        bias = None if b is None else b.detach().contiguous()
        struct = library.Linear(library.KIND_STACK, self.out_features, self.in_features,
                                held.data_ptr(), None, None if bias is None else bias.data_ptr(),
                                None, None, len(bound), 1 << 30)
        tensors = (held, *(t for p in bound for t in p.tensors),
                   *([] if bias is None else [bias]))
        return library.BoundLinear(struct, 1 << 30, tensors)

    def forward(self, x: Tensor) -> Tensor:
        lib = _lib()
        if lib is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            if self.bound is None:
                self.__dict__["bound"] = self.tformer_linear()
            bound = self.bound
            if bound is not None:
                rows = x.reshape(-1, self.in_features).contiguous()
                y = rows.new_empty(rows.shape[0], self.out_features)
                if lib.tformer_linear(ctypes.byref(bound.struct), rows.data_ptr(),
                                      y.data_ptr(), rows.shape[0], torch.get_num_threads()):
                    raise MemoryError(f"no memory for {rows.shape[0]} rows of {self.fmt}")
                return y.view(*x.shape[:-1], self.out_features)
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"
