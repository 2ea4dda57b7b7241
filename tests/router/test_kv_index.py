"""The router's prefix index and the kv-aware cost (issue 29 item 2), on decoded /kv_events answers: snapshots,
events, gaps, epochs, another hash scheme, the cap, answers for unknown instances, malformed answers, scoring
and tie rotation. Pure Python, milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.kv.block_hashes import HASH_SCHEME, prompt_block_hashes
from pdserve.kv.events_wire import KVCacheSnapshot, KVEventsAnswer, decode_answer, encode_answer
from pdserve.router.kv_index import InstanceIndex, KVIndex, KVIndexError
from pdserve.router.kv_route import KVRoute, KVWeights, PromptKeys
from pdserve.router.metrics import RouterMetrics, StreamState
from pdserve.router.policy import Pool

BS = 4
PROMPT = list(range(1, 14))  # 3 full blocks of 4 + 1 token
KEYS = prompt_block_hashes(PROMPT, BS)


def snapshot(
    keys: list[bytes],
    seq: int = 0,
    epoch: str = "e1",
    reason: str = "first",
    block_size: int = BS,
    prefix_caching: bool = True,
    hash_scheme: dict[str, object] = HASH_SCHEME,
) -> KVEventsAnswer:
    return KVEventsAnswer(epoch, seq, KVCacheSnapshot(reason, block_size, prefix_caching, hash_scheme, keys))


def events(after: int, runs: list[tuple[bool, list[bytes]]], epoch: str = "e1") -> KVEventsAnswer:
    return KVEventsAnswer(epoch, after + sum(len(k) for _, k in runs), None, runs)


def test_snapshot_then_events_then_hits_stop_at_the_first_miss() -> None:
    idx = InstanceIndex("http://a")
    assert idx.hit_blocks(KEYS) == 0 and not idx.usable  # never synced: empty
    idx.apply(snapshot([KEYS[0]], seq=5))
    assert idx.usable and (idx.epoch, idx.seq, idx.block_size) == ("e1", 5, BS)
    assert idx.hit_blocks(KEYS) == 1
    idx.apply(events(5, [(True, [KEYS[1], KEYS[2]])]))
    assert idx.hit_blocks(KEYS) == 3 and idx.seq == 7
    idx.apply(events(7, [(False, [KEYS[1]])]))
    assert idx.hit_blocks(KEYS) == 1  # block 2 is still held but the chain breaks at block 1
    idx.apply(events(8, []))  # an empty answer (the keepalive) changes nothing
    assert idx.seq == 8 and idx.num_keys == 2


def test_a_gap_or_another_epoch_without_a_snapshot_resets_until_the_next_snapshot() -> None:
    idx = InstanceIndex("http://a")
    idx.apply(snapshot(KEYS, seq=3))
    with pytest.raises(KVIndexError, match="seq 3"):
        idx.apply(events(4, [(True, [b"x" * 16])]))  # events after seq 4: one is missing
    assert not idx.usable and idx.hit_blocks(KEYS) == 0 and idx.seq is None
    with pytest.raises(KVIndexError, match="never synced"):
        idx.apply(events(0, [(True, [KEYS[0]])]))
    idx.apply(snapshot(KEYS, seq=9))
    with pytest.raises(KVIndexError, match="epoch"):
        idx.apply(events(9, [(True, [b"y" * 16])], epoch="e2"))  # a restart shows as a snapshot, never so
    idx.apply(snapshot([KEYS[0]], seq=0, epoch="e2", reason="epoch"))  # the restarted instance's snapshot
    assert idx.usable and idx.epoch == "e2" and idx.hit_blocks(KEYS) == 1


def test_another_hash_scheme_is_never_scored() -> None:
    idx = InstanceIndex("http://a")
    other = {**HASH_SCHEME, "name": "sha256-chain"}
    with pytest.raises(KVIndexError, match="sha256-chain"):
        idx.apply(snapshot(KEYS, hash_scheme=other))
    assert not idx.usable and idx.num_keys == 0 and idx.hit_blocks(KEYS) == 0


def test_an_instance_without_prefix_caching_scores_empty() -> None:
    idx = InstanceIndex("http://a")
    idx.apply(snapshot([], prefix_caching=False))
    assert not idx.usable and idx.hit_blocks(KEYS) == 0


def test_the_cap_evicts_the_least_recently_stored_or_hit() -> None:
    idx = InstanceIndex("http://a", max_keys=3)
    others = [bytes([i]) * 16 for i in range(3)]
    idx.apply(snapshot([KEYS[0], *others[:2]], seq=0))
    assert idx.hit_blocks(KEYS) == 1  # KEYS[0] is now the most recently used
    idx.apply(events(0, [(True, [others[2]])]))  # one over the cap: others[0] (oldest) goes, KEYS[0] stays
    assert idx.num_keys == 3 and idx.num_evicted == 1 and idx.hit_blocks(KEYS) == 1
    idx.apply(events(1, [(True, [KEYS[1], KEYS[2]])]))
    assert idx.num_keys == 3 and idx.hit_blocks(KEYS) == 3  # the cap holds, the fresh chain is whole
    big = InstanceIndex("http://b", max_keys=2)
    big.apply(snapshot(KEYS))  # a snapshot larger than the cap keeps the cap
    assert big.num_keys == 2


def test_windowed_group_keys_are_skipped() -> None:
    idx = InstanceIndex("http://a")
    idx.apply(snapshot([b"\x01\x00" + KEYS[0], KEYS[0]]))
    assert idx.num_keys == 1 and idx.hit_blocks(KEYS) == 1


def test_answers_for_an_unknown_instance_are_ignored() -> None:
    index = KVIndex(["http://a", "http://a", "http://b"])
    assert list(index.instances) == ["http://a", "http://b"]
    assert not index.apply("http://evil", snapshot(KEYS))
    assert index.num_ignored == 1 and all(i.num_keys == 0 for i in index.instances.values())
    assert index.apply("http://b", snapshot(KEYS))


def test_malformed_answers_are_refused_by_the_decoder() -> None:
    good = encode_answer(events(2, [(True, [KEYS[0]])]))
    assert decode_answer(good, 2).events == [(True, [KEYS[0]])]
    for bad in (
        {"status": "ok"},
        {**good, "version": 99},
        {**good, "events": [["added", [KEYS[0].hex()]]]},
        {**good, "events": [["stored", ["not hex"]]]},
        {**good, "seq": -1},
    ):
        with pytest.raises(ValueError):
            decode_answer(bad, 2)
    with pytest.raises(ValueError, match="expected"):
        decode_answer(good, 0)  # one event cannot span seq 0..3


def route(*urls: str, hit_weight: float = 1.0) -> tuple[Pool, KVIndex, KVRoute, RouterMetrics]:
    pool = Pool("decode", list(urls), "kv-aware")
    index = KVIndex(list(urls))
    metrics = RouterMetrics()
    return pool, index, KVRoute(index, KVWeights(hit_weight, 1.0), metrics), metrics


def test_kv_aware_prefers_the_cache_until_the_load_outweighs_it() -> None:
    pool, index, kv, metrics = route("http://a", "http://b", hit_weight=128.0)  # 12 cached tokens: 1.5 legs
    a, b = pool.backends
    index.apply("http://a", snapshot([]))
    index.apply("http://b", snapshot(KEYS))
    prompt = PromptKeys(PROMPT)
    choice = kv.choose(pool, prompt)
    assert choice.backend is b and choice.hit_tokens == 12  # 3 blocks of 4; 13 - 1 is the cap
    assert metrics.kv_choices["decode"] == 0  # counted when a leg is sent there
    assert kv.used(pool, choice) is b
    assert metrics.kv_choices["decode"] == 1 and metrics.kv_hit_blocks["decode"] == 3
    with pool.lease(b):  # cost b = 1 - 128 * 12/1024 < 0 = cost a: still b
        assert kv.choose(pool, prompt).backend is b
        with pool.lease(b):  # 2 - 1.5 > 0: a
            assert kv.choose(pool, prompt).backend is a


def test_the_hit_counts_cached_tokens_not_the_cached_fraction() -> None:
    pool, index, kv, _ = route("http://a", "http://b")  # the default hit weight: 1 leg per 1,024 tokens
    a, b = pool.backends
    history = PromptKeys(list(range(1, 4098)))  # 4,097 tokens: 1,024 blocks of 4 cached at b
    index.apply("http://a", snapshot([]))
    index.apply("http://b", snapshot(history.hashes(BS)))
    with pool.lease(b), pool.lease(b), pool.lease(b):  # 3 - 4 < 0 (as a fraction: 3 - 1 > 0, a would win)
        assert kv.choose(pool, history).backend is b
        with pool.lease(b), pool.lease(b):  # 5 - 4 > 0: a
            assert kv.choose(pool, history).backend is a
    short = PromptKeys(list(range(1, 14)))  # 12 of 13 tokens cached at b: worth ~0.01 leg, not 0.92
    with pool.lease(b):
        assert kv.choose(pool, short).backend is a
    exact = PromptKeys(PROMPT[:12])  # exactly 3 blocks: the last token is always computed, and the engine
    choice = kv.choose(pool, exact)  # reuses whole blocks only (prefix_cache.take_hits): 2 blocks, 8 tokens
    assert (choice.hit_blocks, choice.hit_tokens) == (2, 8)


def test_kv_aware_rotates_ties_and_falls_back_to_load() -> None:
    pool, index, kv, _ = route("http://a", "http://b", "http://c")
    picks = {kv.choose(pool, PromptKeys(PROMPT)).backend.url for _ in range(3)}  # nothing cached anywhere
    assert picks == {"http://a", "http://b", "http://c"}
    a, b, c = pool.backends
    with pool.lease(a), pool.lease(b):
        assert kv.choose(pool, None).backend is c  # a prompt the router cannot hash: least loaded
    index.apply("http://a", snapshot(KEYS))
    index.instances["http://a"].reset()  # its stream was lost: scored as empty
    with pool.lease(b), pool.lease(c):
        assert kv.choose(pool, PromptKeys(PROMPT)).backend is a


def test_block_sizes_differ_per_instance() -> None:
    pool, index, kv, _ = route("http://a", "http://b")
    index.apply("http://a", snapshot(prompt_block_hashes(PROMPT, 8), block_size=8))  # 1 block of 8
    index.apply("http://b", snapshot(KEYS[:1]))  # 1 block of 4
    assert kv.hit("http://a", PromptKeys(PROMPT)) == (1, 8)
    assert kv.choose(pool, PromptKeys(PROMPT)).backend.url == "http://a"


def test_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="kv-hit-weight"):
        KVWeights(-1.0, 1.0)
    with pytest.raises(ValueError, match="kv-load-weight"):
        KVWeights(1.0, float("nan"))


def test_metrics_render_the_streams_and_the_index() -> None:
    pool, index, kv, metrics = route("http://a")
    metrics.streams["http://a"] = StreamState(up=False, num_failures=2, num_snapshots=3)
    index.apply("http://a", snapshot(KEYS))
    kv.used(pool, kv.choose(pool, PromptKeys(PROMPT)))
    text = metrics.render(index)
    assert 'pdserve_router_kv_stream_up{instance="http://a"} 0' in text
    assert 'pdserve_router_kv_stream_resyncs_total{instance="http://a"} 2' in text
    assert 'pdserve_router_kv_index_keys{instance="http://a"} 3' in text
    assert 'pdserve_router_kv_hit_blocks_total{role="decode"} 3' in text


def test_long_prompts_are_hashed_off_the_event_loop_at_every_block_size() -> None:
    pool, index, kv, _ = route("http://a", "http://b")
    index.apply("http://a", snapshot([], block_size=8))
    index.apply("http://b", snapshot([]))
    long = PromptKeys(list(range(5000)))
    asyncio.run(kv.prepare(long))
    assert sorted(long._by_size) == [BS, 8] and long.hashes(8) == prompt_block_hashes(long.token_ids, 8)
