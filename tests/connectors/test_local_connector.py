"""LocalConnector: the whole connector contract in one process, over a pool of ManagedBuffers."""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch

from omnikv.connectors.base import ManagedBuffer
from omnikv.connectors.local import LocalConnector
from omnikv.errors import ConfigError, ConnectorClosedError, PoolExhaustedError
from omnikv.wire.serializer import decode_object

KIB = 1024


def _fill(value: int) -> Any:
    return lambda t: t.fill_(value)


def test_get_consumes_once_and_edges_never_collide(namespace: str) -> None:
    a, b = LocalConnector({"namespace": namespace}), LocalConnector({"namespace": namespace})
    ok, size, meta = a.put("0", "1", "k", b"hello")
    assert ok and size == 5 and meta is not None
    assert b.get("1", "0", "k") is None
    buf, n = b.get("0", "1", "k")
    assert isinstance(buf, ManagedBuffer) and n == 5 and buf.to_bytes() == b"hello"
    buf.release()
    assert b.get("0", "1", "k") is None
    assert a.health()["puts"] == 1 and b.health()["gets"] == 1


def test_objects_round_trip_through_put_and_get(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    obj = {"a": [1, 2], "t": torch.arange(6).reshape(2, 3).t()}
    assert conn.put("0", "1", "obj", obj)[0]
    got, _ = conn.get("0", "1", "obj")
    assert got["a"] == [1, 2] and torch.equal(got["t"], obj["t"])


def test_wait_hands_objects_over_as_their_encoded_bytes(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    conn.put("0", "1", "obj", {"x": 1})
    buf = conn.wait("0", "1", "obj", deadline=time.monotonic() + 1)
    assert isinstance(buf, ManagedBuffer) and decode_object(buf.tensor) == {"x": 1}


@pytest.mark.timing  # a bound of 50 ms past a deadline: run alone, after the lanes
def test_wait_honours_its_deadline(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    t0 = time.monotonic()
    assert conn.wait("0", "1", "none", deadline=time.monotonic() + 0.1) is None
    assert 0.1 <= time.monotonic() - t0 < 0.15


def test_wait_is_woken_by_put(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    got: list[Any] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(conn.wait("0", "1", "k", deadline=time.monotonic() + 5))
        got.append(time.monotonic())

    th = threading.Thread(target=waiter)
    th.start()
    started.wait(5)
    t_put = time.monotonic()
    conn.put("0", "1", "k", b"x")
    th.join(5)
    assert isinstance(got[0], ManagedBuffer) and got[0].to_bytes() == b"x"
    assert got[1] - t_put < 0.5


def test_put_packed_waits_for_pool_space_until_its_deadline(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace, "pool_size": 64 * KIB})
    assert conn.put_packed("0", "1", "a", 48 * KIB, _fill(1), deadline=0.0)[0]
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError):
        conn.put_packed("0", "1", "b", 48 * KIB, _fill(2), deadline=t0 + 0.2)
    assert 0.2 <= time.monotonic() - t0 < 1.0
    assert conn.pending_keys() == ["a@0_1"]


def test_put_packed_is_woken_when_a_reader_releases_space(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace, "pool_size": 64 * KIB})
    conn.put_packed("0", "1", "a", 48 * KIB, _fill(1), deadline=0.0)
    held = conn.wait("0", "1", "a", deadline=time.monotonic() + 1)
    assert held is not None
    timer = threading.Timer(0.1, held.release)
    timer.start()
    t0 = time.monotonic()
    assert conn.put_packed("0", "1", "b", 48 * KIB, _fill(2), deadline=t0 + 5)[0]
    assert time.monotonic() - t0 < 2.0
    timer.join()


def test_a_failed_write_publishes_nothing_and_frees_its_slot(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})

    def boom(_: torch.Tensor) -> None:
        raise RuntimeError("encode failed")

    with pytest.raises(RuntimeError):
        conn.put_packed("0", "1", "k", 100, boom, deadline=0.0)
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0


