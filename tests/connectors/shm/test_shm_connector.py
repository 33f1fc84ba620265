"""SharedMemoryConnector: semantics, waits, bounds, several peers, permissions.

Cross-process tests use peer processes (tests/connectors/shm/test_shm_peer.py) over real memfd
pools and real
abstract Unix sockets; the in-process ones use two connectors of one process, which talk through
the same sockets and shared memory.
"""

from __future__ import annotations

import gc
import os
import re
import stat
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_shm_peer import Peer, own_memfd_maps, peer_pool, shm_listing, start_peer

from omnikv.connectors.base import ManagedBuffer, get_result
from omnikv.connectors.factory import ConnectorSpec, OmniConnectorFactory
from omnikv.connectors.shm import leadership
from omnikv.connectors.shm.config import DEFAULT_POLL_US, Prefault, ShmConfig
from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.connectors.shm.wire import namespace_prefix
from omnikv.errors import ConfigError, ConnectorClosedError, PoolExhaustedError
from omnikv.wire.decode import decode
from omnikv.wire.serializer import decode_object, encode_object
from omnikv.wire.transfer_data import KVCacheTransferData
from support import paths
from support.polling import until

KIB = 1024


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


@pytest.fixture
def pair(namespace: str) -> Iterator[tuple[SharedMemoryConnector, SharedMemoryConnector]]:
    """A sender (64 KiB pool) and a receiver connector in this process, same namespace."""
    a = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": 64 * KIB, "put_timeout_s": 5, "linger_s": 0}
    )
    b = SharedMemoryConnector({"namespace": namespace})
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _take(c: SharedMemoryConnector, key: str, timeout: float = 5.0) -> tuple[Any, int]:
    got = c.wait("0", "1", key, deadline=time.monotonic() + timeout)
    assert got is not None, f"{key} did not arrive"
    return got, got.size


