"""A decoder layer's decoding step in one C call (step.c): a translation decoder's
(`DecoderStep`) or a language model's (`LMStep`).

A step of beam search over one sentence runs each decoder layer on a few rows: six matrix
products, two attentions, three layer norms, residual additions and an activation, ~25
torch operations and module calls whose Python and dispatch cost, a few microseconds each,
was about a third of a step on OPUS-MT's shape. `DecoderStep` reads a decoder's weights
once per search (Seq2Seq.make_cache makes it) and then runs every layer's step as one call
into step.c, which computes what the modules compute with the same product and attention
kernels: the same bits from those, and layer norms and activations that round a little
differently from torch's. Where it does not apply (training, gradients, attention being
recorded, many fp32 rows, shapes or modules it does not know) the modules run.

A language model's layer is the same story with more calls: SmolLM2-135M's shape (30
layers, RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) makes ~70 torch
operations a layer and a token, ~40 ms of calls a token against ~50 ms of arithmetic.
`LMStep` runs each of its layers as one call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from tformer.kernels import attend, fp32
from tformer.kernels.attend import MAX_POSITIONS, serves_cache
from tformer.kernels.library import KV, BoundLinear, DecoderLayer, Linear, LMLayer, Norm

DecoderCache = Any
"""tformer.layers.cache.DecoderCache (kernels import nothing above them: the modules a step
reads say what they are through `gated` and `rms`)."""
StaticKV = Any
"""tformer.layers.cache.StaticKV: a cross-attention's keys and values (k, v)."""

_ACTIVATIONS = {nn.ReLU: 0, nn.SiLU: 3}
"""step.c's activations (and GELU: 1 exact, 2 tanh)."""


def _activation(module: nn.Module) -> int | None:
    if type(module) is nn.GELU:
        return {"none": 1, "tanh": 2}.get(module.approximate)
    return _ACTIVATIONS.get(type(module))


def _is_f32_cpu(t: Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                         and t.is_contiguous())


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(module: nn.Module, f32_rows: int = fp32.MAX_ROWS) -> BoundLinear | None:
    """A linear layer as step.c reads it, or None where it cannot: its weight format's
    module describes itself (`tformer_linear()`, tformer.h's struct tformer_linear with a
    kind); a plain fp32 layer is given f32_rows at most (fp32.bound_linear)."""
    own = getattr(module, "tformer_linear", None)
    if own is not None:
        return own()
    return fp32.bound_linear(module, f32_rows)


def _norm(module: nn.Module) -> Norm | None:
    """The structure for a LayerNorm or an RMSNorm (step.c's kinds 0 and 1), or None."""
    if getattr(module, "rms", False) and _is_f32_cpu(module.weight):
        return Norm(module.weight.data_ptr(), None, module.eps, 1)
    if not (isinstance(module, nn.LayerNorm) and module.weight is not None
            and len(module.normalized_shape) == 1 and _is_f32_cpu(module.weight)
            and _is_f32_cpu(module.bias)):
        return None
    return Norm(module.weight.data_ptr(), _ptr(module.bias), module.eps, 0)


def _library() -> ctypes.CDLL | None:
    """The kernels' library, where attend.c's kernel (which step.c calls) passed its check."""
    return attend.native()


class _BoundLayer(NamedTuple):
    """A layer's structure, the most rows its products take, and every tensor it points
    into: the layer's parameters and buffers, and what its linears made (packed weights)."""

    struct: DecoderLayer | LMLayer
    max_rows: int
    tensors: list[Tensor]

    @classmethod
    def of(cls, struct: DecoderLayer | LMLayer, layer: nn.Module,
           linears: list[BoundLinear]) -> _BoundLayer:
        tensors = [*layer.parameters(), *layer.buffers(), *(t for b in linears for t in b.tensors)]
        return cls(struct, min(b.max_rows for b in linears), tensors)


def _paged_status(status: int, rows: int) -> None:
    """A paged step's status (step.c) as an error, where it is one."""
    if status == -1:
        raise MemoryError(f"no memory for a decoding step of {rows} rows")
    if status:
        raise IndexError("paged decoding step: a block table names a block outside the pool")


