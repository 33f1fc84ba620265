"""SharedMemoryConnector: node-local KV hand-off through a pooled memfd and a peer mesh.

Design (one page; the parts live in modules of this package, each named in parentheses;
``config`` parses the keys in the table at the end):

* **Pool** (``pool``, ``store``). Every connector that puts owns one pool: an anonymous
  ``memfd`` (no name in ``/dev/shm``), ``0600``, sealed against resizing, sized by
  ``pool_size_bytes`` (default 1 GiB), made at once and *not* populated: memory is
  committed as it is used. With ``prefault`` (``"auto"``) a background thread populates a
  start-up reserve as soon as the connector is known to send (constructor with
  ``role: "sender"``, which the manager's factory passes; else the first put), then stays
  ahead of the high-water mark; nothing ever waits for it. The reserve follows what the stage
  declares it sends (``expected_payload_bytes``, or ``kv_bytes_per_token`` x
  ``max_model_len``: that plus 1 MiB), else 16 MiB; never more than the pool. Slots come
  from the one allocator (``connectors.pool.BufferAllocator``); a put that finds no space
  waits (woken by every free) until the caller's deadline, then raises
  :class:`PoolExhaustedError`, or raises it at once when the pool is full of payloads nobody
  came for (see *A full pool*).
* **Mesh** (``mesh``, ``leadership``, ``wire``). Every connector binds a listener in the
  Linux *abstract* Unix namespace (random suffix) and connects to its namespace's peers
  (non-blocking, bounded) under a per-namespace ``flock`` in a directory only its uid can
  write; peers of another uid are refused (``SO_PEERCRED``) before anything is read. One I/O
  thread serves the sockets; a thread blocked in ``wait`` leads: it serves them itself
  meanwhile (at once, on a selector of its own; the I/O thread parks when it next runs), so its
  offer is read where it is needed (``leadership``), and a put first reads wants that arrived
  while it wrote.
* **Protocol** (msgpack frames, no pickle; ``protocol``, ``recv``, ``store``). ``want`` /
  ``offer`` / ``release``, consume-once; the pool descriptor is passed once per connection and
  checked (memfd, seals, size) before it is mapped. The ``local`` link makes a ``get`` on the
  instance that did the ``put`` work the same way. What the reference-shaped ``put`` stores
  (bytes, raw bytes, an encoded object, or nothing when it travels inline) is ``codec``.
  ``cleanup`` / ``cleanup_prefix`` are carried out by every connector of the namespace, which
  answer how many payloads they dropped (``cleanup``).
* **Lifetime.** A reader may keep what it received as long as it likes: when the sender's pool
  is full, holders migrate their spans to private memory (one copy) and give the slots back; a
  receiver that closes migrates what it still holds first (senders reuse those slots). A
  sender that closes or exits normally lingers up to ``linger_s`` for unconsumed payloads (one
  INFO line when it starts: how many, up to how long), then logs a WARNING naming what it
  dropped; :meth:`flush` waits explicitly. SIGKILL drops at once (nothing leaks: memfds and
  abstract names die with their process).
* **Senders gone, waits explained.** A connector that sends says so to its peers (``hello``)
  and keeps a record in the namespace while it lives (``registry``: a locked file the
  kernel unlocks when the process dies). A wait whose sender went away during it raises
  :class:`PeerGoneError` at its deadline; a receive that found nothing asks
  :meth:`explain_miss` (``diag``), which names the senders alive, those gone (closed, or
  died: also before this connector started) and the keys that wait unconsumed at them, and
  makes the receive ``peer_gone`` when no sender lives and one went.
* **Expiry.** A payload published and claimed by no reader for ``buffer_ttl_seconds`` (300,
  as the Mooncake TE and NIXL connectors; 0: never) after its put is freed: its key is
  forgotten (a reader that comes later misses, as for a key never put), a WARNING names its
  key, size and age, and ``health()`` counts it (``ttl_reaped``, ``ttl_reaped_bytes``). Only
  unclaimed payloads expire: one offered to a reader is that reader's until it releases it,
  so no reader ever sees its slot reused. A timer thread sleeps until the next expiry; puts
  and wants also free what is due before they look. The default bounds what clients that ask
  for KV and never come back (a served deployment) can hold: a pool that fills with such
  payloads empties within ``buffer_ttl_seconds``. With 0 a payload waits for a reader,
  ``cleanup`` or close however long that takes (a pipeline whose every payload is awaited).
* **Delivery verdicts** (``acks``; :mod:`omnikv.connectors.delivery`). A receiver's
  ``acknowledge`` sends ``verdict`` to the peer whose offer it took, on the same link; the
  sender reports each payload put here once to its listener (``set_delivery_listener``):
  ``delivered`` / ``refused`` (with the receiver's reason) when that verdict comes (accepted
  only from the link the offer went to, once); ``expired`` when the payload stayed unclaimed
  for ``buffer_ttl_seconds`` (the reason names the TTL), when the reader that took it went
  away (died, closed, dropped) before its verdict, or when no verdict came within
  ``ack_timeout_s`` of the offer (checked by the TTL timer thread and by ``health()``). A
  payload dropped by ``cleanup`` gets no verdict. ``health()`` counts ``acks_delivered``,
  ``acks_refused``, ``acks_expired``, ``acks_ignored`` (verdicts naming nothing that peer
  took), ``acks_sent`` / ``ack_failures`` (as a receiver).
* **A full pool.** A full pool serves the newest hand-off: a put that finds no space first
  frees payloads published and claimed by no reader for ``unclaimed_grace_seconds`` (10 s),
  oldest first, until it fits (counted as ``grace_evicted`` / ``grace_evicted_bytes``, one
  WARNING naming their keys, each reported ``expired``), so requests whose KV nobody comes for
  cannot starve a producer until their TTL. Otherwise it waits until its deadline while space
  can come back: readers holding payloads are asked to migrate them, a payload being written
  may go to a waiting reader, an unconsumed one may expire or pass its grace, a reader may come
  for one put recently. It fails at once with :class:`PoolExhaustedError` (``put_pool_full``)
  when every slot in use holds a published payload no reader claimed, none expires or passes
  its grace before the deadline, and even the
  youngest has waited at least as long as the put may still wait: only a reader coming for one
  could help, none came for any of them in that long, and a waiting put holds its caller (an
  engine's KV blocks) for nothing. The message says how many payloads of how many bytes hold
  the pool, their ages and when they expire.

Keys are ``"<key>@<from>_<to>"`` with every part escaped; at most 1024 characters.

Config keys (``connector_config = {"type": "SharedMemoryConnector", ...}``; all optional; parsed
strictly by :mod:`omnikv.connectors.shm.config`: a bad value is a ``ConfigError`` naming the key;
booleans are ``True``/``False`` or ``"true"``/``"false"``):

==========================  ===========  =====================================================
key                         default      meaning
==========================  ===========  =====================================================
``namespace``               ``default``  connectors meet only within one namespace (per uid);
                                         1-255 printable characters
``pool_size_bytes``         1 GiB        this connector's send pool (>= 4096; an int or ``"1GiB"``);
                                         the most it keeps unconsumed; a larger payload is refused
``prefault``                ``"auto"``   ``"auto"``: populate a reserve in the background once
                                         sending (see ``role``; sized by the next three keys,
                                         else 16 MiB), then ahead of use;
                                         ``True``: only ahead of use (2x the high-water mark);
                                         a byte count: that reserve at start; ``False``: never
``expected_payload_bytes``  (none)       the largest payload the stage sends (a byte count): the
                                         ``"auto"`` reserve is this plus 1 MiB (its header and
                                         alignment); a WARNING if it exceeds the pool
``kv_bytes_per_token``      (none)       with ``max_model_len`` (both ints >= 0), the same
``max_model_len``           (none)       declaration from the model: a rank's KV bytes per token
                                         (layers x 2 x KV heads x head size x dtype size / TP)
                                         times the longest sequence
``role``                    (unknown)    ``"sender"`` / ``"receiver"`` (the manager's factory
                                         passes it): a sender makes its pool and starts the
                                         ``"auto"`` reserve in the constructor, a receiver never
``put_timeout_s``           30           a put's wait for space when the caller gives no deadline
                                         (>= 0; 0: try once)
``get_timeout_s``           0.1          how long a non-blocking ``get`` waits for peers' answers
``join_timeout_s``          10           longest the constructor waits for the namespace lock
``linger_s``                30           on close / exit, wait this long for unconsumed payloads
                                         (>= 0; 0: drop at once)
``shm_threshold_bytes``     65536        (reference; >= 0; attribute ``threshold``) the largest
                                         payload that ``inline_small_payloads`` sends inline
``inline_small_payloads``   ``False``    (reference) ``True``: the reference-shaped ``put`` of
                                         a payload whose serialized form is at most
                                         ``shm_threshold_bytes`` stores nothing and returns it
                                         in its metadata (``{"inline_bytes", "size"}``);
                                         ``get`` / ``wait`` / ``get_with_deadline`` given that
                                         metadata decode it (``put_packed``, the manager's
                                         path, always uses the pool)
``buffer_ttl_seconds``      300          an unconsumed payload is freed this many seconds after
                                         its put, with a WARNING naming it (a number >= 0;
                                         0: never); a reader that comes later misses
``unclaimed_grace_seconds`` 10           when a put finds the pool full, payloads published and
                                         claimed by no reader for this many seconds are freed,
                                         oldest first, until it fits (a number >= 0; counted as
                                         ``grace_evicted``, logged with their keys, reported
                                         ``expired``)
``ack_timeout_s``           60           a payload taken by a reader and not acknowledged this
                                         many seconds after its offer is reported ``expired``
                                         (a number >= 0; a reader that goes away first makes it
                                         ``expired`` at once)
``shared_readers``          1            every payload put here is for this many readers of the
                                         node (1-64; the ranks of a receiving stage that each
                                         need the whole KV, the receiving stage's world size
                                         without TP): written once, each reader's take maps the
                                         same slot (:meth:`put_shared`); give the same value to
                                         the receiving stage's connector_config, whose ranks then
                                         each read it instead of a leader broadcasting it
``poll_us``                 1000         a blocking wait polls its sockets this many microseconds
                                         before it sleeps (0-100000; 0: never), yielding the CPU
                                         between polls: lower latency for payloads that come soon
                                         (a VM's idle CPU is slow to wake), at up to that much CPU
                                         per wait
``stage_id``                (none)       (reference) this connector's stage, a number >= 0:
                                         ``get_wakeup_generation`` / ``wait_for_change`` wake
                                         it on puts to that stage (``wakeup``)
``extra.wakeup_scope``      namespace    (reference) the scope wakeups reach across (a string)
``type``, ``name``          (ignored)    accepted for the factory; unknown keys are logged
==========================  ===========  =====================================================

Arrival wakeups (the reference's 0.32 API; ``wakeup``): ``get_wakeup_generation()`` and
``wait_for_change(generation, *, timeout)`` let a stage that polls block until a put to its
stage instead of sleeping; ``VLLM_OMNI_SHM_WAKEUP=0`` turns them off. A put that a reader's
blocking wait took at once wakes nobody: nothing is left for a look to find.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from omnikv._logging import RateLimitedLog
from omnikv.connectors.base import (
    GetResult,
    KeyProbe,
    KeyState,
    ManagedBuffer,
    MissReport,
    OmniConnectorBase,
    PutResult,
    Writer,
)
from omnikv.connectors.counters import Counters
from omnikv.connectors.delivery import DeliveryListener, Verdict
from omnikv.connectors.shm import codec
from omnikv.connectors.shm.acks import COUNTER_NAMES as ACK_COUNTERS
from omnikv.connectors.shm.acks import SentVerdicts, TakenPayloads
from omnikv.connectors.shm.cleanup import Cleanups
from omnikv.connectors.shm.config import DEFAULT_POOL_SIZE, ShmConfig
from omnikv.connectors.shm.diag import SenderWatch, held_size
from omnikv.connectors.shm.mesh import COUNTER_NAMES as MESH_COUNTERS
from omnikv.connectors.shm.mesh import Link, Mesh, random_instance
from omnikv.connectors.shm.pool import PeerPool, SenderPool
from omnikv.connectors.shm.protocol import Dispatcher
from omnikv.connectors.shm.recv import COUNTER_NAMES as RECV_COUNTERS
from omnikv.connectors.shm.recv import Offer, RecvSide
from omnikv.connectors.shm.registry import SenderRecord
from omnikv.connectors.shm.shared import Share, check_readers
from omnikv.connectors.shm.store import COUNTER_NAMES as SEND_COUNTERS
from omnikv.connectors.shm.store import Entry, Lifetime, SendStore
from omnikv.connectors.shm.wakeup import Wakeups
from omnikv.connectors.shm.wire import namespace_prefix, transport_key
from omnikv.connectors.verdict_book import VerdictBook
from omnikv.errors import (
    ConnectorClosedError,
    ConnectorError,
    ConnectorUnavailableError,
    OmniKVError,
)

__all__ = ["COUNTER_NAMES", "DEFAULT_POOL_SIZE", "SharedMemoryConnector"]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

#: Everything a connector counts (``health()``): its mesh's, sending side's and receiving side's.
COUNTER_NAMES = (*MESH_COUNTERS, *SEND_COUNTERS, *RECV_COUNTERS, *ACK_COUNTERS)
#: Longest wait for the peers' answers when a receive that found nothing asks them why.
PROBE_S = 0.05


@contextlib.contextmanager
def _boundary(what: str) -> Iterator[None]:
    """The one translation of this backend's failures into :mod:`omnikv.errors`."""
    try:
        yield
    except OmniKVError:
        raise
    except OSError as exc:
        raise ConnectorUnavailableError(f"shared memory: {what} failed: {exc}") from exc


