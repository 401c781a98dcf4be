"""A mixture of experts' feed-forward for a few rows in one C call (experts.c).

At a decoding step a token runs its k chosen experts: as modules, a gate, an up and a down
product each, every one a call into the block kernels with torch's glue around it, 3k calls
(24 for Qwen3-MoE's eight) and their Python a layer. `bind` describes a mixture's experts
to experts.c once (each projection a struct tformer_linear: an fp32 weight, stacked or an
nn.Linear's, or a BlockLinear's blocks, of any kind kinds.c's table has); `run` then
computes every row's weighted sum of its chosen experts, and the shared expert's, in one
call: x rounded once per activation kind, the gate and up products of all the chosen
experts in one parallel region with the threads splitting their output rows evenly, the
gates, the down products likewise, and the sums.

The products are kinds.c's (tformer_linear_rows), the same outputs for an expert as its
module's product, so the result is the module path's within float rounding (the same bits
for one row of block weights, but for the sigmoid of gpt-oss's gate and the shared
expert's, computed here). Where experts.c does not apply (no kernel, another weight format,
another gate) `bind` returns None and the modules run.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from tformer.kernels import library
from tformer.kernels.blocks import KINDS, BlockLinear
from tformer.kernels.library import Experts, Linear, Moe, Router

MAX_ROWS = 8
"""The most rows `run` is given (decoding's, a small batch's): beyond, the modules' grouped
products over repacked weights do better."""
GLU_SILU, GLU_CLAMPED = 0, 1
"""tformer.h's TFORMER_GLU_*."""


class Projection(NamedTuple):
    """A projection as experts.c reads it: the structure and the tensors it points into."""

    struct: Linear
    tensors: tuple[Tensor, ...]


class Binding(NamedTuple):
    """A mixture's experts as experts.c reads them: struct tformer_experts, and every
    structure and tensor it points into, held for as long as it is used."""

    struct: Experts
    held: tuple[object, ...]


def _f32(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                         and t.is_contiguous())


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def projection(module: nn.Module) -> Projection | None:
    """A linear layer as experts.c reads it: a BlockLinear's blocks (no repacked copy: the
    step's few rows stream the file's blocks), an fp32 nn.Linear, or another weight
    format's layer as it describes itself (`tformer_linear()`: int8); None for anything
    else (a StackedLinear, whose rows lie in parts)."""
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach()
    if not _f32(bias):
        return None
    if isinstance(module, BlockLinear):
        blocks = module.blocks
        if blocks.device.type != "cpu" or not blocks.is_contiguous():
            return None
        struct = Linear(KINDS[module.fmt], module.out_features, module.in_features,
                        blocks.data_ptr(), None, _ptr(bias), None, None, 0, 1 << 30)
        return Projection(struct, tuple(t for t in (blocks, bias) if t is not None))
    if type(module) is nn.Linear and _f32(module.weight):
        weight = module.weight.detach()
        n, k = weight.shape
        struct = Linear(library.KIND_FP32, n, k, weight.data_ptr(), None, _ptr(bias))
        return Projection(struct, tuple(t for t in (weight, bias) if t is not None))
    own = getattr(module, "tformer_linear", None)
    bound = own() if own is not None else None
    if bound is None or bound.struct.kind == library.KIND_STACK:
        return None
    return Projection(bound.struct, bound.tensors)


def stacked(weight: Tensor, bias: Tensor | None) -> list[Projection] | None:
    """Each expert's projection out of a stack [E, out, in] fp32 (and biases [E, out]):
    structures over its slices, nothing copied; None where the stack is not fp32,
    contiguous and on the CPU."""
    weight = weight.detach()
    bias = None if bias is None else bias.detach()
    if not (_f32(weight) and _f32(bias)):
        return None
    n_expert, n, k = weight.shape
    base, size = weight.data_ptr(), n * k * weight.element_size()
    return [Projection(Linear(library.KIND_FP32, n, k, base + e * size, None,
                              None if bias is None else bias[e].data_ptr()),
                       tuple(t for t in (weight, bias) if t is not None))
            for e in range(n_expert)]


def bind(gate: Sequence[Projection], up: Sequence[Projection], down: Sequence[Projection], *,
         clamped: tuple[float, float] | None = None,
         shared: Sequence[Projection] | None = None,
         shared_scale: Tensor | None = None) -> Binding | None:
    """The experts (gate[e], up[e], down[e], silu(gate) * up between them, or with
    `clamped` = (limit, alpha) gpt-oss's gate) and the shared expert (its gate, up and down,
    scaled by sigmoid(x . shared_scale), shared_scale a (1, D) or (D,) fp32 tensor, or by 1
    where None) as experts.c reads them; None where the kernel is not here."""
    if _lib() is None or not (len(gate) == len(up) == len(down) > 0):
        return None
    if shared_scale is not None:
        shared_scale = shared_scale.detach().reshape(-1)
        if not _f32(shared_scale):
            return None
    tables = [(Linear * len(p))(*(q.struct for q in p)) for p in (gate, up, down)]
    limit, alpha = clamped if clamped is not None else (0.0, 0.0)
    parts = [Linear(), Linear(), Linear()] if shared is None else [p.struct for p in shared]
    struct = Experts(*(ctypes.addressof(t) for t in tables), len(gate),
                     GLU_CLAMPED if clamped is not None else GLU_SILU, limit, alpha, *parts,
                     _ptr(shared_scale))
    tensors = {id(t): t for p in (*gate, *up, *down, *(shared or ())) for t in p.tensors}
    if shared_scale is not None:
        tensors[id(shared_scale)] = shared_scale
    return Binding(struct, (*tables, *tensors.values()))


