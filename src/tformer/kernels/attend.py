"""A decoding step's attention, one query per row, reading the cache where it lies.

At every decoding step each hypothesis attends with one query over the keys cached so far.
torch's fused attention takes ~90 us a call at these sizes, mostly fixed costs, and wants
the keys of each row in one block: beam search then copies every layer's cache into the
surviving hypotheses' order after each step. `attend.c` computes the step's attention in a
few microseconds and reads each position's key from wherever it was written, following a
table of buffer rows (`rows`, kept by layers.attention.Lineage), so that the cache is never
copied; without a table, rows share buffer rows in groups (the beams of a sentence reading
its encoder output). Where the kernel is not built, `attend_step` computes the same with
torch (gathering the keys).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from tformer.kernels import library
from tformer.kernels.library import KV

MAX_POSITIONS = 8192
"""attend_step keeps a row's scores on the stack: longer caches take torch's path. The paged
kernel (attend_paged) has no such bound: it takes a span of positions at a time."""


@library.self_check
def check(lib: ctypes.CDLL) -> bool:
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


def native() -> ctypes.CDLL | None:
    """The kernels' library, where this module's kernels passed their check; else None."""
    return library.checked(check)


def serves_cache(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether decoding steps over a cache of this dtype on this device run the kernel
    (float32 on a CPU, the library built): where they do, beam search can leave the cache in
    place (layers.attention.Lineage)."""
    return device.type == "cpu" and dtype == torch.float32 and native() is not None


def serves(x: Tensor) -> bool:
    """Whether the kernel computes attention over queries like `x`: serves_cache, and no
    gradient wanted (the kernel has no backward pass), and not under torch.compile."""
    return (
        serves_cache(x.dtype, x.device) and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    )