DECODER_F32_ROWS = 32
"""The most rows an fp32 decoder's step takes. fp32.c's products are slower than oneDNN's
from about eight rows on, but one call a layer saves ~60 torch calls a layer: beam search's
steps over a paged pool (decoding/beam_pool.py) took 0.66-0.83x the modules' time from 8 to
64 rows on a 4 x 128-wide decoder, and 0.53-0.82x from 8 to 32 rows on a 6 x 512-wide one
(1.05x at 64, 1.4x at 128), two threads of a Xeon (benchmarks/README.md)."""


class DecoderStep:
    """Every layer of a decoder (models.seq2seq.DecoderLayer) as step.c reads it, over the
    cache of one search (`of`: `serves` says whether it runs a given step, `run` runs it), or
    over a paged pool (`paged`: `serves_paged`, `run_paged`). Both return None where step.c
    cannot run these layers."""

    def __init__(self, layers: Sequence[nn.Module], structs: list[DecoderLayer], rows: int,
                 tensors: list[Tensor], cache: DecoderCache | None) -> None:
        self.layers = list(layers)
        self.cache = cache
        caches = cache.self_attn if cache is not None else []
        # Every tensor the structures point into, held for as long as they are used (the
        # pointers hold the structures).
        self._tensors = tensors + [t for c in caches for t in (c.k, c.v)]
        self.pointers = [ctypes.pointer(s) for s in structs]
        self.max_rows = rows
        self.self_kv = [ctypes.pointer(KV.of(c.k, c.v)) for c in caches]
        self._pool: list[tuple[Tensor | None, object]] = [(None, None)] * len(structs)
        self._cross: list[tuple[Tensor | None, object]] = [(None, None)] * len(structs)
        # The layers' working memory: floats a row, and one tensor for the search, grown on
        # the first step (rows only fall as sentences leave).
        lib = _library()
        self._scratch_row = max(lib.tformer_decoder_layer_scratch(p) for p in self.pointers)
        self._scratch = torch.empty(0)

    @classmethod
    def of(cls, layers: Sequence[nn.Module], cache: DecoderCache) -> DecoderStep | None:
        """The step for `layers` over `cache`, whose KV caches follow the beams through a
        lineage (never copied), or None where step.c cannot run it."""
        if cache.lineage is None or not all(
                c.k.is_contiguous() and c.v.is_contiguous()
                and serves_cache(c.k.dtype, c.k.device) for c in cache.self_attn):
            return None
        return cls._made(layers, cache)

    @classmethod
    def paged(cls, layers: Sequence[nn.Module]) -> DecoderStep | None:
        """The step for `layers` over a paged pool's blocks (`run_paged`), or None where
        step.c cannot run it."""
        return cls._made(layers, None)

    @classmethod
    def _made(cls, layers: Sequence[nn.Module], cache: DecoderCache | None
              ) -> DecoderStep | None:
        if _library() is None:
            return None
        # step.c computes plain feed-forward layers only: gated ones run as modules.
        if any(getattr(layer.ff, "gated", True) for layer in layers):
            return None
        made = [cls._layer(layer) for layer in layers]
        if None in made:
            return None
        return cls(layers, [m.struct for m in made], min(m.max_rows for m in made),
                   [t for m in made for t in m.tensors], cache)

    @staticmethod
    def _layer(layer: nn.Module) -> _BoundLayer | None:
        self_attn, cross_attn, ff = layer.self_attn, layer.cross_attn, layer.ff
        linears = [_linear(m, DECODER_F32_ROWS)
                   for m in (self_attn.qkv_proj, self_attn.out_proj, cross_attn.q_proj,
                             cross_attn.out_proj, ff.up, ff.down)]
        norms = [_norm(r.norm) for r in (layer.self_residual, layer.cross_residual,
                                          layer.ff_residual)]
        activation = _activation(ff.activation)
        pre = {layer.self_residual.pre, layer.cross_residual.pre, layer.ff_residual.pre}
        if None in linears or None in norms or activation is None or len(pre) != 1:
            return None
        if (cross_attn.d_head, cross_attn.d_value) != (self_attn.d_head, self_attn.d_value):
            return None
        struct = DecoderLayer(*(b.struct for b in linears), *norms, self_attn.n_head,
                              self_attn.d_head, self_attn.d_value, self_attn.d_head**-0.5,
                              int(pre.pop()), activation)
        return _BoundLayer.of(struct, layer, linears)

    def serves(self, x: Tensor, memory_bias: Tensor) -> bool:
        """Whether step.c runs this step: x (N, 1, D) fp32 on the CPU with no gradient wanted,
        the layers in eval mode and recording nothing, N within what the products take,
        every cross-attention's keys in place and shared evenly by the rows, and the source's
        padding as a (sentences, 1, 1, S) float bias."""
        assert self.cache is not None and self.cache.lineage is not None
        lineage_rows = self.cache.lineage.rows
        if (lineage_rows.shape[0] != x.shape[0] or lineage_rows.dtype != torch.int64
                or lineage_rows.stride(1) != 1):
            return False
        # The attention kernel keeps a row's scores on the stack (attend.MAX_POSITIONS).
        return self._serves(x, self.cache.cross_attn, memory_bias, self.cache.length + 1)

    def _serves(self, x: Tensor, cross: Sequence[StaticKV], memory_bias: Tensor,
                positions: int) -> bool:
        n = x.shape[0]
        if (x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != 1
                or n > self.max_rows or (torch.is_grad_enabled() and x.requires_grad)
                or torch.compiler.is_compiling()):
            return False
        for layer, c in zip(self.layers, cross, strict=True):
            if (layer.training or layer.self_attn.recorded is not None
                    or layer.cross_attn.recorded is not None or c.k is None
                    or n % c.k.shape[0] or c.k.stride(3) != 1 or c.v.stride(3) != 1):
                return False
        sentences, source_len = cross[0].k.shape[0], cross[0].k.shape[2]
        return (max(positions, source_len) <= MAX_POSITIONS
                and memory_bias.dtype == torch.float32
                and memory_bias.shape == (sentences, 1, 1, source_len)
                and memory_bias.stride(3) == 1)

    def serves_paged(self, x: Tensor, cross: Sequence[StaticKV], memory_bias: Tensor,
                     k: Tensor) -> bool:
        """Whether `run_paged` runs this step: as `serves`, over a pool's blocks k (fp32 on
        the CPU). (The paged attention keeps no row's scores whole: any length serves.)"""
        return serves_cache(k.dtype, k.device) and self._serves(x, cross, memory_bias, 0)

    def run_paged(self, x: Tensor, k: Sequence[Tensor], v: Sequence[Tensor], tables: Tensor,
                  lengths: Tensor, cross: Sequence[StaticKV], memory_bias: Tensor) -> Tensor:
        """Every layer's step on x (N, 1, D) over a paged pool, where `serves_paged` says so:
        k[i], v[i] (blocks, H, block_size, ·) layer i's blocks (the keys in any strides),
        tables (N, >= used) int64 each row's blocks in order, lengths (N,) int64 its
        positions with the new one, which is stored at lengths - 1; cross[i] layer i's
        encoder keys and values (sentences, H, S, ·), memory_bias their padding (sentences,
        1, 1, S). The result is a new tensor."""
        lib = _library()
        x = x.contiguous().clone()
        n, block = x.shape[0], k[0].shape[2]
        tables, lengths = tables.contiguous(), lengths.contiguous()
        source_len = cross[0].k.shape[2]
        bias = memory_bias[:, 0, 0]
        if self._scratch.numel() < n * self._scratch_row:
            self._scratch = torch.empty(n * self._scratch_row)
        for i, (kb, vb, c) in enumerate(zip(k, v, cross, strict=True)):
            if self._pool[i][0] is not kb:  # the pool's buffers, bound once
                self._pool[i] = (kb, ctypes.pointer(KV.of(kb, vb)))
            if self._cross[i][0] is not c.k:  # made again as sentences join and leave
                self._cross[i] = (c.k, ctypes.pointer(KV.of(c.k, c.v)))
            status = lib.tformer_decoder_layer_step_paged(
                self.pointers[i], x.data_ptr(), n, self._pool[i][1], tables.data_ptr(),
                tables.stride(0), block, lengths.data_ptr(), self._cross[i][1], source_len,
                bias.data_ptr(), bias.stride(0), self._scratch.data_ptr(),
                torch.get_num_threads())
            _paged_status(status, n)
        return x

    def run(self, x: Tensor, memory_bias: Tensor) -> Tensor:
        """Every layer's step on x (N, 1, D), where `serves` says so: the layers' keys and
        values stored in their caches (one position each), the result in a new tensor."""
        assert self.cache is not None and self.cache.lineage is not None
        lib, self_caches, cross = _library(), self.cache.self_attn, self.cache.cross_attn
        lineage_rows = self.cache.lineage.rows
        x = x.contiguous().clone()
        n, length = x.shape[0], self_caches[0].end_after(1)
        source_len = cross[0].k.shape[2]
        bias = memory_bias[:, 0, 0]
        threads = torch.get_num_threads()
        rows_ptr, rows_row = lineage_rows.data_ptr(), lineage_rows.stride(0)
        if self._scratch.numel() < n * self._scratch_row:
            self._scratch = torch.empty(n * self._scratch_row)
        for i, cache in enumerate(cross):
            if self._cross[i][0] is not cache.k:  # made once, and again when sentences leave
                self._cross[i] = (cache.k, ctypes.pointer(KV.of(cache.k, cache.v)))
            status = lib.tformer_decoder_layer_step(
                self.pointers[i], x.data_ptr(), n, self.self_kv[i], length, rows_ptr, rows_row,
                self._cross[i][1], source_len, bias.data_ptr(), bias.stride(0),
                self._scratch.data_ptr(), threads)
            if status == -1:
                raise MemoryError(f"no memory for a decoding step of {n} rows")
            if status:
                raise IndexError("decoding step: the lineage names a row outside the cache")
        for cache in self_caches:
            cache.length = length
        return x


