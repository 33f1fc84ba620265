"""A peer process for the shared-memory tests, driven over a pipe, and the fixture that owns them.

Each peer runs one :class:`SharedMemoryConnector` and executes commands (plain tuples) sent by
the test: put, put that stalls mid-write, wait, wait and hold the view, release, health, close.
Peers start from a forkserver that has imported omnikv already (tens of ms, not seconds); the
fixture kills every peer it started by PID at the end of the test.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["omnikv.connectors.shm.connector", "omnikv.wire.transfer_data"])


def filler(value: int) -> Callable[[Any], object]:
    """A ``put_packed`` writer that fills the slot with one byte value."""

    def write(t: Any) -> object:
        return t.fill_(value)

    return write


def peer_main(conn: Connection, config: dict[str, Any]) -> None:
    """Child entry point: serve commands until ``close`` or EOF."""
    import torch

    from omnikv.connectors.shm.connector import SharedMemoryConnector

    c = SharedMemoryConnector(config)
    held: list[Any] = []
    conn.send(("ready", os.getpid(), c.instance))
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        op = cmd[0]
        try:
            if op == "put":
                _, key, nbytes, fill, timeout = cmd
                t0 = time.monotonic()
                ok, size, _ = c.put_packed(
                    "0",
                    "1",
                    key,
                    nbytes,
                    filler(fill),
                    deadline=time.monotonic() + timeout,
                )
                conn.send(("put", ok, size, t0))
            elif op == "put_stall":
                _, key, nbytes = cmd

                def stall(t: torch.Tensor) -> None:
                    t[: t.numel() // 2].fill_(7)
                    conn.send(("writing",))
                    conn.recv()  # never answered: the test kills us here

                c.put_packed("0", "1", key, nbytes, stall)
            elif op in ("wait", "wait_hold"):
                _, key, timeout, fill = cmd
                conn.send(("waiting",))
                got = c.wait("0", "1", key, deadline=time.monotonic() + timeout)
                t1 = time.monotonic()
                if got is None:
                    conn.send(("miss", t1))
                    continue
                buf, size = got, got.size
                ok = bool((buf.tensor == fill).all()) if size else True
                if op == "wait_hold":
                    held.append(buf)
                else:
                    buf.release()
                conn.send(("got", size, ok, t1))
            elif op == "churn":  # take c0.. in a loop, holding every other view a while
                _, n, timeout = cmd
                for i in range(n):
                    got = c.wait("0", "1", f"c{i}", deadline=time.monotonic() + timeout)
                    if got is None:
                        conn.send(("miss", i))
                        break
                    if held:
                        held.pop().release()
                    if i % 2:
                        held.append(got)
                    else:
                        got.release()
                    conn.send(("progress", i))
            elif op == "churn_put":  # put c0.. of 64 KiB each, filled with i % 251
                _, n = cmd
                for i in range(n):
                    c.put_packed("0", "1", f"c{i}", 64 * 1024, filler(i % 251))
                    conn.send(("progress", i))
            elif op == "held":  # what each held view holds now: (size, min, max)
                conn.send(("held", [_span(b.tensor) for b in held]))
            elif op == "race":  # see _race
                conn.send(_race(c, conn.send, *cmd[1:]))
            elif op == "release":
                for b in held:
                    b.release()
                held.clear()
                conn.send(("released",))
            elif op == "health":
                conn.send(("health", c.health()))
            elif op == "close":
                c.close()
                conn.send(("closed",))
                break
            else:
                conn.send(("error", f"unknown op {op}"))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _span(t: Any) -> tuple[int, int, int]:
    """``(size, min, max)`` of a byte view (``(0, -1, -1)`` when empty)."""
    if not t.numel():
        return 0, -1, -1
    return int(t.numel()), int(t.min()), int(t.max())


def _race(
    c: Any,
    report: Callable[[tuple[Any, ...]], None],
    n: int,
    skip_every: int,
    hold_every: int,
    timeout: float,
    lag: float,
) -> tuple[Any, ...]:
    """A slow client: take ``r0``.. ``r{n-1}`` (every ``skip_every``-th never asked for), each
    asked for ``lag * (i % 4)`` seconds late (its think time, so that some asks meet their
    payload's expiry) and waited for at most ``timeout``; every byte of what arrives must be
    ``i % 251``. ``report(("raced", i))`` after each key. Every ``hold_every``-th view taken is
    kept until the end and checked again then. Returns ``("race", got, missed, wrong)``
    (``wrong``: payloads with a byte that was not theirs)."""
    got = missed = wrong = 0
    held: list[tuple[int, Any]] = []
    for i in range(n):
        if i % skip_every:
            threading.Event().wait(lag * (i % 4))
            buf = c.wait("0", "1", f"r{i}", deadline=time.monotonic() + timeout)
            if buf is None:
                missed += 1
            else:
                got += 1
                wrong += int(_span(buf.tensor)[1:] != (i % 251, i % 251))
                if got % hold_every:
                    buf.release()
                else:
                    held.append((i, buf))
        report(("raced", i))
    for i, buf in held:
        wrong += int(_span(buf.tensor)[1:] != (i % 251, i % 251))
        buf.release()
    return "race", got, missed, wrong


class Peer:
    """Handle of one peer process."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.conn, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=peer_main, args=(child, config), daemon=True)
        self.proc.start()
        child.close()
        ready = self.recv(30.0)
        assert ready[0] == "ready", ready
        self.pid: int = ready[1]

    def send(self, *cmd: Any) -> None:
        self.conn.send(cmd)

    def recv(self, timeout: float = 10.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.proc.pid} did not answer within {timeout}s")
        return self.conn.recv()

    def call(self, *cmd: Any, timeout: float = 10.0) -> Any:
        self.send(*cmd)
        return self.recv(timeout)

    def kill(self) -> None:
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)
        assert not self.proc.is_alive()

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self.call("close", timeout=5.0)
        self.kill()


def peer_pool() -> Iterator[list[Peer]]:
    """Body of a ``peers`` fixture: a list the test appends started peers to; every one is
    killed by PID afterwards."""
    started: list[Peer] = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()


@pytest.fixture
def peers() -> Iterator[list[Peer]]:
    yield from peer_pool()


def start_peer(started: list[Peer], namespace: str, **config: Any) -> Peer:
    p = Peer({"namespace": namespace, **config})
    started.append(p)
    return p


def shm_listing() -> set[str]:
    """Names in /dev/shm that a shared-memory transport of ours (or the reference) could leave.

    Not torch's ``psm_*`` segments: other processes on the machine make those at any time, and
    this transport never uses torch's shared-memory allocator."""
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    return {n for n in names if n.startswith(("omnikv", "omni_", "shm_"))}


def abstract_names(namespace: str) -> set[str]:
    """Abstract socket names of a namespace still bound on the node."""
    from omnikv.connectors.shm.wire import discover, namespace_prefix

    return discover(namespace_prefix(namespace))


def own_memfd_maps() -> list[str]:
    """Lines of /proc/self/maps that map an omnikv pool."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        return [line for line in f if "omnikv-shm" in line]


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_peer_round_trip(peers: list[Peer], namespace: str) -> None:
    """The helper itself: two peers exchange one payload and report it verified."""
    a = start_peer(peers, namespace, pool_size_bytes=1 << 20)
    b = start_peer(peers, namespace)
    assert b.call("wait", "k", 10.0, 5) == ("waiting",)
    put = a.call("put", "k", 1000, 5, 5.0)
    assert put[:3] == ("put", True, 1000)
    got = b.recv()
    assert got[:3] == ("got", 1000, True)
    assert not math.isnan(got[3])
