"""The heap pool (paper section 3.2.1): first fit, coalescing, exhaustion errors, counters."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import PoolExhausted, UserError
from superneurons.memory.pool import BLOCK, HeapPool, round_up

K = BLOCK


def pool(blocks: int) -> HeapPool:
    return HeapPool(blocks * K, CpuBackend())


def test_round_up_to_whole_blocks():
    assert round_up(1) == K and round_up(K) == K and round_up(K + 1) == 2 * K and round_up(0) == K


def test_first_fit_reuses_the_first_hole_that_fits():
    p = pool(16)
    assert p.alloc("a", 2 * K) == 0
    assert p.alloc("b", 3 * K) == 2 * K
    assert p.alloc("c", K) == 5 * K
    p.free("a")  # hole of 2 blocks at 0
    assert p.alloc("d", K) == 0  # first fit: the hole, not the tail
    assert p.alloc("e", 2 * K) == 6 * K  # the remaining 1-block hole is too small
    assert p.alloc("f", 100) == K  # but a small one fits there
    assert p.used_bytes == 8 * K and p.n_allocs == 6 and p.n_frees == 1


def test_free_coalesces_with_both_neighbours():
    p = pool(6)
    for k in "abc":
        p.alloc(k, 2 * K)
    p.free("a")
    p.free("c")
    assert p.largest_free() == 2 * K and p.free_bytes() == 4 * K
    p.free("b")  # joins the hole before and the hole after
    assert p.largest_free() == 6 * K and p.fragmentation() == 0.0
    assert p.alloc("whole", 6 * K) == 0


def test_fragmentation_counter():
    p = pool(4)
    for k in "abcd":
        p.alloc(k, K)
    assert p.fragmentation() == 0.0  # nothing free
    p.free("a")
    p.free("c")
    assert p.fragmentation() == pytest.approx(0.5)  # 2 free blocks, largest 1
    with pytest.raises(PoolExhausted):
        p.alloc("two", 2 * K)  # enough bytes, no single block


def test_exhaustion_is_a_user_error_with_numbers():
    p = pool(4)
    p.alloc("a", 3 * K)
    with pytest.raises(PoolExhausted) as e:
        p.alloc("conv1@diff", 2 * K)
    assert isinstance(e.value, UserError)
    msg = str(e.value)
    assert "need 2.0 KiB for 'conv1@diff'" in msg and "1.0 KiB free of 4.0 KiB" in msg
    assert "largest free block 1.0 KiB" in msg


def test_views_do_not_overlap_and_high_water_is_tracked():
    p = pool(8)
    p.alloc("x", 3 * K)
    p.alloc("y", 3 * K)
    x = p.view("x", (3 * K // 4,), np.float32)
    y = p.view("y", (3 * K // 4,), np.float32)
    x[...] = 1.0
    y[...] = 2.0
    assert (x == 1.0).all() and (y == 2.0).all()
    p.free("x")
    assert p.high_water == 6 * K and p.used_bytes == 3 * K
    p.reset_high_water()
    assert p.high_water == 3 * K
    with pytest.raises(KeyError):
        p.alloc("y", K)  # a key is allocated once
