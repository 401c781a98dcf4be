"""A paged KV cache: fixed-size blocks of keys and values from one pool, each text a list of
blocks (its block table), so that a text holds what it uses and no text widens another
(Kwon et al. 2023, "PagedAttention"). Serving's continuous batching decodes over it
(serving/scheduler.py); a long prompt is read into it a chunk at a time.

A decoding step (one new token a row, or a few: a speculative round's verification) where
the one-call step kernel serves (fp32 on a CPU, a few rows) reads the keys and values where
they lie: each row's block table (a tensor) and length go to kernels/step.c's paged step,
whose attention follows the table block by block, and the new keys and values are written
into their blocks; nothing is gathered or copied. Elsewhere (a prompt's chunk, rows with
different numbers of new tokens) a forward pass hands the model a PagedView, which its
forward reads as a cache (a KVView, layers/cache.py): each layer writes the new keys and
values into the rows' blocks and, on a CPU, attends through the same kernel's paged
attention over the blocks in place (kernels/attend.c), the step's own, with the layer's
scale, soft cap or sinks (Gemma 2, gpt-oss); on a GPU it gathers the rows' blocks into a
(n, H_kv, W, ·) window (W: the longest row's length, shorter rows masked as padding at its
end) and attends over it and the new keys. Positions count real tokens, so a row decodes
as it would alone either way, and on the in-place path to the bit: a query's attention is
computed alike in any pass.

With `prefix_cache`, every full block is known by a hash of its tokens and of everything
before them (the previous block's hash), and kept after its text leaves, until its room is
needed (least recently used first): a text that starts with the same tokens takes those
blocks instead of reading them again (a chat's earlier turns, the n choices of one prompt).
Only full blocks are shared, and a text writes only after its last position, so a shared
block is never written; a rollback into one (speculation) first takes a private copy. Which
blocks are free, held (and by how many rows) or kept under a name is decoding/blocks.py's
BlockPool's business; this module keeps the keys and values and the rows.

A model whose every layer slides a window (Mistral; not Gemma's, whose global layers read
everything) never attends again to the blocks wholly behind it:
they go back to the pool as the text moves on, and the block table holds block 0 in their
place, whose zeros the window's mask hides. A text then holds about window / block_size
blocks however long it grows.

Shapes: n rows in the pass, T new tokens per row, W positions of the longest row, H_kv
key/value heads, d key size, d_value value size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from tformer.decoding.blocks import BlockPool, BlockTable
from tformer.decoding.runner import runner
from tformer.kernels.attend import attend_paged, serves, serves_cache

BLOCK_SIZE = 16
"""Positions per block: small enough that a text wastes little of its last block."""

class PoolFull(RuntimeError):
    """The pool has too few free blocks for what a pass would store."""


@dataclass
class Row:
    """One text's place in the pool: its blocks and how many positions they hold."""

    blocks: BlockTable = field(default_factory=BlockTable)
    length: int = 0
    passes: list[tuple[int, int]] = field(default_factory=list)
    """(columns, positions stored) of its latest passes, the last one last, as far back as
    a rollback may cut (PagedPool.reach columns; the last pass at least)."""
    tokens: list[int] = field(default_factory=list)
    """The tokens whose keys and values it holds (to name its full blocks)."""
    hashes: list[int] = field(default_factory=list)
    """The names of its full blocks, in order."""
    looked_up: bool = False
    """Whether its text has been looked up in the prefix cache (counted once)."""
    behind: int = 0
    """Its first blocks, behind a sliding window, given back (block 0 in their place)."""
    skipped: int = 0
    """Tokens of its text before the first it holds (a text longer than the model's
    context, read from its last `context` tokens: a draft model's row beside a target
    with a longer context)."""


def blocks_for(positions: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-positions // block_size)


class PagedLayer:
    """One layer's part of a pass (a LayerKV, layers/cache.py): its blocks, the window it
    slides (None: it reads every position), and the view that says which are each row's
    and where the new positions go."""

    def __init__(self, k: Tensor, v: Tensor, window: int | None, pass_: PagedView) -> None:
        self.k, self.v, self.window, self.pass_ = k, v, window, pass_

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
               attention: nn.Module) -> Tensor:
        """Store the step's new keys and values in their blocks and attend with q over the
        rows' past and them: (n, H, T, d) -> (n, H, T, d_value)."""
        p = self.pass_
        if p.in_place and attention.is_inference and serves(q):
            # Each row reads its own new tokens after its own past: the mask is causal (and
            # the layer's window), which the kernel applies itself, with the attention's
            # scale, soft cap and sinks.
            p.scatter(self.k, k)
            p.scatter(self.v, v)
            return attend_paged(q, self.k, self.v, p.tables, p.lengths, window=self.window,
                                counts=p.counts, scale=attention.scale,
                                softcap=attention.softcap, sinks=attention.sinks)
        if p.width:
            k_all = torch.cat([p.gather(self.k), k], dim=2)
            v_all = torch.cat([p.gather(self.v), v], dim=2)
        else:
            k_all, v_all = k, v
        out = attention.attend(q, k_all, v_all, mask, is_causal)
        p.scatter(self.k, k)
        p.scatter(self.v, v)
        return out


