"""llama.cpp's K super-blocks, byte for byte: 256 values a block, in groups with scales of
their own, the scales themselves quantized against one fp16 factor.

    q4_k  144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc and minimums mn
          (one each per 32 values), qs[128]: 4-bit q        x = d sc q - dmin mn
    q5_k  176 bytes: as q4_k, with qh[32] (a fifth bit per value) before qs
    q6_k  210 bytes: ql[128] (low 4 bits), qh[64] (top 2 bits), 16 int8 scales (one per 16
          values), fp16 d                                    x = d sc (q - 32)
    iq4_xs 136 bytes: fp16 d, the eight 6-bit scales (one per 32 values, stored plus 32) as
          a 16-bit word of their top two bits and four bytes of their low four, qs[128]:
          4-bit indices into 16 non-linear values v        x = d sc v[q]

The order of values within qs, qh and ql is kquants.c's text (and gguf.quants' dequantizers,
which the tests compare with). The quantize_* functions follow llama.cpp's reference
quantizers (quantize_row_q4_K_ref, _q5_K_ref, _q6_K_ref in ggml-quants.c): for q4_k and
q5_k each 32 values get the scale and minimum of a weighted least-squares search over 21
(q5_k: 16) trial scales besides the plain max-min one (ggml's make_qkx2_quants), weights
|x| + their rms; for q6_k each 16 values the scale of a search over 20 trial scales weighted
by x^2 (make_qx_quants); the scales are then rounded to 6 (8) bits against the block's
largest and the values rounded again with the rounded scales. The sums run in float64
(ggml's in fp32), so a value on a rounding boundary may round otherwise than llama.cpp
rounds it: the bytes are llama.cpp's layout and method, not promised equal to its output
(gguf.quants has no K quantizer to compare with). iq4_xs follows quantize_row_iq4_nl_impl
(ggml-quants.c, no importance matrix): each 32 values the least-squares scale, weights x^2,
for the values nearest x at 15 trial scales (t - 127) / max, t = -7..7, besides 127 / max;
the eight scales rounded to 6 bits against -(the largest) / 32, and the values chosen again
at the rounded scales. kquants.c's tformer_quantize_k computes these same bytes, step for
step, much faster; blocks.quantize uses it where it is built.
"""

from __future__ import annotations

import torch
from torch import Tensor

QK = 256
"""Values in a super-block."""
CHUNK = 1024
"""Super-blocks quantized at a time (the searches hold 21 trials of each)."""


def _fp16(t: Tensor) -> Tensor:
    """fp32 -> the value fp16 rounds it to, back in fp32 (the d a file stores)."""
    return t.to(torch.float16).float()


def _fp16_bytes(t: Tensor) -> Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8)


def _over(numerator: float, t: Tensor) -> Tensor:
    """numerator / t in fp32, correctly rounded as C's division (torch's `number / tensor`
    multiplies by the reciprocal, which may round differently)."""
    return torch.full_like(t, numerator) / t


def _dsum(t: Tensor) -> Tensor:
    """Sum over the last dimension in float64, kept: fp32 products sum exactly enough that
    the order (kquants.c's differs) does not change the result's fp32 rounding."""
    return t.double().sum(-1, keepdim=True)


