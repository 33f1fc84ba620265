"""The shared-memory pool's start-up reserve (``prefault``): parsed strictly, populated in the
background once the connector is known to send, reported by ``health()``, never waited for by a
put, and stopped promptly by ``close()`` without leaving a thread, descriptor or mapping behind.

Population is observed through ``health()`` (a bounded poll of a public view) and the kernel's
own accounting (``RssShmem`` of this process); the put-while-populating test runs the sender and
the receiver in two peer processes (tests/connectors/shm/test_shm_peer.py) over a real memfd pool.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_shm_peer import Peer, own_memfd_maps, peer_pool, start_peer

from omnikv import OmniKVCacheConfig, OmniKVTransferManager
from omnikv.connectors.shm.config import AUTO_RESERVE, RESERVE_SLACK, ShmConfig
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.errors import ConfigError

MIB = 1 << 20
GIB = 1 << 30


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def _rss_shmem() -> int:
    """Shared-memory pages mapped by this process (bytes), as the kernel counts them."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def _memfd_fds() -> list[str]:
    """This process's descriptors of omnikv pools."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor of the listing itself, gone by now
            continue
        if "omnikv-shm" in target:
            out.append(target)
    return out


def _prefault_threads() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if t.name == "omnikv-shm-prefault"}


def _wait_ready(c: SharedMemoryConnector, timeout: float = 30.0) -> dict[str, Any]:
    """Poll ``health()`` (a public view) until the reserve is ready; bounded."""
    deadline = time.monotonic() + timeout
    health = c.health()
    while not health["pool_reserve_ready"] and time.monotonic() < deadline:
        time.sleep(0.01)
        health = c.health()
    assert health["pool_reserve_ready"], health
    return health


# -- parsing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "grow", "reserve", "auto"),
    [
        (None, True, AUTO_RESERVE, True),  # the default: nothing declared, 16 MiB
        ("auto", True, AUTO_RESERVE, True),
        (" AUTO ", True, AUTO_RESERVE, True),
        (True, True, 0, False),  # grow with use only
        ("true", True, 0, False),
        (False, False, 0, False),  # no background work at all
        ("false", False, 0, False),
        (0, False, 0, False),
        ("64MiB", True, 64 * MIB, False),
        (64 * MIB, True, 64 * MIB, False),
        ("4GiB", True, GIB, False),  # clamped to the pool
    ],
)
def test_prefault_values_parse(value: Any, grow: bool, reserve: int, auto: bool) -> None:
    cfg = ShmConfig.parse({} if value is None else {"prefault": value})
    assert (cfg.prefault.ahead, cfg.reserve_bytes, cfg.prefault.auto) == (grow, reserve, auto)
    assert cfg.pool_size == GIB


def test_the_auto_reserve_starts_when_the_connector_is_known_to_send() -> None:
    small = ShmConfig.parse({"pool_size_bytes": "1MiB"})
    assert small.reserve_bytes == MIB  # min(pool, 16 MiB): a tiny pool costs a tiny reserve
    assert ShmConfig.parse({}).reserve_bytes == AUTO_RESERVE
    starts = {
        (prefault, role): ShmConfig.parse({"prefault": prefault, "role": role}).reserve_at_start
        for prefault in ("auto", "64MiB", True, False)
        for role in ("sender", "receiver", None)
    }
    assert {k for k, v in starts.items() if v} == {
        ("auto", "sender"),
        ("64MiB", "sender"),
        ("64MiB", None),  # an explicit byte count is prepared at start (as before)
    }


def test_the_auto_reserve_follows_what_the_stage_declares_it_sends() -> None:
    assert AUTO_RESERVE == 16 * MIB  # nothing declared: a small default, not 256 MiB
    assert ShmConfig.parse({}).reserve_source == "default, nothing declared"
    declared = ShmConfig.parse({"expected_payload_bytes": "224MiB"})
    assert declared.reserve_bytes == 224 * MIB + RESERVE_SLACK
    assert declared.reserve_source == "expected_payload_bytes"
    small = ShmConfig.parse({"expected_payload_bytes": 64 * 1024})  # a 64 KiB stage: ~1 MiB
    assert small.reserve_bytes == 64 * 1024 + RESERVE_SLACK
    # Qwen2.5-7B: 28 layers x 2 x 4 KV heads x 128 x fp16 = 57344 bytes per token
    kv = ShmConfig.parse({"kv_bytes_per_token": 57344, "max_model_len": "4096"})
    assert kv.reserve_bytes == 57344 * 4096 + RESERVE_SLACK
    assert kv.reserve_source == "kv_bytes_per_token x max_model_len"
    # one of the two alone declares nothing; the explicit size wins over the model's
    assert ShmConfig.parse({"max_model_len": 4096}).reserve_bytes == AUTO_RESERVE
    both = {"expected_payload_bytes": MIB, "kv_bytes_per_token": 57344, "max_model_len": 4096}
    assert ShmConfig.parse(both).reserve_bytes == MIB + RESERVE_SLACK
    # never more than the pool; an explicit prefault is taken as given
    assert ShmConfig.parse({**both, "pool_size_bytes": "1MiB"}).reserve_bytes == MIB
    explicit = ShmConfig.parse({**both, "prefault": "8MiB"})
    assert (explicit.reserve_bytes, explicit.reserve_source) == (8 * MIB, "prefault")
    off = ShmConfig.parse({**both, "prefault": False})
    assert (off.reserve_bytes, off.reserve_source) == (0, "none, prefault off")


def test_a_declared_payload_larger_than_the_pool_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = ShmConfig.parse({"expected_payload_bytes": "2GiB", "pool_size_bytes": "1GiB"})
    assert cfg.reserve_bytes == GIB  # clamped
    assert "expected_payload_bytes 2147483648 exceeds pool_size_bytes" in caplog.text


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("expected_payload_bytes", "big"),
        ("expected_payload_bytes", -1),
        ("kv_bytes_per_token", -1),
        ("kv_bytes_per_token", 1.5),
        ("max_model_len", "long"),
        ("max_model_len", True),
        ("prefault", "sometimes"),
        ("prefault", "automatic"),
        ("prefault", "yes"),
        ("prefault", -1),
        ("prefault", 1.5),
        ("prefault", [1]),
        ("role", "both"),
        ("role", 1),
        ("role", True),
    ],
)
def test_bad_prefault_and_role_values_are_config_errors(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} "):
        ShmConfig.parse({key: value})


# -- the reserve in one process --------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_sender_populates_its_reserve_in_the_background_and_reports_it(namespace: str) -> None:
    before = _rss_shmem()
    t0 = time.monotonic()
    config = {"namespace": namespace, "pool_size_bytes": "64MiB", "role": "sender"}
    c = SharedMemoryConnector({**config, "linger_s": 0, "expected_payload_bytes": "63MiB"})
    try:
        assert time.monotonic() - t0 < 5.0  # the constructor does not populate
        first = c.health()
        assert first["pool_size_bytes"] == 64 * MIB  # the pool exists before any put
        assert first["pool_reserve_bytes"] == 64 * MIB
        health = _wait_ready(c)
        assert health["pool_populated_bytes"] >= 64 * MIB
        assert health["pool_prefault"] == "idle" and health["pool_reserve_s"] > 0
        # the kernel agrees: the pages are mapped in this process (the sender's two mappings
        # share them; 1 MiB of slack for the interpreter's own shared pages coming and going)
        assert _rss_shmem() - before >= 63 * MIB
    finally:
        c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("declared", "reserve", "source"),
    [
        ({}, AUTO_RESERVE, "default, nothing declared"),
        ({"expected_payload_bytes": "64KiB"}, 64 * 1024 + RESERVE_SLACK, "expected_payload_bytes"),
    ],
)
def test_a_sender_holds_what_it_declares_not_256_mib(
    namespace: str, declared: dict[str, Any], reserve: int, source: str
) -> None:
    before = _rss_shmem()
    c = SharedMemoryConnector(
        {"namespace": namespace, "role": "sender", "linger_s": 0, **declared}
    )  # the default pool: 1 GiB, committed as it is used
    try:
        health = _wait_ready(c)
        assert health["pool_size_bytes"] == GIB
        assert (health["pool_reserve_bytes"], health["pool_reserve_source"]) == (reserve, source)
        assert health["pool_populated_bytes"] == reserve
        grown = _rss_shmem() - before
        assert reserve - MIB <= grown <= reserve + 2 * MIB, grown  # the kernel agrees
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_without_a_known_role_the_reserve_waits_for_the_first_put(namespace: str) -> None:
    c = SharedMemoryConnector({"namespace": namespace, "pool_size_bytes": "8MiB", "linger_s": 0})
    rx = SharedMemoryConnector({"namespace": namespace, "role": "receiver"})
    try:
        for conn, reserve in ((c, 8 * MIB), (rx, AUTO_RESERVE)):
            health = conn.health()
            assert health["pool_size_bytes"] == 0  # no pool, no memory, no thread
            assert health["pool_reserve_bytes"] == reserve
            assert not health["pool_reserve_ready"]
            assert health["pool_prefault"] == "on first put"
        assert c.put("0", "1", "k", b"x" * 1000)[0]
        assert c.health()["pool_reserve_bytes"] == 8 * MIB
        assert _wait_ready(c)["pool_populated_bytes"] >= 8 * MIB
    finally:
        c.close()
        rx.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_false_or_true_makes_no_start_up_reserve(namespace: str, prefault: bool) -> None:
    threads = _prefault_threads()
    c = SharedMemoryConnector(
        {
            "namespace": namespace,
            "pool_size_bytes": "64MiB",
            "role": "sender",
            "prefault": prefault,
            "linger_s": 0,
        }
    )
    try:
        health = c.health()
        assert health["pool_reserve_bytes"] == 0 and health["pool_reserve_ready"]
        assert health["pool_populated_bytes"] == 0 and _prefault_threads() == threads
        assert c.put("0", "1", "k", b"x" * 1000)[0]
        if not prefault:  # no background work at all: the put faulted its one page
            assert c.health()["pool_prefault"] == "off"
            assert _prefault_threads() == threads and c.health()["pool_populated_bytes"] == 0
    finally:
        c.close()


@pytest.mark.timeout(60)
def test_close_during_population_returns_promptly_and_leaks_nothing(namespace: str) -> None:
    threads, maps, fds = _prefault_threads(), own_memfd_maps(), _memfd_fds()
    before = _rss_shmem()
    c = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": "1GiB", "prefault": "1GiB", "linger_s": 0}
    )
    health = c.health()
    assert health["pool_prefault"] == "populating", health  # 1 GiB takes about a second
    t0 = time.monotonic()
    c.close()
    took = time.monotonic() - t0
    # stopped between two 8 MiB steps (~10 ms each here), not after the whole GiB
    assert took < 1.0, f"close took {took:.3f}s"
    after = c.health()
    assert after["status"] == "closed"
    assert after["pool_populated_bytes"] < GIB and not after["pool_reserve_ready"]
    assert _prefault_threads() == threads  # joined
    assert own_memfd_maps() == maps and _memfd_fds() == fds  # unmapped, descriptors closed
    assert _rss_shmem() - before < 2 * MIB  # the kernel freed the populated pages


# -- a put while the reserve is being populated, across processes ----------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_put_during_population_proceeds_and_its_data_is_intact(
    peers: list[Peer], namespace: str
) -> None:
    rx = start_peer(peers, namespace)
    tx = start_peer(
        peers, namespace, pool_size_bytes="512MiB", prefault="512MiB", role="sender", linger_s=0
    )
    health = tx.call("health")[1]
    assert health["pool_prefault"] == "populating", health
    assert health["pool_reserve_bytes"] == 512 * MIB
    for i, fill in enumerate((9, 11)):  # 2 x 64 MiB from offset 0, over the populating prefix
        assert rx.call("wait", f"k{i}", 30.0, fill) == ("waiting",)
        put = tx.call("put", f"k{i}", 64 * MIB, fill, 30.0, timeout=30.0)
        assert put[:3] == ("put", True, 64 * MIB), put
        got = rx.recv(30.0)
        assert got[:3] == ("got", 64 * MIB, True), got  # every byte checked by the receiver
    deadline = time.monotonic() + 30
    while not health["pool_reserve_ready"] and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded poll of the sender's public view
        health = tx.call("health")[1]
    assert health["pool_reserve_ready"] and health["pool_populated_bytes"] >= 512 * MIB
    assert health["puts"] == 2 and health["put_failures"] == 0


# -- the manager tells its connector its role ------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_sending_manager_prepares_its_pool_before_the_first_request(namespace: str) -> None:
    conn = {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": "16MiB"}
    tx = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={**conn, "linger_s": 0},
            from_stage="0",
            to_stage="1",
            need_send_cache=True,
        )
    )
    rx = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=dict(conn), from_stage="0", stage_id="1", need_recv_cache=True
        )
    )
    try:
        assert isinstance(tx.connector, SharedMemoryConnector)
        assert isinstance(rx.connector, SharedMemoryConnector)
        assert tx.connector.config.role == "sender" and rx.connector.config.role == "receiver"
        assert _wait_ready(tx.connector)["pool_populated_bytes"] >= 16 * MIB
        assert rx.connector.health()["pool_size_bytes"] == 0  # a receiver makes no pool
    finally:
        tx.close()
        rx.close()
