"""Background KV prefetch: the receive of request N+1 overlaps the forward of request N.

Who calls what
--------------
The manager owns one :class:`KVPrefetcher` and uses it only when prefetch is enabled. The
model-runner thread calls :meth:`KVPrefetcher.start_jobs` / :meth:`KVPrefetcher.start`
(non-blocking) and :meth:`KVPrefetcher.consume` (bounded wait); teardown calls
:meth:`KVPrefetcher.shutdown`. One daemon worker thread (``kv-prefetch``), started with the first
prefetch, runs the receives, one at a time ("serial mode"), through the manager's typed receive
(:class:`ReceiveFn`).

Guarantees
----------
* **Consume-once.** A finished prefetch is handed out by exactly one ``consume`` of its
  request id; afterwards the table forgets it.
* **No lost payloads.** omnikv never drops a payload it took from the connector without saying
  so. The reference discarded every other request's future on ``start`` and ``consume`` (the
  "stale sweep"), so a running receive consumed the sender's payload and threw it away, and a
  request prefetched, dropped and scheduled later timed out. Here, by state of the superseded
  prefetch:

  - *queued, not started*: cancelled. It never touched the connector, so the payload is still
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
  is dropped is its time-to-live (``result_ttl_s``, default 600 s: the request was presumably
  aborted) or ``shutdown``; both log at ERROR/WARNING with the request id, and a later consume of
  an evicted request raises :class:`~omnikv.errors.KVPrefetchConsumeError` at once (its payload
  was consumed and cannot come back) instead of waiting out a doomed receive.
* **Every wait is bounded.** A prefetch receive runs under a deadline made when it was started
  (from the config's ``recv_timeout`` at that moment). ``consume`` waits for it at most until
  that deadline plus ``consume_grace_s`` (for a payload taken just before the deadline and still
  being decoded or copied); if the worker is still busy then, ``consume`` returns a timeout and
  the result, if it ever comes, stays in the table for a later consume.
* **One request, one deadline.** When a prefetch timed out, the synchronous fallback is told to
  use what is left of the same deadline (:attr:`PrefetchConsume.retry_deadline`), so a miss does
  not wait a second full ``recv_timeout`` (reference weakness §10.1).
* **Prompt shutdown.** The worker's receives get the prefetcher's stop event; the receiver cuts
  each connector wait into slices of :data:`omnikv.transfer.receive.ABORT_SLICE_S` (50 ms) and
  checks the event between slices, so ``shutdown`` normally joins the worker within one slice.
  A connector call that ignores its deadline cannot be interrupted from Python; ``shutdown``
  then returns after ``join_timeout_s`` anyway, and the worker, once the call returns, never
  calls the connector again (the stop event is checked before every further connector use) and
  exits.
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.config import OmniKVCacheConfig
from omnikv.deadline import deadline_after, remaining
from omnikv.errors import KVPrefetchConsumeError
from omnikv.transfer import staging
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


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class _Entry:
    request_id: str
    sender_info: dict[str, Any] | None
    target_device: torch.device | None
    deadline: float
    state: _State = _State.QUEUED
    done: threading.Event = field(default_factory=threading.Event)
    result: ReceiveResult | None = None
    error: KVPrefetchConsumeError | None = None
    #: set when the background device copy failed and the data is still on the host
    device_pending: torch.device | None = None
    finished_at: float = 0.0

    @property
    def holds_payload(self) -> bool:
        return self.state is _State.DONE and self.result is not None and self.result.ok


class KVPrefetcher:
    """One background worker, a bounded table of prefetches keyed by request id.

    ``receive`` is the manager's typed receive (:class:`ReceiveFn`). ``config`` (the manager's
    ``OmniKVCacheConfig``) is read at each :meth:`start`: ``recv_timeout`` makes the prefetch's
    deadline, ``kv_prefetch_min_free_mem_ratio`` guards device targets. ``stager`` does the
    device copies of ``cuda`` targets (default: a fresh
    :class:`~omnikv.transfer.staging.PinnedStager`). Nothing runs until the first prefetch
    starts the worker; once :meth:`shutdown` ran, nothing starts again. See the module docstring
    for the guarantees.
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
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._entries: dict[str, _Entry] = {}
        self._queue: collections.deque[_Entry] = collections.deque()
        self._lost: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._thread: threading.Thread | None = None
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
        return self._thread

    @property
    def side_streams(self) -> int:
        """CUDA side streams made so far (one per target device; 0 for host targets)."""
        return self._stager.side_streams

    def tracked(self) -> dict[str, str]:
        """``{request_id: state}`` of every tracked prefetch."""
        with self._cond:
            return {rid: e.state.value for rid, e in self._entries.items()}

    # -- start --------------------------------------------------------------------------------
    def start_jobs(self, jobs: Any, target_device: torch.device | str | None = None) -> None:
        """:meth:`start` every job of ``jobs`` (see :func:`iter_prefetch_jobs`); never blocks.

        Called by the manager's ``start_prefetch`` (when prefetch is on, never on FOLLOWERs).
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
        (not started) prefetch of another request is cancelled: it consumed nothing. Running and
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
        with self._cond:
            if self._closed:
                logger.debug("Prefetcher is shut down; not prefetching %s", rid)
                return PrefetchStart.CLOSED
            if rid in self._entries:
                return PrefetchStart.TRACKED
            self._lost.pop(rid, None)
            self._cancel_queued_locked(keep=rid)
            self._evict_locked()
            if len(self._entries) >= self.capacity:
                logger.warning(
                    "KV prefetch table full (%d unconsumed: %s); not prefetching %s, "
                    "its KV stays at the source for the synchronous receive",
                    len(self._entries),
                    ", ".join(self._entries),
                    rid,
                )
                return PrefetchStart.FULL
            entry = _Entry(
                rid,
                dict(sender_info),
                device,
                deadline_after(self.config.recv_timeout, "recv_timeout"),
            )
            self._entries[rid] = entry
            self._queue.append(entry)
            self._ensure_thread_locked()
            self._cond.notify_all()
        logger.debug("KV prefetch queued for %s (device=%s)", rid, device)
        return PrefetchStart.STARTED

    def _cancel_queued_locked(self, keep: str | None) -> None:
        self._cond.notify_all()  # a wait_idle() may be waiting on the entries dropped here
        for entry in [e for e in self._queue if e.request_id != keep]:
            self._queue.remove(entry)
            self._entries.pop(entry.request_id, None)
            entry.done.set()  # result None: nothing was received
            logger.debug(
                "KV prefetch of %s superseded before it started; its payload stays at the source",
                entry.request_id,
            )

    def _evict_locked(self) -> None:
        """Drop failed results; drop successful ones only past their TTL (loudly)."""
        now = time.monotonic()
        for rid, entry in list(self._entries.items()):
            if entry.state is not _State.DONE:
                continue
            if not entry.holds_payload and entry.error is None:
                del self._entries[rid]
            elif now - entry.finished_at > self.result_ttl_s:
                del self._entries[rid]
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

    def _ensure_thread_locked(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
            self._thread.start()

    # -- worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                entry = self._queue.popleft()
                entry.state = _State.RUNNING
            self._execute(entry)
            with self._cond:
                entry.state = _State.DONE
                entry.finished_at = time.monotonic()
                if self._stop.is_set() and entry.holds_payload:
                    logger.warning(
                        "KV of %s arrived during prefetch shutdown and was dropped",
                        entry.request_id,
                    )
                    entry.result = None
                entry.done.set()
                self._cond.notify_all()

    def _execute(self, entry: _Entry) -> None:
        rid, device = entry.request_id, entry.target_device
        t0 = time.monotonic()
        try:
            if device is not None and device.type == "cuda" and torch.cuda.is_available():
                self._execute_cuda(entry, device)
            else:
                entry.result = self._receive(
                    rid,
                    device,
                    sender_info=entry.sender_info,
                    deadline=entry.deadline,
                    abort=self._stop,
                )
        except KVPrefetchConsumeError as exc:
            logger.error("KV prefetch of %s consumed the payload but failed: %s", rid, exc)
            entry.error = exc
        except Exception as exc:  # a bug below the receiver: recorded, consume falls back
            logger.exception("KV prefetch of %s failed (payload may be lost)", rid)
            entry.result = ReceiveResult(
                rid, ReceiveStatus.UNAVAILABLE, reason=f"prefetch failed: {exc!r}"
            )
        res = entry.result
        logger.debug(
            "KV prefetch of %s finished in %.1f ms: %s",
            rid,
            (time.monotonic() - t0) * 1e3,
            res.status.value if res is not None else "consume error",
        )

    def _execute_cuda(self, entry: _Entry, device: torch.device) -> None:
        torch.cuda.set_device(device)  # background threads do not inherit the current device
        stream = self._stager.side_stream(device)
        with torch.cuda.stream(stream):
            result = self._receive(
                entry.request_id,
                None,
                sender_info=entry.sender_info,
                deadline=entry.deadline,
                abort=self._stop,
            )
            entry.result = result
            if not result.ok or result.kv is None:
                return
            try:
                t0 = time.monotonic()
                result.kv = self._stager.to_device(result.kv, device, stream)
                result.timings_ms["device_copy_ms"] = (time.monotonic() - t0) * 1e3
            except Exception as exc:  # OOM and the like: the host copy survives, consume retries
                logger.warning(
                    "Background device copy of %s failed (%s); consume will copy synchronously",
                    entry.request_id,
                    exc,
                )
                entry.device_pending = device

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
        another request is cancelled (it consumed nothing); finished ones are kept. With
        ``target_device`` the data is moved there if it was prefetched elsewhere.

        Raises :class:`KVPrefetchConsumeError` when the payload was consumed but cannot be used.
        """
        rid = str(request_id)
        with self._cond:
            self._cancel_queued_locked(keep=None if rid not in self._entries else rid)
            lost = self._lost.pop(rid, None)
            entry = self._entries.get(rid)
            busy = any(e.state is _State.RUNNING for e in self._entries.values())
            if entry is not None and entry.state is _State.QUEUED and busy:
                # The worker is busy with another request: receiving here is faster.
                self._queue.remove(entry)
                del self._entries[rid]
                logger.debug("KV prefetch of %s had not started; receiving synchronously", rid)
                return PrefetchConsume(None)
        if lost is not None:
            raise KVPrefetchConsumeError(f"Prefetched KV of {rid} was dropped ({lost})")
        if entry is None:
            return PrefetchConsume(None)
        limit = min(deadline, entry.deadline + self.consume_grace_s)
        if not entry.done.wait(timeout=_wait_timeout(limit)):
            logger.error(
                "KV prefetch of %s still running at its deadline; proceeding without it "
                "(a late result stays available to a later consume)",
                rid,
            )
            result = ReceiveResult(
                rid, ReceiveStatus.TIMEOUT, reason="prefetch still running at its deadline"
            )
            return PrefetchConsume(result, sync_retry=False)
        with self._cond:
            if self._entries.get(rid) is entry:
                del self._entries[rid]
        return self._finish_consume(entry, target_device)

    def _finish_consume(
        self, entry: _Entry, target_device: torch.device | str | None
    ) -> PrefetchConsume:
        rid = entry.request_id
        if entry.error is not None:
            raise entry.error
        result = entry.result
        if result is None:  # dropped at shutdown
            return PrefetchConsume(None)
        if not result.ok or result.kv is None:
            status = result.status
            if status is ReceiveStatus.CORRUPT:
                return PrefetchConsume(result, sync_retry=False)
            if status is ReceiveStatus.CANCELLED:
                return PrefetchConsume(result, sync_retry=True)
            return PrefetchConsume(result, sync_retry=True, retry_deadline=entry.deadline)
        kv = result.kv
        want = None if target_device is None else torch.device(target_device)
        move_to = entry.device_pending
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
        with self._cond:
            while any(e.state is not _State.DONE for e in self._entries.values()):
                left = remaining(deadline)
                if left <= 0:
                    return False
                self._cond.wait(None if math.isinf(left) else left)
            return True

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the worker and forget every prefetch; returns whether the worker has exited.

        Called on teardown (``manager.shutdown_prefetch`` / ``close``). Idempotent. Queued
        prefetches are cancelled (their payloads stay at the source); unconsumed results are
        released with a warning naming them; a running receive is aborted at its next wait slice.
        Returns within ``timeout`` (default ``join_timeout_s``) even when the worker is stuck in a
        connector call that ignores its deadline; that worker never touches the connector again.
        """
        with self._cond:
            first = not self._closed
            self._closed = True
            self._stop.set()
            self._queue.clear()
            dropped = [rid for rid, e in self._entries.items() if e.holds_payload]
            self._entries.clear()
            self._cond.notify_all()
            thread = self._thread
        if first and dropped:
            logger.warning(
                "Prefetch shutdown released unconsumed KV of %s", ", ".join(sorted(dropped))
            )
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(self.join_timeout_s if timeout is None else timeout)
        if thread.is_alive():
            logger.error(
                "KV prefetch worker still inside a connector call after shutdown; "
                "it will exit without touching the connector again"
            )
            return False
        return True


def _wait_timeout(limit: float) -> float | None:
    left = remaining(limit)
    return None if math.isinf(left) else left
