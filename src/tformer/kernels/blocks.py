"""Block-quantized weights: llama.cpp's Q8_0, Q4_0 and Q4_1 layouts, byte for byte.

A weight [N out, K in] is cut along K into blocks of 32 values, each stored with its own
fp16 scale d (and for q4_1 an fp16 offset m), so an outlier costs the precision of 32
weights, not of a whole row:

    q8_0  fp16 d; int8 qs[32]                                   x = d * q        34 bytes
    q4_0  fp16 d; uint8 qs[16]: q_j = (qs[j] & 15) - 8,
                               q_{j+16} = (qs[j] >> 4) - 8      x = d * q        18 bytes
    q4_1  fp16 d; fp16 m; uint8 qs[16]: q_j = qs[j] & 15,
                               q_{j+16} = qs[j] >> 4            x = d * q + m    20 bytes

held as a uint8 tensor [N, K/32 * block_bytes], rows contiguous: the order a GGUF file
stores a 2-D tensor's data in, so a file's blocks are used as they are. quantize() rounds
as llama.cpp's reference quantizers do (q8_0: d = max|x| / 127, q = round(x / d), halves
away from zero; q4_0: d = (the value largest in size, with its sign) / -8, q = min(15,
trunc(x / d + 8.5)); q4_1: d = (max - min) / 15, m = min, q = min(15, trunc((x - m) / d +
0.5))), in fp32 as they do, with the same bits.

BlockLinear computes y = x W^T + b with the activations rounded to the same kind of
32-value blocks (one fp32 scale each, q = round(x / d), d = max|x| / 127) and the products
of a block summed exactly in integers, then scaled: blocks.c, on x86-64 with AVX2 (and
AVX-VNNI or AVX-512 VNNI where the CPU has them). Elsewhere (library.py's
TFORMER_ISA=torch, no compiler) it multiplies fp32 rows by the weight dequantized once and
kept: the same weights, the activations unrounded.
"""

from __future__ import annotations

import ctypes
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.errors import TformerError
from tformer.kernels import library

log = logging.getLogger(__name__)

BLOCK = 32
"""Values per block, along the input dimension."""
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
"""Bytes a block takes in each format."""
KINDS = {"q8_0": library.KIND_Q8_0, "q4_0": library.KIND_Q4_0, "q4_1": library.KIND_Q4_1}
"""The C tag of each format (tformer.h's enum tformer_kind)."""
GGML_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3}
"""The GGUF tensor type whose raw blocks each format holds as is."""
ISA_GENERIC, ISA_AVX2, ISA_AVX_VNNI, ISA_AVX512_VNNI = 0, 1, 2, 3
"""blocks.c's paths (tformer.h's TFORMER_BLOCKS_*): plain C, AVX2 (byte multiply-adds),
AVX-VNNI, AVX-512 VNNI."""
ISA_FOR = {"avx512": ISA_AVX512_VNNI, "avxvnni": ISA_AVX_VNNI, "avx2": ISA_AVX2}
"""library.ISAS's kernel instruction sets: the path blocks.c takes for each."""


def _check_format(fmt: str) -> None:
    if fmt not in BLOCK_BYTES:
        raise TformerError(f"unknown block format {fmt!r}: use one of {', '.join(BLOCK_BYTES)}")


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


def quantize(weight: Tensor, fmt: str) -> Tensor:
    """weight [N, K] (K a multiple of 32) -> uint8 blocks [N, K/32 * BLOCK_BYTES[fmt]], as
    llama.cpp's reference quantizer for the format writes them."""
    _check_format(fmt)
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise TformerError(f"{fmt} holds [N, K] weights with K a multiple of {BLOCK}; "
                           f"got {tuple(weight.shape)}")
    n, k = weight.shape
    x = weight.detach().to("cpu", torch.float32).reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = roundf(x * inv).to(torch.int8).view(torch.uint8)
        parts = [_fp16_bytes(d), q]
    elif fmt == "q4_0":
        big = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
        d = big / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = (x * inv + 8.5).trunc().clamp(0, 15)
        parts = [_fp16_bytes(d), _pack_nibbles(q)]
    else:
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = ((x - lo) * inv + 0.5).trunc().clamp(0, 15)
        parts = [_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)]
    return torch.cat(parts, dim=-1).reshape(n, -1)


