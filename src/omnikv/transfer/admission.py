"""Readiness without blocking: a consumer stage admits the requests whose KV is here.

A stage that receives KV (a diffusion transformer, a talker, another LLM) runs a step loop:
each step takes some queued requests and computes them. With the blocking receive
(``receive_kv_cache_for_request``, in queue order) one request whose KV is late or never comes
stalls the step, and every request behind it, for up to ``recv_timeout``. Here the stage offers
its queued requests once (:meth:`KVAdmission.offer`, non-blocking); their receives run in the
background; each step asks :meth:`KVAdmission.poll` (never waits) and takes the ready ones
(:meth:`KVAdmission.take`).

States of an offered request (:class:`Readiness`):

* ``missing``: nothing has arrived for it yet (its receive waits, or waits for a free receive
  thread, or it was looked at and nobody offers its KV yet); this is also what a request whose
  sender never offered it shows until its deadline;
* ``pending``: its payload is on its way (a transport that ``reports_incoming``, such as the
  Transfer Engine, NIXL and the Store, granted its transfer) or has been taken from the
  connector and is being decoded or copied; ``nbytes`` says how big it is;
* ``ready``: its KV is in local memory (or on the target device), held for :meth:`take`;
* ``failed``: its receive ended without KV (timeout at its deadline, corrupt payload, dead peer,
  cancelled), with the typed status and the reason. A failure is handed out by :meth:`take`
  once, as a ready request is.

A request offered with CFG companions (``offer(..., companions=...)``) is one unit: ``ready``
only when every branch has ended (a companion that failed is handed out as such), ``failed``
when the request's own KV failed, ``pending`` while some branch has arrived.

Guarantees: :meth:`offer`, :meth:`poll`, :meth:`ready`, :meth:`take`, :meth:`cancel` and
:meth:`withdraw` never wait for a transfer (only :meth:`wait` and :meth:`close` block, both
bounded); each request has one deadline, counted from its offer (or given to it); at most
``max_receives`` receives run at once (later offers wait their turn, still ``missing`` and not
``started``); a ready payload is held until taken, cancelled or the tracker is closed, and both
of those say what they dropped; ``take`` hands out a request's outcome exactly once; a request
withdrawn before its receive started consumed nothing (its payload stays at the source).

**A ready request is never held behind missing ones.** With a probe (the manager's
``probe_kv_cache``, which takes nothing), a share of the receive threads (a quarter, at least
one: the *lookers*) never wait for KV nobody offers: they look at each offer first (at most
:data:`LOOK_S`), receive it at once when its KV is there, and set it aside when nobody offers it
yet (or the transport could not tell in time). The other threads (the *waiters*) receive offers
in order, and the requests set aside, blocking in the transports' own event-driven waits, so a
late payload is taken as it lands while a waiter is free. Requests set aside beyond the waiters
are looked at again after 5 ms, doubling up to :data:`RELOOK_MAX_S` (1 s), until their
deadline, and at most :data:`RELOOKS_PER_S` (200) looks again per second in all: a burst of
offers for ids that never come (a client's or a stranger's) holds the waiters only, and a
request whose KV is here is received after a look at one offer per looker ahead of it from
either end of the queue (lookers take fresh offers from both ends in turn). Without a probe (the
prefetcher) every thread is a waiter.

This is the one state machine of a request's background receive: the prefetcher
(:class:`omnikv.transfer.prefetch.KVPrefetcher`) is a :class:`KVAdmission` with one receive
thread named ``kv-prefetch`` (a prefetch is offered when it starts and taken when it is
consumed), plus what only prefetch has (its calling conventions, device staging, the table
bound, consume errors).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import torch

from omnikv.connectors.base import KeyProbe, KeyState
from omnikv.deadline import deadline_after, remaining
from omnikv.transfer.receive import ReceiveFn, ReceiveResult, ReceiveStatus
from omnikv.transfer.requests import checked_companions

__all__ = ["KVAdmission", "ProbeFn", "Readiness", "RequestReadiness", "receive_by_id"]

logger = logging.getLogger(__name__)

#: Receives that run at once, by default (each is one thread waiting on the connector).
DEFAULT_MAX_RECEIVES = 32
#: With a probe, this share of the receive threads (at least one) are lookers: they never wait
#: for KV that nobody offers, so a request whose KV is here always finds a free thread.
LOOKER_SHARE = 4
#: Longest look (probe) at one request (seconds).
LOOK_S = 0.05
#: A request looked at and found missing is looked at again after this long, doubling up to
#: :data:`RELOOK_MAX_S` (while no waiting thread is free for it: see :class:`KVAdmission`).
RELOOK_FIRST_S = 0.005
RELOOK_MAX_S = 1.0
#: Looks again per second at most, over every request set aside (with more of them set aside,
#: each is looked at less often): bounds the probes a burst of offers for ids that never come
#: can cost.
RELOOKS_PER_S = 200.0


class ProbeFn(Protocol):
    """The manager's ``probe_kv_cache``: where a request's KV stands, without taking it, within
    ``timeout`` seconds; never raises."""

    def __call__(
        self, request_id: str, *, sender_info: dict[str, Any] | None = ..., timeout: float = ...
    ) -> KeyProbe: ...


def receive_by_id(run: Callable[[str], ReceiveResult]) -> ReceiveFn:
    """An admission's receive that hands each request id to ``run`` and nothing else: for a
    receiver that keeps each request's deadline, abort and checks itself (the vLLM worker's
    loads, offered under their own deadlines); the admission's other arguments (its deadline,
    abort, ``on_arrival``) are not used. Whatever ``run`` returns or raises is the receive's."""

    def receive(
        request_id: str, target_device: torch.device | None = None, **_: Any
    ) -> ReceiveResult:
        return run(request_id)

    return receive


