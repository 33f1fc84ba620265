"""Rate-limited log lines for what an outsider can trigger.

A log line that a peer, a client or a forged payload can cause (a refused control message, an
unauthenticated verdict, a refused payload, a rejected request) must not let that outsider
flood the log. Each such call site owns one :class:`RateLimitedLog` (a module-level constant
next to its ``logger``): per interval it writes the first ``burst`` lines as they come and
counts the rest; the first line after the interval ends is preceded by one summary line with
the count of those suppressed. What is suppressed is only the log line: counters and results
still record every event.

Usage at a call site (a one-line change from ``logger.warning(...)``)::

    _refusals = RateLimitedLog(logger)
    ...
    _refusals.warning("refused control message from %s: %s", peer, why)
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["DEFAULT_BURST", "DEFAULT_INTERVAL_S", "RateLimitedLog", "reset_all"]

#: Seconds per interval: at most ``burst`` lines plus one summary line per interval and site.
DEFAULT_INTERVAL_S = 10.0
#: Lines written as they come at the start of each interval.
DEFAULT_BURST = 5

_every: weakref.WeakSet[RateLimitedLog] = weakref.WeakSet()


def reset_all() -> None:
    """:meth:`RateLimitedLog.reset` every call site (the test suite runs it before each test,
    so that a test's expected log lines do not depend on the tests before it)."""
    for limited in list(_every):
        limited.reset()


class RateLimitedLog:
    """One call site's log lines, at most ``burst`` per ``interval_s`` seconds plus a summary.

    Thread-safe. ``clock`` is monotonic seconds (tests may pass their own). The summary of an
    interval is written when the next line comes after it, at the level of that line, so a
    burst that stops is summed up by the next occurrence (the counters of the caller hold the
    exact totals meanwhile)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        burst: int = DEFAULT_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or burst < 1:
            raise ValueError("interval_s must be positive and burst at least 1")
        self.logger = logger
        self.interval_s, self.burst = interval_s, burst
        self._clock = clock
        self._lock = threading.Lock()
        self._start = -float("inf")
        self._written = 0
        #: lines suppressed in the current interval
        self.suppressed = 0
        _every.add(self)

    def reset(self) -> None:
        """Start a fresh interval with nothing written or suppressed."""
        with self._lock:
            self._start, self._written, self.suppressed = -float("inf"), 0, 0

    def log(self, level: int, msg: str, *args: object, exc_info: bool = False) -> None:
        """``logger.log(level, msg, *args)`` unless this interval's burst is spent."""
        if not self.logger.isEnabledFor(level):
            return
        with self._lock:
            now = self._clock()
            summary = 0
            if now - self._start >= self.interval_s:
                summary, self.suppressed = self.suppressed, 0
                self._start, self._written = now, 0
            if self._written >= self.burst:
                self.suppressed += 1
                return
            self._written += 1
        if summary:
            self.logger.log(
                level,
                "%d similar lines suppressed (at most %d per %.0f s are written)",
                summary,
                self.burst,
                self.interval_s,
            )
        self.logger.log(level, msg, *args, exc_info=exc_info)

    def debug(self, msg: str, *args: object) -> None:
        """:meth:`log` at DEBUG."""
        self.log(logging.DEBUG, msg, *args)

    def info(self, msg: str, *args: object) -> None:
        """:meth:`log` at INFO."""
        self.log(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: object) -> None:
        """:meth:`log` at WARNING."""
        self.log(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: object) -> None:
        """:meth:`log` at ERROR."""
        self.log(logging.ERROR, msg, *args)

    def exception(self, msg: str, *args: object) -> None:
        """:meth:`log` at ERROR with the exception being handled (``logger.exception``)."""
        self.log(logging.ERROR, msg, *args, exc_info=True)
