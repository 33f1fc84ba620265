"""connectors/_pull.py: what the pull connectors share, tested without an engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omnikv.connectors._pool import HostPool
from omnikv.connectors._pull import LateArrivals, PullSettings, sender_endpoint
from omnikv.connectors._stats import Counters
from omnikv.errors import ConfigError, ConnectorUnavailableError

NAMES = ("gets", "get_bytes", "late_arrivals")


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool(1 << 20)
    yield p
    p.close()


def test_a_late_arrival_is_taken_once_and_freed_on_release(pool: HostPool) -> None:
    counters = Counters(NAMES)
    late = LateArrivals(pool, counters)
    offset, _ = pool.allocator.alloc(4096)
    pool.slot(offset, 100).fill_(7)
    assert late.keep("req@0_1", offset, 100) and len(late) == 1
    buf = late.take("req@0_1")
    assert buf is not None and buf.size == 100 and int(buf.tensor[0]) == 7
    assert late.take("req@0_1") is None
    buf.release()
    assert pool.allocator.used_bytes == 0
    assert counters.snapshot() == {"gets": 1, "get_bytes": 100, "late_arrivals": 1}


def test_a_newer_late_arrival_replaces_and_frees_the_older(pool: HostPool) -> None:
    late = LateArrivals(pool, Counters(NAMES))
    first, _ = pool.allocator.alloc(4096)
    second, _ = pool.allocator.alloc(4096)
    late.keep("k", first, 10)
    late.keep("k", second, 20)
    assert len(late) == 1 and pool.allocator.used_bytes == 4096


def test_cleanup_frees_only_the_request_s_slots_and_the_limit_holds(pool: HostPool) -> None:
    late = LateArrivals(pool, Counters(NAMES), limit=2)
    a, _ = pool.allocator.alloc(4096)
    b, _ = pool.allocator.alloc(4096)
    c, _ = pool.allocator.alloc(4096)
    assert late.keep("r1@0_1", a, 1) and late.keep("r2@0_1", b, 1)
    assert not late.keep("r3@0_1", c, 1)  # full: the caller frees c
    late.cleanup("r1")
    assert len(late) == 1 and pool.allocator.used_bytes == 2 * 4096


def test_the_endpoint_comes_from_metadata_then_the_default() -> None:
    meta = {"source_host": "h", "source_port": "7"}
    assert sender_endpoint(meta, ("d", 1)) == ("h", 7)
    assert sender_endpoint({}, ("d", 1)) == ("d", 1)
    with pytest.raises(ConnectorUnavailableError, match="update_sender_info"):
        sender_endpoint(None, None)


def test_settings_need_a_port_for_a_sender_and_a_known_role() -> None:
    with pytest.raises(ConfigError, match="zmq_port"):
        PullSettings.common({"role": "sender"})
    with pytest.raises(ConfigError, match="role"):
        PullSettings.common({"role": "both"})
    with pytest.raises(ConfigError, match="put_timeout_s"):
        PullSettings.common({"role": "receiver", "put_timeout_s": -1})
    s = PullSettings.common({"role": "receiver", "sender_host": "h", "sender_zmq_port": 9})
    assert s["zmq_port"] is None and s["default_sender"] == ("h", 9)


def test_admission_limits_are_parsed_strictly() -> None:
    s = PullSettings.common({"role": "receiver", "max_connections": 5, "heartbeat_seconds": 2})
    assert s["limits"].max_connections == 5 and s["limits"].heartbeat_s == 2.0
    assert s["limits"].max_connections_per_peer == 64
    for key, bad in (
        ("max_connections", 0),
        ("max_connections_per_peer", "8"),
        ("handshake_timeout_seconds", 0),
        ("idle_timeout_seconds", -5),
        ("heartbeat_seconds", True),
    ):
        with pytest.raises(ConfigError, match=key):
            PullSettings.common({"role": "receiver", key: bad})