def _metadata_key(metadata: Any) -> str | None:
    """The transport key a reference-shaped metadata names, if any.

    Accepts ``{"shm": {"name": ...}}`` and ``{key: {"shm": {...}}}``; anything else (None, not a
    dict, empty, RDMA-style host/port, keyed by request id) means "use the key".
    """
    if not isinstance(metadata, dict) or not metadata:
        return None
    handle = metadata.get("shm")
    if handle is None and len(metadata) == 1:
        inner = next(iter(metadata.values()))
        handle = inner.get("shm") if isinstance(inner, dict) else None
    name = handle.get("name") if isinstance(handle, dict) else None
    return name if isinstance(name, str) and "@" in name else None


#: Set once a connector has said at WARNING that it holds the process's exit (said once per
#: process: the next ones log at INFO).
_EXIT_NOTICE = threading.Event()


def _wakeup_config(config: Mapping[str, Any] | None, namespace: str) -> tuple[str, Any]:
    """``(scope, stage_id)`` of the wakeups: ``extra.wakeup_scope`` (else the namespace) and
    ``stage_id`` as the reference reads them (a stage that is not a number has none)."""
    cfg = config or {}
    extra = cfg.get("extra")
    scope = extra.get("wakeup_scope") if isinstance(extra, Mapping) else None
    return (namespace if scope is None else f"scope:{scope}"), cfg.get("stage_id")