def _search_scale_min(x: Tensor, nmax: int, rmin: float, steps: int
                      ) -> tuple[Tensor, Tensor]:
    """x [..., 32] -> (scale, minimum) [..., 1] with x ~ scale * q - minimum, q in 0..nmax
    (ggml's make_qkx2_quants with rdelta 0.1): the minimum at least 0, the pair the best, by
    sum w (scale q - minimum - x)^2 with w = |x| + the 32 values' rms, of the plain max-min
    rounding and of the least-squares fits for q rounded at trial scales
    (nmax + rmin + s/10) / (max - min), s = 0..steps.

    A trial needs only q's sums against w, w x and w q; the fits and their errors are then
    sums of those, in float64 (the products in fp32 first, as kquants.c computes them)."""
    rms = _dsum(x * x).div(32).sqrt().float()
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0.0)
    span = x.amax(dim=-1, keepdim=True) - lo
    flat = span == 0
    span = torch.where(flat, 1.0, span)
    w = x.abs() + rms
    wx, shifted = w * x, x - lo
    sw, sx, sxx = _dsum(w), _dsum(wx), _dsum(wx * x)
    q = torch.empty_like(x)

    def sums(iscale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        torch.mul(shifted, iscale, out=q).round_().clamp_(0, nmax)
        wq = w * q
        return _dsum(wq), _dsum(wq * q), _dsum(wx * q)

    def error(s: Tensor, o: Tensor, sl: Tensor, sl2: Tensor, sxl: Tensor) -> Tensor:
        # sum w (s q + o - x)^2, expanded
        return s * s * sl2 + 2 * s * o * sl - 2 * s * sxl + o * o * sw - 2 * o * sx + sxx

    best_scale, best_min = (span / nmax).double(), lo.double()
    best = error(best_scale, best_min, *sums(_over(float(nmax), span)))
    for step in range(steps + 1):
        sl, sl2, sxl = sums(_over(rmin + 0.1 * step + nmax, span))
        det = sw * sl2 - sl * sl
        solvable = det > 0
        det = torch.where(solvable, det, 1.0)
        scale = (sw * sxl - sx * sl) / det
        offset = (sl2 * sx - sl * sxl) / det
        # the offset at most 0: refitted through zero where the free fit wants it above
        above = offset > 0
        scale = torch.where(above, sxl / torch.where(sl2 > 0, sl2, 1.0), scale)
        offset = torch.where(above, 0.0, offset)
        err = error(scale, offset, sl, sl2, sxl)
        better = solvable & (err < best)
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, offset, best_min)
    return torch.where(flat, 0.0, best_scale.float()), torch.where(flat, -lo, -best_min.float())