def dequantize(blocks: Tensor, fmt: str) -> Tensor:
    """uint8 blocks [N, B * BLOCK_BYTES[fmt]] -> the fp32 weight [N, B * 32]."""
    _check_format(fmt)
    size = BLOCK_BYTES[fmt]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % size:
        raise TformerError(f"{fmt} blocks are uint8 [N, B * {size}]; got {blocks.dtype} "
                           f"{tuple(blocks.shape)}")
    n = blocks.shape[0]
    b = blocks.contiguous().reshape(n, -1, size)
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(n, -1)
    qs = b[..., size - 16:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
    if fmt == "q4_0":
        return (d * (q - 8)).reshape(n, -1)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, -1)


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


def call(lib: ctypes.CDLL, fmt: str, x: Tensor, blocks: Tensor, n: int, k: int,
         bias: Tensor | None) -> Tensor:
    """y = x W^T + b through blocks.c, W as blocks; x (M, K) fp32 contiguous, all checked."""
    m = x.shape[0]
    y = x.new_empty(m, n)
    if lib.tformer_blocks_linear(KINDS[fmt], x.data_ptr(), m, blocks.data_ptr(), n, k,
                                 None if bias is None else bias.data_ptr(), y.data_ptr(),
                                 torch.get_num_threads()):
        raise MemoryError(f"no memory for {m} x {k} activation blocks")
    return y


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, K) fp32 -> (q int8 [M, K/32, 32], d fp32 [M, K/32, 1]): blocks.c's rounding of
    the activations, d = max|x| / 127 per block, q = roundf(x / d) (roundf(x * (1/d)) in fp32,
    as the kernels compute it; q = 0 where d = 0)."""
    m, k = x.shape
    v = x.float().reshape(m, k // BLOCK, BLOCK)
    d = v.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return roundf(v * inv).to(torch.int8), d


def computes_right(lib: ctypes.CDLL) -> bool:
    """A check that the block products compute what they should on the path chosen: every
    format, 1 to 9 rows (so the few-row and many-row products), weight rows not a multiple
    of the kernels' step, against the block arithmetic in float64 (the activations rounded
    by quantize_activations, one rounded to zero), within fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    n, k = 13, 96
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    for fmt in BLOCK_BYTES:
        blocks = quantize(w, fmt)
        for m in (1, 2, 3, 4, 5, 9):
            x = torch.randn(m, k, generator=g)
            x[0, :BLOCK] = 0.0
            got = call(lib, fmt, x, blocks, n, k, bias if m % 2 else None)
            q, d = quantize_activations(x)
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
    """{parameter name: format} of the model's weights held as blocks (FORMATS_KEY's)."""
    return {f"{name}.weight": m.fmt for name, m in model.named_modules()
            if isinstance(m, BlockLinear)}