class Readiness(str, Enum):
    MISSING = "missing"
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class RequestReadiness:
    """One request's state as :meth:`KVAdmission.poll` saw it (a snapshot, never updated)."""

    request_id: str
    state: Readiness
    #: The payload's size once it is on its way or has arrived (``pending`` and ``ready``),
    #: else 0.
    nbytes: int = 0
    #: Seconds since the request was offered.
    age_s: float = 0.0
    #: ``failed`` only: the receive's status and reason.
    status: ReceiveStatus | None = None
    reason: str | None = None
    #: Whether its receive has begun (a receive thread took it: it may have touched the
    #: connector). ``missing`` and not started: still queued for a free receive thread, or set
    #: aside after a look (a probe, which takes nothing) found nobody offering its KV yet.
    started: bool = False
    #: ``ready`` / ``failed`` (its own outcome): seconds that outcome has waited to be taken.
    held_s: float = 0.0


class _Tracked:
    __slots__ = (
        "abort",
        "deadline",
        "ended",
        "nbytes",
        "offered",
        "relook",
        "result",
        "started",
        "state",
    )

    def __init__(self, deadline: float) -> None:
        #: seconds until the next look once found missing (0: never looked at)
        self.relook = 0.0
        self.state = Readiness.MISSING
        self.nbytes = 0
        self.offered = time.monotonic()
        self.deadline = deadline
        self.abort = threading.Event()
        self.result: ReceiveResult | None = None
        self.started = False
        self.ended = 0.0


_Job = tuple[str, _Tracked, "torch.device | None", "dict[str, Any] | None"]