class PagedView:
    """The rows of one pass over the pool as a model's forward reads its cache (a KVView,
    layers/cache.py): block tables as a tensor, which positions are each row's, and a
    PagedLayer per layer.

    Where the kernel serves (float32 on a CPU, not training), the layers read the keys and
    values in their blocks through kernels/attend.py's paged attention
    (`in_place`), each row its own new tokens (a prompt's chunk beside decoding rows, rows
    of any lengths): nothing is gathered, and a query's result does not depend on the pass
    it is in, so a prompt gives the same logits read alone, beside others or in other
    chunks. Elsewhere (a GPU, training, recorded attention) each layer gathers the rows'
    blocks into a window of the longest row's positions, padded and masked."""

    lineage = None
    step = None

    def __init__(self, pool: PagedPool, rows: list[Row], real: Tensor) -> None:
        device = pool.device
        bs = pool.block_size
        held = [row.length for row in rows]  # known on the host: no device sync for them
        lengths = torch.tensor(held, device=device)
        self.width = max(held)
        self.length = self.width
        self.tables = pool.block_tables(rows)  # every block a row holds, the new ones' too
        self.table = self.tables[:, : blocks_for(self.width, bs)]
        all_real = bool(real.all())
        uniform = all(h == self.width for h in held) and all_real
        self.is_real: Tensor | None = None
        if not uniform:
            self.is_real = torch.cat([
                torch.arange(self.width, device=device)[None] < lengths[:, None], real], dim=1)
        counts = real.sum(1)
        self.in_place = (pool.in_place and serves_cache(pool.k[0].dtype, device)
                         and bool((real == (torch.arange(real.shape[1], device=device)[None]
                                            < counts[:, None])).all()))
        """Whether the layers read the blocks in place: the kernel serves, and each row's
        new tokens come first (the in-place path's columns past them are ignored)."""
        self.lengths = lengths + counts
        """Each row's positions with its new ones (the in-place path's)."""
        self.counts = None if all_real else counts
        """Each row's new tokens where some read fewer than T (the in-place path's)."""
        # The new positions of each row, in order, and the block and offset each goes to.
        self.real = real
        rank = (real.cumsum(1) - 1) + lengths[:, None]
        rows_of, cols = real.nonzero(as_tuple=True)
        positions = rank[rows_of, cols]
        self.dest_block = self.tables[rows_of, positions // bs]
        self.dest_offset = positions % bs
        self.self_attn = [PagedLayer(k, v, window, self)
                          for k, v, window in zip(pool.k, pool.v, pool.windows, strict=True)]

    def gather(self, blocks: Tensor) -> Tensor:
        """(blocks, H, bs, ·) pool -> (n, H, W, ·) the rows' past positions."""
        n, nb = self.table.shape
        gathered = blocks[self.table]
        H, bs, d = gathered.shape[2:]
        return gathered.transpose(1, 2).reshape(n, H, nb * bs, d)[:, :, : self.width]

    def scatter(self, blocks: Tensor, new: Tensor) -> None:
        """Write (n, H, T, ·) new keys or values, the real ones, into their blocks."""
        blocks[self.dest_block, :, self.dest_offset] = new.transpose(1, 2)[self.real]


class PagedPool:
    """Blocks of keys and values for every layer of `model`, `blocks` of `block_size`
    positions each, and the rows decoding over them (the first `rows` in `active`, in the
    order of the sequences in flight). Block 0 holds zeros and pads the block tables: the
    positions a pass gathers but masks must be finite, since a masked NaN spreads through
    0 * NaN. `k[i]` and `v[i]` are layer i's keys and values, both read as (blocks, H_kv,
    block_size, ·); the keys lie turned (a view of (blocks, H_kv, d, block_size))."""

    def __init__(self, model: nn.Module, blocks: int, *, block_size: int = BLOCK_SIZE,
                 prefix_cache: bool = True) -> None:
        self.blocks = BlockPool(blocks, prefix_cache=prefix_cache)
        """Which blocks are free, held, or kept under a name (decoding/blocks.py)."""
        self.model = model = runner(model)
        # A decoder-only model's positions, or an encoder-decoder's target positions.
        self.context = getattr(model.cfg, "context", None) or model.cfg.max_len
        self.window: int | None = getattr(model.cfg, "cache_window", None)
        self.block_size = block_size
        probe = model.make_cache(1, 1).self_attn
        slides = getattr(model.cfg, "slides", None)
        self.windows: list[int | None] = [
            model.cfg.window if slides is not None and slides(i) else None
            for i in range(len(probe))]
        """Each layer's sliding window (None: it reads every position)."""
        self.in_place = True
        """Whether passes of rows in step read the blocks in place where the kernel serves
        (PagedView); False: every layer gathers (the path to compare it with)."""
        # The keys are stored turned, (blocks, H_kv, d, block_size), and read through a view
        # of the shape of the values: a key component of a block's positions side by side,
        # as the paged attention's scores load them (kernels/attend_tile.h; vLLM's key
        # cache is laid out alike).
        self.k = [layer.k.new_empty(blocks, layer.k.shape[1], layer.k.shape[3], block_size)
                  .transpose(2, 3) for layer in probe]
        self.v = [layer.v.new_empty(blocks, layer.v.shape[1], block_size, layer.v.shape[3])
                  for layer in probe]
        for buf in (*self.k, *self.v):
            buf[0].zero_()
        self.device = self.k[0].device
        self._step = model.make_cache(1, 1).step
        """The model's one-call decoding step (kernels/step.py), or None."""
        self.total = blocks - 1
        self.active: list[Row] = []
        self.prefix_cache = prefix_cache
        self.reach = 1
        """The most columns a rollback may cut (`truncate`): speculation sets it."""
        self.looked_up = 0
        """Prompt positions looked up in the prefix cache, and those found there."""
        self.found = 0

    @staticmethod
    def block_bytes(model: nn.Module, block_size: int = BLOCK_SIZE) -> int:
        """Bytes one block takes over every layer."""
        probe = model.make_cache(1, 1).self_attn
        return sum(block_size * (c.k.shape[1] * c.k.shape[3] + c.v.shape[1] * c.v.shape[3])
                   * c.k.element_size() for c in probe)

    @property
    def rows(self) -> int:
        return len(self.active)

    @property
    def available(self) -> int:
        """Blocks a row may take: free ones and named ones no row holds."""
        return self.blocks.available

    @property
    def used(self) -> int:
        return self.blocks.used

    def _take(self) -> int:
        """A block from the manager, zeroed: what a pass gathers and masks must be finite
        (new memory may hold NaN, and a masked NaN spreads through 0 * NaN)."""
        block = self.blocks.take()
        for buf in (*self.k, *self.v):
            buf[block].zero_()
        return block

    def _drop(self, block: int) -> None:
        self.blocks.drop(block)

    def allocate(self, rows: list[Row], adding: list[int]) -> None:
        """Give each row the blocks it needs for `adding` more positions, all or none."""
        needs = [blocks_for(row.length + a, self.block_size) - len(row.blocks)
                 for row, a in zip(rows, adding, strict=True)]
        if sum(max(0, n) for n in needs) > self.available:
            raise PoolFull(f"{sum(needs)} KV blocks needed, {self.available} free")
        for row, need in zip(rows, needs, strict=True):
            for _ in range(need):
                row.blocks.append(self._take())

    def _name_blocks(self, row: Row) -> None:
        """Name the row's blocks that are full, and offer them to texts that follow."""
        bs = self.block_size
        while len(row.hashes) < row.length // bs:
            i = len(row.hashes)
            name = hash((row.hashes[-1] if i else 0, tuple(row.tokens[i * bs : (i + 1) * bs])))
            row.hashes.append(name)
            self.blocks.name(row.blocks[i], name)

    def reuse(self, row: Row, text: list[int]) -> int:
        """Take the named blocks that hold the start of `text` after what the row holds
        (the row holding whole blocks of it so far), up to its last token, whose logits a
        pass must compute; the positions taken."""
        bs = self.block_size
        if not self.prefix_cache or row.length % bs or row.length != len(row.hashes) * bs:
            return 0
        start = row.length
        if not row.looked_up:
            row.looked_up = True
            self.looked_up += len(text)
        while row.length + bs <= len(text) - 1:
            i = len(row.hashes)
            chunk = tuple(text[row.length : row.length + bs])
            name = hash((row.hashes[-1] if i else 0, chunk))
            block = self.blocks.find(name)
            if block is None:
                break
            self.blocks.hold(block)
            row.blocks.append(block)
            row.hashes.append(name)
            row.tokens += chunk
            row.length += bs
        self.found += row.length - start
        return row.length - start

    def forward(self, rows: list[Row], tokens: Tensor, real: Tensor | None = None, *,
                last_only: bool = False) -> Tensor:
        """(n, T) new tokens of `rows` (False in `real` where a row has fewer) -> (n, T, V)
        logits, or (n, 1, V) with `last_only`; their keys and values stored. PoolFull (and
        nothing stored) where the free blocks cannot hold them."""
        tokens = tokens.to(self.device)
        if real is None:
            real = torch.ones_like(tokens, dtype=torch.bool)
        real = real.to(self.device)
        counts = real.sum(1).tolist()
        longest = max(row.length + c for row, c in zip(rows, counts, strict=True))
        if longest > self.context:
            raise ValueError(f"{longest} positions exceed the model's context of "
                             f"{self.context}")
        self.allocate(rows, counts)
        logits = None
        if bool(real.all()):
            logits = self._step_in_place(rows, tokens, last_only)
        if logits is None:
            view = PagedView(self, rows, real)
            logits = self.model(tokens, None if view.is_real is None else real, cache=view,
                                last_only=last_only)
        columns = tokens.shape[1]
        for i, (row, count) in enumerate(zip(rows, counts, strict=True)):
            row.length += count
            row.passes.append((columns, count))
            while sum(c for c, _ in row.passes[1:]) >= self.reach and len(row.passes) > 1:
                del row.passes[0]
            row.tokens += tokens[i][real[i]].tolist()
            self._name_blocks(row)
            if self.window is not None:
                self._leave_behind(row)
        return logits

    def _leave_behind(self, row: Row) -> None:
        """Give back the row's blocks wholly behind the window of every token it may yet
        read: from the length before the last pass on, since a rollback may cut back to
        it. A query at position q sees keys after q - window."""
        since = row.length - sum(stored for _, stored in row.passes)
        behind = min((since - self.window + 1) // self.block_size,
                     len(row.blocks) - 1)
        for i in range(row.behind, behind):
            self._drop(row.blocks[i])
            row.blocks[i] = 0
        row.behind = max(row.behind, behind)

    def block_tables(self, rows: list[Row], width: int | None = None) -> Tensor:
        """(n, width) int64: each row's blocks in order (width: the most any row holds),
        block 0 after a row's last."""
        width = max((len(row.blocks) for row in rows), default=0) if width is None else width
        tables = np.zeros((len(rows), width), dtype=np.int64)
        for row, table in zip(rows, tables, strict=True):
            row.blocks.copy_into(table)
        return torch.from_numpy(tables).to(self.device)

    def _step_in_place(self, rows: list[Row], tokens: Tensor, last_only: bool
                       ) -> Tensor | None:
        """A pass of a few new tokens a row whose attention reads every row's keys and
        values in their blocks (the one-call step kernel, kernels/step.c's paged step), the
        new ones stored there too: (n, T, V) logits, or (n, 1, V) with `last_only`; None
        where the kernel does not serve (many rows or tokens, not fp32 on a CPU)."""
        if self._step is None:
            return None
        return self.model.paged_step(tokens, self.k, self.v, self.block_tables(rows),
                                     [row.length for row in rows], self.window,
                                     last_only=last_only)

    def read_chunk(self, row: Row, tokens: list[int], *, every_position: bool = False) -> Tensor:
        """Read a chunk of a row's text: its (1, V) last-position logits, or (T, V)."""
        ids = torch.tensor([tokens], device=self.device)
        return self.forward([row], ids, last_only=not every_position)[0]

    def release(self, row: Row) -> None:
        """Give a row's blocks back."""
        for block in reversed(row.blocks[row.behind:]):
            self._drop(block)
        row.blocks, row.length, row.tokens, row.hashes = BlockTable(), 0, [], []
        row.behind = row.skipped = 0
        row.passes = []

    # decoding/pool.py's Rows (what a speculative round asks of its cache), over the active
    # rows.

    @property
    def read(self) -> list[int]:
        """Per active row: the tokens of its text it has read."""
        return [row.skipped + row.length for row in self.active]

    def held(self) -> int:
        return max((row.length for row in self.active), default=0)

    def seat(self, row: Row) -> None:
        self.active.append(row)

    def join(self, text: list[int]) -> None:
        """Read a text (its last `context` tokens) into a new active row, in one pass (an
        empty text: a row that starts empty)."""
        row = Row(skipped=max(0, len(text) - self.context))
        if text:
            self.forward([row], torch.tensor([text[row.skipped :]], device=self.device),
                         last_only=True)
        self.seat(row)

    def step(self, last_tokens: list[int]) -> Tensor:
        """One new token per active row -> (n, V) logits for the next ones."""
        tokens = torch.tensor(last_tokens, device=self.device)[:, None]
        return self.forward(self.active, tokens, last_only=True)[:, -1]

    def extend(self, tokens: Tensor, real: Tensor, *, last_only: bool = False) -> Tensor:
        """(n, T) new tokens per active row, False in `real` after a row's last ->
        (n, T, V) logits, or (n, 1, V) with `last_only`."""
        return self.forward(self.active, tokens, real, last_only=last_only)

    def truncate(self, kept: Tensor, written: int) -> None:
        """Row i keeps the first kept[i] of the `written` columns its latest passes stored
        (each pass's real columns first): speculation's rollback of rejected drafts, over
        one pass (the target's verification) or several (a drafter's one-token passes)."""
        bs = self.block_size
        for row, keep in zip(self.active, kept.tolist(), strict=True):
            recent: list[tuple[int, int]] = []  # the passes of the last `written` columns
            columns = 0
            for width, count in reversed(row.passes):
                if columns >= written:
                    break
                recent.insert(0, (width, count))
                columns += width
            if columns != written:
                raise ValueError(f"a rollback of {written} columns, past the {columns} the "
                                 f"pool keeps (PagedPool.reach)")
            dropped = seen = 0
            for width, count in recent:
                dropped += count - min(count, max(0, keep - seen))
                seen += width
            row.length -= dropped
            row.passes.clear()
            del row.tokens[row.length :]
            del row.hashes[row.length // bs :]
            keep_blocks = blocks_for(row.length, bs)
            for block in reversed(row.blocks[keep_blocks:]):
                self._drop(block)
            del row.blocks[keep_blocks:]
            if row.length % bs:
                self.own_last([row])

    def own_last(self, rows: list[Row]) -> None:
        """Make each row's last block its own before it writes into it again: unnamed, or
        a copy where other rows hold it too (copy on write; the copies in one indexed copy
        per buffer). PoolFull (nothing changed) where too few blocks are free for them."""
        blocks = self.blocks
        lasts = [row.blocks.last for row in rows]
        if sum(map(blocks.shared, lasts)) > self.available:
            raise PoolFull("too few KV blocks free to copy the shared ones into")
        sources, copies = [], []
        for row, block in zip(rows, lasts, strict=True):
            # A block that the last of its rows comes to is no longer shared: it is that
            # row's own, with no copy (each copy is taken before its source is dropped).
            if not blocks.shared(block):
                blocks.unname(block)
                continue
            copy = blocks.take()
            blocks.drop(block)
            row.blocks[-1] = copy
            sources.append(block)
            copies.append(copy)
        if copies:
            src = torch.tensor(sources, device=self.device)
            dst = torch.tensor(copies, device=self.device)
            for buf in (*self.k, *self.v):
                if not buf.is_contiguous():  # the keys, turned: copied as they lie
                    buf = buf.transpose(2, 3)
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def fork(self, row: Row) -> Row:
        """A row that continues `row` (beam search: a hypothesis extending another): it
        holds the same blocks, nothing copied; whichever of them next writes into a last
        block that both hold first takes a copy (`own_last`)."""
        for block in row.blocks[row.behind :]:
            self.blocks.hold(block)
        return Row(blocks=row.blocks.copy(), length=row.length, tokens=list(row.tokens),
                   hashes=list(row.hashes), looked_up=row.looked_up, behind=row.behind,
                   skipped=row.skipped)

    def remove(self, row: int) -> None:
        """Free an active row; the last one moves into its place."""
        self.release(self.active[row])
        last = self.active.pop()
        if row < len(self.active):
            self.active[row] = last

    def clear(self) -> None:
        for row in self.active:
            self.release(row)
        self.active.clear()