LM_F32_ROWS = 8
"""The most rows an fp32 language model's step takes. From five rows on, fp32.c's products
are slower than oneDNN's, but one call a layer saves ~70 torch calls, which wins up to
about here where the weights fit the cache; a model whose matrices do not loses more of the
products' speed (the figures: benchmarks/README.md, "The kernels' thresholds")."""


class LMStep:
    """Every block of a language model (models.gpt.GPTBlock) as step.c reads it. Made by
    `LMStep.of`, which returns None where step.c cannot run these blocks; `serves` says
    whether it runs a given step over a given cache."""

    def __init__(self, blocks: Sequence[nn.Module], structs: list[LMLayer], rows: int,
                 tensors: list[Tensor]) -> None:
        self.blocks = list(blocks)
        # Every tensor the structures point into, held for as long as they are used.
        self._tensors = tensors
        self.pointers = [ctypes.pointer(s) for s in structs]
        self.max_rows = rows
        self.rotary = self.blocks[0].attn.rotary
        self._kv: list[tuple[Tensor | None, object]] = [(None, None)] * len(structs)
        # tformer_lm_step's arrays: every layer, and every layer's cache (made anew with it)
        self._layers = (ctypes.POINTER(LMLayer) * len(structs))(*self.pointers)
        self._kvs = (ctypes.POINTER(KV) * len(structs))()
        self._scratch_row = max(_library().tformer_lm_layer_scratch(p) for p in self.pointers)
        self._scratch = torch.empty(0)

    @classmethod
    def of(cls, blocks: Sequence[nn.Module]) -> LMStep | None:
        """The step for `blocks`, or None where step.c cannot run them."""
        if _library() is None:
            return None
        made = [cls._layer(block) for block in blocks]
        # One rotary table serves every layer's step (`run`), and one mask: layers that
        # rotate by other bases, or slide while others do not, run as modules.
        if None in made or len({id(b.attn.rotary) for b in blocks}) > 1 or len(
                {getattr(b, "slides", True) for b in blocks}) > 1:
            return None
        return cls(blocks, [m.struct for m in made], min(m.max_rows for m in made),
                   [t for m in made for t in m.tensors])

    @staticmethod
    def _layer(block: nn.Module) -> _BoundLayer | None:
        attn, ff = block.attn, block.ff
        gated = getattr(ff, "gated", None)  # layers.feedforward's two kinds
        # A mixture of experts (layers.experts) describes itself for experts.c, or cannot.
        bind_mixture = getattr(ff, "tformer_moe", None)
        mixture = bind_mixture() if bind_mixture is not None else None
        # step.c's attention has no sink logits.
        if attn.cross or (gated is None and mixture is None) or getattr(
                attn, "sinks", None) is not None:
            return None
        absent = BoundLinear(Linear(), 1 << 30, ())
        projections = (None, None, None) if mixture else (ff.gate if gated else None, ff.up,
                                                          ff.down)
        linears = [_linear(m, LM_F32_ROWS) if m is not None else absent
                   for m in (attn.qkv_proj, attn.out_proj, *projections)]
        norms = [_norm(block.attn_residual.norm), _norm(block.ff_residual.norm)]
        head_norms = [Norm(), Norm()]
        if attn.q_norm is not None:
            head_norms = [_norm(attn.q_norm), _norm(attn.k_norm)]
        activation = _activation(ff.activation) if mixture is None else 0
        pre = {block.attn_residual.pre, block.ff_residual.pre}
        if (None in linears or None in norms or None in head_norms or activation is None
                or len(pre) != 1):
            return None
        # What step.c does not compute: soft-capped scores, a norm on a sublayer's output.
        if attn.softcap is not None or any(getattr(r, "out_norm", None) is not None
                                           for r in (block.attn_residual, block.ff_residual)):
            return None
        rotary = attn.rotary
        scale = attn.d_head**-0.5 if attn.scale is None else attn.scale
        struct = LMLayer(*(b.struct for b in linears), *norms, *head_norms, attn.n_head,
                         attn.n_kv_head, attn.d_head, attn.d_value,
                         0 if rotary is None else rotary.rotated,
                         int(rotary is not None and rotary.interleaved), scale,
                         int(pre.pop()), activation)
        if mixture is not None:  # its structure and tensors held as a part's, its rows too
            struct.moe = ctypes.addressof(mixture.struct)
            linears.append(BoundLinear(Linear(), mixture.max_rows, (mixture.struct,
                                                                    *mixture.held)))
        return _BoundLayer.of(struct, block, linears)

    def serves(self, x: Tensor, cache: DecoderCache) -> bool:
        """Whether step.c runs this step: x (N, T, D) fp32 on the CPU with no gradient wanted
        (T new tokens of N sequences: one a step, or a few, as speculative decoding's
        verification reads them), the blocks in eval mode and recording nothing, N * T rows
        within what the products take, and the cache's N rows in query order, fp32 and
        contiguous, with room in the kernel."""
        n, tokens = x.shape[:2]
        if (x.dtype != torch.float32 or x.device.type != "cpu"
                or n * tokens > (self.max_rows if tokens == 1 else min(self.max_rows, LM_F32_ROWS))
                or cache.lineage is not None
                or cache.length + tokens > MAX_POSITIONS
                or (torch.is_grad_enabled() and x.requires_grad)
                or torch.compiler.is_compiling()):
            return False
        return all(not block.training and block.attn.recorded is None
                   and c.k.shape[0] == n and c.k.is_contiguous() and c.v.is_contiguous()
                   and serves_cache(c.k.dtype, c.k.device)
                   for block, c in zip(self.blocks, cache.self_attn, strict=True))

    def run(self, x: Tensor, cache: DecoderCache, positions: Tensor,
            mask: Tensor | None) -> Tensor:
        """Every block's step on x (N, T, D), where `serves` says so, at `positions` ((N, T)
        or (T,), for rotary embeddings) under a may-attend `mask` broadcastable to (N, 1, T,
        S) whose last query row covers the others' (padding, not a window that slides
        between them; None: every cached position), the tokens attending causally among
        themselves: the blocks' keys and values stored in the cache (T positions each), the
        result in a new tensor."""
        lib = _library()
        x = x.contiguous().clone()
        batch, tokens = x.shape[:2]
        n, length = batch * tokens, cache.self_attn[0].end_after(tokens)
        cache.reserve(length)  # every layer's buffers, grown where they must
        cos = sin = None
        if self.rotary is not None:
            cos, sin = (t.reshape(-1, t.shape[-1]) for t in self.rotary.cos_sin(positions,
                                                                                x.dtype))
            if cos.shape[0] != n:  # the same positions for every sequence
                cos, sin = cos.repeat(n // cos.shape[0], 1), sin.repeat(n // sin.shape[0], 1)
            cos, sin = cos.contiguous(), sin.contiguous()
        bias = None
        if mask is not None:  # the last token's row: the causal part is the kernel's
            last = mask[..., -1, :]
            bias = torch.zeros(last.shape, dtype=x.dtype).masked_fill_(~last, float("-inf"))
            bias = bias.reshape(-1, mask.shape[-1])
            bias = bias.expand(batch, -1)
        if self._scratch.numel() < n * self._scratch_row:
            self._scratch = torch.empty(n * self._scratch_row)
        for i, c in enumerate(cache.self_attn):
            if self._kv[i][0] is not c.k:  # a new cache, or new views of the same buffers
                self._kv[i] = (c.k, ctypes.pointer(KV.of(c.k, c.v)))
                self._kvs[i] = self._kv[i][1]
        # Every layer in one call: with several threads, one parallel region (step.c's team).
        if lib.tformer_lm_step(self._layers, self._kvs, len(self.pointers), x.data_ptr(), n,
                               tokens, length, _ptr(cos), _ptr(sin), _ptr(bias),
                               0 if bias is None else bias.stride(0), self._scratch.data_ptr(),
                               torch.get_num_threads()):
            raise MemoryError(f"no memory for a decoding step of {n} rows")
        for c in cache.self_attn:
            c.length = length
        return x

    def serves_paged(self, x: Tensor, pool: Tensor) -> bool:
        """Whether step.c runs this step over a paged pool (`run_paged`): x (N, T, D) fp32 on
        the CPU with no gradient wanted (T new tokens of N sequences: one a step, or a few,
        as speculative decoding's verification reads them), N * T rows within what the
        products take, the pool's blocks fp32 on the CPU (any history: the paged
        attention takes a span of positions at a time), the blocks in eval mode and
        recording nothing."""
        n, tokens = x.shape[:2]
        rows = self.max_rows if tokens == 1 else min(self.max_rows, LM_F32_ROWS)
        return (x.dtype == torch.float32 and x.device.type == "cpu" and n * tokens <= rows
                and not (torch.is_grad_enabled() and x.requires_grad)
                and not torch.compiler.is_compiling()
                and serves_cache(pool.dtype, pool.device)
                and all(not block.training and block.attn.recorded is None
                        for block in self.blocks))

    def run_paged(self, x: Tensor, k: Sequence[Tensor], v: Sequence[Tensor], tables: Tensor,
                  lengths: Tensor, positions: Tensor, window: int | None) -> Tensor:
        """Every block's step on x (N, T, D), T new tokens of each of N sequences, over a
        paged pool, where `serves_paged` says so: k[i], v[i] (blocks, H_kv, block_size, ·)
        layer i's blocks (the keys in any strides, PagedPool's turned; the values' last
        axis contiguous); tables (N, >= used) int64, the blocks of each sequence in order;
        lengths (N,) int64, its positions with the new ones, which are stored at positions
        lengths - T .. lengths - 1 and attend causally; positions (N, T) theirs (rotary);
        window: a sliding window, or None. The keys and values are read where they lie (no
        gather); the result is a new tensor."""
        lib = _library()
        x = x.contiguous().clone()
        batch, tokens = x.shape[:2]
        n = batch * tokens
        tables, lengths = tables.contiguous(), lengths.contiguous()
        cos = sin = None
        if self.rotary is not None:
            cos, sin = (t.reshape(n, -1).contiguous()
                        for t in self.rotary.cos_sin(positions, x.dtype))
        if self._scratch.numel() < n * self._scratch_row:
            self._scratch = torch.empty(n * self._scratch_row)
        for i, (kb, vb) in enumerate(zip(k, v, strict=True)):
            if self._kv[i][0] is not kb:  # the pool's buffers, bound once
                self._kv[i] = (kb, ctypes.pointer(KV.of(kb, vb)))
                self._kvs[i] = self._kv[i][1]
        # Every layer in one call: with several threads, one parallel region (step.c's team).
        status = lib.tformer_lm_step_paged(
            self._layers, self._kvs, len(self.pointers), x.data_ptr(), n, tokens,
            tables.data_ptr(), tables.stride(0), k[0].shape[2], lengths.data_ptr(),
            window or 0, _ptr(cos), _ptr(sin), self._scratch.data_ptr(), torch.get_num_threads())
        _paged_status(status, n)
        return x