def _close_ref(ref: weakref.ref[SharedMemoryConnector]) -> None:
    """Process exit (``atexit`` / multiprocessing exit): close, lingering for consumers."""
    conn = ref()
    if conn is not None:
        conn.close_at_exit()


class SharedMemoryConnector(OmniConnectorBase):
    """Node-local connector over a memfd pool and abstract Unix sockets (see module docstring).

    Thread-safe: any number of threads may put / get / wait at once; one I/O thread per
    connector serves the sockets, or one waiting thread while it waits (``leadership``).
    """

    acknowledges = True
    #: An abortable receive waits once, its want open throughout (``RecvSide.take``).
    takes_abort = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self._closed = True  # until fully built, so __del__ of a half-built object is a no-op
        self._exiting = False  # closing because the process exits (close_at_exit)
        self.config = ShmConfig.parse(config)
        self.namespace = self.config.namespace
        self.threshold = self.config.threshold
        self.put_timeout_s = self.config.put_timeout_s
        self.instance = random_instance()
        self._counters = Counters(COUNTER_NAMES)
        self._mesh = Mesh(
            namespace_prefix(self.namespace),
            self.instance,
            self,
            self._counters,
            poll_s=self.config.poll_us / 1e6,
        )
        self._verdicts = SentVerdicts(VerdictBook(self.config.ack_timeout_s, self._counters))
        self._taken = TakenPayloads(self._mesh, self._counters)
        self._store = SendStore(
            self.config.pool_size,
            self.config.prefault.ahead,
            self._mesh.send,
            self._mesh.drop,
            counters=self._counters,
            reserve=self.config.reserve_bytes,
            lifetime=Lifetime(self.config.buffer_ttl_s, self.config.unclaimed_grace_s),
            verdicts=self._verdicts,
        )
        self._recv = RecvSide(self._mesh, self._counters)
        self._cleanups = Cleanups(self._mesh, self._store)
        self._dispatcher = Dispatcher(
            self._mesh, self._store, self._recv, self._cleanups, self._verdicts
        )
        self._watch = SenderWatch(self._mesh.prefix, self.namespace, self.instance)
        self._sends = threading.Lock()  # held while this connector starts to send
        self._record: SenderRecord | None = None  # the namespace's record of us, once we send
        self._sending = False
        self._wakeups = Wakeups(*_wakeup_config(config, self.namespace))
        try:
            self._mesh.join(self.config.join_timeout_s)
        except (OSError, TimeoutError) as exc:
            self._mesh.close()
            raise ConnectorUnavailableError(
                f"cannot join shared-memory namespace {self.namespace!r}: {exc}"
            ) from exc
        self._closed = False
        if self.config.role == "sender":
            self._start_sending()
        if self.config.reserve_at_start:
            # a sending stage populates its reserve while it starts (model load, ...), so its
            # first request does not pay for fresh pages
            try:
                with _boundary("pool creation"):
                    self._store.ensure_pool(self._on_pool_created)
            except ConnectorError:
                self.close(linger=False)
                raise
        multiprocessing.util.Finalize(self, _close_ref, (weakref.ref(self),), exitpriority=50)
        logger.debug(
            "SharedMemoryConnector %s joined namespace %r with %d peer(s)",
            self.instance,
            self.namespace,
            len(self._mesh.links(local=False)),
        )

    @property
    def mesh(self) -> Mesh:
        """This connector's peer mesh: its links and, as ``mesh.leadership``, who serves them.
        For diagnostics and tests; not part of the connector contract."""
        return self._mesh

    # -- mesh handler -------------------------------------------------------------------------
    def on_link_up(self, link: Link) -> list[list[Any]]:
        """Mesh callback for a peer that connected: our open blocking wants, and our ``hello``
        as a sender if we send."""
        return [*self._recv.blocking_wants(link), *([self._hello()] if self._sending else [])]

    def on_link_gone(self, link: Link) -> None:
        self._store.on_link_gone(link)
        self._verdicts.link_gone(link)
        self._recv.on_link_gone(link)
        self._taken.link_gone(link)
        self._cleanups.on_link_gone(link)
        self._watch.lost(link)

    def on_message(self, link: Link, msg: list[Any]) -> None:
        """Validate and dispatch one control message (``protocol``; ``ValueError`` drops
        the peer)."""
        self._dispatcher.on_message(link, msg)

    def _hello(self) -> list[Any]:
        return ["hello", self.instance, os.getpid(), "sender"]

    def _start_sending(self) -> None:
        """This connector sends from now on (its role says so, or its first put): tell every
        peer (a receive can then tell a sender that went away) and keep a record in the
        namespace (``registry``: receivers started later learn of us, also if we die).
        Once; a record that cannot be made is logged at DEBUG (diagnostics only)."""
        with self._sends:
            if self._sending:
                return
            self._sending = True
            try:
                self._record = SenderRecord(self._mesh.prefix, self.instance)
            except OSError as exc:
                logger.debug("no sender record in namespace %r: %s", self.namespace, exc)
        for link in self._mesh.links(local=False):
            self._mesh.send(link, [self._hello()])

    # -- sending ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError("SharedMemoryConnector is closed")

    def _on_pool_created(self, pool: SenderPool) -> None:
        # our own reads go through a second mapping, so a migrated span never hides the pool
        # from the sender's writes
        assert pool.fd is not None
        self._mesh.local.pool = PeerPool(self._store.pool_id, os.dup(pool.fd), pool.size)
        self._mesh.leadership.note_sending()

    def _put(
        self,
        key: str,
        label: str,
        nbytes: int,
        write: Writer,
        kind: str,
        deadline: float,
        *,
        share: Share | None = None,
    ) -> tuple[PutResult, bool]:
        """Write and publish one payload (``share``: for several readers, see
        :meth:`put_shared`): the put's result, and whether it was offered to a reader waiting
        for it (then nothing is left for a wakeup to find)."""
        self._check_open()
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if math.isinf(deadline):
            deadline = time.monotonic() + self.config.put_timeout_s
        with _boundary("put"):
            alloc = self._store.ensure_pool(self._on_pool_created)
            try:
                offset = self._store.allocate(key, nbytes, deadline)
            except ConnectorError:
                self._store.count_failure()
                raise
            if share is None and self.config.shared_readers > 1:
                share = Share(self.config.shared_readers)
            entry = Entry(key, label, offset, nbytes, kind, share=share)
            self._store.write_slot(entry, write)
            if not self._store.wanted(key):  # its reader's want may be unread yet
                self._pump()
            offered = self._store.publish(entry)
        if self._record is not None:
            self._record.touch()
        elif not self._sending:
            self._start_sending()
        logger.debug(
            "SharedMemoryConnector put %s (%d bytes at %d of %d)", key, nbytes, offset, alloc.total
        )
        meta = {"key": key, "size": nbytes, "shm": {"name": key, "size": nbytes}}
        return (True, nbytes, meta), offered

    def _pump(self) -> None:
        """Before a publish: a want that reached us while we wrote is answered by this put, not
        by the I/O thread once it gets the interpreter lock (see ``mesh``). An optimisation
        only: whatever goes wrong in it is logged and never fails the put."""
        try:
            self._mesh.pump()
        except Exception:
            logger.exception("reading peers' messages before a put failed")

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Reference-shaped put: ``data`` is copied into the pool once; ``(False, 0, None)`` on
        failure (the reason is logged). Waits for space at most ``put_timeout_s``. With
        ``inline_small_payloads``, data whose serialized form is at most ``shm_threshold_bytes``
        is not stored: it travels in the metadata returned (``{"inline_bytes", "size"}``), and
        ``get`` / ``wait`` given that metadata decode it from there.

        Bytes-like data comes back from ``get`` as ``bytes``; a 1-D ``uint8`` tensor / array as
        a :class:`ManagedBuffer`; anything else is framed by the one object encoder
        (:func:`omnikv.wire.serializer.encode_object`: tensors, arrays, dataclasses too) and comes
        back decoded (from ``wait``: as that encoding, like every connector's). The
        metadata returned (``{"key", "size", "shm": {"name", "size"}}``) is accepted by ``get``.
        """
        try:
            self._check_open()
            key = transport_key(put_key, from_stage, to_stage)
            small = None
            if self.config.inline_small_payloads:
                small = codec.serialize_small(data, self.threshold)
                if small is not None and len(small) <= self.threshold:
                    return True, len(small), {"inline_bytes": small, "size": len(small)}
            kind, nbytes, write = codec.prepare(data, small)
            deadline = time.monotonic() + self.put_timeout_s
            result, offered = self._put(key, put_key, nbytes, write, kind, deadline)
            if not offered:  # a reader that took it at once leaves nothing to look for
                self._wakeups.notify(to_stage)
            return result
        except (OmniKVError, ValueError, TypeError, OverflowError) as exc:
            logger.warning("SharedMemoryConnector put of %r failed: %s", put_key, exc)
            return False, 0, None

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float = math.inf,
    ) -> PutResult:
        """The sender's hot path: ``write`` fills a pool slot of ``nbytes`` in place (one copy).

        Waits for space until ``deadline`` (``math.inf``: ``put_timeout_s``), then raises
        :class:`PoolExhaustedError`; a payload larger than the pool raises it at once, and so
        does a pool full of payloads that no reader came for (module docstring). Raises
        ``ConnectorClosedError`` after close and ``ValueError`` for an unusable key. If ``write``
        raises, the slot is freed, nothing is published and the exception propagates.
        """
        key = transport_key(put_key, from_stage, to_stage)
        result, offered = self._put(key, put_key, int(nbytes), write, codec.KIND_RAW, deadline)
        if not offered:  # a reader that took it at once leaves nothing to look for
            self._wakeups.notify(to_stage)
        return result

    def put_shared(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        readers: int,
        deadline: float = math.inf,
    ) -> PutResult:
        """:meth:`put_packed` of one payload that ``readers`` receivers of this node each
        need whole (CFG branches, sequence-parallel ranks): written into the pool once, and
        each of the first ``readers`` takes of ``put_key`` (``get`` / ``wait`` / the managers'
        receive, unchanged) maps the same slot zero-copy (``shared``).

        Called by a sender whose receiving stage has several ranks that read one payload.
        The slot goes back to the pool once every reader that took it released it (or went
        away) and the claims left are gone: all taken, or the TTL (``buffer_ttl_seconds``),
        grace, ``cleanup`` or close dropped the payload unclaimed, so readers that never come
        hold nothing past the TTL. ``readers`` is 1 to
        :data:`~omnikv.connectors.shm.shared.MAX_SHARED_READERS` (``ValueError`` otherwise);
        a take beyond them misses. Counted once in ``puts`` / ``put_bytes``, and as
        ``shared_puts``; each reader's offer as ``shared_claims``. Its delivery verdict is
        reported once: ``expired`` when claims were left at its TTL, else the verdict of the
        reader that took its last claim (``shared``). Raises as :meth:`put_packed` does.
        """
        share = Share(check_readers(readers))
        key = transport_key(put_key, from_stage, to_stage)
        result, offered = self._put(
            key, put_key, int(nbytes), write, codec.KIND_RAW, deadline, share=share
        )
        if not offered:  # claims are left: a reader that looks finds it
            self._wakeups.notify(to_stage)
        return result

    # -- arrival wakeups (the reference's 0.32 API; see ``wakeup``) ----------------------------
    def get_wakeup_generation(self) -> int | None:
        """A snapshot to pass to :meth:`wait_for_change`, taken before a look for data; a later
        put to this connector's ``stage_id`` changes it. ``None`` when this connector has no
        wakeups (no ``stage_id``, ``VLLM_OMNI_SHM_WAKEUP`` off, closed): keep a timed poll."""
        return self._wakeups.generation()

    def wait_for_change(self, generation: int, *, timeout: float) -> bool:
        """Block until a put to this stage since ``generation`` (from
        :meth:`get_wakeup_generation`), at most ``timeout`` seconds; whether there was one.
        ``False`` at once when this connector has no wakeups. A hint: look for the data
        after it, whatever it returns."""
        return self._wakeups.wait_for_change(generation, timeout)

    # -- receiving ----------------------------------------------------------------------------
    def _take(
        self, key: str, block: bool, deadline: float, abort: threading.Event | None = None
    ) -> Offer | None:
        self._check_open()
        with _boundary("receive"):
            offer = self._recv.take(key, block, deadline, abort)
        if offer is not None:
            self._taken.took(key, offer.link, offer.token, offer.acks)
        return offer

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the payload if this connector or a peer holds it (consume-once); else ``None``.

        ``metadata`` from ``put`` names the payload; any other metadata falls back to the key.
        Waits for peers' answers at most ``get_timeout_s``. Returns ``(obj, size)`` (see
        :meth:`put` for ``obj``). Raises ``ConnectorClosedError`` after close; other failures
        are logged and give ``None``.
        """
        self._check_open()
        try:
            inline = codec.inline_payload(metadata)
            if inline is not None:
                return codec.decode_inline(inline), len(inline)
            key = _metadata_key(metadata) or transport_key(get_key, from_stage, to_stage)
            offer = self._take(key, False, time.monotonic() + self.config.get_timeout_s)
            if offer is None:
                return None
            buf = self._recv.materialize(offer)
            if offer.kind == codec.KIND_RAW:
                return buf, offer.nbytes
            with buf:
                raw = buf.to_bytes()
            return codec.decode(offer.kind, raw), offer.nbytes
        except ConnectorClosedError:
            raise
        except (OmniKVError, ValueError) as exc:
            _outsider.warning("SharedMemoryConnector get of %r failed: %s", get_key, exc)
            return None

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
        abort: threading.Event | None = None,
    ) -> ManagedBuffer | None:
        """Wait for a peer's (or this connector's) offer of ``get_key``, woken by its offer
        message (no polling): a zero-copy view of the payload's bytes, or ``None`` also once
        closed meanwhile, or once ``abort`` is set (``takes_abort``: looked at every
        :data:`~omnikv.connectors.base.ABORT_POLL_S`; one wait, the want open throughout).
        Raises :class:`PeerGoneError` when a sender connected during the wait went away and
        nothing arrived."""
        inline = codec.inline_payload(metadata)
        if inline is not None:
            self._check_open()
            return ManagedBuffer.host(codec.inline_frame(inline))
        key = _metadata_key(metadata) or transport_key(get_key, from_stage, to_stage)
        offer = self._take(key, True, deadline, abort)
        return None if offer is None else self._recv.materialize(offer)

    def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> GetResult | None:
        """The base's (built on :meth:`wait`), except that a payload that travelled inline is
        decoded from ``metadata`` at once, with its put's size, as :meth:`get` does."""
        if codec.inline_payload(metadata) is not None:
            return self.get(from_stage, to_stage, get_key, metadata)
        return super().get_with_deadline(from_stage, to_stage, get_key, metadata, deadline=deadline)

    def explain_miss(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        metadata: dict[str, Any] | None = None,
    ) -> MissReport | None:
        """Why a wait for ``get_key`` found nothing (see ``diag``): which senders of the
        namespace live, which went away (closed, or died: also before this connector started)
        and which keys wait unconsumed at them; ``peer_gone`` when none lives and one went.
        Asks the peers, waiting for their answers at most :data:`PROBE_S` (``get_timeout_s``
        if shorter). ``None`` once closed or for an unusable key; never raises."""
        if self._closed:
            return None
        try:
            key = _metadata_key(metadata) or transport_key(get_key, from_stage, to_stage)
        except ValueError:
            return None
        wait_s = min(PROBE_S, self.config.get_timeout_s)
        probed = self._recv.probe(key, time.monotonic() + wait_s)
        return self._watch.explain(
            key, self._mesh.links(local=False), probed.answers, waited_s=wait_s
        )

    def probe(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> KeyProbe:
        """``ready`` with its size when this connector or a peer of the namespace holds the
        payload unclaimed (it is in shared memory of this node: a take maps it), ``missing``
        when every peer answered without it or went away (a dead sender offers nothing),
        ``unknown`` when one still connected did not answer by ``deadline`` or once closed.
        One ``want`` with
        ``probe`` per peer (the message :meth:`explain_miss` sends): nothing is offered or
        claimed. A payload that travelled inline in ``metadata`` is ``ready``. Never raises."""
        if self._closed:
            return KeyProbe(KeyState.UNKNOWN, detail="SharedMemoryConnector is closed")
        try:
            inline = codec.inline_payload(metadata)
            if inline is not None:
                return KeyProbe(KeyState.READY, len(inline))
            key = _metadata_key(metadata) or transport_key(get_key, from_stage, to_stage)
            probed = self._recv.probe(key, deadline)
        except Exception as exc:  # never raises: the scheduler asks again or receives
            return KeyProbe(KeyState.UNKNOWN, detail=f"{type(exc).__name__}: {exc}")
        size = held_size(probed.answers)
        if size is not None:
            return KeyProbe(KeyState.READY, size)
        silent = probed.asked - len(probed.answers) - len(probed.gone)
        if silent > 0:
            detail = f"{silent} of {probed.asked} peer(s) did not answer"
            return KeyProbe(KeyState.UNKNOWN, detail=detail)
        return KeyProbe(KeyState.MISSING)

    def cleanup(self, request_id: str) -> bool:
        """Drop unconsumed payloads of ``request_id`` here and at every peer of the namespace;
        True when any went (the reference's 0.32 returns whether it removed something).

        Matches keys by :func:`~omnikv.connectors.base.matches_request` (the reference's rule:
        the key equals the id, starts with ``id_`` or ends with ``_id``), on every stage edge.
        Waits for the peers' answers at most ``get_timeout_s`` (a peer that answers later
        still drops its payloads, uncounted). Payloads already held by readers are theirs to
        release. After close: False.
        """
        if self._closed:
            return False
        return self._cleanups.run(request_id, "request", self.config.get_timeout_s) > 0

    def cleanup_prefix(self, prefix: str) -> int:
        """Drop every unconsumed payload whose key (as given to ``put``) starts with ``prefix``,
        on every stage edge, here and at every peer of the namespace (the reference's 0.32, for
        the keys of one request's chunks); how many went, counted as :meth:`cleanup` counts.
        An empty ``prefix`` is a ``ValueError`` (it would drop every stage's payloads). After
        close: 0.
        """
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"cleanup_prefix needs a non-empty string, got {prefix!r:.60}")
        if self._closed:
            return 0
        return self._cleanups.run(prefix, "prefix", self.config.get_timeout_s)

    def withdraw(self, from_stage: str, to_stage: str, put_key: str) -> bool:
        """Drop the payload put here under ``put_key`` while no reader has it (published, not
        offered; :meth:`~omnikv.connectors.base.OmniConnectorBase.withdraw`); no verdict is
        reported for it. Only this connector's pool is touched, never a peer's."""
        if self._closed:
            return False
        try:
            key = transport_key(put_key, from_stage, to_stage)
        except ValueError:
            return False
        return bool(self._store.drop_matching(lambda k: k == key))

    # -- delivery verdicts ---------------------------------------------------------------------
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
        """Send ``verdict`` on the payload taken under ``get_key`` to the peer that offered it,
        over the mesh link it came on (``acks``): at most one small control message's send.
        Nothing is sent for a payload that travelled inline, not taken here, or acknowledged
        already; a verdict its sender's link cannot carry is counted ``ack_failures``."""
        try:
            if self._closed or codec.inline_payload(metadata) is not None:
                return
            key = _metadata_key(metadata) or transport_key(get_key, from_stage, to_stage)
        except Exception as exc:
            logger.debug("no verdict sent for %r: %s", get_key, exc)
            return
        self._taken.acknowledge(key, verdict, reason)

    def set_delivery_listener(self, listener: DeliveryListener | None) -> None:
        """Report each payload put here from now on to ``listener`` once: ``delivered`` /
        ``refused`` from its reader's verdict, ``expired`` on its TTL, when its reader went away
        before a verdict, or after ``ack_timeout_s`` without one (see the module docstring)."""
        self._verdicts.notices.set_listener(listener)

    # -- lifetime -----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> list[str]:
        """Wait until every payload put here was taken by a reader, or ``timeout`` seconds
        (``None``: no limit); returns the keys still unconsumed."""
        deadline = math.inf if timeout is None else time.monotonic() + max(0.0, timeout)
        return self._store.flush(deadline)

    def health(self) -> dict[str, Any]:
        """Status, pool occupancy, the pool's population (``pool_populated_bytes``,
        ``pool_reserve_bytes``, ``pool_reserve_ready``, ``pool_reserve_s``, ``pool_prefault``:
        a stage may poll ``pool_reserve_ready`` before its first request), what is unconsumed
        (``published``, ``published_bytes``, ``oldest_published_s``, ``youngest_published_s``;
        ``buffer_ttl_seconds``)
        and counters (among them ``ttl_reaped`` / ``ttl_reaped_bytes``: payloads freed unconsumed
        by their TTL, ``put_pool_full``: puts refused at once; the verdicts' ``acks_delivered``,
        ``acks_refused``, ``acks_expired``, ``acks_ignored``, ``acks_sent``, ``ack_failures``,
        and ``awaiting_verdicts``: payloads taken here and not yet acknowledged); cheap and never
        raising. Expires the verdicts overdue by ``ack_timeout_s`` first."""
        if not self._closed:
            self._verdicts.sweep()
        return {
            "status": "closed" if self._closed else "healthy",
            "type": "SharedMemoryConnector",
            "namespace": self.namespace,
            "instance": self.instance,
            "threshold": self.threshold,
            "buffer_ttl_seconds": self.config.buffer_ttl_s,
            "unclaimed_grace_seconds": self.config.unclaimed_grace_s,
            "ack_timeout_s": self.config.ack_timeout_s,
            "awaiting_verdicts": self._verdicts.awaiting(),
            "pool_reserve_source": self.config.reserve_source,
            "peers": len(self._mesh.links(local=False)),
            **self._store.snapshot(),
            **self._recv.snapshot(),
            **self._counters.snapshot(),
        }

    def close(self, *, linger: bool = True) -> None:
        """Idempotent. Waits up to ``linger_s`` for unconsumed payloads (``linger=False``: not at
        all), logs a WARNING naming those dropped, wakes waiters (they return ``None``) and puts
        waiting for space (``ConnectorClosedError``). Views held by readers stay valid."""
        if self._closed:
            return
        if linger and self.config.linger_s > 0:
            self._linger(self.config.linger_s)
        self._closed = True
        self._wakeups.close()
        self._recv.close()
        dropped = self._store.close()
        self._mesh.close()
        if self._record is not None:
            self._record.close()
        if dropped:
            logger.warning(
                "SharedMemoryConnector %s dropped %d unconsumed payload(s): %s",
                self.instance,
                len(dropped),
                ", ".join(dropped[:20]) + (" ..." if len(dropped) > 20 else ""),
            )
        logger.debug("SharedMemoryConnector %s closed", self.instance)

    def close_at_exit(self) -> None:
        """:meth:`close` at process exit (called by the exit hook): the same, but a wait for
        receivers says so at WARNING, once per process."""
        self._exiting = True
        self.close()

    def _linger(self, linger_s: float) -> None:
        """Close (or process exit) with payloads unconsumed: one line saying how many, for how
        long at most and how to skip the wait, then wait for readers to take them (see
        :meth:`flush`). At process exit the first such line of the process is a WARNING (the
        default log level shows it on stderr: the exit would otherwise hang in silence)."""
        status = self._store.snapshot()
        if not status["published"]:
            return
        loud = self._exiting and not _EXIT_NOTICE.is_set()
        if loud:
            _EXIT_NOTICE.set()
        logger.log(
            logging.WARNING if loud else logging.INFO,
            "SharedMemoryConnector %s: %s waits up to %gs (linger_s) for receivers to take %d"
            " unconsumed payload(s) of %d bytes; to skip the wait set linger_s to 0 in its"
            " connector_config, or close(linger=False) it first",
            self.instance,
            "the process exit" if self._exiting else "close",
            linger_s,
            status["published"],
            status["published_bytes"],
        )
        self.flush(linger_s)

    def __del__(self) -> None:
        # garbage collection never lingers (a process exit or close() does)
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True):
                self.close(linger=False)
