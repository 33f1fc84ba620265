"""Background KV prefetch: the receive of request N+1 overlaps the forward of request N.

Who calls what
--------------
The manager owns one :class:`KVPrefetcher` and uses it only when prefetch is enabled. The
model-runner thread calls :meth:`KVPrefetcher.start_jobs` / :meth:`KVPrefetcher.start`
(non-blocking) and :meth:`KVPrefetcher.consume` (bounded wait); teardown calls
:meth:`KVPrefetcher.shutdown`.

A prefetch is an entry of a :class:`~omnikv.transfer.admission.KVAdmission`, the one state
machine of a background receive: ``start`` offers it, ``consume`` waits for it and takes it, a
superseded queued prefetch is withdrawn, ``shutdown`` closes the tracker. The prefetcher's
tracker has one receive thread, ``kv-prefetch``, made with the first prefetch, so prefetches
run one at a time ("serial mode") through the edge's typed receive (:class:`ReceiveFn`).
What the prefetcher keeps itself is what only prefetch has: which jobs are prefetched (a
sender endpoint, device memory to spare, room in the table), the reference's calling
conventions (``sender_info``, ``deadline``, ``abort``; the reference's job dicts), the CUDA
staging, the TTL of unconsumed results, and the consume errors and fallbacks below.

Guarantees
----------
* **Consume-once.** A finished prefetch is handed out by exactly one ``consume`` of its
  request id (the tracker's ``take``); afterwards the table forgets it.
* **No lost payloads.** omnikv never drops a payload it took from the connector without saying
  so. The reference discarded every other request's future on ``start`` and ``consume`` (the
  "stale sweep"), so a running receive consumed the sender's payload and threw it away, and a
  request prefetched, dropped and scheduled later timed out. Here, by state of the superseded
  prefetch:

  - *queued, not started*: withdrawn. It never touched the connector, so the payload is still
    at the source and a later (prefetch or synchronous) receive of that request finds it;
  - *running*: it finishes into the table;
  - *finished*: its result stays in the table until that request is consumed.

  So the answer to "kept or left at the source?" is: kept once the receive has started, left at
  the source before. ``tests/transfer/test_prefetch_shm.py`` checks all three states across
  processes
  over a real ``SharedMemoryConnector``: each request, scheduled later, gets its own KV.

  The table is bounded (``capacity`` entries, default 4). A finished *successful* result is
  never evicted to make room: when the table is full of them, ``start`` declines the new
  prefetch (a warning), so that request's payload stays at its source and the synchronous
  receive gets it. Failed results (no payload) are evicted freely. The only way a taken payload
  is dropped is its time-to-live (``result_ttl_s``, default 600 s from its arrival: the request
  was presumably aborted) or ``shutdown``; both log at ERROR/WARNING with the request id, and a
  later consume of an evicted request raises :class:`~omnikv.errors.KVPrefetchConsumeError` at
  once (its payload was consumed and cannot come back) instead of waiting out a doomed receive.
* **Every wait is bounded.** A prefetch receive runs under a deadline made when it was started
  (from the config's ``recv_timeout`` at that moment). ``consume`` waits for it at most until
  that deadline plus ``consume_grace_s`` (for a payload taken just before the deadline and still
  being decoded or copied); if the receive is still running then, ``consume`` returns a timeout
  and the result, if it ever comes, stays in the table for a later consume.
* **One request, one deadline.** When a prefetch timed out, the synchronous fallback is told to
  use what is left of the same deadline (:attr:`PrefetchConsume.retry_deadline`), so a miss does
  not wait a second full ``recv_timeout`` (reference weakness §10.1).
* **Prompt shutdown.** Closing the tracker sets every receive's abort event; a connector that
  ``takes_abort`` (shared memory, the pull connectors, the Store) looks at it during its one
  wait at least every :data:`omnikv.connectors.base.ABORT_POLL_S` (50 ms); for any other the
  receiver cuts each connector wait into slices of
  :data:`omnikv.transfer.receive.ABORT_SLICE_S` (50 ms) and checks the event between slices.
  So ``shutdown`` normally joins the worker within 50 ms.
  A connector call that ignores its deadline cannot be interrupted from Python; ``shutdown``
  then returns after ``join_timeout_s`` anyway, and the worker, once the call returns, never
  calls the connector again (the abort event is checked before every further connector use, and
  queued prefetches end unreceived) and exits.
* **Consume errors.** :class:`~omnikv.errors.KVPrefetchConsumeError` is raised by ``consume``
  exactly when a payload was taken from the connector but cannot be used. A failed background
  device copy is not yet such a case: the host tensors are kept and ``consume`` retries the copy
  synchronously; only when that fails too is the error raised.

CUDA targets
------------
For a ``cuda`` target the worker sets its current device (threads do not inherit it), receives
to host memory, and copies to the device on a side stream through pinned staging chunks
(:mod:`omnikv.transfer.staging`). The side stream is synchronised before the result is
published; ``consume`` then records the consumer's current stream on every device tensor, so
the caching allocator does not reuse their memory while the consumer's stream may still read it.
The config's ``kv_prefetch_min_free_mem_ratio`` skips a prefetch when the target device's
free/total memory is below the ratio (a failing query counts as enough memory). On machines
without CUDA all of this is a no-op.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.config import OmniKVCacheConfig
from omnikv.deadline import deadline_after
from omnikv.errors import KVPrefetchConsumeError
from omnikv.transfer import staging
from omnikv.transfer.admission import KVAdmission, Readiness, RequestReadiness
from omnikv.transfer.receive import ReceiveFn, ReceiveResult, ReceiveStatus
from omnikv.transfer.received import ReceivedKV, move_kv

__all__ = [
    "KVPrefetchJob",
    "KVPrefetcher",
    "PrefetchConsume",
    "PrefetchStart",
    "ReceiveFn",
    "iter_prefetch_jobs",
]

logger = logging.getLogger(__name__)

#: The name of the prefetch's one receive thread (and of its tracker in log lines).
_THREAD_NAME = "kv-prefetch"
_ENDED = (Readiness.READY, Readiness.FAILED)


_LOST_KEPT = 1024


@dataclass(frozen=True)
class KVPrefetchJob:
    """One prefetch job as the scheduler emits it: ``{request_id, kv_sender_info}``."""

    request_id: str
    kv_sender_info: dict[str, Any] | None = None

    @classmethod
    def from_value(cls, value: Any) -> KVPrefetchJob | None:
        """A job from the reference's dict form or a job; ``None`` when it names no request."""
        if isinstance(value, KVPrefetchJob):
            return value if value.request_id else None
        if not isinstance(value, Mapping):
            return None
        rid = value.get("request_id")
        ids = value.get("request_ids")
        if (rid is None or rid == "") and isinstance(ids, list | tuple) and ids:
            rid = ids[0]  # the diffusion request shape
        if rid is None or rid == "":
            return None
        info = value.get("kv_sender_info")
        return cls(str(rid), dict(info) if isinstance(info, Mapping) else None)


