"""The sending connector's verdict book: one for every transport that carries verdicts.

:class:`VerdictBook` keeps, per transport key this connector published, the publication
(its number and the key given to ``put``, its *label*), who took it (the *taker*: whatever
identity the transport can vouch for, compared with ``==``), when its verdict is due
(``ack_timeout_s`` after it was taken: the book alone keeps these deadlines) and a verdict that
came before the transport saw the take. It reports each publication at most once, through
:class:`~omnikv.connectors.delivery.DeliveryNotices` (the listener), counting reports by kind
(``acks_delivered``, ``acks_refused``, ``acks_expired``) and verdicts that changed nothing
(``acks_ignored``) in the connector's :class:`~omnikv.connectors.counters.Counters`. Its table
is bounded by :data:`~omnikv.connectors.delivery.MAX_WATCHED` (the oldest publication is
dropped first, as the notices drop it).

What a backend keeps is only how a verdict reaches it: the shared-memory connector's mesh
link and offer token (:mod:`omnikv.connectors.shm.acks`), the pull connectors' control
message from the peer that pulled (:mod:`omnikv.connectors.pull.verdicts`), the Store's
records polled from the store (:mod:`omnikv.connectors.mooncake_store.acks`). The rules are
the same everywhere: a verdict counts only from the taker of the key's current publication
(or, for the Store, from the record the store holds under the key), once; events about a
replaced publication change nothing; a taken publication without a verdict by its deadline
ends ``expired`` (:meth:`VerdictBook.sweep`, from a timer the backend already runs).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import (
    MAX_WATCHED,
    DeliveryListener,
    DeliveryNotices,
    Verdict,
)

__all__ = ["VERDICT_COUNTERS", "VerdictBook"]

#: The counters a verdict book adds to (its connector declares them).
VERDICT_COUNTERS = ("acks_delivered", "acks_refused", "acks_expired", "acks_ignored")
_COUNTER = {v: f"acks_{v.value}" for v in Verdict}


@dataclass
class _Publication:
    label: str
    pub: int
    taker: Hashable | None = None
    due: float = float("inf")
    early: tuple[Hashable, Verdict, str | None] | None = None


class VerdictBook:
    """Publications and their verdicts, by transport key (thread-safe; one lock, never held
    while reporting). See the module docstring; ``ack_timeout_s`` is the seconds a taken
    publication may go without its verdict."""

    def __init__(self, ack_timeout_s: float, counters: Counters) -> None:
        self.notices = DeliveryNotices(ack_timeout_s)
        self._counters = counters
        self._lock = threading.Lock()
        self._table: OrderedDict[str, _Publication] = OrderedDict()
        self._by_label: dict[str, str] = {}
        self._next_pub = 0
        self._next_due = float("inf")  # no taken publication is due before this

    @property
    def ack_timeout_s(self) -> float:
        return self.notices.ack_timeout_s

    @property
    def listening(self) -> bool:
        return self.notices.listening

    def set_listener(self, listener: DeliveryListener | None) -> None:
        self.notices.set_listener(listener)

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def publications(self) -> list[tuple[str, int, bool]]:
        """``(key, publication, taken)`` of every publication watched, oldest first (the
        Store's poll asks the store about these)."""
        with self._lock:
            return [(k, e.pub, e.taker is not None) for k, e in self._table.items()]

    def awaiting(self) -> int:
        """How many publications were taken and wait for their verdict."""
        with self._lock:
            return sum(1 for p in self._table.values() if p.taker is not None)

    # -- the sending side ---------------------------------------------------------------------
    def published(self, key: str, label: str) -> int:
        """``key`` is about to be visible, put as ``label``: its verdict is due from now on (an
        earlier publication of the key is replaced: nothing about it counts any more). Returns
        the publication's number (for :meth:`taken`, :meth:`expired`, :meth:`forget`)."""
        self.notices.published(label)
        with self._lock:
            self._next_pub += 1
            self._drop_locked(key)
            self._table[key] = _Publication(label, self._next_pub)
            self._by_label[label] = key
            while len(self._table) > MAX_WATCHED:
                self._drop_locked(next(iter(self._table)))
            return self._next_pub

    def taken(self, key: str, taker: Hashable, *, pub: int | None = None) -> None:
        """Publication ``pub`` of ``key`` (``None``: the current one) was taken by ``taker``:
        only its verdict counts from now on, due within ``ack_timeout_s``; one ``taker``
        sent early (:meth:`settle` with ``early_ok``) is reported now. A publication already
        taken keeps its taker (:meth:`returned` first)."""
        now = time.monotonic()
        with self._lock:
            entry = self._current_locked(key, pub)
            if entry is None or entry.taker is not None:
                return
            entry.taker = taker
            entry.due = now + self.notices.ack_timeout_s
            self._next_due = min(self._next_due, entry.due)
            early, entry.early = entry.early, None
            if early is not None and early[0] == taker:
                self._drop_locked(key)
            else:
                early = None
        if early is not None:
            self._report(entry.label, early[1], early[2])

    def returned(self, key: str, taker: Hashable) -> None:
        """``taker`` gave ``key`` back unused (or the offer to it never left): the publication
        is untaken again, its ``ack_timeout_s`` watch stops."""
        with self._lock:
            entry = self._table.get(key)
            if entry is None or entry.taker is None or entry.taker != taker:
                return
            entry.taker, entry.due = None, float("inf")

    def expired(self, key: str, why: str, *, pub: int | None = None) -> None:
        """Publication ``pub`` of ``key`` (``None``: the current one) ended without a verdict
        (its TTL, its taker gone): reported ``expired`` with ``why``."""
        with self._lock:
            entry = self._current_locked(key, pub)
            if entry is None:
                return
            self._drop_locked(key)
        self._report(entry.label, Verdict.EXPIRED, why)

    def expired_label(self, label: str, why: str) -> None:
        """:meth:`expired` of the publication put as ``label``."""
        with self._lock:
            key = self._by_label.get(label)
            if key is not None:
                self._drop_locked(key)
        self._report(label, Verdict.EXPIRED, why)

    def forget(self, key: str, *, pub: int | None = None) -> None:
        """Publication ``pub`` of ``key`` (``None``: the current one) was dropped by its owner
        (``cleanup``, ``withdraw``): no verdict is reported."""
        with self._lock:
            entry = self._current_locked(key, pub)
            if entry is None:
                return
            self._drop_locked(key)
        self.notices.forget(entry.label)

    def forget_label(self, label: str) -> None:
        """:meth:`forget` of the publication put as ``label``."""
        with self._lock:
            key = self._by_label.get(label)
            if key is not None:
                self._drop_locked(key)
        self.notices.forget(label)

    def clear(self) -> list[str]:
        """Forget every publication (the connector closes); their keys."""
        with self._lock:
            entries = list(self._table.items())
            self._table.clear()
            self._by_label.clear()
        for _key, entry in entries:
            self.notices.forget(entry.label)
        return [k for k, _ in entries]

    # -- verdicts -------------------------------------------------------------------------------
    def settle(
        self,
        key: str,
        taker: Hashable,
        verdict: Verdict,
        reason: str | None,
        *,
        early_ok: bool = False,
    ) -> bool:
        """A verdict on ``key`` from ``taker``; whether it counted. It is reported when
        ``taker`` took the key's current publication and gave no verdict yet; with
        ``early_ok`` (the transport vouches that ``taker`` is taking it and the take may
        still be on its way) it is kept, one per publication, until :meth:`taken` names the
        same taker. Anything else changes nothing and is counted ``acks_ignored``."""
        with self._lock:
            entry = self._table.get(key)
            accepted = entry is not None and entry.taker is not None and entry.taker == taker
            kept = entry is not None and entry.taker is None and early_ok and entry.early is None
            if accepted:
                self._drop_locked(key)
            elif kept:
                assert entry is not None
                entry.early = (taker, verdict, reason)
        if accepted:
            assert entry is not None
            self._report(entry.label, verdict, reason)
        elif not kept:
            self._counters.add("acks_ignored")
        return accepted or kept

    def resolve(
        self, key: str, verdict: Verdict, reason: str | None, *, pub: int | None = None
    ) -> bool:
        """A verdict on publication ``pub`` of ``key`` (``None``: the current one) whose
        transport vouches for its author (the Store: the record under the key); whether it
        was reported."""
        with self._lock:
            entry = self._current_locked(key, pub)
            if entry is None:
                return False
            self._drop_locked(key)
        return self._report(entry.label, verdict, reason)

    def expire_taken_by(self, gone: Callable[[Hashable], bool], why: str) -> int:
        """Every publication whose taker ``gone`` names (its peer went away) ends ``expired``;
        how many."""
        with self._lock:
            hits = [k for k, e in self._table.items() if e.taker is not None and gone(e.taker)]
            labels = [self._table[k].label for k in hits]
            for k in hits:
                self._drop_locked(k)
        for label in labels:
            self._report(label, Verdict.EXPIRED, why)
        return len(labels)

    def sweep(self, now: float | None = None) -> list[str]:
        """Expire the taken publications whose verdict is overdue (reported, counted); their
        keys. Cheap until :meth:`next_due`: a backend may call it on every turn."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now < self._next_due:
                return []
            due = [(k, e.label) for k, e in self._table.items() if e.due <= now]
            for k, _label in due:
                self._drop_locked(k)
            self._next_due = min((e.due for e in self._table.values()), default=float("inf"))
        why = f"taken by a receiver that sent no verdict within {self.ack_timeout_s:g} s"
        for _key, label in due:
            self._report(label, Verdict.EXPIRED, why)
        return [k for k, _ in due]

    def next_due(self) -> float:
        """No taken publication falls due before this (monotonic; ``inf``: none is taken)."""
        with self._lock:
            return self._next_due

    # -- inside ---------------------------------------------------------------------------------
    def _current_locked(self, key: str, pub: int | None) -> _Publication | None:
        entry = self._table.get(key)
        if entry is None or (pub is not None and entry.pub != pub):
            return None
        return entry

    def _drop_locked(self, key: str) -> None:
        entry = self._table.pop(key, None)
        if entry is not None and self._by_label.get(entry.label) == key:
            del self._by_label[entry.label]

    def _report(self, label: str, verdict: Verdict, reason: str | None) -> bool:
        if not self.notices.report(label, verdict, reason):
            return False
        self._counters.add(_COUNTER[verdict])
        return True
