"""The one allocator (``_pool.BufferAllocator``) and the shared-memory mappings (``pool``).

In-process tests of the allocator's blocking, deadline-aware allocation; the pool's seals, lazy
population and in-place migration; and (slow) the SIGBUS attack: a same-uid peer offering an
unsealed memfd that it shrinks later must be refused before anything is mapped.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from omnikv.connectors.pool import BufferAllocator
from omnikv.connectors.shm.pool import PAGE, PeerPool, SenderPool, check_pool_fd
from omnikv.errors import ConnectorClosedError, PoolExhaustedError

MIB = 1 << 20


# -- the allocator -------------------------------------------------------------------------------
@pytest.mark.timing  # a bound of 0.5 s or less past a deadline: run alone, after the lanes
def test_alloc_waits_for_a_free_until_its_deadline_then_raises() -> None:
    a = BufferAllocator(4 * PAGE)
    off, size = a.alloc(4 * PAGE)
    assert (off, size) == (0, 4 * PAGE)
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="no 4096-byte slot"):
        a.alloc(1, deadline=time.monotonic() + 0.1)
    assert 0.1 <= time.monotonic() - t0 < 0.4
    with pytest.raises(PoolExhaustedError):
        a.alloc(1)  # deadline 0.0: do not wait
    with pytest.raises(PoolExhaustedError, match="the pool holds"):
        a.alloc(5 * PAGE, deadline=time.monotonic() + 10)  # can never fit: fails at once


def test_alloc_is_woken_by_free_without_polling() -> None:
    a = BufferAllocator(2 * PAGE)
    first, _ = a.alloc(2 * PAGE)
    asked: list[int] = []
    got: list[tuple[int, int]] = []

    def on_wait(size: int) -> None:
        asked.append(size)
        threading.Timer(0.05, a.free, (first,)).start()

    t = threading.Thread(
        target=lambda: got.append(a.alloc(PAGE, deadline=time.monotonic() + 5, on_wait=on_wait))
    )
    t.start()
    t.join(5)
    assert asked == [PAGE]  # the on_wait hook runs once, before the first wait
    assert got == [(0, PAGE)]
    assert a.used_bytes == PAGE and a.free_bytes() == PAGE


def test_close_wakes_waiting_allocs_with_connector_closed() -> None:
    a = BufferAllocator(PAGE)
    a.alloc(PAGE)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            a.alloc(PAGE, deadline=time.monotonic() + 30)
        except ConnectorClosedError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    threading.Timer(0.05, a.close).start()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1


def test_reference_shaped_api_keeps_working() -> None:
    a = BufferAllocator(8 * PAGE)
    offs = [a.try_alloc(PAGE) for _ in range(8)]
    with pytest.raises(MemoryError):
        a.try_alloc(1)
    for off in offs[::2]:
        a.free(off)
    assert a.free_bytes() == 4 * PAGE and a.largest_free() == PAGE
    a.free(offs[0])  # exact double free: ignored with a warning
    for off in offs[1::2]:
        a.free(off)
    assert a.largest_free() == 8 * PAGE and a.block_size(1) == PAGE


# -- the sender's pool and peers' mappings ---------------------------------------------------------
def test_sender_pool_is_sealed_owner_only_and_populated_with_use() -> None:
    pool = SenderPool(64 * MIB, "omnikv-shm-test", prefault=True)
    try:
        assert pool.fd is not None
        check_pool_fd(pool.fd, pool.size)  # memfd, GROW | SHRINK | SEAL, exact size
        assert os.fstat(pool.fd).st_mode & 0o777 == 0o600
        with pytest.raises(PermissionError):
            os.ftruncate(pool.fd, 0)
        assert pool.populated_bytes == 0  # nothing committed before use
        pool.note_used(64 * 1024)
        deadline = time.monotonic() + 5
        while pool.populated_bytes == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        # ahead of use, proportional to it: far below the 64 MiB pool
        assert 0 < pool.populated_bytes <= 8 * MIB
    finally:
        pool.close()


def test_migrate_keeps_a_views_contents_and_frees_the_shared_pages() -> None:
    pool = SenderPool(4 * PAGE, "omnikv-shm-test", prefault=False)
    assert pool.fd is not None
    reader = PeerPool(1, os.dup(pool.fd), pool.size)
    try:
        pool.view(0, PAGE).fill_(7)
        region = reader.region()
        held = region.view(0, 100)
        region.migrate(0, 100)
        pool.view(0, PAGE).fill_(9)  # the sender reuses the slot
        assert bool((held == 7).all())  # the reader's view kept its bytes
        assert bool((reader.region().view(0, PAGE) == 9).all())  # new views see the pool
    finally:
        reader.close()
        pool.close()


def test_unsealed_or_resized_descriptors_are_refused() -> None:
    fd = os.memfd_create("omnikv-shm-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, PAGE)
        with pytest.raises(ValueError, match="seals"):
            check_pool_fd(fd, PAGE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(ValueError, match="seals"):
            check_pool_fd(fd, PAGE)  # shrink alone is not enough: GROW and SEAL too
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with pytest.raises(ValueError, match="announced"):
            check_pool_fd(fd, 2 * PAGE)
        check_pool_fd(fd, PAGE)
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a sealable memfd"):
            check_pool_fd(r, PAGE)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(ValueError):
        PeerPool(1, os.memfd_create("x", os.MFD_CLOEXEC), PAGE)  # fd closed on refusal


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_peer_that_shrinks_an_unsealed_memfd_cannot_sigbus_the_receiver(namespace: str) -> None:
    """Attack: a same-uid peer offers an unsealed memfd, then truncates it to 0."""
    from omnikv.connectors.shm.connector import SharedMemoryConnector
    from support.shm_attack import Attacker

    rx = SharedMemoryConnector({"namespace": namespace})
    attacker = Attacker(namespace, "sigbus")
    try:
        assert attacker.ready() == "ready"
        t0 = time.monotonic()
        got = rx.wait("0", "1", "victim", deadline=time.monotonic() + 2.0)
        assert got is None and time.monotonic() - t0 < 3.0
        assert rx.health()["peers_dropped"] == 1  # refused before mapping, disconnected
        assert not [line for line in _maps() if "omnikv-attack" in line]
    finally:
        attacker.stop()
        rx.close()


def _maps() -> list[str]:
    with open("/proc/self/maps", encoding="utf-8") as f:
        return list(f)
