"""Waiting for one descriptor to become readable or writable, whatever its number.

``select.select`` refuses descriptors at or above ``FD_SETSIZE`` (1024) with ``ValueError``; a
process that holds many connections (a serving stage, a receiver beside a thousand sockets) gets
such numbers for its newest sockets, and a wait that treated the error as a closed connection
would drop every connection it opened from then on. ``poll`` has no such limit.
"""

from __future__ import annotations

import math
import select

__all__ = ["wait_readable", "wait_writable"]

#: The longest timeout ``poll`` takes (a C int of milliseconds); longer waits are cut to it.
_MAX_POLL_MS = 2**31 - 1


def _wait(fd: int, events: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, events)
    if timeout_s is None or math.isinf(timeout_s):
        ms = None
    else:
        # rounded up: a positive wait shorter than a millisecond must not become a busy loop
        ms = min(max(0, math.ceil(timeout_s * 1000.0)), _MAX_POLL_MS)
    return bool(poller.poll(ms))


def wait_readable(fd: int, timeout_s: float | None) -> bool:
    """Whether ``fd`` became readable within ``timeout_s`` seconds (``None``: no limit).

    Called by the socket readers that wait with a deadline (the pull connectors' control
    client, the shared-memory wake-up socket, the demo's pipe reader). End of stream, a reset
    and an error count as readable, as with ``select``: the read that follows reports them.
    A timeout past ``poll``'s limit (about 24 days) is cut to it. Raises ``ValueError`` for a
    negative or closed descriptor only."""
    return _wait(fd, select.POLLIN, timeout_s)


def wait_writable(fd: int, timeout_s: float | None) -> bool:
    """Whether ``fd`` became writable (or failed: ``SO_ERROR`` says which) within
    ``timeout_s`` seconds (``None``: no limit). Called by a non-blocking ``connect`` waiting
    for its outcome (the shared-memory mesh joining its peers)."""
    return _wait(fd, select.POLLOUT, timeout_s)
