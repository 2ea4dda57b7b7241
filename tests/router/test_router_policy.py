"""Instance choice and the router's own small pieces (no processes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.router.call import prefill_body
from pdserve.router.config import RouterConfig
from pdserve.router.policy import Pool


def test_least_loaded_picks_the_idlest_and_rotates_ties() -> None:
    pool = Pool("decode", ["http://a", "http://b/", "http://c"])
    assert [b.url for b in pool.backends] == ["http://a", "http://b", "http://c"]
    first = pool.choose()
    lease = pool.lease(first)
    second = pool.choose()
    assert second is not first
    with pool.lease(second):
        third = pool.choose()
        assert third not in (first, second)
    lease.release()
    lease.release()  # idempotent
    assert [b.num_outstanding for b in pool.backends] == [0, 0, 0]
    picks = {pool.choose().url for _ in range(3)}
    assert picks == {"http://a", "http://b", "http://c"}  # ties rotate instead of piling on the first


def test_least_loaded_follows_outstanding_counts() -> None:
    pool = Pool("prefill", ["http://a", "http://b"])
    a, b = pool.backends
    leases = [pool.lease(a), pool.lease(a)]
    assert all(pool.choose() is b for _ in range(4))
    for lease in leases:
        lease.release()
    with pool.lease(b):
        assert pool.choose() is a


def test_round_robin_ignores_load() -> None:
    pool = Pool("decode", ["http://a", "http://b"], "round-robin")
    a, b = pool.backends
    with pool.lease(a), pool.lease(a):
        assert [pool.choose() for _ in range(4)] == [a, b, a, b]


def test_bad_pools_and_configs() -> None:
    with pytest.raises(ValueError, match="prefill"):
        Pool("prefill", [])
    with pytest.raises(ValueError, match="random"):
        Pool("decode", ["http://a"], "random")
    with pytest.raises(ValueError, match="mode"):
        RouterConfig(mode="both", prefill_urls=("http://a",), decode_urls=("http://b",))
    with pytest.raises(ValueError, match="http"):
        RouterConfig(mode="pull", prefill_urls=("a:80",), decode_urls=("http://b",))


def test_prefill_body() -> None:
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "seed": 3}
    out = prefill_body(body, {"do_remote_decode": True})
    kv = {"do_remote_decode": True}
    assert out == {"prompt": "x", "max_tokens": 1, "stream": False, "seed": 3, "kv_transfer_params": kv}
    assert body["max_tokens"] == 50 and body["stream"] is True  # the client's body is untouched
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, {})
    assert chat["max_tokens"] == 1 and chat["max_completion_tokens"] == 1


def test_router_imports_neither_engine_nor_torch() -> None:
    code = (
        "import sys, pdserve.cli, pdserve.router.cli, pdserve.router.proxy; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('pdserve.engine', 'pdserve.model'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_unhealthy_backends_are_routed_around_and_taken_back(policy: str) -> None:
    pool = Pool("decode", ["http://a", "http://b", "http://c"], policy)
    a, b, c = pool.backends
    b.healthy = False
    assert {pool.choose().url for _ in range(12)} == {"http://a", "http://c"}
    a.healthy = c.healthy = False
    assert not pool.has_healthy()
    assert pool.choose() in pool.backends  # none healthy: the leg fails with the backend's own error
    b.healthy = True
    assert all(pool.choose() is b for _ in range(6))


def test_push_refetches_p_only_after_a_failure_stale_coordinates_explain() -> None:
    """router/push.py: P's 403 (the router signed over coordinates P no longer has), or a 5xx other than an
    admission 503 (D could not reach the P they named), fetches P's coordinates again; a client's 4xx or a busy
    instance's 503 does not."""
    from pdserve.router.push import may_be_stale
    from pdserve.router.upstream import LegError

    def leg(status: int) -> LegError:
        return LegError("decode", "http://d", "x", status=status)

    statuses = (400, 403, 404, 413, 429, 499, 500, 502, 503, 504)
    assert [s for s in statuses if may_be_stale(leg(s))] == [403, 500, 502, 504]
