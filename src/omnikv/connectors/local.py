"""In-process connector: both stages live in one process (tests, single-process pipelines).

Honours the whole connector contract and is the reference double for tests: payloads live in a
pool shared by the connectors of one ``namespace`` (config key, default ``"default"``), so a
sender and a receiver manager in the same process meet, and ``wait`` hands out
:class:`~omnikv.connectors.base.ManagedBuffer` views of pool slots exactly like the engine
connectors (release or adopt them; the slot is free again afterwards). ``put_packed`` waits for
pool space until its deadline (then ``PoolExhaustedError``); ``wait`` is woken by ``put`` through
a condition variable (no polling); consume-once ``get``, ``cleanup``, ``flush``, ``health`` and an
idempotent ``close``.

Config keys (read by :mod:`omnikv.values`): ``namespace``; ``pool_size`` (bytes or ``"512MB"``,
default 1 GiB of virtual memory, taken by the first connector of a namespace; pages are touched
only as payloads use them); ``put_timeout_s`` (seconds >= 0 the reference-shaped ``put`` waits
for space, default 0); ``buffer_ttl_seconds`` (default 300, as the other connectors; 0: never):
a payload unconsumed for that long is dropped and its slot freed, with a warning naming it and
the ``ttl_reaped`` / ``ttl_reaped_bytes`` counts. The namespace is swept on its next operation
(put, get, wait, health), at most every ``buffer_ttl_seconds / 2``. Verdicts
(:mod:`omnikv.connectors.delivery`): a receiver's ``acknowledge`` reaches the publishing
connector's listener directly; an expired payload is reported ``expired``, and so is one taken
and not acknowledged within ``ack_timeout_s`` (default 60; checked by ``health`` and
``reap_consumed``).
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from omnikv.connectors.base import (
    GetResult,
    KeyProbe,
    KeyState,
    ManagedBuffer,
    OmniConnectorBase,
    PutResult,
    SlotRelease,
    Writer,
    fill_slot,
    matches_request,
)
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    DEFAULT_ACK_TIMEOUT_S,
    DeliveryListener,
    DeliveryNotices,
    Verdict,
)
from omnikv.connectors.pool import BufferAllocator
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError
from omnikv.values import parse_number, parse_size

__all__ = ["LocalConnector"]

logger = logging.getLogger(__name__)

_DEFAULT_POOL = 1 << 30
#: ``buffer_ttl_seconds`` by default (the other connectors' default).
DEFAULT_BUFFER_TTL_S = 300.0
# Python < 3.13 lacks the constant; 0x4000 is its value on Linux.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_ALIGN = 64


class _Pool:
    """Plain host memory with an allocator (never registered anywhere, never closed).

    The memory is an anonymous ``MAP_NORESERVE`` mapping: pages cost memory only once written,
    and the virtual size is not charged to the process's commit, so a process holding many
    namespaces' pools can still ``fork`` (a private ``torch.empty`` of the same size is charged
    in full, and adjacent ones merge into one mapping the kernel refuses to duplicate).
    """

    closed = False

    def __init__(self, size: int) -> None:
        self.allocator = BufferAllocator(size, alignment=_ALIGN)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._map = mmap.mmap(-1, self.allocator.total, flags=flags)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    def slot(self, offset: int, size: int) -> torch.Tensor:
        return self.buffer[offset : offset + size]


@dataclass
class _Item:
    offset: int
    size: int
    put_at: float
    put_key: str
    notices: DeliveryNotices


@dataclass
class _Taken:
    put_key: str
    notices: DeliveryNotices


class _Store:
    def __init__(self, pool_size: int) -> None:
        self.items: dict[str, _Item] = {}
        # taken and not yet acknowledged: key -> who published it (bounded by the senders'
        # notices: an entry whose sender stopped watching it is dropped by the sweep)
        self.taken: dict[str, _Taken] = {}
        self.cond = threading.Condition()
        self.pool = _Pool(pool_size)
        self.users = 0
        self.next_sweep = 0.0

    def reap_locked(self, ttl_s: float, counters: Counters) -> None:
        """Drop the payloads unconsumed for ``ttl_s`` (0: never); the caller holds ``cond``."""
        now = time.monotonic()
        if ttl_s <= 0 or now < self.next_sweep:
            return
        self.next_sweep = now + max(0.05, ttl_s / 2)
        old = [k for k, it in self.items.items() if now - it.put_at >= ttl_s]
        for key in old:
            item = self.items.pop(key)
            self.pool.allocator.free(item.offset)
            counters.add("ttl_reaped")
            counters.add("ttl_reaped_bytes", item.size)
            logger.warning("LocalConnector dropped %s after %.0f s unconsumed (TTL)", key, ttl_s)
            item.notices.report(item.put_key, Verdict.EXPIRED, f"unconsumed for {ttl_s:g} s (TTL)")
        for key in [k for k, t in self.taken.items() if not t.notices.is_open(t.put_key)]:
            del self.taken[key]


class LocalConnector(OmniConnectorBase):
    """Keyed in-memory hand-off between managers of one process, over a shared pool."""

    acknowledges = True
    _stores: ClassVar[dict[str, _Store]] = {}
    # reentrant: a garbage-collected connector may close inside another one's constructor
    _stores_lock: ClassVar[threading.RLock] = threading.RLock()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = dict(config or {})
        self.namespace = str(cfg.get("namespace", "default"))
        size = parse_size("pool_size", cfg.get("pool_size"), _DEFAULT_POOL)
        self.put_timeout_s = parse_number("put_timeout_s", cfg.get("put_timeout_s"), 0.0)
        self.buffer_ttl_s = parse_number(
            "buffer_ttl_seconds", cfg.get("buffer_ttl_seconds"), DEFAULT_BUFFER_TTL_S
        )
        with self._stores_lock:
            store = self._stores.get(self.namespace)
            if store is None:
                store = self._stores[self.namespace] = _Store(size)
            store.users += 1
        self._store = store
        self._counters = Counters(
            ("puts", "put_bytes", "gets", "get_bytes", "misses", "ttl_reaped", "ttl_reaped_bytes")
        )
        self._notices = DeliveryNotices(
            parse_number("ack_timeout_s", cfg.get("ack_timeout_s"), DEFAULT_ACK_TIMEOUT_S)
        )

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError("LocalConnector is closed")

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float,
    ) -> PutResult:
        """``write`` fills a slot of the namespace's pool; the payload replaces one put under
        the same key and not yet taken."""
        self._check_open()
        pool = self._store.pool
        offset = fill_slot(pool, nbytes, write, deadline)
        key = self._make_key(put_key, from_stage, to_stage)
        self._notices.published(put_key)
        with self._store.cond:
            self._store.reap_locked(self.buffer_ttl_s, self._counters)
            old = self._store.items.pop(key, None)
            item = _Item(offset, nbytes, time.monotonic(), put_key, self._notices)
            self._store.items[key] = item
            self._store.taken.pop(key, None)
            self._store.cond.notify_all()
        if old is not None:
            pool.allocator.free(old.offset)
        self._counters.add("puts")
        self._counters.add("put_bytes", nbytes)
        logger.debug("LocalConnector put %s (%d bytes)", key, nbytes)
        return True, nbytes, {"key": key, "size": nbytes}

    def _take(self, key: str) -> ManagedBuffer | None:
        self._store.reap_locked(self.buffer_ttl_s, self._counters)
        item = self._store.items.pop(key, None)
        if item is None:
            return None
        self._store.cond.notify_all()  # flush() waits for consumption
        self._store.taken[key] = _Taken(item.put_key, item.notices)
        item.notices.taken(item.put_key)
        self._counters.add("gets")
        self._counters.add("get_bytes", item.size)
        pool = self._store.pool
        return ManagedBuffer(pool.slot(item.offset, item.size), SlotRelease(pool, item.offset))

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the payload if present (consume-once; one look of :meth:`wait`):
        ``(ManagedBuffer, size)`` or ``(obj, n)``."""
        return self.get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=0.0)

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> ManagedBuffer | None:
        """Block on the store's condition until the key is put or ``deadline`` passes."""
        self._check_open()
        key = self._make_key(get_key, from_stage, to_stage)
        with self._store.cond:
            while True:
                buf = self._take(key)
                if buf is not None:
                    return buf
                left = remaining(deadline)
                if left <= 0 or self._closed:
                    self._counters.add("misses")
                    return None
                self._store.cond.wait(timeout=min(left, 3600.0))

    def probe(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> KeyProbe:
        """``ready`` with its size when the payload is in the namespace's pool (one process:
        a take is local), else ``missing``; ``unknown`` once closed. Never waits."""
        if self._closed:
            return KeyProbe(KeyState.UNKNOWN, detail="LocalConnector is closed")
        key = self._make_key(get_key, from_stage, to_stage)
        with self._store.cond:
            self._store.reap_locked(self.buffer_ttl_s, self._counters)
            item = self._store.items.get(key)
        if item is None:
            return KeyProbe(KeyState.MISSING)
        return KeyProbe(KeyState.READY, item.size)

    def cleanup(self, request_id: str) -> None:
        """Drop unconsumed payloads of ``request_id`` (:func:`matches_request`); their senders
        get no verdict for them (the owner dropped them on purpose)."""
        with self._store.cond:
            keys = [k for k in self._store.items if matches_request(k, request_id)]
            dropped = [self._store.items.pop(k) for k in keys]
        for item in dropped:
            self._store.pool.allocator.free(item.offset)
            item.notices.forget(item.put_key)

    def withdraw(self, from_stage: str, to_stage: str, put_key: str) -> bool:
        """Remove the payload this connector put under ``put_key`` while nobody took it
        (:meth:`~omnikv.connectors.base.OmniConnectorBase.withdraw`); a payload another
        connector of the namespace put is left alone."""
        key = self._make_key(put_key, from_stage, to_stage)
        with self._store.cond:
            item = self._store.items.get(key)
            if item is None or item.notices is not self._notices:
                return False
            del self._store.items[key]
            self._store.cond.notify_all()  # flush() waits for the namespace to empty
        self._store.pool.allocator.free(item.offset)
        item.notices.forget(item.put_key)
        return True

    def acknowledge(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        verdict: Verdict,
        reason: str | None = None,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Report ``verdict`` to the connector that published the payload taken under
        ``get_key`` (once; a second verdict, or one for a key not taken, is ignored)."""
        key = self._make_key(get_key, from_stage, to_stage)
        with self._store.cond:
            taken = self._store.taken.pop(key, None)
        if taken is not None:
            taken.notices.report(taken.put_key, verdict, reason)

    def set_delivery_listener(self, listener: DeliveryListener | None) -> None:
        """Report each payload published here to ``listener`` once (see
        :mod:`omnikv.connectors.delivery`)."""
        self._notices.set_listener(listener)

    def pending_keys(self) -> list[str]:
        """Keys published and not yet consumed (tests, diagnostics)."""
        with self._store.cond:
            return list(self._store.items)

    def flush(self, timeout: float | None = None) -> list[str]:
        """Wait up to ``timeout`` s until this namespace holds nothing unconsumed."""
        end = time.monotonic() + (0.0 if timeout is None else max(0.0, timeout))
        with self._store.cond:
            while self._store.items and time.monotonic() < end:
                self._store.cond.wait(timeout=end - time.monotonic())
            return list(self._store.items)

    def reap_consumed(self, *, max_keys: int = 64) -> None:
        """Expire what is due: payloads past ``buffer_ttl_seconds`` and verdicts overdue by
        ``ack_timeout_s`` (this connector runs no timer; a sender calls this between steps).
        Expiry is one pass over a dict, so ``max_keys`` does not bound it further."""
        self._notices.sweep()
        with self._store.cond:
            self._store.reap_locked(self.buffer_ttl_s, self._counters)

    def health(self) -> dict[str, Any]:
        self._notices.sweep()
        with self._store.cond:
            self._store.reap_locked(self.buffer_ttl_s, self._counters)
            pending = len(self._store.items)
        allocator = self._store.pool.allocator
        return {
            "status": "closed" if self._closed else "healthy",
            "type": "LocalConnector",
            "namespace": self.namespace,
            "pending": pending,
            "pool_size": allocator.total,
            "pool_used": allocator.used_bytes,
            **self._counters.snapshot(),
        }

    def close(self) -> None:
        """Idempotent; wakes waiters (they return ``None``). Unconsumed data stays for others
        of the namespace; the namespace's pool goes when its last connector closes empty.
        """
        if self._closed:
            return
        self._closed = True
        with self._store.cond:
            self._store.cond.notify_all()
        with self._stores_lock:
            self._store.users -= 1
            if self._store.users == 0 and not self._store.items:
                self._stores.pop(self.namespace, None)
