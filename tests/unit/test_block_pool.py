"""Block pool: allocation, ref counts, LRU eviction of prefix-cache blocks (no torch)."""

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocks, hash_block


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.free(a)
    assert pool.num_free == 4


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_prefix_cache_hit_survives_free_until_evicted():
    pool = BlockPool(3)
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    blocks = pool.allocate(2)
    pool.cache(blocks[0], h0)
    pool.cache(blocks[1], h1)
    pool.free(reversed(blocks))
    assert pool.num_free == 3  # evictable blocks count as free
    assert pool.lookup([h0, h1]) == blocks
    pool.touch(blocks)
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 1
    pool.free(reversed(blocks))
    # LRU: the never-used block goes first, then the tail block (freed first), then the prefix block
    order = [pool.allocate(1)[0] for _ in range(3)]
    assert order[1:] == [blocks[1], blocks[0]]
    assert pool.lookup([h0]) == []


def test_shared_block_needs_every_reference_dropped():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    h = hash_block(None, [7])
    pool.cache(b, h)
    pool.touch(pool.lookup([h]))
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2


def test_hash_chain_depends_on_the_whole_prefix():
    assert hash_block(hash_block(None, [1]), [2]) != hash_block(hash_block(None, [9]), [2])


def test_prefix_caching_off_never_hits():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    pool.cache(b, 123)
    assert pool.lookup([123]) == []