def attend_step(
    q: Tensor, k: Tensor, v: Tensor, length: int, *, rows: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """softmax(q . k / sqrt(d) + bias) v for one query per row over `length` positions.

    q: (N, H, d).
    k, v: (R, H_kv, P >= length, d) and (R, H_kv, P, d_value) buffers, the last axis
        contiguous; H_kv divides H, and query head h reads key/value head h // (H / H_kv)
        (grouped-query attention).
    rows: (N, >= length) int64: position s of row i's keys and values is in buffer row
        rows[i, s], in [0, R) (IndexError from the kernel otherwise). None: row i reads
        buffer row i // (N // R) throughout (N a multiple of R).
    bias: (R, >= length) float added to the scores of buffer row R's positions (0 or -inf
        for the source's padding); only where `rows` is None.
    Returns (N, H, d_value).
    """
    # A decoding step calls this a dozen times, each a few microseconds of C: the checks are
    # written as plain comparisons of shapes and strides read once.
    n, heads, d = q.shape
    r, k_heads, k_positions, k_d = k.shape
    v_r, v_heads, v_positions, dv = v.shape
    if rows is None and n % r:
        raise ValueError(f"attend_step: {n} query rows cannot share {r} buffer rows evenly")
    if rows is not None and bias is not None:
        raise ValueError("attend_step: a bias is for shared buffer rows (rows = None)")
    if not 1 <= length <= min(k_positions, v_positions):
        raise ValueError(f"attend_step: {length} positions of a cache of {k_positions}")
    if heads % k_heads or k_d != d or v_r != r or v_heads != k_heads:
        raise ValueError(f"attend_step: queries {tuple(q.shape)} over keys {tuple(k.shape)} "
                         f"and values {tuple(v.shape)}")
    if rows is not None and (rows.dim() != 2 or rows.shape[0] != n or rows.shape[1] < length):
        raise ValueError(f"attend_step: rows {tuple(rows.shape)} for {n} rows of {length}")
    if bias is not None and (bias.dim() != 2 or bias.shape[0] != r or bias.shape[1] < length):
        raise ValueError(f"attend_step: bias {tuple(bias.shape)} for {r} rows of {length}")
    q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
    if q_stride[1] != d or q_stride[2] != 1:  # the kernel finds head h at row + h * d
        q = q.contiguous()
        q_stride = q.stride()
    lib = native()
    if (lib is None or k_stride[3] != 1 or v_stride[3] != 1 or length > MAX_POSITIONS
            or k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device
            or v.device != q.device or not serves(q)
            or (rows is not None and (rows.dtype != torch.long or rows.stride(1) != 1
                                      or rows.device != q.device))
            or (bias is not None and (bias.dtype != q.dtype or bias.stride(1) != 1
                                      or bias.device != q.device))):
        return attend_step_reference(q, k, v, length, rows=rows, bias=bias)
    out = q.new_empty(n, heads, dv)
    if lib.tformer_attend_step(
        q.data_ptr(), q_stride[0], k.data_ptr(), k_stride[0], k_stride[1], k_stride[2],
        v.data_ptr(), v_stride[0], v_stride[1], v_stride[2],
        None if rows is None else rows.data_ptr(), 0 if rows is None else rows.stride(0),
        n // r, None if bias is None else bias.data_ptr(), 0 if bias is None else bias.stride(0),
        out.data_ptr(), n, r, heads, heads // k_heads, length, 1, d, dv, d**-0.5,
        torch.get_num_threads(),
    ):
        raise IndexError(f"attend_step: a row of `rows` is not among the {r} buffer rows")
    return out


def gather_positions(buffer: Tensor, rows: Tensor, length: int) -> Tensor:
    """(R, H, P, ·) buffer, (N, >= length) rows -> (N, H, length, ·): position s of row i
    taken from buffer row rows[i, s]."""
    positions = torch.arange(length, device=buffer.device)
    return buffer[rows[:, :length], :, positions].transpose(1, 2)


def attend_step_reference(
    q: Tensor, k: Tensor, v: Tensor, length: int, *, rows: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """attend_step with torch: the keys and values gathered into each row's order, then
    attention written out."""
    n, r, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if rows is None:
        shared = torch.arange(n, device=q.device) // (n // r)
        k, v = k[shared, :, :length], v[shared, :, :length]
    else:
        k, v = gather_positions(k, rows, length), gather_positions(v, rows, length)
    scores = (q[:, :, None, :] @ k.transpose(-1, -2))[:, :, 0] / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias[shared, None, :length]
    return (scores.softmax(dim=-1)[:, :, None, :] @ v)[:, :, 0]


def attend_paged(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, lengths: Tensor, *,
                 window: int | None = None, counts: Tensor | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: Tensor | None = None) -> Tensor:
    """attend_step over a paged cache (Kwon et al. 2023), the keys read in their blocks.

    q: (N, H, d) one query per sequence, or (N, H, T, d): T new tokens of each sequence
        (a prompt's chunk, a speculative round's drafts), each attending causally.
    k, v: (blocks, H_kv, block_size, d) and (blocks, H_kv, block_size, d_value): the pool's
        blocks, the new tokens' keys and values stored already; the values' last axis
        contiguous, the keys' in any strides, read fastest turned as the pool keeps them
        (a view of (blocks, H_kv, d, block_size): PagedPool's).
    tables: (N, >= used) int64: sequence i's position s lies at slot s % block_size of block
        tables[i, s // block_size] (IndexError from the kernel where it names no block).
    lengths: (N,) int64, sequence i's positions with its new ones: its T queries are
        positions lengths[i] - T .. lengths[i] - 1.
    window: each query reads only the last `window` positions up to its own (None: all).
    counts: (N,) int64, sequence i's real new tokens, the first counts[i] of its T columns
        (its last counts[i] positions; the other columns' outputs are zeros): rows of a pass
        that read chunks of different lengths (None: all T).
    scale, softcap, sinks: as layers/scaled_dot_product.py's (Gemma 2's scale and soft cap,
        gpt-oss's sink logit per query head).
    Returns (N, H, d_value), or (N, H, T, d_value) for T new tokens (a view of a (N, T, H,
    d_value) tensor: attention's output flattens its heads without a copy).
    """
    tokens = q.shape[2] if q.dim() == 4 else 1
    n, heads, d = q.shape[0], q.shape[1], q.shape[-1]
    blocks, k_heads, block, _ = k.shape
    dv = v.shape[-1]
    lib = native()
    if (lib is None or not serves(q) or v.stride(3) != 1 or k.dtype != q.dtype
            or v.dtype != q.dtype):
        return attend_paged_reference(q, k, v, tables, lengths, window=window, counts=counts,
                                      scale=scale, softcap=softcap, sinks=sinks)
    # Row i of the kernel's queries is token i % tokens of sequence i // tokens.
    rows = (q.transpose(1, 2) if q.dim() == 4 else q).contiguous()
    tables, lengths = tables.contiguous(), lengths.contiguous()
    if counts is not None:
        counts = counts.to(torch.long).contiguous()
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    out = q.new_empty(n * tokens, heads, dv)
    if lib.tformer_attend_paged(
        rows.data_ptr(), heads * d, ctypes.byref(KV.of(k, v)), tables.data_ptr(),
        tables.stride(0), block, lengths.data_ptr(),
        None if counts is None else counts.data_ptr(), window or 0, out.data_ptr(),
        n * tokens, tokens, heads, heads // k_heads, d, dv, d**-0.5 if scale is None else scale,
        softcap or 0.0, None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
    ):
        raise IndexError(f"attend_paged: a block table names a block outside the {blocks}, "
                         f"or a length is below its new tokens (of {tokens})")
    if q.dim() == 3:
        return out
    return out.view(n, tokens, heads, dv).transpose(1, 2)


def attend_paged_reference(q: Tensor, k: Tensor, v: Tensor, tables: Tensor, lengths: Tensor,
                           *, window: int | None = None, counts: Tensor | None = None,
                           scale: float | None = None, softcap: float | None = None,
                           sinks: Tensor | None = None) -> Tensor:
    """attend_paged with torch: each sequence's blocks gathered in order, then attention
    written out over its positions (each query's causal window's)."""
    block, group = k.shape[2], q.shape[1] // k.shape[1]
    queries = q if q.dim() == 4 else q[:, :, None]
    tokens = queries.shape[2]
    reals = [tokens] * len(lengths) if counts is None else counts.tolist()
    out = []
    for i, (length, real) in enumerate(zip(lengths.tolist(), reals, strict=True)):
        used = tables[i, : -(-length // block)]
        keys, values = (t[used].transpose(0, 1).flatten(1, 2)[:, :length]
                        .repeat_interleave(group, dim=0) for t in (k, v))
        scores = (queries[i] @ keys.transpose(1, 2)) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)  # (H, T, S)
        at = torch.arange(length - real, length - real + tokens)[:, None]  # each query's position
        seen = torch.arange(length)[None] <= at
        if window:
            seen &= torch.arange(length)[None] > at - window
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:  # one more logit a head, with no value behind it
            sink = sinks.to(scores.dtype)[:, None, None].expand(-1, tokens, 1)
            scores = torch.cat([scores, sink], dim=-1)
        probs = scores.softmax(dim=-1)[..., :length]
        probs = probs.masked_fill(torch.arange(tokens)[:, None] >= real, 0.0)
        out.append(probs @ values)
    result = torch.stack(out)
    return result if q.dim() == 4 else result[:, :, 0]