def hold_blocks(model: nn.Module, formats: dict[str, str]) -> None:
    """Make the linear layers whose weights `formats` names ({parameter name: format}, a
    checkpoint's FORMATS_KEY) BlockLinears of those formats, in place, their blocks
    uninitialised (untouched memory) until the checkpoint's are loaded into them. A name
    that is not an nn.Linear's weight of a fitting shape is a TformerError."""
    modules = dict(model.named_modules())
    for param, fmt in formats.items():
        _check_format(fmt)
        path = param.removesuffix(".weight")
        if path not in modules and _split_owner(model, path):
            modules = dict(model.named_modules())
        linear = modules.get(path)
        if not param.endswith(".weight") or not isinstance(linear, nn.Linear):
            raise TformerError(f"{param} is held as {fmt} blocks, but the model has no linear "
                               f"layer of that name")
        if linear.in_features % BLOCK:
            raise TformerError(f"{param} is held as {fmt} blocks, but its {linear.in_features} "
                               f"inputs are not a multiple of {BLOCK}")
        n, k = linear.out_features, linear.in_features
        empty = torch.empty(n, k // BLOCK * BLOCK_BYTES[fmt], dtype=torch.uint8)
        parent, _, attr = path.rpartition(".")
        setattr(modules[parent] if parent else model, attr,
                BlockLinear(empty, fmt, k, linear.bias))


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
    """Make every BlockLinear of `model` (but those in format `keep`) an fp32 nn.Linear of
    the same weight, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockLinear) and child.fmt != keep:
                linear = nn.Linear(child.in_features, child.out_features,
                                   bias=child.bias is not None, device="meta")
                linear.weight = nn.Parameter(child.weight, requires_grad=False)
                linear.bias = child.bias
                setattr(parent, name, linear)


def quantizer(fmt: str):
    """How the weight-format registry makes an nn.Linear into `fmt`: a BlockLinear, or the
    layer as it is where its input size is not a multiple of 32 (no such blocks exist)."""
    _check_format(fmt)

    def make(linear: nn.Linear) -> nn.Module:
        if linear.in_features % BLOCK:
            return linear
        return BlockLinear.from_linear(linear, fmt)

    return make


class BlockLinear(nn.Module):
    """y = x W^T + b with W held as blocks of one of BLOCK_BYTES's formats (see the
    module's text), for inference.

    x: (..., in_features) -> (..., out_features). Made from an nn.Linear (from_linear,
    which rounds its weight) or from blocks as a file holds them.
    """

    def __init__(self, blocks: Tensor, fmt: str, in_features: int,
                 bias: Tensor | nn.Parameter | None = None) -> None:
        super().__init__()
        _check_format(fmt)
        out_features = blocks.shape[0] if blocks.dim() == 2 else -1
        want = (out_features, in_features // BLOCK * BLOCK_BYTES[fmt])
        if (blocks.dtype != torch.uint8 or tuple(blocks.shape) != want
                or in_features % BLOCK):
            raise TformerError(f"{fmt} blocks of a [N, {in_features}] weight are uint8 "
                               f"{want}; got {blocks.dtype} {tuple(blocks.shape)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = bias
        self._dense: Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> BlockLinear:
        return cls(quantize(linear.weight, fmt), fmt, linear.in_features, linear.bias)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's)
        super()._apply(fn, recurse)
        self._dense = None
        return self

    @property
    def weight(self) -> Tensor:
        """The weight as the products see it, in fp32: for code that reads a linear's weight
        (Transformer-XL projects its memory with a slice of it)."""
        return dequantize(self.blocks, self.fmt)

    # A checkpoint holds the blocks under the parameter's own name, `weight` (uint8), as an
    # nn.Linear's weight would be: so a model saves and loads as its file names it.
    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001, ANN202
        destination[prefix + "weight"] = self.blocks if keep_vars else self.blocks.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):  # noqa: ANN001, ANN202
        if prefix + "weight" in state_dict:
            state_dict[prefix + "blocks"] = state_dict.pop(prefix + "weight")
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _fits(self, x: Tensor) -> bool:
        b = self.bias
        return (x.dtype == torch.float32 and x.device.type == "cpu"
                and self.blocks.device.type == "cpu"
                and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu"
                                   and b.is_contiguous())))

    def tformer_linear(self) -> library.BoundLinear | None:
        """The layer as step.c reads it (tformer.h's TFORMER_Q8_0, _Q4_0 or _Q4_1), or None
        where blocks.c cannot read its tensors; any number of rows."""
        if _lib() is None or not self._fits(torch.empty(0)):
            return None
        bias = None if self.bias is None else self.bias.detach()
        struct = library.Linear(KINDS[self.fmt], self.out_features, self.in_features,
                                self.blocks.data_ptr(), None,
                                None if bias is None else bias.data_ptr(), None, None, 0,
                                1 << 30)
        return library.BoundLinear(struct, 1 << 30,
                                   (self.blocks, *([] if bias is None else [bias])))

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
        y = call(lib, self.fmt, rows, self.blocks, self.out_features, self.in_features,
                 None if self.bias is None else self.bias.detach())
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"
