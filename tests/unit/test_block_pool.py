"""Block pool: allocation, ref counts, contiguous runs, LRU eviction of prefix-cache blocks, verified hashes
(no torch)."""

import random
import time

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
    pool.cache(b, hash_block(None, [1]))
    assert pool.lookup([hash_block(None, [1])]) == []


def runs(block_ids: list[int]) -> int:
    """Runs of consecutive ascending ids (what one block-major transfer costs in descriptors, one side)."""
    return 1 + sum(1 for a, b in zip(block_ids, block_ids[1:], strict=False) if b != a + 1) if block_ids else 0


def test_fresh_pool_hands_out_one_run_and_free_merges_it_back():
    pool = BlockPool(64)
    a, b = pool.allocate(10), pool.allocate(20)
    assert a == list(range(10)) and b == list(range(10, 30))
    pool.free(reversed(a))
    assert pool.free_runs() == [(0, 10), (30, 64)]
    pool.free(reversed(b))
    assert pool.free_runs() == [(0, 64)]


def test_allocation_takes_the_smallest_run_that_fits():
    pool = BlockPool(40)
    blocks = pool.allocate(40)
    pool.free([*blocks[2:5], *blocks[10:30], *blocks[35:37]])  # free runs of 3, 20, 2
    assert pool.allocate(3) == [2, 3, 4]  # exact fit, not the front of the long run
    assert pool.allocate(2) == [35, 36]
    assert pool.allocate(15) == list(range(10, 25))


def test_allocation_without_a_fitting_run_takes_the_longest_runs_first():
    pool = BlockPool(30)
    blocks = pool.allocate(30)
    pool.free([blocks[0], *blocks[3:7], *blocks[10:18], blocks[20]])  # runs of 1, 4, 8, 1
    got = pool.allocate(12)
    assert got == [*range(10, 18), *range(3, 7)] and runs(sorted(got)) == 2


def test_growing_request_extends_its_last_block_in_place():
    pool = BlockPool(16)
    x, a, b = pool.allocate(2), pool.allocate(4), pool.allocate(2)
    pool.allocate(8)
    pool.free(x)
    pool.free(b)  # two free runs of 2: [0, 2) and [6, 8), right after a
    assert pool.allocate(2, after=a[-1]) == [6, 7]
    assert pool.allocate(2, after=a[-1]) == [0, 1]  # nothing free after it any more: the usual choice


def test_failed_allocation_takes_nothing_even_with_evictable_blocks():
    pool = BlockPool(4)
    b = pool.allocate(2)
    pool.cache(b[0], hash_block(None, [1]))
    pool.free(b)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5)
    assert pool.num_free == 4 and pool.lookup([hash_block(None, [1])]) == [b[0]]


def test_unhashed_blocks_are_used_before_prefix_cache_entries_are_evicted():
    pool = BlockPool(8)
    blocks = pool.allocate(8)
    h = hash_block(None, [5, 6])
    pool.cache(blocks[0], h)
    pool.free(reversed(blocks))
    assert sorted(pool.allocate(7)) == list(range(1, 8))  # block 0 keeps its prefix-cache entry
    assert pool.lookup([h]) == [0]


def test_eviction_does_not_scatter_a_freed_request():
    """With every free block a cache entry, evicted blocks go back to the runs: a request that takes an old
    request's place gets one run, not that request's blocks in LRU (reverse) order."""
    pool = BlockPool(64)
    parent = None
    reqs = []
    for r in range(4):
        ids = pool.allocate(16)
        for i, b in enumerate(ids):
            parent = hash_block(parent, [r, i])
            pool.cache(b, parent)
        reqs.append(ids)
    for ids in reqs:
        pool.free(reversed(ids))
    assert pool.num_free == 64 and pool.free_runs() == []
    got = pool.allocate(16)
    assert got == reqs[0]  # the least recently freed request's blocks, ascending: one run


def test_churn_keeps_requests_in_few_runs():
    rng = random.Random(0)
    pool = BlockPool(4096, enable_prefix_caching=False)
    live: list[list[int]] = []
    for _ in range(3000):  # random allocate/free churn at 50-90% occupancy
        if live and (pool.num_free < 600 or rng.random() < 0.45):
            pool.free(reversed(live.pop(rng.randrange(len(live)))))
        else:
            live.append(pool.allocate(rng.randint(1, 300)))
    while pool.num_free < 1024:
        pool.free(reversed(live.pop(rng.randrange(len(live)))))
    got = pool.allocate(1024)
    assert len(set(got)) == 1024 and runs(got) <= 64  # a random scatter would be ~1000 runs
    assert all(pool.ref_count(b) == 1 for b in got)


def test_allocation_stays_cheap():
    pool = BlockPool(65536, enable_prefix_caching=False)
    rng = random.Random(1)
    live = [pool.allocate(rng.randint(1, 64)) for _ in range(1500)]
    for i in rng.sample(range(len(live)), 750):
        pool.free(reversed(live[i]))
    t0 = time.perf_counter()
    got = pool.allocate(1024)
    pool.free(reversed(got))
    assert len(got) == 1024
    assert time.perf_counter() - t0 < 1.0  # generous: ~1 ms measured; guards against an O(n^2) walk


def test_hash_is_a_digest_of_every_token():
    h = hash_block(None, [1, 2, 3])
    assert isinstance(h, bytes) and len(h) == 16
    assert h == hash_block(None, (1, 2, 3))
    assert h != hash_block(None, [1, 2, 4]) and h != hash_block(None, [1, 2, 3, 0])
    assert hash_block(h, [7]) != hash_block(hash_block(None, [1, 2, 4]), [7])
    # Python's hash() of small ints collides across -1 and -2: the digest does not
    assert hash((None, (-1,))) == hash((None, (-2,)))
    assert hash_block(None, [-1]) != hash_block(None, [-2])