class MixtureBinding(NamedTuple):
    """A mixture (router and experts) as step.c's layer step reads it: struct tformer_moe,
    the most rows it is given, and what it points into."""

    struct: Moe
    max_rows: int
    held: tuple[object, ...]


def bind_mixture(experts: Binding, router: Tensor, bias: Tensor | None, k: int, *,
                 after: bool, renormalise: bool) -> MixtureBinding | None:
    """The experts behind a router of fp32 scores router [E, D] (+ bias [E]) that picks k
    (layers/experts.py's Router: softmax over every score, or `after` over the k chosen,
    `renormalise`d to sum to 1 or not); None where the router's tensors are not fp32 on
    the CPU."""
    router = router.detach()
    bias = None if bias is None else bias.detach()
    if not (_f32(router) and _f32(bias)):
        return None
    n_expert, d = router.shape
    scores = Linear(library.KIND_FP32, n_expert, d, router.data_ptr(), None, _ptr(bias))
    struct = Moe(Router(scores, k, int(after), int(renormalise)), experts.struct)
    held = (*experts.held, *(t for t in (router, bias) if t is not None))
    return MixtureBinding(struct, MAX_ROWS, held)


def run(binding: Binding, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
    """x (N, D) fp32, N at most MAX_ROWS -> (N, D): sum_j weights[:, j] expert_{experts[:,
    j]}(x), and the shared expert's output scaled by its gate. experts (N, k) int64 and
    weights (N, k) fp32, the router's."""
    lib = _lib()
    x = x.contiguous()
    ids = experts.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    status = lib.tformer_experts_step(ctypes.byref(binding.struct), x.data_ptr(), x.shape[0],
                                      ids.data_ptr(), w.data_ptr(), ids.shape[1],
                                      out.data_ptr(), torch.get_num_threads())
    if status == -1:
        raise MemoryError(f"no memory for a mixture's step of {x.shape[0]} rows")
    if status:
        raise ValueError(f"experts.c refused the step ({status}): an expert id out of range "
                         f"or projections whose shapes do not fit together")
    return out


def reference(x: Tensor, experts: Tensor, weights: Tensor, gate: Sequence[Tensor],
              up: Sequence[Tensor], down: Sequence[Tensor]) -> Tensor:
    """What `run` computes for silu-gated experts without biases, in float64 from their fp32
    weights (gate[e] [F, D], ...): the self-check's and the tests' reference."""
    x = x.double()
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j, e in enumerate(experts[i].tolist()):
            g, u = x[i] @ gate[e].double().T, x[i] @ up[e].double().T
            out[i] += weights[i, j].double() * ((torch.nn.functional.silu(g) * u)
                                                 @ down[e].double().T)
    return out


@library.self_check
def check(lib: ctypes.CDLL) -> bool:
    """The step against its float64 reference on small q8_0 and fp32 experts (library.
    checked runs it once per library)."""
    from tformer.kernels.blocks import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    d, f, n_expert, k, m = 64, 32, 4, 2, 3
    weights = [torch.randn(n_expert, f, d, generator=g) * 0.2,
               torch.randn(n_expert, f, d, generator=g) * 0.2,
               torch.randn(n_expert, d, f, generator=g) * 0.2]
    x = torch.randn(m, d, generator=g)
    ids = torch.tensor([[0, 2], [2, 3], [1, 0]])
    w = torch.rand(m, k, generator=g)
    for fmt in ("q8_0", None):
        if fmt is None:
            parts = [stacked(t, None) for t in weights]
            used = weights
        else:
            parts = [[projection(BlockLinear(quantize(t[e], fmt), fmt, t.shape[2]))
                      for e in range(n_expert)] for t in weights]
            used = [torch.stack([dequantize(quantize(t[e], fmt), fmt) for e in range(n_expert)])
                    for t in weights]
        tables = [(Linear * n_expert)(*(p.struct for p in q)) for q in parts]
        struct = Experts(*(ctypes.addressof(t) for t in tables), n_expert, GLU_SILU, 0.0, 0.0)
        out = torch.empty(m, d)
        if lib.tformer_experts_step(ctypes.byref(struct), x.data_ptr(), m, ids.data_ptr(),
                                    w.data_ptr(), k, out.data_ptr(), 1):
            return False
        want = reference(x, ids, w, *used).float()
        # q8_0 rounds x to blocks: within a few hundredths of the output's scale
        tolerance = 1e-4 if fmt is None else 3e-2
        if not torch.allclose(out, want, rtol=0, atol=tolerance * float(want.abs().max())):
            return False
    return True


def _lib() -> ctypes.CDLL | None:
    return library.checked(check)


def available() -> bool:
    """Whether experts.c runs here."""
    return _lib() is not None