def iter_prefetch_jobs(jobs: Any) -> list[KVPrefetchJob]:
    """The jobs in ``jobs``: one dict / :class:`KVPrefetchJob`, or a list or tuple of them."""
    if not jobs:
        return []
    items: Iterable[Any] = jobs if isinstance(jobs, list | tuple) else (jobs,)
    out = []
    for item in items:
        job = KVPrefetchJob.from_value(item)
        if job is None:
            logger.debug("Prefetch job without request_id ignored: %r", item)
        else:
            out.append(job)
    return out


class PrefetchStart(str, enum.Enum):
    """What :meth:`KVPrefetcher.start` did."""

    STARTED = "started"
    TRACKED = "already_tracked"
    NO_SENDER_INFO = "no_sender_info"
    LOW_MEMORY = "low_device_memory"
    FULL = "table_full"
    CLOSED = "closed"


@dataclass(frozen=True)
class PrefetchConsume:
    """What :meth:`KVPrefetcher.consume` found for a request.

    ``result`` is ``None`` when nothing was prefetched for it. ``sync_retry`` says whether a
    synchronous receive may still find the payload (false after a corrupt payload or while the
    background receive still runs); ``retry_deadline`` is the deadline that receive should use
    (``None``: a fresh ``recv_timeout``).
    """

    result: ReceiveResult | None
    sync_retry: bool = True
    retry_deadline: float | None = None


