"""Delivery verdicts through a Mooncake Store: the sender's watch, the receiver's records.

A receiver that took the payload stored under ``key`` stores its verdict as a small JSON record
under ``key + ".ack"`` (the format: :mod:`omnikv.connectors.mooncake_store.protocol`). The
sending client watches the keys it published (:class:`VerdictWatch`): one background thread
asks the master, in one ``batch_is_exist``, which of its open keys have a record and which
payloads are gone (taken), reads and removes each record, and reports it through the
connector's :class:`~omnikv.connectors.verdict_book.VerdictBook`. Records are hostile input
(:func:`~omnikv.connectors.mooncake_store.protocol.parse_record`); a malformed one is dropped
and counted.

The receiver keeps the keys of the records it wrote (:class:`WrittenRecords`) so they cannot
leak: records unread after ``buffer_ttl_seconds`` are removed as the sender's payloads are, and
at its close the receiver waits up to ``ack_linger_s`` for its sender to read the recent ones
(a record may lie in the receiver's own segment, which goes with it), then removes the rest.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any, Protocol

from omnikv._logging import RateLimitedLog
from omnikv.connectors.boundary import ErrorMap
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    MAX_KEY_CHARS,
    Verdict,
)
from omnikv.connectors.mooncake_store.protocol import (
    MAX_RECORD_BYTES,
    ack_key,
    encode_record,
    parse_record,
)
from omnikv.connectors.verdict_book import VerdictBook
from omnikv.errors import ConnectorError

__all__ = ["VerdictWatch", "WrittenRecords"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: The watch's poll interval: this after a change, doubling while nothing changes, up to the cap.
POLL_MIN_S = 0.02
POLL_MAX_S = 0.2
#: Tries of a verdict record's ``put``.
_PUT_ATTEMPTS = 3
#: Most keys named in one ``batch_is_exist`` / ``batch_remove``.
_BATCH = 4096


def _exists(errors: ErrorMap, store: Any, keys: list[str]) -> list[int] | None:
    """``batch_is_exist`` over ``keys`` in chunks (1: there, 0: not, -1: error); ``None`` when
    the store could not be asked (logged)."""
    found: list[int] = []
    try:
        for i in range(0, len(keys), _BATCH):
            chunk = keys[i : i + _BATCH]
            with errors.translate("batch_is_exist of verdict records"):
                got = [int(e) for e in store.batch_is_exist(chunk)]
            if len(got) != len(chunk):
                return None
            found.extend(got)
    except ConnectorError as exc:
        logger.debug("batch_is_exist over %d keys failed: %s", len(keys), exc)
        return None
    return found


def _remove(errors: ErrorMap, store: Any, keys: list[str]) -> int:
    """Remove ``keys`` from the store (force; missing ones are fine); how many were there."""
    removed = 0
    for i in range(0, len(keys), _BATCH):
        chunk = keys[i : i + _BATCH]
        try:
            with errors.translate("batch_remove of verdict records"):
                removed += sum(1 for rc in store.batch_remove(chunk, True) if int(rc) == 0)
        except ConnectorError as exc:
            logger.debug("batch_remove of %d verdict records failed: %s", len(chunk), exc)
    return removed


class StoreOwner(Protocol):
    """What :class:`VerdictWatch` asks of the connector it serves (held weakly)."""

    def live_store(self) -> Any | None:
        """The store client, or ``None`` once closed."""

    def reap_expired(self) -> list[str]:
        """The TTL sweep (it calls :meth:`VerdictWatch.expired_by_ttl` for what it removed)."""

    def consumed_elsewhere(self, key: str) -> None:
        """The payload under ``key`` is gone from the store: another client took it."""


#: The taker of every payload the Store watch finds gone (the store does not say who took it;
#: the record under the payload's key is the verdict, whoever wrote it).
_STORE_TAKER = "store"


class VerdictWatch:
    """The sending client's watch on the verdict records of the payloads it published: how
    verdicts reach the connector's :class:`~omnikv.connectors.verdict_book.VerdictBook`
    through the store.

    :meth:`published` is called by ``put_packed`` after each successful put (a no-op unless a
    delivery listener is installed); the first one starts the watch thread, which polls while
    any key is open (every :data:`POLL_MIN_S` after a change, backing off to
    :data:`POLL_MAX_S`; no polling at all while nothing is open) and stops at :meth:`close`.
    Each poll: the owner's TTL sweep (reported ``expired``), the ``ack_timeout_s`` sweep, one
    ``batch_is_exist`` over the open keys' records and not-yet-taken payloads, then per record
    found a read, its removal and the report; a payload found gone starts its ``ack_timeout_s``
    watch. Only keys published here and still without a verdict are ever looked up. Nothing in
    the thread raises out of it (failures are logged and the next poll tries again).
    """

    def __init__(
        self,
        owner: StoreOwner,
        book: VerdictBook,
        counters: Counters,
        errors: ErrorMap,
    ) -> None:
        self.book = book
        self.notices = book.notices
        self._owner = weakref.ref(owner)
        self._counters = counters
        self._errors = errors
        self._lock = threading.Lock()
        self._ended: list[str] = []  # keys expired by the ack sweep: their records go
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- called by the connector ----------------------------------------------------------
    def published(self, key: str, put_key: str) -> None:
        """Watch ``key`` (the store key; ``put_key`` as given to the put, which the report
        names) for a verdict. Called by the sender after a successful put."""
        if not self.book.listening or self._stop.is_set():
            return
        self.book.published(key, put_key)
        with self._lock:
            thread = None
            if self._thread is None:
                thread = self._thread = threading.Thread(
                    target=self._run, name="omnikv-mooncake-verdicts", daemon=True
                )
        if thread is not None:
            thread.start()
        self._wake.set()

    def expired_by_ttl(self, key: str, ttl_s: float) -> None:
        """The owner's TTL sweep removed ``key`` unconsumed: report it ``expired``."""
        why = f"removed from the store unconsumed after {ttl_s:g} s (buffer_ttl_seconds TTL)"
        self.book.expired(key, why)

    def forget(self, key: str) -> None:
        """``key`` was removed on purpose (``cleanup``, ``withdraw``): no verdict is due."""
        self.book.forget(key)

    def sweep(self) -> None:
        """Expire the taken keys whose ``ack_timeout_s`` ran out (counted ``acks_expired``);
        their records are removed by the next poll."""
        ended = self.book.sweep()
        if ended:
            with self._lock:
                self._ended.extend(ended)

    def watched(self) -> int:
        return len(self.book)

    def close(self, store: Any | None, timeout_s: float = 10.0) -> None:
        """Stop and join the thread, stop watching, and remove the records of the keys still
        watched (a verdict arriving now has nobody to read it). Called by the connector's
        ``close`` while ``store`` is still open; idempotent."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("the verdict watch did not stop within %.0f s", timeout_s)
        left = self.book.clear()
        if store is not None and left:
            _remove(self._errors, store, [ack_key(k) for k in left])

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        interval = POLL_MIN_S
        while not self._stop.is_set():
            owner = self._owner()
            if owner is None:
                return
            changed = False
            try:
                owner.reap_expired()
                changed = self.poll(owner)
            except Exception:  # the watch must outlive any one failure
                logger.exception("verdict poll failed")
            del owner  # hold the connector only while polling
            if not len(self.book):
                self._wake.wait()
                self._wake.clear()
                interval = POLL_MIN_S
                continue
            interval = POLL_MIN_S if changed else min(interval * 2, POLL_MAX_S)
            due = self.book.next_due() - time.monotonic()
            self._stop.wait(max(0.001, min(interval, due)))

    def poll(self, owner: StoreOwner) -> bool:
        """One look at the store for the open keys; whether anything changed. Called by the
        watch thread (and tests); never raises for the store's failures."""
        store = owner.live_store()
        if store is None:
            return False
        self.sweep()
        with self._lock:
            done, self._ended = self._ended, []
        if done:  # expired: a record arriving for them would be read by nobody
            _remove(self._errors, store, [ack_key(k) for k in done])
        items = self.book.publications()
        if not items:
            return bool(done)
        records = [ack_key(k) for k, _, _ in items]
        untaken = [k for k, _, taken in items if not taken]
        found = _exists(self._errors, store, records + untaken)
        if found is None:
            return bool(done)
        payload_there = dict(zip(untaken, found[len(records) :], strict=True))
        changed = bool(done)
        for (key, pub, taken), has_record in zip(items, found[: len(records)], strict=True):
            gone = not taken and payload_there[key] == 0
            if gone:
                owner.consumed_elsewhere(key)
            if has_record == 1:
                changed = True
                self._read(store, key, pub)
            elif gone:
                changed = True
                self.book.taken(key, _STORE_TAKER, pub=pub)
        return changed

    def _read(self, store: Any, key: str, pub: int) -> None:
        """Read, remove and report the record of publication ``pub`` of ``key``; a malformed
        one is dropped, counted and the key stays watched."""
        rkey = ack_key(key)
        try:
            with self._errors.translate(f"read of verdict record {rkey}"):
                size = int(store.get_size(rkey))
                body = bytes(store.get(rkey)) if 0 < size <= MAX_RECORD_BYTES else b""
                store.remove(rkey, True)
        except ConnectorError as exc:
            logger.debug("verdict record %s unreadable for now: %s", rkey, exc)
            return
        if size <= 0:
            return
        parsed = parse_record(body, key) if body else None
        if parsed is None:
            if body or size > MAX_RECORD_BYTES:
                self._counters.add("acks_malformed")
                _outsider.warning("dropped a malformed verdict record %s (%d bytes)", rkey, size)
            else:  # listed but unreadable: its holder went away; the ack timeout decides
                logger.debug("verdict record %s could not be read; removed", rkey)
            return
        verdict, reason = parsed
        self.book.resolve(key, verdict, reason, pub=pub)


