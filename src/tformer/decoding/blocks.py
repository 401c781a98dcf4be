"""The KV pool's blocks as a budget (vLLM's block manager): which block ids are free, how
many rows hold each (reference counts), and which full blocks are known by a name (a hash of
their tokens and of everything before them) so that a later text starting with the same
tokens takes them instead of reading them again (prefix caching).

A named block that no row holds is not freed but kept idle, least recently used first, and
given out again only when no free block is left (then its name is forgotten). The manager
holds no tensor: decoding/paged.py's PagedPool keeps the keys and values and asks it for
block ids. Block 0 is never given out (it pads block tables).

A text's blocks in order are its BlockTable: int64 ids in an array that grows by doubling,
from which a pass's (rows, width) table is copied a row at a time, not built from Python
lists a block at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np


class BlockPool:
    """Block ids 1 .. blocks - 1, each free, held by rows, or idle under a name."""

    def __init__(self, blocks: int, *, prefix_cache: bool = True) -> None:
        if blocks < 2:
            raise ValueError(f"a paged pool needs at least 2 blocks, not {blocks}")
        self.total = blocks - 1
        self.prefix_cache = prefix_cache
        self._free = list(range(blocks - 1, 0, -1))  # popped from the end: 1 first
        self._refs = [0] * blocks
        self._by_name: dict[int, int] = {}
        self._name_of: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()

    @property
    def available(self) -> int:
        """Blocks a row may take: free ones and named ones no row holds."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.total - self.available

    @property
    def idle(self) -> int:
        """Named blocks no row holds (given out again only when no block is free)."""
        return len(self._idle)

    def take(self) -> int:
        """A block for one row: a free one, else the least recently used idle named one
        (its name forgotten). IndexError where none is left (callers count first)."""
        if self._free:
            block = self._free.pop()
        elif self._idle:
            block, _ = self._idle.popitem(last=False)
            self.unname(block)
        else:
            raise IndexError("no KV block is free")
        self._refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more row holds a block it found by name."""
        self._idle.pop(block, None)
        self._refs[block] += 1

    def drop(self, block: int) -> None:
        """A row lets go of a block: free once no row holds it, or idle where it is named."""
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._name_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def shared(self, block: int) -> bool:
        """Whether more than one row holds the block (a row must copy it before writing)."""
        return self._refs[block] > 1

    def name(self, block: int, name: int) -> None:
        """Offer a full block under its name (the first block of a name keeps it)."""
        if self.prefix_cache and name not in self._by_name and block not in self._name_of:
            self._by_name[name] = block
            self._name_of[block] = name

    def unname(self, block: int) -> None:
        """Forget a block's name (it is about to change)."""
        name = self._name_of.pop(block, None)
        if name is not None:
            del self._by_name[name]

    def find(self, name: int) -> int | None:
        """The block known by this name, if any."""
        return self._by_name.get(name)


class BlockTable:
    """One text's block ids in order (block 0 where a block was given back behind a sliding
    window), as int64 in an array that grows by doubling. It reads as a list of ints
    (len, iteration, indexing and slicing, equality with a list); it changes only at its end
    (`append`, `del table[k:]`) or by setting one id."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        ids = list(ids)
        self._ids = np.zeros(max(16, len(ids)), dtype=np.int64)
        self._ids[: len(ids)] = ids
        self._n = len(ids)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids[: self._n].tolist())

    def __getitem__(self, i: int | slice) -> int | list[int]:
        held = self._ids[: self._n]
        return held[i].tolist() if isinstance(i, slice) else int(held[i])

    def __setitem__(self, i: int, block: int) -> None:
        self._ids[: self._n][i] = block

    def __delitem__(self, tail: slice) -> None:
        """`del table[k:]`: forget the ids from k on."""
        if tail.stop is not None or tail.step is not None:
            raise ValueError("a block table drops ids only from its end (del table[k:])")
        self._n = range(self._n)[tail].start if tail.start is not None else 0
        self._ids[self._n :] = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (BlockTable, list)) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockTable({list(self)})"

    @property
    def last(self) -> int:
        """The last id (a row's block that its next position may go to)."""
        return int(self._ids[self._n - 1])

    def copy(self) -> BlockTable:
        table = BlockTable.__new__(BlockTable)
        table._ids, table._n = self._ids.copy(), self._n
        return table

    def append(self, block: int) -> None:
        if self._n == len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
        self._ids[self._n] = block
        self._n += 1

    def copy_into(self, row: np.ndarray) -> None:
        """Write its first len(row) ids into row (an int64 row of zeros: block 0 after its
        last)."""
        n = min(self._n, len(row))
        row[:n] = self._ids[:n]
