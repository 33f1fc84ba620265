"""The one polling helper of the tests: wait, bounded, until a condition holds.

For what a test can only observe by asking (a step loop's ``poll``, a peer's state over a pipe,
threads ending); never a substitute for an event the code under test offers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["until"]

T = TypeVar("T")

#: Pause between two checks (seconds): short against every bound the tests use.
POLL_S = 0.002


def until(check: Callable[[], T], timeout: float = 5.0, what: str = "") -> T:
    """Call ``check`` until it returns a truthy value (returned) or ``timeout`` seconds passed
    (an ``AssertionError`` naming ``what`` and the last value)."""
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what or check!r} (last: {got!r:.200})")
        time.sleep(POLL_S)