@pytest.mark.timeout(20)
def test_factory_builds_it_from_a_typed_config(namespace: str) -> None:
    c = OmniConnectorFactory.create_connector(
        ConnectorSpec(
            "SharedMemoryConnector",
            {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": 1 << 20},
        )
    )
    try:
        assert isinstance(c, SharedMemoryConnector)
        assert c.health()["status"] == "healthy"
    finally:
        c.close()
    assert c.health()["status"] == "closed"
    with pytest.raises(ValueError, match="Failed to create connector"):
        OmniConnectorFactory.create_connector(
            ConnectorSpec("SharedMemoryConnector", {"pool_size_bytes": 10})
        )
    with pytest.raises(ConfigError):
        SharedMemoryConnector({"namespace": namespace, "put_timeout_s": -1})


@pytest.mark.slow
@pytest.mark.timeout(60)  # the lane's first peer also starts the forkserver (imports omnikv)
def test_cross_process_put_get_is_consume_once(peers: list[Peer], namespace: str) -> None:
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    # A get returns once a peer offers the key or every peer answered: the long timeout only
    # covers a sender starved by a busy host (the 0.1 s default ran out so in a full make test).
    rx = SharedMemoryConnector({"namespace": namespace, "get_timeout_s": 10})
    try:
        assert sender.call("put", "req1", 300 * KIB, 9, 5.0)[:3] == ("put", True, 300 * KIB)
        got = rx.get("0", "1", "req1")
        assert got is not None
        buf, size = got
        assert isinstance(buf, ManagedBuffer) and size == 300 * KIB
        assert bool((buf.tensor == 9).all())
        assert buf.tensor.data_ptr() % 4096 == 0  # page-aligned slot, zero-copy view
        assert rx.get("0", "1", "req1") is None  # consumed
        assert sender.call("health")[1]["held_by_readers"] == 1
        buf.release()
        # the release travels to the sender; its next health answer follows it on the wire
        assert rx.get("0", "1", "req1") is None
        h = sender.call("health")[1]
        assert h["held_by_readers"] == 0 or h["releases"] <= 1
    finally:
        rx.close()


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.timeout(30)
def test_waiter_wakes_on_put_within_a_millisecond(peers: list[Peer], namespace: str) -> None:
    """Put -> wake latency across processes (median of 30; the issue asks for <= 1 ms)."""
    sender = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    receiver = start_peer(peers, namespace)
    lat: list[float] = []
    for i in range(30):
        assert receiver.call("wait", f"k{i}", 10.0, i % 200) == ("waiting",)
        put = sender.call("put", f"k{i}", 4 * KIB, i % 200, 5.0)
        got = receiver.recv()
        assert put[1] is True and got[:3] == ("got", 4 * KIB, True)
        lat.append(got[3] - put[3])
    med = statistics.median(lat)
    assert med < 0.002, f"median put->wake {med * 1e3:.3f} ms"


@pytest.mark.timing  # bounds of 0.1 s past a deadline: run alone, after the lanes
@pytest.mark.timeout(20)
def test_wait_honours_its_deadline_and_get_does_not_block(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    t0 = time.monotonic()
    assert b.wait("0", "1", "absent", deadline=t0 + 0.2) is None
    waited = time.monotonic() - t0
    assert 0.2 <= waited < 0.3
    t0 = time.monotonic()
    assert b.get("0", "1", "absent") is None
    assert time.monotonic() - t0 < 0.15
    # a put after a timed-out wait is still there for the next one (nothing consumed)
    assert a.put("0", "1", "late", b"x" * 10)[0]
    buf, size = _take(b, "late")
    assert buf.to_bytes() == b"x" * 10 and size == 10
    buf.release()


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.timeout(20)
def test_full_pool_put_waits_until_its_deadline_then_fails_clearly(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, _b = pair
    assert a.put("0", "1", "fill", b"\1" * (40 * KIB))[0]
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match=r"pool of 65536 bytes has 24576 free"):
        a.put_packed(
            "0", "1", "more", 40 * KIB, lambda t: t.fill_(2), deadline=time.monotonic() + 0.2
        )
    assert 0.2 <= time.monotonic() - t0 < 0.5
    with pytest.raises(PoolExhaustedError, match="can never fit"):
        a.put_packed("0", "1", "huge", 65 * KIB, lambda t: None)
    assert a.health()["put_timeouts"] == 1
    assert a.health()["pool_free_bytes"] == 24 * KIB  # failed puts freed their slots


@pytest.mark.timeout(20)
def test_put_waiting_for_space_proceeds_when_a_reader_releases(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    assert a.put("0", "1", "k1", b"\1" * (40 * KIB))[0]
    view, _ = _take(b, "k1")
    result: list[Any] = []
    started = threading.Event()

    def second_put() -> None:
        started.set()
        result.append(
            a.put_packed(
                "0", "1", "k2", 40 * KIB, lambda t: t.fill_(3), deadline=time.monotonic() + 10
            )
        )

    t = threading.Thread(target=second_put)
    t.start()
    started.wait(5)
    view.release()  # the only way k2 can fit
    t.join(10)
    assert result and result[0][0] is True
    buf, _ = _take(b, "k2")
    assert bool((buf.tensor == 3).all())
    buf.release()


@pytest.mark.timeout(20)
def test_payload_kinds_round_trip(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    t = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    assert a.put("0", "1", "d", {"meta": [1, "x"], "t": t})[0]
    got = b.get("0", "1", "d")  # get decodes; wait would hand back the encoded bytes
    assert got is not None
    obj = got[0]
    assert obj["meta"] == [1, "x"] and torch.equal(obj["t"], t)
    assert b.get("0", "1", "nothing") is None  # travels after the release on the same socket
    assert a.health()["pool_free_bytes"] == 64 * KIB  # dicts are decoded, slot released
    for i, data in enumerate(
        [bytearray(b"ab"), memoryview(b"cde"), torch.arange(5, dtype=torch.uint8), b""]
    ):
        assert a.put("0", "1", f"r{i}", data)[0]
        buf, size = _take(b, f"r{i}")
        expected = bytes(data) if not isinstance(data, torch.Tensor) else data.numpy().tobytes()
        assert size == len(expected) and buf.to_bytes() == expected
        buf.release()
    assert a.put("0", "1", "none", None) == (False, 0, None)
    assert a.put("0", "1", "obj", object()) == (False, 0, None)


@pytest.mark.timeout(20)
def test_kv_payload_packed_in_place_and_adopted(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    k = [torch.randn(16, 2, 8).half() for _ in range(2)]
    v = [torch.randn(16, 2, 8).half() for _ in range(2)]
    kv = KVCacheTransferData("r1", {"key_cache": k, "value_cache": v}, [0, 1], {"seq_len": 16})
    plan = kv.plan()
    ok, size, _ = a.put_packed("0", "1", "omni_0_to_1_kv_cache_r1", plan.nbytes, plan)
    assert ok and size == plan.nbytes
    buf, _ = _take(b, "omni_0_to_1_kv_cache_r1")
    owned = buf.adopt()
    assert owned is not None
    out = decode(owned)
    del owned
    blocks = out["layer_blocks"]
    assert all(torch.equal(x, y) for x, y in zip(blocks["key_cache"], k, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(blocks["value_cache"], v, strict=True))
    del blocks
    assert a.health()["held_by_readers"] == 1  # the decoded views pin the slot
    del out
    gc.collect()
    # the release went out; a get on the same link after it proves the sender processed it
    assert b.get("0", "1", "anything") is None
    assert a.health()["held_by_readers"] == 0


@pytest.mark.timeout(20)
def test_a_host_array_writer_gets_numpy_any_other_writer_a_tensor(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    """The slot is handed over as numpy only to writers that declare they take it
    (``HostArrayWriter``); both kinds publish exactly their bytes."""
    a, b = pair
    seen: list[str] = []

    class Declared:
        def __call__(self, dst: torch.Tensor) -> None:
            raise AssertionError("a HostArrayWriter is given numpy")

        def write_host(self, dst: Any) -> None:
            seen.append(type(dst).__name__)
            dst[:] = 7

    def plain(dst: torch.Tensor) -> None:
        seen.append(type(dst).__name__)
        dst.fill_(9)

    assert a.put_packed("0", "1", "declared", 64, Declared())[0]
    assert a.put_packed("0", "1", "plain", 64, plain)[0]
    assert seen == ["ndarray", "Tensor"]
    for key, fill in (("declared", 7), ("plain", 9)):
        buf, size = _take(b, key)
        assert size == 64 and bytes(buf.tensor.numpy()) == bytes([fill]) * 64
        buf.release()


@pytest.mark.timeout(20)
def test_keys_are_escaped_bounded_and_per_edge(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    for key in ("../../etc/x y", "a b", "a%20b", "é@0_1"):
        assert a.put("0", "1", key, key.encode())[0]
    for key in ("a%20b", "../../etc/x y", "é@0_1", "a b"):
        buf, _ = _take(b, key)
        assert buf.to_bytes() == key.encode()
        buf.release()
    assert a.put("0", "1", "x" * 2000, b"1") == (False, 0, None)
    with pytest.raises(ValueError, match="too long"):
        a.put_packed("0", "1", "x" * 2000, 1, lambda t: None)
    assert a.put("0", "1", "same", b"to1")[0] and a.put("0", "2", "same", b"to2")[0]
    got = b.wait("0", "2", "same", deadline=time.monotonic() + 5)
    assert got is not None and got.to_bytes() == b"to2"
    got.release()
    buf, _ = _take(b, "same")
    assert buf.to_bytes() == b"to1"
    buf.release()


@pytest.mark.timeout(20)
def test_cleanup_drops_a_requests_unconsumed_payloads_at_the_sender(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    for key in ("r1", "r1_0_0_1", "omni_0_to_1_kv_cache_r1", "r10", "r2"):
        assert a.put("0", "1", key, b"z")[0]
    b.cleanup("r1")  # sent to the sender; the wants below travel after it on the same socket
    for key in ("r1", "r1_0_0_1", "omni_0_to_1_kv_cache_r1"):
        assert b.get("0", "1", key) is None
    for key in ("r10", "r2"):
        buf, _ = _take(b, key)
        buf.release()


@pytest.mark.timeout(20)
def test_close_is_idempotent_and_wakes_waiters(namespace: str) -> None:
    c = SharedMemoryConnector({"namespace": namespace, "pool_size_bytes": 1 << 16})
    out: list[Any] = []
    entered = threading.Event()

    def waiter() -> None:
        entered.set()
        out.append(c.wait("0", "1", "never", deadline=time.monotonic() + 30))

    t = threading.Thread(target=waiter)
    t.start()
    entered.wait(5)
    t0 = time.monotonic()
    c.close()
    c.close()
    t.join(5)
    assert not t.is_alive() and out == [None] and time.monotonic() - t0 < 5
    assert c.put("0", "1", "k", b"x") == (False, 0, None)
    with pytest.raises(ConnectorClosedError):
        c.put_packed("0", "1", "k", 1, lambda t: None)
    with pytest.raises(ConnectorClosedError):
        c.get("0", "1", "k")


@pytest.mark.slow
@pytest.mark.timeout(40)
def test_several_senders_and_receivers_at_once(peers: list[Peer], namespace: str) -> None:
    """Two sender processes (TP ranks) and four receiving threads of another process."""
    s0 = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    s1 = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    rx = SharedMemoryConnector({"namespace": namespace})
    keys = {f"r{i}_0_0_{src}_{i % 2}": (src, 10 * i + src) for i in range(4) for src in (0, 1)}
    results: dict[str, bool] = {}
    errors: list[BaseException] = []

    def take(key: str, fill: int) -> None:
        try:
            buf, size = _take(rx, key, 20.0)
            results[key] = size == 64 * KIB and bool((buf.tensor == fill).all())
            buf.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(k, f)) for k, (_, f) in keys.items()]
    try:
        for t in threads:
            t.start()
        for key, (src, fill) in keys.items():
            (s0 if src == 0 else s1).send("put", key, 64 * KIB, fill, 10.0)
        for src, _ in keys.values():
            assert (s0 if src == 0 else s1).recv()[:2] == ("put", True)
        for t in threads:
            t.join(20)
        assert not errors and results == dict.fromkeys(keys, True)
    finally:
        rx.close()


@pytest.mark.timeout(20)
def test_owner_only_memory_and_nothing_named(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    before = shm_listing()
    a, _b = pair
    assert a.put("0", "1", "k", b"x")[0]
    pools = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:omnikv-shm" in target:
            pools.append(os.stat(f"/proc/self/fd/{fd}").st_mode)
    assert pools and all(stat.S_IMODE(m) == 0o600 for m in pools)
    assert shm_listing() == before
    assert own_memfd_maps()


@pytest.mark.slow
@pytest.mark.timeout(20)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_peers_of_another_uid_are_refused(namespace: str) -> None:
    c = SharedMemoryConnector({"namespace": namespace})
    try:
        name = namespace_prefix(namespace) + c.instance
        code = (
            "import socket,sys\n"
            "s=socket.socket(socket.AF_UNIX,socket.SOCK_STREAM)\n"
            "s.settimeout(5)\n"
            "s.connect(b'\\0'+sys.argv[1].encode())\n"
            "print('eof' if s.recv(100)==b'' else 'data')\n"
        )
        out = subprocess.run(
            [
                "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable,
                "-c",
                code,
                name,
            ],
            check=False,
            user=65534,
            capture_output=True,
            text=True,
            timeout=15,
        )
        assert out.stdout.strip() == "eof", out.stderr
        assert c.health()["peers_refused"] == 1
    finally:
        c.close()


def test_no_pickle_in_the_shared_memory_code() -> None:
    src = paths.SRC / "omnikv" / "connectors"
    files = [src / "pool.py", *(src / "shm").glob("*.py")]
    assert len(files) >= 10
    for path in files:
        assert not re.search(r"import pickle|pickle\.", path.read_text()), path


# -- the reference's surface and calling conventions (reference-behaviour §8.3, §9 items 69-72) ----
@pytest.fixture
def one(namespace: str) -> Iterator[SharedMemoryConnector]:
    """One connector that both puts and gets, as a stage that sends and receives in one process."""
    c = SharedMemoryConnector({"namespace": namespace, "shm_threshold_bytes": 1024, "linger_s": 0})
    try:
        yield c
    finally:
        c.close()


@pytest.mark.timeout(20)
def test_reference_put_then_get_on_the_same_instance(one: SharedMemoryConnector) -> None:
    data = {"request_id": "r1", "layers": [torch.ones(2, 3)], "note": "x" * 2000}
    ok, size, meta = one.put("stage_0", "stage_1", "r1", data)
    assert ok and size > 0 and meta is not None and meta["size"] == size
    assert meta["shm"]["size"] == size and isinstance(meta["shm"]["name"], str)
    assert one.health()["published"] == 1  # pending until consumed
    got = one.get("stage_0", "stage_1", "r1")
    assert got is not None
    obj, got_size = got
    assert got_size == size and obj["request_id"] == "r1" and obj["note"] == "x" * 2000
    assert torch.equal(obj["layers"][0], torch.ones(2, 3))
    assert one.health()["published"] == 0  # consume-once
    assert one.get("stage_0", "stage_1", "r1") is None
    assert one.get("stage_0", "stage_1", "missing") is None
    assert one.put("0", "1", "raw", b"abc")[0]
    assert one.get("0", "1", "raw") == (b"abc", 3)  # bytes come back as bytes


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "metadata",
    [
        None,
        "not-a-dict",
        {},
        {"host": "10.0.0.1", "port": 5555, "size": 3},  # RDMA-style
        {"req_7": {"seq_len": 3}},  # keyed by request id
    ],
)
def test_reference_get_falls_back_to_the_key(one: SharedMemoryConnector, metadata: Any) -> None:
    assert one.put("0", "1", "req_7", b"xyz")[0]
    assert one.get("0", "1", "req_7", metadata=metadata) == (b"xyz", 3)


@pytest.mark.timeout(20)
def test_reference_get_accepts_put_metadata_plain_and_wrapped(one: SharedMemoryConnector) -> None:
    _, _, meta = one.put("0", "1", "a", b"AAA")
    assert one.get("0", "1", "a", metadata=meta) == (b"AAA", 3)
    _, _, meta = one.put("0", "1", "b", b"BBB")
    assert one.get("0", "1", "b", metadata={"b": meta}) == (b"BBB", 3)  # {key: meta}
    _, _, meta = one.put("0", "1", "c", b"CCC")
    assert one.get("0", "1", "some-other-key", metadata=meta) == (b"CCC", 3)  # the handle wins


@pytest.mark.timeout(20)
def test_reference_per_rank_keys_for_heterogeneous_tp(namespace: str) -> None:
    """A TP2 sender writes one key per rank; a TP1 receiver (another connector) reads both."""
    tx = SharedMemoryConnector({"namespace": namespace, "linger_s": 0})
    # get_timeout_s: see test_cross_process_put_get_is_consume_once (this one missed once so)
    rx = SharedMemoryConnector({"namespace": namespace, "get_timeout_s": 10})
    try:
        for rank in range(2):
            assert tx.put("0", "1", f"omni_0_to_1_kv_cache_r1_rank{rank}", {"rank": rank})[0]
        for rank in (1, 0):  # independent: any order
            got = rx.get("0", "1", f"omni_0_to_1_kv_cache_r1_rank{rank}")
            assert got is not None and got[0] == {"rank": rank}
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(20)
def test_reference_cleanup_and_close_drop_pending(one: SharedMemoryConnector) -> None:
    assert one.put("0", "1", "cleanup_req_42", b"1")[0]
    assert one.put("0", "1", "keep_req_420", b"2")[0]
    one.cleanup("req_42")
    assert one.get("0", "1", "cleanup_req_42") is None
    assert one.health()["published"] == 1
    assert one.put("0", "1", "req_42", b"3")[0]
    assert one.get("0", "1", "req_42") == (b"3", 1)
    one.cleanup("req_42")  # no-op after consumption
    one.close()  # clears every pending payload
    assert one.health()["published"] == 0 and one.health()["status"] == "closed"


def test_reference_config_keys_are_accepted(namespace: str) -> None:
    c = SharedMemoryConnector({"namespace": namespace})
    try:
        assert c.threshold == 65536 and c.health()["threshold"] == 65536
    finally:
        c.close()
    c = SharedMemoryConnector(
        {"namespace": namespace, "shm_threshold_bytes": 4096, "inline_small_payloads": True}
    )
    try:
        assert c.threshold == 4096  # accepted; every payload still goes through the pool
    finally:
        c.close()
    for bad in ({"prefault": "yes"}, {"linger_s": -1}, {"pool_size_bytes": "big"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SharedMemoryConnector({"namespace": namespace, **bad})


_BAD_CONFIG_VALUES = [
    ("prefault", "yes"),
    ("prefault", -1),
    ("prefault", 1.5),
    ("prefault", [1]),
    ("pool_size_bytes", "big"),
    ("pool_size_bytes", 0),
    ("pool_size_bytes", -4096),
    ("pool_size_bytes", 1024),  # below the 4096-byte minimum
    ("pool_size_bytes", True),
    ("put_timeout_s", -1),
    ("put_timeout_s", "soon"),
    ("put_timeout_s", float("nan")),
    ("get_timeout_s", 0),
    ("get_timeout_s", -0.5),
    ("join_timeout_s", 0),
    ("join_timeout_s", float("inf")),
    ("linger_s", -1),
    ("linger_s", "forever"),
    ("linger_s", False),
    ("shm_threshold_bytes", -1),
    ("shm_threshold_bytes", "64k?"),
    ("shm_threshold_bytes", 1.5),
    ("inline_small_payloads", "no"),
    ("inline_small_payloads", 1),
    ("poll_us", -1),
    ("poll_us", 100_001),
    ("poll_us", 1.5),
    ("poll_us", "soon"),
    ("namespace", ""),
    ("namespace", "   "),
    ("namespace", 7),
    ("namespace", "a\x00b"),
    ("namespace", "x" * 256),
]


@pytest.mark.parametrize(("key", "value"), _BAD_CONFIG_VALUES)
def test_a_bad_config_value_is_a_config_error_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} "):
        ShmConfig.parse({key: value})


def test_config_values_are_parsed_strictly_not_coerced() -> None:
    assert ShmConfig.parse(None) == ShmConfig()
    cfg = ShmConfig.parse(
        {
            "prefault": "64KiB",
            "pool_size_bytes": "1MiB",
            "put_timeout_s": 0,  # try once
            "linger_s": "0",
            "inline_small_payloads": "TRUE",
            "shm_threshold_bytes": "0",
            "namespace": "stage pipeline:1",
            "poll_us": "500",
        }
    )
    assert cfg.poll_us == 500 and ShmConfig().poll_us == DEFAULT_POLL_US == 1000
    assert ShmConfig.parse({"poll_us": 0}).poll_us == 0  # never poll
    assert cfg.prefault == Prefault(ahead=True, reserve=64 * KIB, auto=False)
    assert cfg.pool_size == 1 << 20
    assert (cfg.put_timeout_s, cfg.linger_s, cfg.threshold) == (0.0, 0.0, 0)
    assert cfg.inline_small_payloads and cfg.namespace == "stage pipeline:1"
    assert ShmConfig.parse({}).prefault == Prefault()
    for off in (False, "false", 0):
        assert not ShmConfig.parse({"prefault": off}).prefault.ahead


@pytest.mark.timeout(20)
def test_views_held_after_the_receiver_closes_keep_their_bytes(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    a, b = pair
    a.put_packed("0", "1", "k1", 40 * KIB, lambda t: t.fill_(1))
    buf, _ = _take(b, "k1")
    view = buf.adopt()  # the application keeps the tensor, not the buffer
    assert view is not None
    b.close()  # the sender reclaims the slot once the connection is gone ...
    deadline = time.monotonic() + 5
    while a.health()["pool_free_bytes"] != 64 * KIB and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded poll of a public view: the sender's I/O thread reclaims
    a.put_packed("0", "1", "k2", 40 * KIB, lambda t: t.fill_(2))  # ... and reuses it
    assert bool((view == 1).all())  # the held tensor was moved to private memory at close


@pytest.mark.timeout(20)
def test_wait_hands_back_every_kind_as_a_managed_buffer(
    pair: tuple[SharedMemoryConnector, SharedMemoryConnector],
) -> None:
    """Contract 1: ``wait`` -> ``ManagedBuffer | None``; objects come back as their encoding."""
    a, b = pair
    assert a.put("0", "1", "obj", {"x": 1})[0]
    got = b.wait("0", "1", "obj", deadline=time.monotonic() + 5)
    assert isinstance(got, ManagedBuffer)
    assert decode_object(got.to_bytes()) == {"x": 1}  # the one object encoder's framing
    # any connector's receiver decodes it the same way (and the slot goes back)
    assert get_result(got) == ({"x": 1}, len(encode_object({"x": 1})))
    assert got.released


@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
@pytest.mark.timeout(20)
def test_a_put_without_a_deadline_waits_put_timeout_s(namespace: str) -> None:
    """Contract 2: the caller's deadline rules; ``math.inf`` (none given): ``put_timeout_s``."""
    c = SharedMemoryConnector(
        {"namespace": namespace, "pool_size_bytes": 8 * KIB, "put_timeout_s": 0.3, "linger_s": 0}
    )
    try:
        c.put_packed("0", "1", "fill", 8 * KIB, lambda t: t.fill_(1))
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError):
            c.put_packed("0", "1", "more", KIB, lambda t: t.fill_(2))
        assert 0.3 <= time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        with pytest.raises(PoolExhaustedError):  # a caller's deadline beyond put_timeout_s wins
            c.put_packed("0", "1", "more", KIB, lambda t: t.fill_(2), deadline=t0 + 0.6)
        assert 0.6 <= time.monotonic() - t0 < 1.3
    finally:
        c.close()


# -- abortable waits -------------------------------------------------------------------------
def _abortable_receive(rx: SharedMemoryConnector, key: str, abort: threading.Event) -> Any:
    """The transfer layer's abortable wait of ``key`` (30 s deadline): the buffer, or the
    exception it raised."""
    from omnikv.transfer.receive import _wait_sliced

    try:
        return _wait_sliced(rx, ("0", "1"), key, time.monotonic() + 30.0, None, abort)
    except Exception as exc:
        return exc


@pytest.mark.timeout(60)
def test_an_abortable_wait_keeps_one_want_open_and_ends_at_its_abort(
    peers: list[Peer], namespace: str
) -> None:
    """Shared memory ``takes_abort``: an abortable receive is one wait with its want open
    throughout (sliced, each 50 ms slice counted a miss and sent a want and a cancel to every
    peer, and an offer that crossed a slice's end went back to its sender). The abort ends it
    within a few of its 50 ms checks; an offer that comes during the wait is taken, never
    returned."""
    from omnikv.transfer.receive import ReceiveCancelled

    tx = start_peer(peers, namespace, pool_size_bytes=64 * KIB, linger_s=0)
    rx = SharedMemoryConnector({"namespace": namespace})
    try:
        assert SharedMemoryConnector.takes_abort
        until(lambda: rx.health()["peers"] == 1, 10.0, "the sender peer joined")
        # an offer during a long abortable wait
        abort = threading.Event()
        out: list[Any] = []
        waiter = threading.Thread(target=lambda: out.append(_abortable_receive(rx, "k", abort)))
        waiter.start()
        until(lambda: rx.mesh.leadership.has_leader, 10.0, "the waiter leads")
        time.sleep(0.3)  # let six 50 ms checks pass before the put (what is measured)
        assert tx.call("put", "k", 4 * KIB, 9, 5.0)[1]
        waiter.join(10.0)
        got = out[0]
        assert isinstance(got, ManagedBuffer), got
        assert bytes(got.to_bytes()[:4]) == b"\t\t\t\t"
        got.release()
        assert rx.health()["misses"] == 0
        assert tx.call("health")[1]["returns"] == 0
        # nothing comes: the abort ends the wait, counted as one miss, not one per check
        abort2 = threading.Event()
        out.clear()
        waiter = threading.Thread(target=lambda: out.append(_abortable_receive(rx, "n", abort2)))
        waiter.start()
        time.sleep(0.3)  # six 50 ms checks pass before the abort (what is measured)
        t0 = time.monotonic()
        abort2.set()
        waiter.join(10.0)
        assert isinstance(out[0], ReceiveCancelled), out
        assert time.monotonic() - t0 < 5.0
        assert rx.health()["misses"] == 1
    finally:
        rx.close()


@pytest.mark.timeout(60)
def test_a_get_asks_a_peer_whose_connection_nobody_accepted_yet(
    peers: list[Peer], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-blocking ``get`` (the reference's) right after a sender joined and published: on a
    loaded host the thread serving the receiver's listener may not have had a CPU since the
    sender connected, and the get, asking the peers it knows once, missed a payload the sender
    held (seen in a full run). The get now accepts the waiting connections before it asks.
    Here the receiver's I/O thread is kept parked (a thread leads without serving, and the
    linger after it is long) while the sender joins and publishes."""
    monkeypatch.setattr(leadership, "LINGER_S", 30.0)
    monkeypatch.setattr(leadership, "PARK_CHECK_S", 30.0)
    rx = SharedMemoryConnector({"namespace": namespace, "get_timeout_s": 10})
    try:
        lead = rx.mesh.leadership
        with lead.lead() as leading:
            assert leading
            until(lambda: lead.parked, 10.0, "the I/O thread parked")
            tx = start_peer(peers, namespace, pool_size_bytes=64 * KIB, linger_s=0)
            assert tx.call("put", "k", 4 * KIB, 7, 5.0)[1]
            assert rx.health()["peers"] == 0  # connected to the listener, not accepted
        got = rx.get("0", "1", "k")
        assert got is not None, "the get did not ask the sender"
        assert got[1] == 4 * KIB
        assert rx.health()["peers"] == 1
    finally:
        rx.close()