def test_release_returns_the_slot_to_the_pool(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    conn.put_packed("0", "1", "k", 10 * KIB, _fill(5), deadline=0.0)
    buf = conn.wait("0", "1", "k", deadline=time.monotonic() + 1)
    assert buf is not None and conn.health()["pool_used"] > 0
    assert bool((buf.tensor == 5).all())
    buf.release()
    assert conn.health()["pool_used"] == 0


@pytest.mark.slow
def test_adopted_views_keep_the_slot_until_they_die(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    conn.put_packed("0", "1", "k", 4 * KIB, _fill(9), deadline=0.0)
    buf = conn.wait("0", "1", "k", deadline=time.monotonic() + 1)
    assert buf is not None
    owned = buf.adopt()
    assert owned is not None and buf.released
    view = owned[:16].view(torch.float32)
    del owned
    gc.collect()
    assert conn.health()["pool_used"] > 0
    assert int(view.view(torch.uint8)[0]) == 9
    del view
    gc.collect()
    assert conn.health()["pool_used"] == 0


def test_cleanup_drops_the_request_and_frees_its_slots(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    conn.put_packed("0", "1", "req_42", 16, _fill(3), deadline=0.0)
    conn.put("0", "1", "other_req_42", b"y")
    conn.put("0", "1", "keep", b"z")
    conn.cleanup("req_42")
    assert [k.split("@")[0] for k in conn.pending_keys()] == ["keep"]


def test_flush_waits_for_consumption(namespace: str) -> None:
    tx, rx = LocalConnector({"namespace": namespace}), LocalConnector({"namespace": namespace})
    tx.put("0", "1", "k", b"x")
    assert tx.flush(timeout=0.05) == ["k@0_1"]
    timer = threading.Timer(0.05, lambda: rx.get("0", "1", "k"))
    timer.start()
    assert tx.flush(timeout=5) == []
    timer.join()


def test_closed_connector(namespace: str) -> None:
    with LocalConnector({"namespace": namespace}) as conn:
        pass
    assert conn.closed
    conn.close()  # idempotent
    assert conn.put("0", "1", "k", b"x") == (False, 0, None)
    with pytest.raises(ConnectorClosedError):
        conn.get("0", "1", "k")


def test_pool_size_must_be_positive(namespace: str) -> None:
    with pytest.raises(ConfigError, match="pool_size"):
        LocalConnector({"namespace": namespace, "pool_size": 0})


@pytest.mark.parametrize(("key", "bad"), [("pool_size", 1.5), ("put_timeout_s", -1)])
def test_bad_values_are_config_errors_naming_the_key(namespace: str, key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key):
        LocalConnector({"namespace": namespace, key: bad})


def test_sizes_may_carry_a_unit_and_health_counts_bytes(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace, "pool_size": "64KB"})
    try:
        assert conn.health()["pool_size"] == 64 * KIB
        assert conn.put("0", "1", "k", b"abc")[0]
        got = conn.get("0", "1", "k")
        assert got is not None and got[1] == 3
        got[0].release()
        h = conn.health()
        assert (h["puts"], h["put_bytes"], h["gets"], h["get_bytes"]) == (1, 3, 1, 3)
    finally:
        conn.close()


def test_many_namespaces_cost_no_commit_and_the_process_can_still_fork() -> None:
    # 32 pools of 1 GiB: more than this machine's memory. Their pages cost memory only once
    # written, and their size is not charged to the process, so fork (subprocess with
    # preexec_fn / another uid, multiprocessing's fork) still works.
    names = [f"fork-probe-{os.getpid()}-{i}" for i in range(32)]
    conns = [LocalConnector({"namespace": name}) for name in names]
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        for conn in conns:
            conn.close()


def test_an_unconsumed_payload_expires_after_its_ttl_and_is_named(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``buffer_ttl_seconds``: a payload nobody takes is dropped (slot freed, counted, logged
    with its key) at the namespace's next operation after the TTL; one taken in time is not."""
    tx = LocalConnector({"namespace": namespace, "buffer_ttl_seconds": 0.2})
    rx = LocalConnector({"namespace": namespace, "buffer_ttl_seconds": 0.2})
    assert tx.put("0", "1", "orphan", b"x" * 100)[0]
    assert tx.put("0", "1", "taken", b"y" * 10)[0]
    buf = rx.get("0", "1", "taken")
    assert buf is not None
    buf[0].release()
    end = time.monotonic() + 10
    with caplog.at_level("WARNING"):
        while tx.health()["pending"]:
            assert time.monotonic() < end, tx.health()
            time.sleep(0.01)
    health = tx.health()
    assert health["ttl_reaped"] == 1 and health["ttl_reaped_bytes"] == 100, health
    assert health["pool_used"] == 0
    assert "orphan" in caplog.text and "TTL" in caplog.text
    assert rx.get("0", "1", "orphan") is None
    never = LocalConnector({"namespace": f"{namespace}-n", "buffer_ttl_seconds": 0})
    assert never.buffer_ttl_s == 0
    with pytest.raises(ConfigError, match="buffer_ttl_seconds"):
        LocalConnector({"namespace": namespace, "buffer_ttl_seconds": "soon"})


def test_withdraw_takes_back_only_this_connectors_untaken_payload(namespace: str) -> None:
    """``withdraw``: the sender's own untaken payload goes (slot freed, no verdict); a second
    call, another connector of the namespace, a taken payload and a reader get False."""
    from omnikv.connectors.delivery import DeliveryReport

    a, b = LocalConnector({"namespace": namespace}), LocalConnector({"namespace": namespace})
    reports: list[DeliveryReport] = []
    a.set_delivery_listener(reports.append)
    assert a.put("0", "1", "gone", b"x" * 100)[0] and a.put("0", "1", "kept", b"y" * 100)[0]
    assert b.withdraw("0", "1", "gone") is False  # not b's
    assert a.withdraw("0", "1", "gone") is True
    assert a.withdraw("0", "1", "gone") is False
    assert b.get("0", "1", "gone") is None
    buf, _ = b.get("0", "1", "kept")
    assert a.withdraw("0", "1", "kept") is False  # taken
    buf.release()
    a.reap_consumed()
    assert reports == [] and a.pending_keys() == []
