"""Room in a full pull sender pool (``pull/room.py``), unit level: which entries go, in which
order, and when the next one passes its grace. The senders' behaviour with real processes is
``test_pull_pool_room.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from omnikv.connectors.pull.room import evict_unclaimed


@dataclass
class _Entry:
    key: str
    size: int
    created: float
    pub: int = 0
    busy: bool = False


def _table(*entries: _Entry) -> dict[str, _Entry]:
    return {e.key: e for e in entries}


def test_the_oldest_unclaimed_past_their_grace_go_first_until_it_fits() -> None:
    table = _table(
        _Entry("young", 1, created=95.0),
        _Entry("old", 1, created=10.0),
        _Entry("older-busy", 1, created=5.0, busy=True),
        _Entry("mid", 1, created=50.0),
    )
    freed: list[str] = []

    def drop(e: _Entry) -> None:
        del table[e.key]
        freed.append(e.key)

    gone, next_grace = evict_unclaimed(
        table, lambda e: not e.busy, drop, 10.0, lambda: len(freed) >= 2, now=100.0
    )
    assert [e.key for e in gone] == freed == ["old", "mid"]  # oldest first, never the busy one
    assert next_grace == math.inf  # it fitted: nothing more was looked at
    assert set(table) == {"young", "older-busy"}


def test_nothing_within_its_grace_goes_and_the_next_grace_is_told() -> None:
    table = _table(_Entry("a", 1, created=95.0), _Entry("b", 1, created=92.0))
    gone, next_grace = evict_unclaimed(
        table, lambda e: True, lambda e: None, 10.0, lambda: False, now=100.0
    )
    assert gone == [] and next_grace == 102.0