@dataclass(eq=False)
class _Prefetch:
    """What the prefetcher knows of one prefetch beyond its tracker entry (whose state, result
    and deadline enforcement live in the :class:`KVAdmission`)."""

    #: made by ``start`` and given to the tracker's offer; bounds ``consume``'s wait
    deadline: float
    #: the payload was consumed but cannot be used (set by the worker; ``consume`` raises it)
    error: KVPrefetchConsumeError | None = None
    #: the background device copy failed: the data is still on the host, ``consume`` copies
    device_pending: torch.device | None = None


def _phase(state: RequestReadiness) -> str:
    """A tracker state as the prefetch's ``queued`` / ``running`` / ``done``."""
    if state.state in _ENDED:
        return "done"
    return "running" if state.started else "queued"


class KVPrefetcher:
    """A bounded table of prefetches keyed by request id, received by one background thread.

    ``receive`` is the edge's typed receive (:class:`ReceiveFn`). ``config`` (the manager's
    ``OmniKVCacheConfig``) is read at each :meth:`start`: ``recv_timeout`` makes the prefetch's
    deadline, ``kv_prefetch_min_free_mem_ratio`` guards device targets. ``stager`` does the
    device copies of ``cuda`` targets (default: a fresh
    :class:`~omnikv.transfer.staging.PinnedStager`). Nothing runs until the first prefetch
    makes the tracker (a :class:`KVAdmission` with one ``kv-prefetch`` thread); once
    :meth:`shutdown` ran, nothing starts again. See the module docstring for the guarantees.
    """

    def __init__(
        self,
        receive: ReceiveFn,
        *,
        config: OmniKVCacheConfig,
        capacity: int = 4,
        result_ttl_s: float = 600.0,
        consume_grace_s: float = 0.5,
        join_timeout_s: float = 2.0,
        stager: staging.PinnedStager | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._receive = receive
        self.config = config
        self.capacity = capacity
        self.result_ttl_s = result_ttl_s
        self.consume_grace_s = consume_grace_s
        self.join_timeout_s = join_timeout_s
        self._stager = stager or staging.PinnedStager()
        #: guards the prefetcher's own bookkeeping; never held by the worker while the tracker's
        #: lock is, so the two locks are always taken in this order
        self._lock = threading.Lock()
        self._admission: KVAdmission | None = None
        self._prefetches: dict[str, _Prefetch] = {}
        self._lost: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._closed = False

    # -- inspection (tests, diagnostics) ------------------------------------------------------
    @property
    def min_free_mem_ratio(self) -> float:
        """The free/total device memory below which a device prefetch is skipped (0: never)."""
        return max(0.0, float(self.config.kv_prefetch_min_free_mem_ratio))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread (``None`` before the first start)."""
        admission = self._admission
        return None if admission is None else admission.threads[0]

    @property
    def side_streams(self) -> int:
        """CUDA side streams made so far (one per target device; 0 for host targets)."""
        return self._stager.side_streams

    def tracked(self) -> dict[str, str]:
        """``{request_id: state}`` of every tracked prefetch: ``queued`` (waiting for the
        worker: nothing consumed), ``running`` or ``done`` (its outcome is in)."""
        admission = self._admission
        if admission is None:
            return {}
        return {rid: _phase(state) for rid, state in admission.poll().items()}

    def readiness(self) -> dict[str, RequestReadiness]:
        """Every tracked prefetch's state in the admission's terms (never waits): ``missing``
        (queued, or its receive waits for the payload), ``pending`` (taken from the connector,
        being decoded or copied; with its bytes), ``ready`` or ``failed`` (with the status
        and reason). :meth:`tracked` is the same table in prefetch's own words."""
        admission = self._admission
        return {} if admission is None else admission.poll()

    # -- start --------------------------------------------------------------------------------
    def start_jobs(self, jobs: Any, target_device: torch.device | str | None = None) -> None:
        """:meth:`start` every job of ``jobs`` (see :func:`iter_prefetch_jobs`); never blocks.

        Called by the manager's ``start_prefetch`` (when prefetch is on; on FOLLOWERs only when
        every rank reads the KV itself, ``shared_readers``).
        """
        for job in iter_prefetch_jobs(jobs):
            self.start(job.request_id, job.kv_sender_info, target_device)

    def start(
        self,
        request_id: str,
        sender_info: Mapping[str, Any] | None,
        target_device: torch.device | str | None = None,
    ) -> PrefetchStart:
        """Queue a background receive of ``request_id``; never blocks on the transport.

        Called by the model-runner thread after the current request's KV was consumed. A queued
        (not started) prefetch of another request is withdrawn: it consumed nothing. Running and
        finished ones are kept (module docstring).
        """
        rid = str(request_id)
        device = None if target_device is None else torch.device(target_device)
        if not sender_info:
            logger.debug("No kv_sender_info for %s; not prefetching", rid)
            return PrefetchStart.NO_SENDER_INFO
        if not staging.device_memory_ok(device, self.min_free_mem_ratio):
            logger.warning(
                "Skip KV prefetch for %s: device free mem below %.3f", rid, self.min_free_mem_ratio
            )
            return PrefetchStart.LOW_MEMORY
        with self._lock:
            if self._closed:
                logger.debug("Prefetcher is shut down; not prefetching %s", rid)
                return PrefetchStart.CLOSED
            if rid in self._prefetches:
                return PrefetchStart.TRACKED
            self._lost.pop(rid, None)
            self._withdraw_queued_locked(keep=rid)
            self._evict_locked()
            if len(self._prefetches) >= self.capacity:
                logger.warning(
                    "KV prefetch table full (%d unconsumed: %s); not prefetching %s, "
                    "its KV stays at the source for the synchronous receive",
                    len(self._prefetches),
                    ", ".join(self._prefetches),
                    rid,
                )
                return PrefetchStart.FULL
            deadline = deadline_after(self.config.recv_timeout, "recv_timeout")
            self._prefetches[rid] = _Prefetch(deadline)
            self._tracker_locked().offer(
                rid, target_device=device, sender_info=dict(sender_info), deadline=deadline
            )
        logger.debug("KV prefetch queued for %s (device=%s)", rid, device)
        return PrefetchStart.STARTED

    def _tracker_locked(self) -> KVAdmission:
        """The tracker, made (with its ``kv-prefetch`` thread) by the first prefetch."""
        if self._admission is None:
            self._admission = KVAdmission(
                self._receive_prefetch,
                recv_timeout=self.config.recv_timeout,
                max_receives=1,
                name=_THREAD_NAME,
            )
        return self._admission

    def _withdraw_queued_locked(self, keep: str | None) -> None:
        """Withdraw every prefetch but ``keep`` that the worker has not started yet."""
        if self._admission is None:
            return
        for rid in [r for r in self._prefetches if r != keep]:
            if self._admission.withdraw(rid):
                del self._prefetches[rid]
                logger.debug(
                    "KV prefetch of %s superseded before it started; its payload stays at the "
                    "source",
                    rid,
                )

    def _evict_locked(self) -> None:
        """Drop failed results; drop successful ones (and consume errors) only past their TTL
        (loudly)."""
        if self._admission is None:
            return
        for rid, state in self._admission.poll(list(self._prefetches)).items():
            if state.state not in _ENDED:
                continue
            prefetch = self._prefetches[rid]
            if state.state is Readiness.FAILED and prefetch.error is None:
                self._admission.take(rid)
                del self._prefetches[rid]
            elif state.held_s > self.result_ttl_s:
                self._admission.take(rid)
                del self._prefetches[rid]
                self._mark_lost_locked(rid, f"evicted after {self.result_ttl_s:.0f}s unconsumed")
                logger.error(
                    "Prefetched KV of %s was never consumed within %.0fs: released; "
                    "its payload is lost (a later consume raises KVPrefetchConsumeError)",
                    rid,
                    self.result_ttl_s,
                )

    def _mark_lost_locked(self, rid: str, why: str) -> None:
        self._lost[rid] = why
        while len(self._lost) > _LOST_KEPT:
            self._lost.popitem(last=False)

    # -- worker -------------------------------------------------------------------------------
    def _receive_prefetch(
        self, request_id: str, target_device: torch.device | None = None, **options: Any
    ) -> ReceiveResult:
        """The receive the tracker runs for each prefetch, on the ``kv-prefetch`` thread.

        Calls the edge's receive as the prefetch always has, with the tracker's ``options``
        (``sender_info``, ``deadline``, ``abort``, and ``on_arrival``, so that
        :meth:`readiness` shows ``pending`` once the payload is taken) but its ``quiet``: a
        prefetch miss is logged as any receive's; a ``cuda`` target through the pinned stager
        on a side stream. Never raises: a consume error is kept for ``consume`` to raise (the
        result says ``corrupt``), an unexpected error becomes ``unavailable`` (``consume``
        falls back to a synchronous receive).
        """
        rid, device = request_id, target_device
        with self._lock:
            prefetch = self._prefetches.get(rid)  # None only once shutdown forgot it
        passed = {k: v for k, v in options.items() if k != "quiet"}

        def receive(to: torch.device | None) -> ReceiveResult:
            return self._receive(rid, to, **passed)

        t0 = time.monotonic()
        try:
            if device is not None and device.type == "cuda" and torch.cuda.is_available():
                result = self._receive_cuda(rid, device, prefetch, receive)
            else:
                result = receive(device)
        except KVPrefetchConsumeError as exc:
            logger.error("KV prefetch of %s consumed the payload but failed: %s", rid, exc)
            with self._lock:
                if prefetch is not None:
                    prefetch.error = exc
            result = ReceiveResult(rid, ReceiveStatus.CORRUPT, reason=f"consume error: {exc}")
        except Exception as exc:  # a bug below the receiver: recorded, consume falls back
            logger.exception("KV prefetch of %s failed (payload may be lost)", rid)
            result = ReceiveResult(
                rid, ReceiveStatus.UNAVAILABLE, reason=f"prefetch failed: {exc!r}"
            )
        logger.debug(
            "KV prefetch of %s finished in %.1f ms: %s",
            rid,
            (time.monotonic() - t0) * 1e3,
            result.status.value,
        )
        return result

    def _receive_cuda(
        self,
        rid: str,
        device: torch.device,
        prefetch: _Prefetch | None,
        receive: Callable[[torch.device | None], ReceiveResult],
    ) -> ReceiveResult:
        """``receive`` to the host, then the copy to ``device`` on the stager's side stream."""
        torch.cuda.set_device(device)  # background threads do not inherit the current device
        stream = self._stager.side_stream(device)
        with torch.cuda.stream(stream):
            result = receive(None)
            if not result.ok or result.kv is None:
                return result
            try:
                t0 = time.monotonic()
                result.kv = self._stager.to_device(result.kv, device, stream)
                result.timings_ms["device_copy_ms"] = (time.monotonic() - t0) * 1e3
            except Exception as exc:  # OOM and the like: the host copy survives, consume retries
                logger.warning(
                    "Background device copy of %s failed (%s); consume will copy synchronously",
                    rid,
                    exc,
                )
                with self._lock:
                    if prefetch is not None:
                        prefetch.device_pending = device
        return result

    # -- consume ------------------------------------------------------------------------------
    def consume(
        self,
        request_id: str,
        *,
        target_device: torch.device | str | None = None,
        deadline: float = math.inf,
    ) -> PrefetchConsume:
        """Take the prefetch of ``request_id`` (consume-once), waiting for it boundedly.

        Called by the model-runner thread. Waits at most until the prefetch's own receive
        deadline plus ``consume_grace_s`` (and never past ``deadline``). A queued prefetch of
        another request is withdrawn (it consumed nothing); finished ones are kept. A prefetch
        of this request still queued behind another one's running receive is withdrawn too
        (receiving it here is faster: ``result`` ``None``). With ``target_device`` the data is
        moved there if it was prefetched elsewhere.

        Raises :class:`KVPrefetchConsumeError` when the payload was consumed but cannot be used.
        """
        rid = str(request_id)
        with self._lock:
            prefetch = self._prefetches.get(rid)
            self._withdraw_queued_locked(keep=None if prefetch is None else rid)
            lost = self._lost.pop(rid, None)
            admission = self._admission
            if prefetch is not None and admission is not None:
                busy = any(_phase(s) == "running" for s in admission.poll().values())
                if busy and admission.withdraw(rid):  # False once its own receive started
                    del self._prefetches[rid]
                    logger.debug("KV prefetch of %s had not started; receiving synchronously", rid)
                    return PrefetchConsume(None)
        if lost is not None:
            raise KVPrefetchConsumeError(f"Prefetched KV of {rid} was dropped ({lost})")
        if prefetch is None or admission is None:
            return PrefetchConsume(None)
        if not admission.wait(rid, min(deadline, prefetch.deadline + self.consume_grace_s)):
            logger.error(
                "KV prefetch of %s still running at its deadline; proceeding without it "
                "(a late result stays available to a later consume)",
                rid,
            )
            result = ReceiveResult(
                rid, ReceiveStatus.TIMEOUT, reason="prefetch still running at its deadline"
            )
            return PrefetchConsume(result, sync_retry=False)
        taken = admission.take(rid)
        with self._lock:
            if self._prefetches.get(rid) is prefetch:
                del self._prefetches[rid]
        if taken is None:  # released by shutdown, or taken by a concurrent consume
            return PrefetchConsume(None)
        return self._finish_consume(prefetch, taken, target_device)

    def _finish_consume(
        self,
        prefetch: _Prefetch,
        result: ReceiveResult,
        target_device: torch.device | str | None,
    ) -> PrefetchConsume:
        rid = result.request_id
        if prefetch.error is not None:
            raise prefetch.error
        if not result.ok or result.kv is None:
            status = result.status
            if status is ReceiveStatus.CORRUPT:
                return PrefetchConsume(result, sync_retry=False)
            if status is ReceiveStatus.CANCELLED:
                return PrefetchConsume(result, sync_retry=True)
            return PrefetchConsume(result, sync_retry=True, retry_deadline=prefetch.deadline)
        kv = result.kv
        want = None if target_device is None else torch.device(target_device)
        move_to = prefetch.device_pending
        if want is not None and any(t.device != want for t in kv.tensors()):
            move_to = want
        if move_to is not None:
            try:
                kv = result.kv = move_kv(kv, move_to)
            except Exception as exc:
                logger.exception("Device copy of prefetched KV of %s failed", rid)
                raise KVPrefetchConsumeError(
                    f"Prefetched KV of {rid} could not be moved to {move_to}: {exc}; "
                    "payload already consumed"
                ) from exc
        staging.record_stream_for(kv)
        logger.debug("Consumed prefetched KV of %s (%d bytes)", rid, result.nbytes)
        return PrefetchConsume(result, sync_retry=False)

    def consume_kv(self, request_id: str) -> ReceivedKV | None:
        """The prefetched KV of ``request_id`` (consume-once, where it was received), or
        ``None`` when nothing usable was prefetched for it (the seed's ``consume_prefetched_kv``).

        Raises :class:`KVPrefetchConsumeError` when it was consumed but cannot be used.
        """
        result = self.consume(request_id).result
        return result.kv if result is not None and result.ok else None

    # -- waiting ------------------------------------------------------------------------------
    def wait_idle(self, deadline: float = math.inf) -> bool:
        """Block until no prefetch is queued or running, or ``deadline`` passes; whether idle.

        Called by the model-runner thread (``manager.wait_prefetch``) before it pauses the worker
        or frees device memory. Finished results stay for their consumers. Each running receive
        ends by its own receive deadline, so even ``math.inf`` returns within about one
        ``recv_timeout`` per queued request.
        """
        admission = self._admission
        return True if admission is None else admission.wait(None, deadline)

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the worker and forget every prefetch; returns whether the worker has exited.

        Called on teardown (``manager.shutdown_prefetch`` / ``close``). Idempotent. Queued
        prefetches are cancelled (their payloads stay at the source); unconsumed results are
        released with a warning naming them (the tracker's close); a running receive is aborted
        at its next wait slice. Returns within ``timeout`` (default ``join_timeout_s``) even
        when the worker is stuck in a connector call that ignores its deadline; that worker
        never touches the connector again.
        """
        with self._lock:
            self._closed = True
            self._prefetches.clear()
            admission = self._admission
        if admission is None:
            return True
        admission.close(self.join_timeout_s if timeout is None else timeout)
        thread = admission.threads[0]
        if thread is threading.current_thread() or not thread.is_alive():
            return True
        logger.error(
            "KV prefetch worker still inside a connector call after shutdown; "
            "it will exit without touching the connector again"
        )
        return False
