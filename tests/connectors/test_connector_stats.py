"""connectors/counters.py: the event counters every connector's ``health()`` shows."""

from __future__ import annotations

import threading

import pytest

from omnikv.connectors.counters import Counters


def test_counters_start_at_zero_and_add_from_many_threads() -> None:
    counters = Counters(("puts", "put_bytes"))
    assert counters.snapshot() == {"puts": 0, "put_bytes": 0}

    def work() -> None:
        for _ in range(1000):
            counters.add("puts")
            counters.add("put_bytes", 4)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert counters.snapshot() == {"puts": 4000, "put_bytes": 16000}


def test_counting_an_undeclared_name_is_a_key_error() -> None:
    counters = Counters(("puts",))
    with pytest.raises(KeyError):
        counters.add("putz")


def test_snapshot_is_a_copy() -> None:
    counters = Counters(("gets",))
    snap = counters.snapshot()
    snap["gets"] = 99
    assert counters.snapshot() == {"gets": 0}