class WrittenRecords:
    """The verdict records this (receiving) client stored and may still have to remove.

    :meth:`write` is called by ``acknowledge``; :meth:`reap` by the TTL sweep; :meth:`settle` by
    ``close``. At most ``limit`` are remembered (the oldest are forgotten first). Thread-safe;
    nothing here raises for the store's failures.
    """

    def __init__(self, counters: Counters, errors: ErrorMap, limit: int) -> None:
        self._counters = counters
        self._errors = errors
        self._limit = max(1, int(limit))
        self._lock = threading.Lock()
        self._written: collections.OrderedDict[str, float] = collections.OrderedDict()

    def write(
        self, store: Any, config: Any, key: str, verdict: Verdict, reason: str | None
    ) -> None:
        """Store the verdict record for the payload taken under ``key``: one ``put`` of a few
        hundred bytes, tried up to three times (the store places each try anew, and a place in
        the segment of a client that died and is still listed fails). A failure is logged and
        counted ``ack_failures``: the sender then sees ``expired`` from its own watch."""
        rkey = ack_key(key)
        if len(key) > MAX_KEY_CHARS:
            self._counters.add("ack_failures")
            _outsider.warning("no verdict record for a key of %d characters", len(key))
            return
        try:
            body = encode_record(key, verdict, reason)
            for _ in range(_PUT_ATTEMPTS):  # a failed put may have picked a dead client's segment
                with self._errors.translate(f"put of verdict record {rkey}"):
                    rc = int(store.put(rkey, body, config))
                if rc == 0:
                    break
        except (ConnectorError, ValueError, TypeError) as exc:
            self._counters.add("ack_failures")
            logger.warning("verdict record %s not stored: %s", rkey, exc)
            return
        if rc != 0:
            self._counters.add("ack_failures")
            logger.warning("verdict record %s not stored (put returned %d)", rkey, rc)
            return
        self._counters.add("acks_sent")
        with self._lock:
            self._written[rkey] = time.monotonic()
            self._written.move_to_end(rkey)
            while len(self._written) > self._limit:
                self._written.popitem(last=False)

    def reap(self, store: Any, ttl_s: float) -> None:
        """Remove the records written ``ttl_s`` ago or more that are still there (their sender
        never read them), counted ``ack_records_dropped``. Called by the TTL sweep."""
        now = time.monotonic()
        with self._lock:
            old = [k for k, t in self._written.items() if now - t >= ttl_s]
            for k in old:
                del self._written[k]
        if old:
            self._drop(store, old)

    def settle(self, store: Any, linger_s: float) -> None:
        """At close: wait until the sender has read (and removed) the records written less than
        ``linger_s`` ago, at most until ``linger_s`` after the newest one, polling every
        :data:`POLL_MIN_S`; then remove what is left. Bounded by ``linger_s``."""
        with self._lock:
            written = dict(self._written)
            self._written.clear()
        if not written:
            return
        end = min(time.monotonic(), max(written.values())) + max(0.0, linger_s)
        keys = list(written)
        while keys:
            found = _exists(self._errors, store, keys)
            if found is None:
                break
            keys = [k for k, e in zip(keys, found, strict=True) if e != 0]
            left = end - time.monotonic()
            if not keys or left <= 0:
                break
            time.sleep(min(POLL_MIN_S, left))  # bounded by linger_s: waiting for the sender
        if keys:
            self._drop(store, keys)

    def _drop(self, store: Any, keys: list[str]) -> None:
        dropped = _remove(self._errors, store, keys)
        if dropped:
            self._counters.add("ack_records_dropped", dropped)
            logger.info("removed %d verdict record(s) their sender never read", dropped)
