"""Arrival wakeups of :class:`~omnikv.connectors.shm.connector.SharedMemoryConnector`: the
reference's (vllm-omni 0.32) ``get_wakeup_generation`` / ``wait_for_change``.

A receiving stage that polls for data takes a generation, looks, and then blocks in
``wait_for_change(generation, timeout=...)`` until a ``put`` to its stage happened since, instead
of sleeping a fixed interval. Wakeups are hints: a missed one costs the waiter its timeout, a
spurious one a look, never data.

How: each waiting connector binds a datagram socket in the Linux *abstract* namespace (no file,
nothing left behind by a killed process) named ``omnikv-shm-wake/<uid>/<scope>/<stage>/<random>``;
a ``put`` to stage ``S`` sends one byte to every such socket of ``S`` in its scope (unless a
reader's blocking wait took the payload at once: nothing is then left to look for), listed from
``/proc/net/unix`` (at most every :data:`RESCAN_S`; the names found last are reused in between;
at most :data:`MAX_WAITERS` per stage, so names bound by others cannot make a put unbounded).
A waiter that binds its socket just after a sender listed is not woken by that sender's puts
until the sender lists again, up to :data:`RESCAN_S` later (it waits its timeout instead).
The scope is the connector's ``extra.wakeup_scope`` when set, else its namespace. Stages are
numbers, as in the reference (``stage_id``; a connector without a number >= 0 has no wakeups,
and puts to a stage that is not a number wake nobody). ``VLLM_OMNI_SHM_WAKEUP`` other than
``"1"`` turns wakeups off (``get_wakeup_generation`` then returns ``None``: keep polling).

Anyone on the host may send a byte to a wakeup socket: that is a spurious wakeup, no more.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from omnikv.polling import wait_readable

__all__ = ["MAX_WAITERS", "RESCAN_S", "WAKEUP_ENV", "Wakeups", "wakeups_enabled"]

logger = logging.getLogger(__name__)

#: The environment variable that turns wakeups off unless it is ``"1"`` (the reference's).
WAKEUP_ENV = "VLLM_OMNI_SHM_WAKEUP"
#: A put lists the waiting sockets of its stage again when its list is older than this (s).
RESCAN_S = 0.1
#: The most waiting sockets a put wakes per stage (a put's cost is one send per socket).
MAX_WAITERS = 256
#: Datagrams drained per wake (a flood only makes one wake).
_MAX_DRAIN = 1024


def wakeups_enabled() -> bool:
    """Whether ``VLLM_OMNI_SHM_WAKEUP`` allows wakeups (read at every use, as the reference)."""
    return os.environ.get(WAKEUP_ENV, "1") == "1"


def _stage_number(stage: Any) -> int | None:
    try:
        number = int(stage)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        return None
    return number if number >= 0 else None


def _bound_datagrams(prefix: str, limit: int = MAX_WAITERS) -> list[str]:
    """Abstract datagram socket names starting with ``prefix`` (from ``/proc/net/unix``), at
    most ``limit`` of them: anyone on the host may bind names under the prefix, and a put sends
    to every name listed."""
    found: list[str] = []
    want = "@" + prefix
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                # Num RefCount Protocol Flags Type St Inode Path; datagram sockets: Type 0002
                if len(parts) >= 8 and parts[4] == "0002" and parts[7].startswith(want):
                    if len(found) >= limit:
                        logger.debug("more than %d wakeup sockets under %s", limit, prefix)
                        break
                    found.append(parts[7][1:])
    except OSError:
        return found
    return found


class Wakeups:
    """One connector's wakeups: its receiving socket (made on first use) and what its puts
    send. Thread-safe; ``wait_for_change`` blocks outside the lock."""

    def __init__(self, scope: str, stage_id: Any) -> None:
        digest = hashlib.sha256(scope.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        self._prefix = f"omnikv-shm-wake/{os.getuid()}/{digest}/"
        self._stage = _stage_number(stage_id)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._generation = 0
        self._closed = False
        self._out: socket.socket | None = None
        self._known: dict[int, tuple[float, list[str]]] = {}  # stage -> (listed at, names)

    def _open(self) -> bool:
        """Bind the receiving socket if it is not bound; whether this connector has one."""
        if self._sock is not None:
            return True
        if self._closed or self._stage is None or not wakeups_enabled():
            return False
        name = f"{self._prefix}{self._stage}/{uuid.uuid4().hex}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(b"\0" + name.encode())
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            logger.debug("shared-memory wakeups unavailable (%s): %s", name, exc)
            return False
        self._sock = sock
        return True

    def generation(self) -> int | None:
        """The current generation, or ``None`` when this connector has no wakeups (no stage
        number, ``VLLM_OMNI_SHM_WAKEUP`` off, closed): the caller keeps its timed poll."""
        with self._lock:
            return self._generation if self._open() else None

    def wait_for_change(self, generation: int, timeout: float) -> bool:
        """Block until a put to this stage since ``generation``, at most ``timeout`` seconds;
        whether the generation has changed. ``False`` at once without wakeups or once
        closed."""
        if math.isnan(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a number >= 0, got {timeout!r}")
        with self._lock:
            sock = self._sock
            if self._closed or sock is None:
                return False
            if self._generation != generation:
                return True
        try:  # an engine holds descriptors past 1024: wait_readable does not use select
            readable = wait_readable(sock.fileno(), timeout)
        except (OSError, ValueError):  # closed meanwhile
            return False
        with self._lock:
            if self._closed or self._sock is not sock:
                return False
            if readable and self._drain(sock):
                self._generation += 1
            return self._generation != generation

    @staticmethod
    def _drain(sock: socket.socket) -> bool:
        got = False
        for _ in range(_MAX_DRAIN):
            try:
                sock.recv(16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            got = True
        return got

    def notify(self, to_stage: Any) -> None:
        """Wake every connector waiting for ``to_stage`` in this scope (called after each put;
        never raises, never blocks)."""
        stage = _stage_number(to_stage)
        if stage is None or not wakeups_enabled():
            return
        with self._lock:
            if self._closed:
                return
            now = time.monotonic()
            listed_at, names = self._known.get(stage, (-RESCAN_S, []))
            if now - listed_at >= RESCAN_S:
                names = _bound_datagrams(f"{self._prefix}{stage}/")
                self._known[stage] = (now, names)
            if not names:
                return
            if self._out is None:
                self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._out.setblocking(False)
            gone = []
            for name in names:
                try:
                    self._out.sendto(b"\0", b"\0" + name.encode())
                except (BlockingIOError, InterruptedError):
                    pass  # its queue is full: it has wakes to read already
                except OSError:
                    gone.append(name)
            if gone:
                self._known[stage] = (self._known[stage][0], [n for n in names if n not in gone])

    def close(self) -> None:
        """Close both sockets, ending a wait in progress (it returns ``False``); later calls
        find no wakeups (idempotent)."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                # a byte to itself wakes a waiter's poll, which a close alone does not
                with contextlib.suppress(OSError):
                    self._sock.sendto(b"\0", self._sock.getsockname())
            for sock in (self._sock, self._out):
                if sock is not None:
                    sock.close()
            self._sock = self._out = None
