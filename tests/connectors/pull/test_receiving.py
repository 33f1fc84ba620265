"""The pull receivers' one core (:class:`PullReceiver`) over a scripted backend: what it asks,
how long it holds, and what it hands back. The real backends (Transfer Engine, NIXL) run
through it in ``tests/connectors/mooncake_te``, ``nixl`` and ``pull``."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import pytest

from omnikv.connectors.base import ABORT_POLL_S, ManagedBuffer
from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import PULL_COUNTER_NAMES, deliver
from omnikv.connectors.pull.quarantine import Outcome
from omnikv.connectors.pull.receiving import PARKED_HOLD_S, PullReceiver
from omnikv.errors import ConnectorClosedError

EP = ("127.0.0.1", 1)


@dataclass(frozen=True)
class _Grant:
    key: str
    size: int


class _Backend:
    """Grants ``key`` on the ``grant_on``-th ask (never when 0); the transfer fills a slot.
    Each ask sleeps its hold (at most 20 ms) as a sender holding a long-poll would."""

    def __init__(self, pool: HostPool, counters: Counters, grant_on: int = 0) -> None:
        self.pool, self.counters, self.grant_on = pool, counters, grant_on
        self.holds: list[float] = []
        self.events: list[str] = []

    def claim(
        self, key: str, endpoint: tuple[str, int], deadline: float, hold_s: float
    ) -> _Grant | None:
        self.holds.append(hold_s)
        self.events.append("claim")
        if self.grant_on and len(self.holds) >= self.grant_on:
            return _Grant(key, 4096)
        time.sleep(min(hold_s, 0.02, max(0.0, deadline - time.monotonic())))
        return None

    def transfer(self, grant: _Grant, deadline: float) -> ManagedBuffer | None:
        self.events.append("transfer")
        offset, _ = self.pool.allocator.alloc(grant.size)
        return deliver(self.pool, self.counters, offset, grant.size)


def _core(grant_on: int = 0) -> tuple[PullReceiver[_Grant], _Backend, Counters]:
    pool = HostPool(1 << 20)
    counters = Counters(PULL_COUNTER_NAMES)
    backend = _Backend(pool, counters, grant_on)
    core = PullReceiver(
        backend,
        pool,
        counters,
        peer_timeout_s=1.0,
        quarantine_interval_s=0.005,
        quarantine_name="test-core",
        engine="TestConnector",
    )
    return core, backend, counters


def test_a_wait_holds_its_asks_until_granted_and_hears_the_size_first() -> None:
    core, backend, counters = _core(grant_on=3)
    heard: list[int] = []

    def on_incoming(size: int) -> None:
        heard.append(size)
        backend.events.append("incoming")

    buf = core.wait("k", EP, time.monotonic() + 5, on_incoming)
    assert buf is not None and buf.size == 4096
    buf.release()
    assert backend.holds == [math.inf] * 3  # long-polls up to the engine's cap
    assert backend.events[-3:] == ["claim", "incoming", "transfer"] and heard == [4096]
    assert counters.snapshot()["gets"] == 1 and counters.snapshot()["misses"] == 0
    core.close(1.0)


def test_a_wait_ends_at_its_deadline_as_a_miss() -> None:
    core, _, counters = _core()
    t0 = time.monotonic()
    assert core.wait("k", EP, t0 + 0.1) is None
    assert time.monotonic() - t0 < 1.0
    assert counters.snapshot()["misses"] == 1
    core.close(1.0)


def test_an_abort_shortens_every_hold_and_ends_the_wait() -> None:
    core, backend, _ = _core()
    abort = threading.Event()
    threading.Timer(0.1, abort.set).start()
    t0 = time.monotonic()
    assert core.wait("k", EP, t0 + 30, abort=abort) is None
    assert time.monotonic() - t0 < 5.0
    assert backend.holds and all(h <= ABORT_POLL_S for h in backend.holds)
    core.close(1.0)


def test_a_parked_transfer_of_the_key_shortens_the_hold_and_its_late_arrival_is_taken() -> None:
    core, backend, counters = _core()

    class _Finished:
        now = Outcome.RUNNING

        def outcome(self) -> Outcome:
            return self.now

    parked = _Finished()
    offset, _ = backend.pool.allocator.alloc(4096)
    core.park("x1", "k", offset, 4096, parked)
    deadline = time.monotonic() + 10
    threading.Timer(0.1, lambda: setattr(parked, "now", Outcome.DONE)).start()
    buf = core.wait("k", EP, deadline)
    assert buf is not None and buf.size == 4096  # the late arrival, not a new transfer
    assert PARKED_HOLD_S in backend.holds and "transfer" not in backend.events
    assert counters.snapshot()["late_arrivals"] == 1
    buf.release()
    core.close(1.0)


def test_take_asks_once_without_a_hold() -> None:
    core, backend, counters = _core()
    assert core.take("k", EP) is None
    assert backend.holds == [0.0] and counters.snapshot()["misses"] == 1
    core.close(1.0)


def test_a_closed_core_refuses_waits() -> None:
    core, _, _ = _core()
    core.close(1.0)
    with pytest.raises(ConnectorClosedError, match="TestConnector is closed"):
        core.wait("k", EP, time.monotonic() + 1)