class KVAdmission:
    """Background receives for offered requests, and their readiness on demand.

    Made by :attr:`TransferEdge.admission <omnikv.transfer.edge.TransferEdge.admission>` (one
    per edge), by the prefetcher (one receive thread, ``name="kv-prefetch"``) or directly with
    an edge's ``receive``. Thread-safe: a scheduler thread may poll while another
    offers. The ``max_receives`` receive threads start here, so that an offer only queues
    (starting a thread waits until it runs: milliseconds on a busy host); they are named
    ``name`` when there is one, ``name-0``, ``name-1``, ... otherwise, and ``name`` also heads
    this tracker's log lines.
    """

    def __init__(
        self,
        receive: ReceiveFn,
        *,
        recv_timeout: float,
        max_receives: int = DEFAULT_MAX_RECEIVES,
        name: str = "kv-admission",
        probe: ProbeFn | None = None,
    ) -> None:
        if max_receives < 1:
            raise ValueError(f"max_receives must be >= 1, got {max_receives}")
        self._receive = receive
        self._probe = probe
        self.recv_timeout = float(recv_timeout)
        self.name = name
        self._lock = threading.Lock()
        #: notified whenever a request ends or stops being tracked (:meth:`wait`)
        self._changed = threading.Condition(self._lock)
        #: notified when there is work for a receive thread (an offer, a request found missing)
        self._work = threading.Condition(self._lock)
        self._tracked: OrderedDict[str, _Tracked] = OrderedDict()
        self._ready_order: list[str] = []
        #: primary id -> its CFG companions' ids; companion id -> its primary
        self._groups: dict[str, tuple[str, ...]] = {}
        self._primary_of: dict[str, str] = {}
        self._closed = False
        #: offered, not looked at or received yet (in offer order)
        self._fresh: deque[_Job] = deque()
        #: looked at and found missing: (when to look again, order, job)
        self._parked: list[tuple[float, int, _Job]] = []
        self._order = itertools.count()
        self._from_back = False  # lookers take fresh offers from both ends in turn
        lookers = max(1, max_receives // LOOKER_SHARE) if probe and max_receives > 1 else 0
        names = [name] if max_receives == 1 else [f"{name}-{i}" for i in range(max_receives)]
        self._threads = tuple(
            threading.Thread(
                target=self._serve, args=(i >= max_receives - lookers,), name=n, daemon=True
            )
            for i, n in enumerate(names)
        )
        for t in self._threads:
            t.start()

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The receive threads (diagnostics; after :meth:`close` they have exited, or are left
        inside a connector call that ignores its deadline)."""
        return self._threads

    # -- offering -------------------------------------------------------------------------------
    def offer(
        self,
        request_ids: str | Iterable[str],
        *,
        target_device: torch.device | None = None,
        sender_info: dict[str, Any] | None = None,
        timeout: float | None = None,
        companions: Mapping[str, Iterable[str]] | None = None,
        deadline: float | None = None,
    ) -> list[str]:
        """Start receiving each request not tracked yet; never waits. Returns the ids it started.

        Each request's deadline is ``timeout`` (default: ``recv_timeout``) from now, or
        ``deadline`` (an absolute ``time.monotonic()`` value) when the caller made it at its
        own entry point (the prefetcher, from ``recv_timeout``); giving both is a
        ``ValueError``. ``target_device`` and ``sender_info`` go to each of these requests'
        receives. An id that is already tracked (in any state, until taken) is left as it is.
        ``companions`` maps a request to its CFG companions' request ids
        (``sampling_params.cfg_kv_request_ids``'s values): they are received beside it under
        the same deadline, and the request is ``ready`` only when every branch has ended; a
        companion is never listed by :meth:`ready` itself, and is taken by its own id once its
        request is. Companions are the caller's own: only ids of the form
        ``<request id>__<suffix>`` are taken, at most eight per request
        (:func:`~omnikv.transfer.requests.checked_companions`; others are left out, logged), and
        an id already tracked is never made a companion.
        """
        if timeout is not None and deadline is not None:
            raise ValueError("offer takes a timeout or a deadline, not both")
        ids = [request_ids] if isinstance(request_ids, str) else [str(r) for r in request_ids]
        groups = {
            str(k): tuple(checked_companions(str(k), dict(enumerate(v))).values())
            for k, v in (companions or {}).items()
        }
        limit = self.recv_timeout if timeout is None else float(timeout)
        started: list[str] = []
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            for rid in ids:
                if rid in self._tracked:
                    continue
                ends = deadline_after(limit, "admission timeout") if deadline is None else deadline
                members = tuple(c for c in groups.get(rid, ()) if c not in self._tracked)
                if members:
                    self._groups[rid] = members
                    self._primary_of.update(dict.fromkeys(members, rid))
                for one in (rid, *members):
                    entry = _Tracked(ends)
                    self._tracked[one] = entry
                    self._fresh.append((one, entry, target_device, sender_info))
                    started.append(one)
            if started:  # a thread per offer: waking every idle one costs each a GIL turn
                self._work.notify(len(started))
        return started

    def _serve(self, looker: bool) -> None:
        """A receive thread, until :meth:`close`. A waiter (``looker`` false) receives the next
        fresh offer (in offer order), else a request a looker found missing, blocking until its
        KV comes or its deadline: the transports' own waits are event-driven, so a late payload
        is taken as it lands. A looker first looks (:data:`LOOK_S` at most, taking nothing) at
        a fresh offer (from both ends of the queue in turn), and at a request set aside once it
        is due again; it receives what is there (``ready`` / ``offered``) and sets aside the
        rest (``missing``, or ``unknown``), so it never waits for KV. So requests whose KV never
        comes hold at most the waiters, and a request whose KV is here is received by a looker
        after a look at one fresh offer per looker ahead of it, from either end."""
        while True:
            with self._lock:
                picked = self._pick_locked(looker)
                while picked is None:
                    if self._closed:
                        return
                    self._work.wait(self._idle_locked(looker))
                    picked = self._pick_locked(looker)
            job, look = picked
            if look:
                self._look(job)
            else:
                self._run(*job)

    def _pick_locked(self, looker: bool) -> tuple[_Job, bool] | None:
        """The next job of a thread and whether to look first; ``None``: nothing to do."""
        if self._closed:
            self._parked.clear()  # aborted: nobody looks again
            return (self._fresh.popleft(), False) if self._fresh else None
        if self._fresh:
            if not looker:
                return self._fresh.popleft(), False
            self._from_back = not self._from_back
            return (self._fresh.pop() if self._from_back else self._fresh.popleft()), True
        if self._parked and (not looker or self._parked[0][0] <= time.monotonic()):
            return heapq.heappop(self._parked)[2], looker
        return None

    def _idle_locked(self, looker: bool) -> float | None:
        """How long an idle thread sleeps before it looks for work again (``None``: until
        woken): a looker until the next request set aside is due."""
        if not looker or not self._parked:
            return None
        return max(0.0, self._parked[0][0] - time.monotonic())

    def _look(self, job: _Job) -> None:
        """A looker's turn with ``job``: received now when its KV is there (``ready`` or
        ``offered``), else (``missing``, or ``unknown``: a peer did not answer in time) set
        aside to be looked at again, or received by a free waiter."""
        rid, entry, _, sender_info = job
        probe = self._probe
        left = entry.deadline - time.monotonic()
        if probe is None or entry.abort.is_set() or left <= 0:
            self._run(*job, expired="nothing was offered for it by its deadline")
            return
        try:
            state = probe(rid, sender_info=sender_info, timeout=min(LOOK_S, left)).state
        except Exception:  # the manager's probe never raises; a custom one may
            state = KeyState.UNKNOWN
        if state in (KeyState.READY, KeyState.OFFERED):
            self._run(*job)
            return
        # missing, or unknown (a peer slow to answer): a waiter may take it, or a later look
        with self._lock:
            if self._closed:
                return
            entry.relook = min(RELOOK_MAX_S, 2 * entry.relook) if entry.relook else RELOOK_FIRST_S
            spread = len(self._parked) / RELOOKS_PER_S
            due = min(time.monotonic() + max(entry.relook, spread), entry.deadline)
            heapq.heappush(self._parked, (due, next(self._order), job))
            self._work.notify_all()

    def _run(
        self,
        rid: str,
        entry: _Tracked,
        target_device: torch.device | None,
        sender_info: dict[str, Any] | None,
        *,
        expired: str = "deadline passed before a receive thread was free",
    ) -> None:
        def arrived(nbytes: int) -> None:
            with self._lock:
                entry.nbytes = int(nbytes)
                if entry.state is Readiness.MISSING:
                    entry.state = Readiness.PENDING

        with self._lock:  # one step with withdraw(): a request withdrawn never starts
            if entry.abort.is_set():
                entry.result = ReceiveResult(
                    rid, ReceiveStatus.CANCELLED, reason="cancelled before start"
                )
                return
            begins = entry.started = time.monotonic() < entry.deadline
        if not begins:
            result = ReceiveResult(rid, ReceiveStatus.TIMEOUT, reason=expired)
        else:
            try:
                result = self._receive(
                    rid,
                    target_device,
                    sender_info=sender_info,
                    deadline=entry.deadline,
                    abort=entry.abort,
                    quiet=True,
                    on_arrival=arrived,
                )
            except Exception as exc:  # a consumed payload that cannot be used, or a bug
                result = ReceiveResult(
                    rid, ReceiveStatus.CORRUPT, reason=f"{type(exc).__name__}: {exc}"
                )
        with self._lock:
            entry.result = result
            entry.ended = time.monotonic()
            entry.nbytes = result.nbytes or entry.nbytes
            entry.state = Readiness.READY if result.ok else Readiness.FAILED
            self._changed.notify_all()
            if self._tracked.get(rid) is entry:
                primary = self._primary_of.get(rid, rid)
                if self._group_ended_locked(primary) and primary not in self._ready_order:
                    self._ready_order.append(primary)
                return
        # cancelled or closed while receiving: nobody will take it
        if result.ok:
            logger.warning("%s dropped the KV of %s (cancelled while it arrived)", self.name, rid)

    def _group_ended_locked(self, primary: str) -> bool:
        """Whether ``primary`` and each companion still tracked have their outcome."""
        for one in (primary, *self._groups.get(primary, ())):
            e = self._tracked.get(one)
            if e is not None and e.result is None:
                return False
        return primary in self._tracked

    def _group_state_locked(self, primary: str, e: _Tracked) -> tuple[Readiness, int]:
        """A request's state with its companions: ``failed`` with it; ``ready`` when every
        branch has ended; otherwise ``pending`` once any branch has arrived."""
        members = [self._tracked.get(c) for c in self._groups.get(primary, ())]
        branches = [e, *(m for m in members if m is not None)]
        nbytes = sum(b.nbytes for b in branches)
        if e.state is Readiness.FAILED:
            return Readiness.FAILED, nbytes
        if all(b.result is not None for b in branches):
            return Readiness.READY, nbytes
        if any(b.state is not Readiness.MISSING for b in branches):
            return Readiness.PENDING, nbytes
        return Readiness.MISSING, nbytes

    # -- asking ---------------------------------------------------------------------------------
    def poll(self, request_ids: Iterable[str] | None = None) -> dict[str, RequestReadiness]:
        """The state of each tracked request (or of those listed; unknown ids are left out);
        never waits."""
        now = time.monotonic()
        with self._lock:
            ids = list(self._tracked) if request_ids is None else [str(r) for r in request_ids]
            out: dict[str, RequestReadiness] = {}
            for rid in ids:
                e = self._tracked.get(rid)
                if e is None:
                    continue
                state, nbytes = self._group_state_locked(rid, e)
                res = e.result if state is Readiness.FAILED else None
                out[rid] = RequestReadiness(
                    rid,
                    state,
                    nbytes,
                    age_s=now - e.offered,
                    status=res.status if res is not None else None,
                    reason=res.reason if res is not None else None,
                    started=e.started,
                    held_s=now - e.ended if e.result is not None else 0.0,
                )
            return out

    def ready(self, limit: int | None = None) -> list[str]:
        """Ids whose outcome is in (``ready`` or ``failed``), in the order they ended, at most
        ``limit``; never waits. Each stays listed until :meth:`take` hands it out."""
        with self._lock:
            return list(self._ready_order[:limit] if limit is not None else self._ready_order)

    def take(self, request_id: str) -> ReceiveResult | None:
        """The outcome of a request that is ``ready`` or ``failed``, exactly once: its KV
        (``ok``) or its failure. ``None`` (and nothing changes) while it, or one of its
        companions, is ``missing`` or ``pending``, for a companion whose request has not been
        taken yet, or for an id not tracked; never waits."""
        rid = str(request_id)
        with self._lock:
            e = self._tracked.get(rid)
            if e is None or e.result is None:
                return None
            primary = self._primary_of.get(rid)
            if primary is not None and primary in self._tracked:
                return None  # a companion goes with its request, after it
            if primary is None and not self._group_ended_locked(rid):
                return None
            del self._tracked[rid]
            if rid in self._ready_order:
                self._ready_order.remove(rid)
            self._groups.pop(rid, None)
            self._primary_of.pop(rid, None)
            self._changed.notify_all()
            return e.result

    def cancel(self, request_id: str) -> bool:
        """Stop tracking a request (aborted upstream): its receive is aborted within one wait
        slice, a payload already received is dropped (logged). ``False`` for an unknown id."""
        rid = str(request_id)
        with self._lock:
            if rid not in self._tracked:
                return False
            dropped = []
            for one in (rid, *self._groups.pop(rid, ())):  # a request's companions go with it
                e = self._tracked.pop(one, None)
                self._primary_of.pop(one, None)
                if e is None:
                    continue
                if one in self._ready_order:
                    self._ready_order.remove(one)
                e.abort.set()
                if e.result is not None and e.result.ok:
                    dropped.append(one)
            self._changed.notify_all()
        if dropped:
            logger.warning("%s dropped the KV of %s (cancelled)", self.name, dropped)
        return True

    def withdraw(self, request_id: str) -> bool:
        """Stop tracking a request whose receive has not started; never waits.

        Called by the prefetcher when a queued prefetch is superseded. ``True`` when it (with
        its CFG companions) was still waiting for a free receive thread: it never touched the
        connector, so its payload stays at the source for a later receive. ``False``, and
        nothing changes, once any of its branches has started or ended, for a companion (it
        goes with its request) and for an unknown id. Deciding and removing are one step with
        a receive thread's start, so a withdrawn request is never received.
        """
        rid = str(request_id)
        with self._lock:
            e = self._tracked.get(rid)
            if e is None or rid in self._primary_of:
                return False
            members = (self._tracked.get(c) for c in self._groups.get(rid, ()))
            branches = [e, *(m for m in members if m is not None)]
            if any(b.started or b.result is not None for b in branches):
                return False
            for one in (rid, *self._groups.pop(rid, ())):
                b = self._tracked.pop(one, None)
                self._primary_of.pop(one, None)
                if b is not None:
                    b.abort.set()  # its queued job ends at once, unreceived
            self._changed.notify_all()
        return True

    def wait(
        self, request_ids: str | Iterable[str] | None = None, deadline: float = math.inf
    ) -> bool:
        """Block until every listed request (default: every tracked one), with its CFG
        companions, has its outcome in or is no longer tracked, or until ``deadline`` (absolute
        ``time.monotonic()``) passes; whether nothing listed is still ``missing`` / ``pending``.

        For a caller with nothing else to do (the prefetcher's consume and ``wait_prefetch``);
        a step loop polls instead. Takes nothing: outcomes stay for :meth:`take`. Each receive
        ends by its own deadline, so even ``math.inf`` returns within about one deadline per
        request queued behind the others.
        """
        if request_ids is None:
            ids = None
        else:
            ids = [request_ids] if isinstance(request_ids, str) else [str(r) for r in request_ids]
        with self._changed:
            while True:
                if ids is None:
                    entries: Iterable[_Tracked | None] = self._tracked.values()
                else:
                    every = [m for r in ids for m in (r, *self._groups.get(r, ()))]
                    entries = (self._tracked.get(m) for m in every)
                if all(e is None or e.result is not None for e in entries):
                    return True
                left = remaining(deadline)
                if left <= 0:
                    return False
                self._changed.wait(None if math.isinf(left) else left)

    def __len__(self) -> int:
        with self._lock:
            return len(self._tracked)

    def close(self, timeout: float | None = 5.0) -> list[str]:
        """Abort every receive, drop what was not taken (logged) and stop the threads.
        Idempotent; returns the ids that were still tracked. A receive stuck in a connector
        call that ignores its deadline is left to its daemon thread after ``timeout``."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            entries = list(self._tracked.items())
            self._tracked.clear()
            self._ready_order.clear()
            self._groups.clear()
            self._primary_of.clear()
            self._changed.notify_all()
            for _, e in entries:
                e.abort.set()  # queued jobs end at once, aborted, and the threads exit
            self._work.notify_all()
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            if t is not threading.current_thread():  # closed from a receive (its callback)
                t.join(None if end is None else max(0.0, end - time.monotonic()))
        dropped = [rid for rid, e in entries if e.result is not None and e.result.ok]
        if dropped:
            logger.warning(
                "%s closed with %d KV payload(s) not taken: %s",
                self.name,
                len(dropped),
                dropped[:8],
            )
        return [rid for rid, _ in entries]
