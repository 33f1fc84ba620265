"""The pull receivers' one quarantine (TE and NIXL differ only in how a transfer is asked):
a running transfer keeps its slot, a finished one becomes a late arrival, a gone one frees it."""

from __future__ import annotations

import threading

from omnikv.connectors.counters import Counters
from omnikv.connectors.pool import HostPool
from omnikv.connectors.pull.connector import PULL_COUNTER_NAMES, LateArrivals
from omnikv.connectors.pull.quarantine import Outcome, Quarantine


class _Switch:
    """A transfer whose outcome the test sets; ``asked`` is set each time the reaper asks."""

    def __init__(self) -> None:
        self.now = Outcome.RUNNING
        self.asked = threading.Event()

    def outcome(self) -> Outcome:
        self.asked.set()
        return self.now


def test_a_quarantined_slot_is_kept_while_running_then_delivered_or_freed() -> None:
    pool = HostPool(1 << 20)
    counters = Counters(PULL_COUNTER_NAMES)
    late = LateArrivals(pool, counters)
    closing = threading.Event()
    q = Quarantine(
        pool, late, counters, interval_s=0.005, name="test-quarantine", closed=closing.is_set
    )
    try:
        done, gone = _Switch(), _Switch()
        a, _ = pool.allocator.alloc(4096)
        b, _ = pool.allocator.alloc(4096)
        q.add("x1", "k-done", a, 4096, done)
        q.add("x2", "k-gone", b, 4096, gone)
        for t in (done, gone):  # asked at least twice while running: nothing moves
            assert t.asked.wait(5)
            t.asked.clear()
            assert t.asked.wait(5)
        assert len(q) == 2 and q.holds("k-done") and pool.allocator.allocations == 2
        done.now, gone.now = Outcome.DONE, Outcome.GONE
        thread = q.thread
        assert thread is not None
        for _ in range(1000):
            if len(q) == 0:
                break
            done.asked.clear()
            done.asked.wait(0.05)
        assert len(q) == 0 and not q.holds("k-done")
        assert late.size("k-done") == 4096 and late.size("k-gone") is None
        snap = counters.snapshot()
        assert (snap["quarantine_events"], snap["quarantine_freed"]) == (2, 1)
        assert pool.allocator.allocations == 1  # the late arrival's slot
    finally:
        assert q.close(5.0) == []
        late.clear()
        pool.close()
    assert q.thread is not None and not q.thread.is_alive()
