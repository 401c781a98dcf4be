"""decoding/blocks.py's BlockPool (the KV blocks' budget, without a tensor) and BlockTable."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tformer.decoding.blocks import BlockPool, BlockTable


def test_blocks_are_taken_held_and_given_back_by_count():
    pool = BlockPool(4)  # blocks 1, 2, 3 (0 pads tables)
    a, b = pool.take(), pool.take()
    assert {a, b} <= {1, 2, 3} and 0 not in (a, b) and pool.used == 2
    pool.hold(a)  # a second row shares it
    assert pool.shared(a) and not pool.shared(b)
    pool.drop(a)
    assert pool.used == 2 and not pool.shared(a)
    pool.drop(a)
    pool.drop(b)
    assert pool.used == 0 and pool.available == 3
    for _ in range(3):
        pool.take()
    with pytest.raises(IndexError):
        pool.take()


def test_named_blocks_wait_idle_and_the_least_recently_used_goes_first():
    pool = BlockPool(4)
    blocks = [pool.take() for _ in range(3)]
    for name, block in zip((10, 11, 12), blocks, strict=True):
        pool.name(block, name)
    for block in blocks:  # their rows leave: kept under their names, still available
        pool.drop(block)
    assert pool.available == 3 and pool.idle == 3 and pool.find(11) == blocks[1]
    pool.hold(blocks[0])  # found again: used, so no longer idle...
    pool.drop(blocks[0])  # ... and now the most recently used
    taken = pool.take()  # no free block: the least recently used idle one, name forgotten
    assert taken == blocks[1] and pool.find(11) is None and pool.find(10) == blocks[0]
    assert pool.take() == blocks[2] and pool.take() == blocks[0]
    assert pool.find(10) is pool.find(12) is None


def test_a_name_is_kept_by_its_first_block_and_forgotten_on_request():
    pool = BlockPool(4)
    a, b = pool.take(), pool.take()
    pool.name(a, 7)
    pool.name(b, 7)  # the same tokens read twice: the first block keeps the name
    assert pool.find(7) == a
    pool.unname(a)
    assert pool.find(7) is None
    pool.drop(a)  # unnamed: free, not idle
    assert pool.available == 2
    off = BlockPool(4, prefix_cache=False)
    c = off.take()
    off.name(c, 7)
    assert off.find(7) is None


def test_a_block_table_reads_as_the_list_it_was_made_by():
    """Random appends, settings and cuts of the tail, past the array's first capacity,
    against a plain list doing the same; a pass's table row holds its ids, then zeros."""
    rng = random.Random(0)
    table, model = BlockTable(), []
    for _ in range(400):
        op = rng.random()
        if op < 0.6:
            block = rng.randrange(1, 1000)
            table.append(block)
            model.append(block)
        elif op < 0.8 and model:
            i = rng.randrange(-len(model), len(model))
            table[i] = model[i] = 0
        else:
            k = rng.randrange(0, len(model) + 3)
            del table[k:]
            del model[k:]
        assert table == model and len(table) == len(model) and list(table) == model
        if model:
            assert table[-1] == model[-1] and table[1:4] == model[1:4]
        row = np.zeros(len(model) + 5, dtype=np.int64)
        table.copy_into(row)
        assert row.tolist() == model + [0] * 5
    short = np.zeros(2, dtype=np.int64)
    BlockTable([4, 5, 6]).copy_into(short)
    assert short.tolist() == [4, 5]
    with pytest.raises(ValueError, match="from its end"):
        del table[1:2]
