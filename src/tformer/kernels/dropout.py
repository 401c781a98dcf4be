"""Dropout for training on the CPU, with a counter-based random number generator.

torch's CPU dropout draws every element's keep-or-drop from one Mersenne Twister, an element
at a time (about 12 ns each): at the Multi30k config's size (d_model 128, dropout in 42
places a step) that was a quarter of a training step. `dropout.c` computes each element's
random word as Philox4x32-10 of its index under a seed (the generator torch's own GPU dropout
uses), eight counters at a time in AVX2 lanes and blocks on any number of threads, and
multiplies in the same pass. The backward pass draws the same mask again from the seed, so
nothing but the seed is kept for it (torch keeps a mask the size of the input).

The seed is drawn from torch's default generator, one number a call: `torch.manual_seed`
makes a run repeatable, and a checkpoint's saved generator state resumes it exactly, as with
torch's dropout. The masks differ from torch's (another generator); their statistics do not.
Where the kernel does not apply (not a float32 CPU tensor, no compiled kernel, under
torch.compile, p of 0 or 1) this is `F.dropout`.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from tformer.kernels import library


def philox4x32(lib: ctypes.CDLL, counter: list[int], key: list[int]) -> list[int]:
    """dropout.c's generator on its own: the four words of Philox4x32-10 for one counter
    (four 32-bit words) and key (two), for known-answer tests and the check below."""
    out = (ctypes.c_uint32 * 4)()
    lib.tformer_philox4x32((ctypes.c_uint32 * 4)(*counter), (ctypes.c_uint32 * 2)(*key), out)
    return list(out)


def check(lib: ctypes.CDLL) -> bool:
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


def native() -> ctypes.CDLL | None:
    """The kernels' library, where this module's kernels passed their check; else None."""
    return library.checked(check)


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """F.dropout(x, p, training): zero each element with probability p and scale the rest by
    1 / (1 - p); the identity when not training."""
    if not training or p == 0.0:
        return x
    if not runs_natively(x, p):
        return F.dropout(x, p, training)
    seed = int(torch.randint(0, 2**63 - 1, ()))
    return _PhiloxDropout.apply(x, p, seed)


def runs_natively(x: Tensor, p: float) -> bool:
    """Whether `dropout(x, p)` in training runs the kernel (else it is F.dropout)."""
    return (
        0.0 < p < 1.0 and x.device.type == "cpu" and x.dtype == torch.float32
        and not torch.compiler.is_compiling() and native() is not None
    )


class Dropout(nn.Dropout):
    """nn.Dropout through `dropout` (the same attributes, state and behaviour)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)


class _PhiloxDropout(torch.autograd.Function):
    """y = x * mask / (1 - p), and the gradient g * mask / (1 - p) with the same mask, drawn
    again from the seed."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float, seed: int) -> Tensor:  # type: ignore[override]
        ctx.p, ctx.seed = p, seed
        return apply_mask(x, p, seed)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        return apply_mask(grad, ctx.p, ctx.seed), None, None


def threshold(p: float) -> int:
    """Elements whose 32-bit word is below this are dropped: floor(p * 2^32)."""
    return min(int(p * 2**32), 2**32 - 1)


def apply_mask(x: Tensor, p: float, seed: int) -> Tensor:
    """x * mask(seed) / (1 - p) through the kernel: x a float32 CPU tensor, 0 < p < 1."""
    lib = native()
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.tformer_dropout(x.data_ptr(), y.data_ptr(), x.numel(), seed, threshold(p),
                        1.0 / (1.0 - p), torch.get_num_threads())
    return y
