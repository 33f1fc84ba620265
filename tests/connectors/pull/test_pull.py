"""connectors/pull/connector.py: what the pull connectors share, tested without an engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import LateArrivals, PullSettings, sender_endpoint
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
    # the one value parser (omnikv.values): digit strings are counts, fractions are not
    s = PullSettings.common({"role": "receiver", "max_connections_per_peer": "8"})
    assert s["limits"].max_connections_per_peer == 8
    for key, bad in (
        ("max_connections", 0),
        ("max_connections_per_peer", 2.5),
        ("handshake_timeout_seconds", 0),
        ("idle_timeout_seconds", -5),
        ("heartbeat_seconds", True),
    ):
        with pytest.raises(ConfigError, match=key):
            PullSettings.common({"role": "receiver", key: bad})


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({"peer_timeout_seconds": 0}, "peer_timeout_seconds"),
        ({"buffer_ttl_seconds": -1}, "buffer_ttl_seconds"),
        ({"close_timeout_seconds": "soon"}, "close_timeout_seconds"),
        ({"memory_pool_size": 2.9}, "memory_pool_size"),
        ({"memory_pool_size": "lots"}, "memory_pool_size"),
        ({"auth_secret": ""}, "auth_secret"),
        ({"role": "sender", "zmq_port": 70000}, "zmq_port"),
        ({"sender_host": "h", "sender_zmq_port": "x"}, "sender_zmq_port"),
    ],
)
def test_pull_keys_are_strict_and_name_their_key(cfg: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        PullSettings.common({"role": "receiver", **cfg})


def test_pull_values_keep_their_accepted_forms() -> None:
    s = PullSettings.common(
        {
            "role": "sender",
            "zmq_port": "50051",
            "memory_pool_size": "64MB",
            "peer_timeout_seconds": 2,
            "auth_secret": "s",
        }
    )
    assert s["zmq_port"] == 50051 and s["pool_size"] == 64 << 20
    assert s["peer_timeout_s"] == 2.0 and s["secret"] == b"s"
