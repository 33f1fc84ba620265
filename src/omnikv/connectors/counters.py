"""Event counters of a connector, shown by its ``health()``.

One naming scheme for every connector: the operation first, then what is counted, so that a
name reads the same in every ``health()``: ``puts`` / ``gets`` (completed operations),
``put_bytes`` / ``get_bytes`` (their payload bytes), ``put_failures``, ``put_timeouts``,
``misses`` (a get or wait that found nothing), and each transport's own events named the same
way (``pulls_served``, ``pull_failures``, ``ttl_reaped``, ...).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["Counters"]


class Counters:
    """Thread-safe, monotonic event counters over a fixed set of names.

    Built once by a connector with every name it counts (all start at 0) and shared with its
    sender / receiver sides; any thread may ``add``. Counting a name not declared is a
    ``KeyError``, so a misspelt counter fails in the tests instead of vanishing.
    """

    __slots__ = ("_lock", "_values")

    def __init__(self, names: Iterable[str]) -> None:
        self._values = dict.fromkeys(names, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` (default 1) to the counter ``name``."""
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter (for ``health()``); cheap, never raises."""
        with self._lock:
            return dict(self._values)