def _pack_scales(sc: Tensor, mn: Tensor) -> Tensor:
    """Eight 6-bit scales and minimums [..., 8] -> q4_k's 12 bytes (kquants.c's k_scales)."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    out = torch.zeros(*sc.shape[:-1], 12, dtype=torch.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return out


def _unpack_scales(b: Tensor) -> tuple[Tensor, Tensor]:
    """q4_k's 12 bytes [..., 12] -> (scales, minimums) [..., 8], as integers."""
    b = b.long()
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _quantize_qk(x: Tensor, nmax: int, rmin: float, steps: int
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, 256] -> (the 4-byte d and dmin, the 12 scale bytes, q [B, 256] in 0..nmax)."""
    g = x.reshape(-1, 8, 32)
    scale, minimum = _search_scale_min(g, nmax, rmin, steps)
    scale, minimum = scale.squeeze(-1), minimum.squeeze(-1)
    top_s = scale.amax(-1, keepdim=True).clamp(min=0)
    top_m = minimum.amax(-1, keepdim=True).clamp(min=0)
    inv_s = torch.where(top_s > 0, _over(63.0, torch.where(top_s > 0, top_s, 1.0)), 0.0)
    inv_m = torch.where(top_m > 0, _over(63.0, torch.where(top_m > 0, top_m, 1.0)), 0.0)
    ls = torch.round(inv_s * scale).clamp(max=63)
    lm = torch.round(inv_m * minimum).clamp(max=63)
    d, dmin = _fp16(top_s / 63), _fp16(top_m / 63)
    dj = (d * ls).unsqueeze(-1)
    mj = (dmin * lm).unsqueeze(-1)
    q = torch.round((g + mj) / torch.where(dj == 0, 1.0, dj)).clamp(0, nmax)
    q = torch.where(dj == 0, 0.0, q)
    head = torch.cat([_fp16_bytes(d), _fp16_bytes(dmin)], -1)
    return head, _pack_scales(ls, lm), q.reshape(-1, QK).to(torch.uint8)


def _nibbles(q: Tensor) -> Tensor:
    """q [B, 256] -> qs [B, 128]: each 64 values j as 32 bytes, the first 32 in the low
    halves, the next 32 in the high."""
    q = (q & 15).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(x: Tensor) -> Tensor:
    head, scales, q = _quantize_qk(x, 15, -1.0, 20)
    return torch.cat([head, scales, _nibbles(q)], -1)


def quantize_q5_k(x: Tensor) -> Tensor:
    head, scales, q = _quantize_qk(x, 31, -0.5, 15)
    bits = (q >> 4).reshape(-1, 8, 32)  # value 32i + l's fifth bit: bit i of qh[l]
    qh = (bits << torch.arange(8, dtype=torch.uint8)[:, None]).sum(1, dtype=torch.uint8)
    return torch.cat([head, scales, qh, _nibbles(q)], -1)


def _search_scale(x: Tensor, nmax: int) -> Tensor:
    """x [..., 16] -> scale [..., 1] with x ~ scale * q, q in -nmax..nmax-1 (ggml's
    make_qx_quants, its rmse_type 1): the least-squares scale, by weights x^2, for q
    rounded at -nmax / max (max the value largest in size), replaced by that of any of the
    trials -(nmax + s/10) / max, s = -9..9, that fits better."""
    big = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    tiny = big.abs() < 1e-15
    big = torch.where(tiny, 1.0, big)
    w = x * x
    wx = w * x

    def trial(iscale: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        return _dsum(wx * q), _dsum(w * q * q)

    sxl, sl2 = trial(_over(float(-nmax), big))
    scale = sxl / torch.where(sl2 > 0, sl2, 1.0)
    best = scale * sxl
    for s in range(-9, 10):
        txl, tl2 = trial(_over(-(nmax + 0.1 * s), big))
        better = (tl2 > 0) & (txl * txl > best * tl2)
        tscale = txl / torch.where(tl2 > 0, tl2, 1.0)
        scale = torch.where(better, tscale, scale)
        best = torch.where(better, tscale * txl, best)
    return torch.where(tiny, 0.0, scale.float())


def quantize_q6_k(x: Tensor) -> Tensor:
    g = x.reshape(-1, 16, 16)
    scale = _search_scale(g, 32).squeeze(-1)
    big = scale.gather(-1, scale.abs().argmax(-1, keepdim=True))
    nonzero = big != 0
    iscale = torch.where(nonzero, _over(-128.0, torch.where(nonzero, big, 1.0)), 0.0)
    d = _fp16(torch.where(nonzero, torch.reciprocal(torch.where(nonzero, iscale, 1.0)), 0.0))
    sc = torch.round(iscale * scale).clamp(max=127)
    dj = (d * sc).unsqueeze(-1)
    q = torch.round(g / torch.where(dj == 0, 1.0, dj)).clamp(-32, 31) + 32
    q = torch.where(dj == 0, 32.0, q).reshape(-1, 2, 4, 32).to(torch.uint8)
    # each 128 values h: ql's 64 bytes hold parts 0, 1 in low halves and 2, 3 in high
    ql = torch.cat([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                    (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], -1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _fp16_bytes(d)], -1)


def dequantize_q4_k(b: Tensor) -> Tensor:
    return _dequantize_qk(b, b[:, 16:144], None)


def dequantize_q5_k(b: Tensor) -> Tensor:
    return _dequantize_qk(b, b[:, 48:176], b[:, 16:48])


def _dequantize_qk(b: Tensor, qs: Tensor, qh: Tensor | None) -> Tensor:
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    dmin = b[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = _unpack_scales(b[:, 4:16])
    qs = qs.reshape(-1, 4, 1, 32)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32).long()
    if qh is not None:
        q = q | (((qh[:, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1).long()
                 << 4)
    return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(-1, QK)


def dequantize_q6_k(b: Tensor) -> Tensor:
    ql, qh = b[:, :128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], 2).reshape(-1, 2, 4, 32)
    top = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
    q = (low.long() | (top.long() << 4)).reshape(-1, 16, 16) - 32
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = b[:, 208:210].contiguous().view(torch.float16).float()
    return ((d * sc)[..., None] * q).reshape(-1, QK)


IQ4_VALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=torch.float32)
"""iq4_xs's 16 values (llama.cpp's kvalues_iq4nl), in order."""


def _iq4_nearest(v: Tensor) -> Tensor:
    """The index of IQ4_VALUES' value nearest to each of v (fp32), the larger where two are
    as near (ggml's best_index_int8)."""
    above = torch.bucketize(v, IQ4_VALUES, right=True).clamp(1, 15)  # the first value > v
    below = above - 1
    down = (v - IQ4_VALUES[below]) < (IQ4_VALUES[above] - v)
    return torch.where(down, below, above)


def _iq4_search(x: Tensor) -> Tensor:
    """x [..., 32] -> scale [...] with x ~ scale v, v one of IQ4_VALUES (kquants.c's
    iq4_search): the least-squares scale, weights x^2, of the values nearest x at
    127 / max (max the value largest in size), replaced by any trial's at (t - 127) / max,
    t = -7..7, that fits better; products in fp32, their sums in float64."""
    w = x * x
    big = x.gather(-1, x.abs().argmax(-1, keepdim=True))
    tiny = big.abs() < 1e-15
    big = torch.where(tiny, 1.0, big)

    def trial(iscale: Tensor) -> tuple[Tensor, Tensor]:
        v = IQ4_VALUES[_iq4_nearest(iscale * x)]
        wv = w * v
        return _dsum(wv * x), _dsum(wv * v)

    sxv, svv = trial(_over(1.0, big / torch.full_like(big, 127.0)))  # C's divisions
    scale = torch.where(svv > 0, sxv / torch.where(svv > 0, svv, 1.0), 0.0)
    best = scale * sxv
    for t in range(-7, 8):
        txv, tvv = trial(_over(float(t - 127), big))
        better = (tvv > 0) & (txv * txv > best * tvv)
        tscale = txv / torch.where(tvv > 0, tvv, 1.0)
        scale = torch.where(better, tscale, scale)
        best = torch.where(better, tscale * txv, best)
    return torch.where(tiny, 0.0, scale.float()).squeeze(-1)


def quantize_iq4_xs(x: Tensor) -> Tensor:
    g = x.reshape(-1, 8, 32)
    scale = _iq4_search(g)
    big = scale.gather(-1, scale.abs().argmax(-1, keepdim=True))
    d = -big / 32
    inv = torch.where(d != 0, _over(1.0, torch.where(d != 0, d, 1.0)), 0.0)
    ls = torch.round(inv * scale).clamp(-32, 31)
    dl = (d * ls).unsqueeze(-1)
    idl = torch.where(dl != 0, _over(1.0, torch.where(dl != 0, dl, 1.0)), 0.0)
    q = _iq4_nearest(idl * g).to(torch.uint8)  # [B, 8, 32]
    stored = (ls + 32).to(torch.int64)
    low = stored & 15
    scales_l = (low[:, 0::2] | (low[:, 1::2] << 4)).to(torch.uint8)
    high = ((stored >> 4) << (2 * torch.arange(8))).sum(-1, keepdim=True)
    scales_h = torch.cat([high & 255, high >> 8], -1).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(-1, 128)
    return torch.cat([_fp16_bytes(d), scales_h, scales_l, qs], -1)


def dequantize_iq4_xs(b: Tensor) -> Tensor:
    d = b[:, 0:2].contiguous().view(torch.float16).float()
    high = b[:, 2].long() | (b[:, 3].long() << 8)
    j = torch.arange(8)
    low = (b[:, 4 + j // 2].long() >> (4 * (j % 2))) & 15
    sc = (low | (((high[:, None] >> (2 * j)) & 3) << 4)) - 32
    qs = b[:, 8:].reshape(-1, 8, 1, 16)
    q = torch.cat([qs & 15, qs >> 4], 2).reshape(-1, 8, 32).long()
    return ((d * sc.float())[..., None] * IQ4_VALUES[q]).reshape(-1, QK)


QUANTIZE = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k,
            "iq4_xs": quantize_iq4_xs}
DEQUANTIZE = {"q4_k": dequantize_q4_k, "q5_k": dequantize_q5_k, "q6_k": dequantize_q6_k,
              "iq4_xs": dequantize_iq4_xs}
"""x [B, 256] fp32 <-> super-blocks [B, bytes] uint8, per format."""


def chunked(fn, x: Tensor) -> Tensor:  # noqa: ANN001
    """fn over x's rows [B, ...] CHUNK at a time (the searches' memory stays bounded)."""
    return torch.cat([fn(x[i:i + CHUNK]) for i in range(0, max(len(x), 1), CHUNK)])
