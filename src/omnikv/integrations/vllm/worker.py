"""The worker half of :class:`OmniKVConnector`: sends on a bounded pool, loads on admissions.

vLLM's model runner calls its hooks (vLLM's names) once per step, on its own thread:
:meth:`WorkerSide.bind_connector_metadata` (the step's sends start here),
:meth:`WorkerSide.start_load_kv`, :meth:`WorkerSide.wait_for_save` (nothing to do, or with
``stream_kv`` ship the blocks the step's prefill completed) and
:meth:`WorkerSide.get_transfer_results`. With speculative decoding vLLM 0.32 calls
``get_transfer_results`` before ``wait_for_save``; since sends start at bind, a finished
request is reported whichever comes first.

A send is of a request that finished in an earlier step: its blocks are complete and held by
vLLM until :meth:`WorkerSide.get_transfer_results` reports the send, and the forward pass does
not write them, so the send starts at bind, beside the step's forward pass. (Started after it, at
``wait_for_save``, a send waited a whole step; on a busy producer whose prefill steps take
seconds, consumers' loads timed out before the KV was even sent.)

Guarantees:

* **Nothing blocks the engine.** Sends run on a pool of ``max_concurrent_sends`` threads, loads
  on the receive threads of :class:`~omnikv.transfer.admission.KVAdmission` (the one state
  machine of a background receive: it queues, runs each load under its deadline and ends the
  ones whose deadline passed in the queue), so one slow or stuck transfer never serialises the
  others. Each load's deadline counts from its admission; a load still queued at its deadline
  fails at once, without waiting. The one wait on the runner's thread is in a step that computes
  nothing while sends or loads run (``idle_step_wait_s``, 2 ms by default, ended by the first
  transfer to end): it paces vLLM's busy loop so that the transfer threads get the GIL, and a
  transfer that ends within it is reported by that step. A load whose payload has arrived by
  the end of that wait is waited for once more, at most as long again (twice
  ``idle_step_wait_s`` in all).
* **Loads that wait do not hold up loads that are ready.** A load waits at most
  ``load_first_wait_s`` on the first admission (``max_concurrent_loads`` threads); if its KV has
  not arrived by then (a never-issued id, a slow producer), it is offered to a second one
  (``max_waiting_loads`` threads) for the rest of its deadline, and the first one's thread takes
  the next load. Ids that never arrive can fill the waiting admission, never the first. A load
  under a router's id (early hand-off: its KV is still being computed) waits there from the
  start, in one receive, so a streamed prefill's blocks taken early are never refused by a first
  wait that ended.
* **Check before write.** A load looks up only the key its own binding gives (see
  :mod:`.binding`); what it receives is checked (binding, MAC with ``auth_secret``, layer count,
  tokens, heads, head size, dtype, optionally finiteness) before a byte of it is written into
  vLLM's blocks. A whole payload is checked whole; a refused one leaves the blocks untouched.
  A streamed one is checked and written chunk by chunk (or layer group by layer group) as the
  chunks arrive (each is sealed with its own MAC by the producer's stream step), so the
  finish leaves only the tail to check and write; a chunk refused ends the load at once. A
  failed load makes vLLM recompute the prefill, over whatever earlier chunks wrote.
* **Transfer threads are not pinned to the engine's compute core.** vLLM's CPU backend binds
  the worker's thread to its compute cores, and threads inherit that binding; omnikv's send,
  load and transport threads would then queue behind the engine's spinning loop (on a small
  host two engines' workers share one core, and a load answered within milliseconds timed out).
  They run on every CPU the process may use (:func:`transfer_cpus`).
* **Every layout is read as the kernel writes it.** vLLM's CPU attention with AMX tiles
  (``bfloat16`` on CPUs with AMX) stores blocks in tile order; the worker reads and writes them
  through :class:`omnikv.layouts.blocks.AmxPackedLayerBlocks`, and asks Linux for the AMX tile
  state at registration (:func:`_request_amx_tiles`).
* **Every transfer ends.** Each send and load reports exactly once (``finished_sending`` /
  ``finished_recving``, plus ``failed_recving``), whatever it raised, so vLLM always frees the
  blocks it holds for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from omnikv.config import config_from_dict, options_from_dict
from omnikv.connectors.factory import LazyConnector
from omnikv.errors import OmniKVError
from omnikv.integrations.vllm._vllm import KVConnectorTransferResults
from omnikv.integrations.vllm.binding import check_sealed_ranges, kv_mac, kv_mac_refusal
from omnikv.integrations.vllm.metadata import (
    LoadSpec,
    OmniKVConnectorMetadata,
    SendSpec,
    StreamSpec,
)
from omnikv.integrations.vllm.options import ConnectorOptions, default_layer_groups
from omnikv.integrations.vllm.stats import OmniKVConnectorStats, TransferCounters
from omnikv.layouts.blocks import LayerBlocks, vllm_layer_blocks
from omnikv.ranks.discovery import discover_tp
from omnikv.topology.placement import StagePlacement
from omnikv.transfer.admission import KVAdmission, receive_by_id
from omnikv.transfer.edge import KVCaches, TransferEdge
from omnikv.transfer.received import ReceivedChunk, ReceivedKV
from omnikv.transfer.results import ReceiveResult, ReceiveStatus, SendResult, StreamProgress
from omnikv.transfer.stream.sending import Seal
from omnikv.wire.codec import round_trip
from omnikv.wire.mac import PayloadSeal

__all__ = [
    "META_BINDING",
    "META_MAC",
    "META_SEALED",
    "META_SENT_AT",
    "WorkerSide",
    "handoff_seconds",
    "transfer_cpus",
]

logger = logging.getLogger(__name__)

#: Payload metadata keys written by the producer and checked by the consumer.
META_BINDING = "omnikv_binding"
META_MAC = "omnikv_mac"
#: A streamed request's finish: ``[start, stop, mac]`` of each chunk and of the tail.
META_SEALED = "omnikv_sealed"
#: The producer's wall clock (``time.time()``) as it began sending a finished request's KV:
#: where the hand-off that the consumer's ``handoff_seconds`` measures starts.
META_SENT_AT = "omnikv_sent_at"
#: A hand-off is measured only within this many seconds either way of the consumer's clock (a
#: value beyond is a wrong clock or a forged stamp, not a hand-off).
HANDOFF_BOUND_S = 3600.0

_T = TypeVar("_T")
#: Failure warnings are logged at most once per this many seconds (each failure: DEBUG).
WARN_EVERY_S = 10.0


def _pairs(
    keys: Sequence[torch.Tensor | None], values: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V), for a MAC (the checks refused absent layers before)."""
    return [(k, v) for k, v in zip(keys, values, strict=True) if k is not None and v is not None]


def handoff_seconds(sent_at: object, now: float) -> float | None:
    """A loaded request's hand-off: from the producer's :data:`META_SENT_AT` (its wall clock as
    it began sending the finished request's KV) to ``now`` (the consumer's wall clock, its KV
    written). ``None`` for a stamp that is not a finite number within :data:`HANDOFF_BOUND_S`
    of ``now`` (absent: a producer without it; else a wrong clock or a forgery); a stamp ahead
    of ``now`` (two hosts' clocks apart) counts as 0. Called by the consumer's load path once
    the payload passed its checks and was written."""
    if isinstance(sent_at, bool) or not isinstance(sent_at, int | float):
        return None
    seconds = now - float(sent_at)
    if not abs(seconds) <= HANDOFF_BOUND_S:  # NaN fails too
        return None
    return max(0.0, seconds)


def _parse_cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def transfer_cpus() -> set[int] | None:
    """The CPUs omnikv's transfer threads run on in a vLLM worker: every CPU the process's
    cgroup allows (all CPUs without a cpuset), or ``None`` where affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = set(range(os.cpu_count() or 1))
    try:
        with open("/sys/fs/cgroup/cpuset.cpus.effective") as f:
            cpus &= _parse_cpu_list(f.read()) or cpus
    except (OSError, ValueError):
        pass
    return cpus


def _use_cpus(cpus: set[int] | None) -> None:
    """Thread initializer: run the calling thread on ``cpus`` (never raises)."""
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


def _on_cpus(cpus: set[int] | None, build: Callable[[], _T]) -> _T:
    """``build()`` on a short-lived thread that runs on ``cpus``, so that the threads it
    starts inherit them; its result, or its exception re-raised here."""
    box: list[_T] = []
    error: list[BaseException] = []

    def run() -> None:
        _use_cpus(cpus)
        try:
            box.append(build())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="omnikv-vllm-init")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return box[0]


def _request_amx_tiles() -> None:
    """Ask Linux for the AMX tile state for this process (once, at registration).

    vLLM's AMX attention kernel uses tile instructions without asking for them; oneDNN asks on
    its first large ``bfloat16`` matrix product. An engine whose first step is small (a
    consumer's first step after a load computes one token per request) reached the kernel first
    and died with SIGILL. Asking twice is harmless; where the kernel refuses, vLLM's own kernel
    would fail the same way, so that is only logged.
    """
    init = getattr(torch.cpu, "_init_amx", None)
    if init is None or not bool(init()):
        logger.warning("OmniKVConnector: could not enable AMX tiles for this process")


def _pool(size: int, role: str, cpus: set[int] | None) -> ThreadPoolExecutor:
    """One of the worker's thread pools (sends, loads, waits), its threads on ``cpus``."""
    return ThreadPoolExecutor(
        size, thread_name_prefix=f"omnikv-vllm-{role}", initializer=_use_cpus, initargs=(cpus,)
    )


class _RateLimitedWarning:
    """One WARNING per :data:`WARN_EVERY_S` with the count of failures since the last one, so
    that a client sending nonsense cannot flood the server's log (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = -WARN_EVERY_S
        self._count = 0

    def warn(self, template: str, detail: str | None) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < WARN_EVERY_S:
                return
            count, self._count, self._last = self._count, 0, now
        logger.warning(template, count, WARN_EVERY_S, detail)


class WorkerSide:
    """Per-worker transfer state. Its public methods are the worker-side hooks of vLLM's
    ``KVConnectorBase_V1``, under their names, called by
    :class:`~omnikv.integrations.vllm.OmniKVConnector` on a worker's instance from vLLM's
    runner thread."""

    def __init__(self, options: ConnectorOptions, block_size: int) -> None:
        cfg = options.omni_kv_config
        self.options = options
        cpus = transfer_cpus()
        # Built on a thread with every CPU, so that the transport's own threads and the
        # loads' receive threads inherit that.
        #: the transfer edge every send, stream step and receive goes through
        self.edge: TransferEdge
        self.edge, self._connector = _on_cpus(cpus, lambda: self._open_edge(cfg))
        #: the loads' receives (a consumer only): a first wait of at most ``load_first_wait_s``
        #: on ``max_concurrent_loads`` threads, the rest of a deadline on ``max_waiting_loads``
        self._first: KVAdmission | None = None
        self._waiting: KVAdmission | None = None
        if self.edge.config.need_recv_cache:
            self._first, self._waiting = _on_cpus(cpus, self._admissions)
        #: payload key -> (its load, the load's deadline), while the load is offered
        self._offered: dict[str, tuple[LoadSpec, float]] = {}
        self.block_size = block_size
        self.counters = TransferCounters()
        self.layers: dict[str, LayerBlocks] = {}
        #: The layout :attr:`layers` are read in (None until registered with a known layout).
        self.layout: str | None = None
        self.layout_error: str | None = "register_kv_caches was not called"
        self._send_pool = _pool(options.max_concurrent_sends, "send", cpus)
        self._warned = _RateLimitedWarning()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        #: notified when a send or load ends (an idle step's wait stops at it)
        self._transfer_ended = threading.Condition(self._lock)
        #: the bound step computes nothing (runner thread only)
        self._idle_step = False
        self._running = 0
        #: loads whose payload was taken (or is arriving) and not ended yet: their check and
        #: write run on bytes that are here (req ids)
        self._landing: set[str] = set()
        self._pending_loads: list[LoadSpec] = []
        self._sending: set[str] = set()
        self._released: set[str] = set()
        self._sent: set[str] = set()
        self._loaded: set[str] = set()
        self._failed: set[str] = set()
        self._aborts: dict[str, threading.Event] = {}
        # sends published through a connector that acknowledges, until their verdict:
        # send key -> request id (the request's blocks stay held meanwhile when
        # free_blocks_on is "verdict")
        self._verdicts_due: dict[str, str] = {}
        #: DEBUG only: request id -> transfer id of its send or load, until reported
        self._traced: dict[str, str] = {}
        #: this step's stream specs (runner thread only: bind, then wait_for_save)
        self._streams_due: list[StreamSpec] = []
        #: with stream_layer_groups > 1: each layer's position, the groups of positions, and
        #: this step's layers written and groups shipped (runner thread only)
        self._layer_pos: dict[str, int] = {}
        self._groups: list[tuple[int, int]] = []
        self._saved: set[int] = set()
        self._groups_shipped = 0

    def _open_edge(self, cfg: Mapping[str, Any]) -> tuple[TransferEdge, LazyConnector]:
        """This worker's transfer edge (``omni_kv_config`` ``cfg``) and the connector it
        owns; a sender's connector is made at once (its pool and listener exist before the
        first send). Verdicts are pushed to :meth:`_on_verdict`. With ``auth_secret`` the
        payloads carry the KV MAC, which the consumer checks over the same bytes, instead of
        the data check (unless ``payload_checksum`` is set)."""
        config, options = config_from_dict(dict(cfg)), options_from_dict(dict(cfg))
        conn = cfg.get("connector_config") or {}
        if self.options.secret is not None and "payload_checksum" not in {*cfg, *conn}:
            options = dataclasses.replace(options, payload_checksum=False)
        place = StagePlacement.of(config, discover_tp())
        lazy = LazyConnector.for_stage(
            config, place.topology.local_rank, retry_interval=options.connector_retry_interval
        )
        moves = bool(config.need_send_cache or config.need_recv_cache)
        edge = TransferEdge(
            config,
            options=options,
            placement=place,
            connector=lazy,
            configured=moves and bool((config.connector_config or {}).get("type")),
            on_verdict=self._on_verdict,
            on_stream_step=self._on_stream_step,
        )
        if config.need_send_cache:
            lazy.get()
        return edge, lazy

    def _admissions(self) -> tuple[KVAdmission, KVAdmission]:
        """The two admissions the loads run on (each thread of theirs runs :meth:`_load`, as a
        first wait or the rest of a deadline; the load keeps its own deadline, abort and
        checks)."""
        timeout = self.edge.config.recv_timeout
        first = KVAdmission(
            receive_by_id(lambda key: self._load(key, first=True)),
            recv_timeout=timeout,
            max_receives=self.options.max_concurrent_loads,
            name="omnikv-vllm-load",
        )
        waiting = KVAdmission(
            receive_by_id(lambda key: self._load(key, first=False)),
            recv_timeout=timeout,
            max_receives=self.options.max_waiting_loads,
            name="omnikv-vllm-wait",
        )
        return first, waiting

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], layout: str | None) -> None:
        """Per layer the blocks of the engine's caches, read in ``layout`` (the facade's
        choice from the attention backend: :func:`omnikv.layouts.blocks.vllm_layer_blocks`;
        ``None``: unknown, transfers are off)."""
        if layout is None:
            self.layout_error = "unknown attention backend layout (set vllm_kv_layout)"
            logger.error("OmniKVConnector: %s; transfers are off", self.layout_error)
            return
        try:
            self.layers = {name: vllm_layer_blocks(t, layout) for name, t in kv_caches.items()}
        except OmniKVError as exc:
            self.layout_error = f"layout {layout!r}: {exc}"
            logger.error("OmniKVConnector: %s; transfers are off", self.layout_error)
            return
        if any(layer.uses_amx_tiles for layer in self.layers.values()):
            _request_amx_tiles()
        if not self.layers:
            self.layout_error = "the engine registered no KV cache layers"
            logger.error("OmniKVConnector: %s; transfers are off", self.layout_error)
            return
        self.layout_error = None
        self.layout = layout
        self._layer_pos = {name: i for i, name in enumerate(self.layers)}
        groups = self.options.stream_layer_groups
        if groups is None:
            groups = default_layer_groups(next(iter(kv_caches.values())).device)
        self._groups = layer_groups(len(self.layers), groups)
        logger.info("OmniKVConnector: %d layers, layout %s", len(self.layers), layout)

    # -- per step ---------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: OmniKVConnectorMetadata) -> None:
        """Start the step's sends, note its loads, cancel what is gone."""
        if logger.isEnabledFor(logging.DEBUG) and len(self._traced) < 4096:
            self._traced.update((s.req_id, s.transfer_id) for s in meta.sends)
            self._traced.update((s.req_id, s.transfer_id) for s in meta.loads)
        with self._lock:
            self._sending.update(s.req_id for s in meta.sends)
            self._pending_loads.extend(meta.loads)
            for rid in meta.cancels:
                event = self._aborts.get(rid)
                if event is not None:
                    event.set()
        self._idle_step = meta.idle
        self._streams_due.extend(meta.streams)
        self._saved, self._groups_shipped = set(), 0
        for key in meta.stream_aborts:
            self.edge.abort_stream(key)
        self._submit_sends(meta.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads are asynchronous (the request joins a batch only once its
        KV is written, so a slow producer never holds up a forward pass), and a streamed load
        writes each chunk or layer group as it arrives."""

    def save_kv_layer(self, layer_name: str) -> None:
        """With ``stream_kv`` and ``stream_layer_groups`` > 1: note that the forward pass
        wrote ``layer_name``, and ship, in order, every layer group whose layers are all
        written, for each producer request this step streams (see :meth:`wait_for_save` for
        what a chunk is); otherwise nothing. Runs on the runner's thread, inside the
        forward pass; never raises."""
        if len(self._groups) <= 1 or not self._streams_due or not self._streamable():
            return
        pos = self._layer_pos.get(layer_name)
        if pos is None:
            return
        self._saved.add(pos)
        while self._groups_shipped < len(self._groups):
            first, end = self._groups[self._groups_shipped]
            if not all(i in self._saved for i in range(first, end)):
                return
            self._groups_shipped += 1
            for spec in self._streams_due:
                self._ship(spec, (first, end))

    def wait_for_save(self) -> None:
        """With ``stream_kv``: ship the blocks this step's forward pass
        completed for producer requests still in prefill (one chunk per request and step), so
        that at the request's finish only its last blocks and the metadata move. With
        ``stream_layer_groups`` > 1 the step's groups went from ``save_kv_layer`` as their
        layers were written; any not shipped yet go now. Runs on the runner's thread, which
        only hands each step to the edge's stream worker: the copy out of the engine's cache,
        the seal (with ``auth_secret``: the chunk's MAC, which the encoder hashes as it writes
        its tokens, :class:`~omnikv.wire.mac.PayloadSeal`, work the finish would otherwise do
        for the whole KV) and the put run there, in order, while the runner goes on. The
        blocks stay the request's meanwhile: a full block is never written again, the finish
        (its send) and a stream abort (``stream_aborts``, before the blocks can be reused)
        each wait for a step of the request still running and drop those queued. A packed
        layout (AMX tiles) is not streamed: such a request is sent whole at its finish. Never
        raises."""
        due, self._streams_due = self._streams_due, []
        shipped, self._groups_shipped = self._groups_shipped, 0
        self._saved = set()
        if not due or not self._streamable():
            return
        rest: list[tuple[int, int] | None] = [None]
        if shipped:  # save_kv_layer shipped the first groups; every layer is written now
            rest = list(self._groups[shipped:])
        for layers in rest:
            for spec in due:
                self._ship(spec, layers)

    def _streamable(self) -> bool:
        """Whether stream steps ship: not for a layout read from a copy of the request's
        blocks (AMX tiles), which a stream step would copy whole every step."""
        return self.layout_error is None and not any(
            layer.copies_to_send for layer in self.layers.values()
        )

    def _ship(self, spec: StreamSpec, layers: tuple[int, int] | None) -> None:
        """One stream step of ``spec``: its newly full blocks, or (``layers``) one layer group
        of them, handed to the edge's stream worker as a chunk (counted when published:
        :meth:`_on_stream_step`). Never raises (the finish still sends what was not
        shipped)."""
        t0 = time.monotonic()
        try:
            # A streamed layout's views do not depend on the blocks (_streamable): the ids are
            # read once, not once per layer, so that the runner's step stays short.
            first, *rest = self.layers.values()
            (k, v), ids = first.send_source(spec.block_ids)
            views: list[Any] = [(k, v), *(layer.send_source(())[0] for layer in rest)]
            entry = {"block_ids": list(ids), "seq_len": spec.num_tokens}
            progress = self.edge.ship(
                spec.key,
                entry,
                KVCaches(views, self.block_size, str(views[0][0].dtype)),
                seal=None if self.options.secret is None else self._sealer(spec.key),
                layers=layers,
            )
        except Exception as exc:
            logger.debug("OmniKVConnector: stream step of %s failed: %s", spec.req_id, exc)
            return
        logger.debug(
            "OmniKVConnector: stream step of %s: %d tokens, layers %s, handed over in %.2f ms%s",
            spec.req_id,
            spec.num_tokens,
            "all" if layers is None else list(layers),
            (time.monotonic() - t0) * 1e3,
            "" if progress.reason is None else f" ({progress.reason})",
        )

    def _on_stream_step(self, progress: StreamProgress, layers: tuple[int, int] | None) -> None:
        """A stream step ran on the edge's stream worker: count what it published."""
        if progress.nbytes:
            self.counters.add("chunks_streamed")
            self.counters.add("bytes_streamed", int(progress.nbytes))
            if layers is not None:
                self.counters.add("layer_groups_streamed")

    def _sealer(self, key: str) -> Seal:
        """The stream step's seal for ``key``: a chunk's MAC over its own tokens, computed by
        the encoder from the one coding it makes (what the consumer decodes). The stream keeps
        it beside the chunk's range for the finish (:meth:`_seal_finish`)."""
        secret = self.options.secret
        assert secret is not None

        def seal(
            start: int,
            stop: int,
            block_ids: Sequence[int],
            *,
            layers: tuple[int, int] | None = None,
        ) -> dict[str, Any]:
            return {META_MAC: PayloadSeal(secret, key, start, 0 if layers is None else layers[0])}

        return seal

    def _mac_of_tokens(
        self,
        key: str,
        block_ids: Sequence[int],
        start: int,
        count: int,
        layers: tuple[int, int] | None = None,
    ) -> str:
        """The producer's MAC of request tokens ``[start, start + count)``, held from the first
        of ``block_ids`` on, of every layer or of ``layers`` (a layer group): over what the
        consumer decodes (coded and decoded again with a codec), not over what was coded.
        Gathers the tokens a second time: only for a shipped chunk whose own MAC the finish
        lacks (its encoder's seal has no one value). Needs ``auth_secret``."""
        secret = self.options.secret
        assert secret is not None
        first, end = (0, len(self.layers)) if layers is None else layers
        chosen = list(self.layers.values())[first:end]
        tokens = [layer.gather(block_ids, count) for layer in chosen]
        codec = self.edge.options.wire_codec
        if codec != "off":
            tokens = [(round_trip(k, codec), round_trip(v, codec)) for k, v in tokens]
        return kv_mac(secret, key, tokens, start, first)

    def start_load_kv(self) -> None:
        """Start the loads noted at bind (asynchronous)."""
        with self._lock:
            loads, self._pending_loads = self._pending_loads, []
            now = time.monotonic()
            starts = []
            for spec in loads:
                abort = threading.Event()
                self._aborts[spec.req_id] = abort
                starts.append((spec, now + spec.remaining_s, abort))
            self._running += len(starts)
        for spec, deadline, _ in starts:
            self.counters.record(spec.transfer_id, req_id=spec.req_id, submitted=now)
            # a router's id: the producer is still computing it, so it waits off the first wait
            self._offer(self._waiting if spec.early else self._first, spec, deadline)

    def _offer(self, admission: KVAdmission | None, spec: LoadSpec, deadline: float) -> None:
        """Queue ``spec``'s load on ``admission`` under its own deadline (a worker without
        admissions does not receive: the load ends at once, failed)."""
        if admission is None:
            self._end_load(spec, deadline, "this worker does not receive KV (need_recv_cache)", 0)
            return
        with self._lock:
            self._offered[spec.key] = (spec, deadline)
        admission.offer(spec.key, deadline=deadline)

    def _reap_loads(self) -> None:
        """Take what the admissions hold of ended loads; a load they ended without running
        it (its deadline passed while it was queued) ends here, failed, without waiting."""
        for admission in (self._first, self._waiting):
            if admission is None:
                continue
            for key in admission.ready():
                result = admission.take(key)
                if result is None or result.ok:
                    continue  # the load reported itself
                with self._lock:
                    offered = self._offered.pop(key, None)
                if offered is not None:
                    why = "timeout: recv_timeout passed before the load could start"
                    self._end_load(offered[0], offered[1], why, 0)

    def _submit_sends(self, sends: list[SendSpec]) -> None:
        if not sends:
            return
        with self._lock:
            self._running += len(sends)
        now = time.monotonic()
        for spec in sends:
            self.counters.record(spec.transfer_id, req_id=spec.req_id, submitted=now)
            self._send_pool.submit(self._send, spec)

    def get_transfer_results(self, finished_req_ids: Iterable[str]) -> KVConnectorTransferResults:
        """Sends done for finished requests, loads ended. A send is
        done when its payload is staged in the connector (a copy: the blocks are no longer
        read), or, with ``free_blocks_on: verdict``, when the consumer's verdict is in
        (delivered, refused or expired: by ``buffer_ttl_seconds + ack_timeout_s`` at the
        latest). In a step that computes nothing while sends or loads run and nothing is
        ready to report, first waits up to ``idle_step_wait_s`` for one to end (see
        :mod:`.options`): the transfer threads get the GIL meanwhile, and one that ends
        within the wait is reported by this step rather than the next. If a load's payload
        arrived by then (its check and write run on bytes that are here), the step waits up to
        ``idle_step_wait_s`` more for a transfer to end."""
        self._expire_verdicts()
        self._reap_loads()
        with self._lock:
            self._released.update(r for r in finished_req_ids if r in self._sending)
            if self._idle_step and self._running and not self._reportable():
                # an idle step while transfers run: let their threads have the GIL
                wait = self.options.idle_step_wait_s
                self._transfer_ended.wait(wait)
                if self._landing and not self._reportable():
                    # a load past its payload wait checks and writes bytes that are here:
                    # reported by this step rather than a whole idle step later
                    self._transfer_ended.wait_for(self._reportable, wait)
            self._idle_step = False
            sent = self._sent & self._released
            self._sent -= sent
            self._released -= sent
            self._sending -= sent
            loaded, failed = self._loaded, self._failed
            self._loaded, self._failed = set(), set()
        if self._traced and (sent or loaded):
            self._log_timelines(sent | loaded)
        return KVConnectorTransferResults(
            finished_sending=sent, finished_recving=loaded, failed_recving=failed
        )

    def _log_timelines(self, req_ids: Iterable[str]) -> None:
        """DEBUG: for each send or load reported now, when it was handed to a thread
        (``submitted``), began (a send's ``start``), ended, and this report (monotonic
        seconds; ``omnikv bench vllm`` reads them for its per-step breakdown)."""
        now = time.monotonic()
        for rid in req_ids:
            tid = self._traced.pop(rid, None)
            record = None if tid is None else self.counters.get(tid)
            if record is None:
                continue
            at = {k: record[k] for k in ("submitted", "start", "end") if k in record}
            logger.debug(
                "OmniKVConnector: %s timeline of request %s (transfer %s): %s",
                "send" if "send_key" in record else "load",
                rid,
                tid,
                " ".join(f"{k}={v:.6f}" for k, v in [*at.items(), ("reported", now)]),
            )

    def _reportable(self) -> bool:
        """Whether a load ended or a released send is done (called with the lock held)."""
        return bool(self._loaded or self._failed or self._sent & self._released)

    def transfer_record(self, transfer_id: str) -> dict[str, Any] | None:
        """What this worker did for a transfer; a sent one also says what became of it at the
        consumer (``delivery``: ``sent`` until the consumer's verdict, then ``delivered``,
        ``refused`` or ``expired``, with ``delivery_reason``)."""
        record = self.counters.get(transfer_id)
        key = None if record is None else record.get("send_key")
        result = None if key is None else self.edge.send_result(key)
        if record is not None and result is not None:
            record["delivery"] = result.status.value
            record["delivery_reason"] = result.reason
        return record

    def _on_verdict(self, result: SendResult) -> None:
        """The edge pushes a send's verdict (on the connector's listener thread, or on the
        send's own thread when the verdict came first): counted (``sends_delivered``,
        ``sends_refused``, ``sends_expired``); with ``free_blocks_on: verdict`` the request's
        send is done now. Only notes it."""
        with self._lock:
            req_id = self._verdicts_due.pop(result.request_id, None)
            if req_id is not None and self.options.free_blocks_on == "verdict":
                self._sent.add(req_id)
        if req_id is not None:
            self.counters.add(f"sends_{result.status.value}")

    def _expire_verdicts(self) -> None:
        """While verdicts are due, let a transport without a timer of its own expire what is
        past its TTL now (the verdicts themselves are pushed: :meth:`_on_verdict`)."""
        with self._lock:
            due = bool(self._verdicts_due)
        connector = self._connector.current if due else None
        if connector is not None:
            connector.reap_consumed()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's older form of :meth:`get_transfer_results`: requests whose send is done,
        requests whose load ended (``None`` for none)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> OmniKVConnectorStats | None:
        """The interval's counts and durations."""
        return self.counters.take_interval()

    def _done(self) -> None:
        """One submitted transfer ended (called with the lock held): an idle step waiting
        for it goes on."""
        self._running -= 1
        self._transfer_ended.notify_all()
        if self._running == 0:
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no send, load or stream step is in flight; False at ``timeout``."""
        end = time.monotonic() + timeout
        if not self.edge.wait_streams(timeout):
            return False
        for admission in (self._first, self._waiting):  # a first wait may move to waiting
            if admission is not None:
                admission.wait(deadline=end)
        self._reap_loads()
        timeout = max(0.0, end - time.monotonic())
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout=timeout)

    # -- producer ---------------------------------------------------------------------------
    def _send(self, spec: SendSpec) -> None:
        t0 = time.monotonic()
        reason = self.layout_error
        nbytes = 0
        connector = self._connector.get()
        watched = connector is not None and connector.acknowledges
        if watched:  # before the put: a verdict may come before the send returns
            with self._lock:
                self._verdicts_due[spec.key] = spec.req_id
        try:
            if reason is None:
                reason, nbytes = self._put(spec)
        except Exception as exc:  # the thread must always report, or the blocks stay held
            logger.debug("OmniKVConnector: send of %s raised", spec.transfer_id, exc_info=True)
            reason = f"{type(exc).__name__}: {exc}"
        ok = reason is None
        end = time.monotonic()
        self.counters.add("sends_ok" if ok else "sends_failed")
        self.counters.add("bytes_sent", nbytes)
        self.counters.observe("send_seconds", end - t0)
        self.counters.record(
            spec.transfer_id,
            send_key=spec.key,
            block_ids=list(spec.block_ids),
            num_tokens=spec.num_tokens,
            start=t0,
            end=end,
            ok=ok,
            reason=reason,
        )
        watched = watched and ok
        with self._lock:
            if not watched:
                self._verdicts_due.pop(spec.key, None)
            if not (watched and self.options.free_blocks_on == "verdict"):
                self._sent.add(spec.req_id)
            self._done()
        if not ok:
            logger.debug("OmniKVConnector: send of %s failed: %s", spec.transfer_id, reason)
            self._warned.warn(
                "OmniKVConnector: %d send(s) failed in the last %.0f s (see the sends_failed "
                "count); latest: %s",
                reason,
            )

    def _put(self, spec: SendSpec) -> tuple[str | None, int]:
        layers = list(self.layers.values())
        metadata: dict[str, Any] = {META_BINDING: spec.binding, "source": "vllm"}
        metadata[META_SENT_AT] = time.time()  # the hand-off's start (handoff_seconds)
        if self.options.secret is not None:
            metadata.update(self._seal_finish(spec))
        # What the sender gathers from: the cache's own views, or (packed layouts) a copy of
        # the request's blocks; the block ids are the same for every layer.
        sources = [layer.send_source(spec.block_ids) for layer in layers]
        views: list[Any] = [kv for kv, _ in sources]
        block_ids = sources[0][1] if sources else tuple(spec.block_ids)
        entry = {
            "block_ids": list(block_ids),
            "seq_len": spec.num_tokens,
            "custom_metadata": metadata,
        }
        caches = KVCaches(views, self.block_size, str(views[0][0].dtype))
        result = self.edge.send(spec.key, entry, caches)
        if result.ok:
            return None, int(result.nbytes)
        return f"{result.status.value}: {result.reason}", 0

    def _seal_finish(self, spec: SendSpec) -> dict[str, Any]:
        """The finish's MAC metadata: over every token (``omnikv_mac``), or, after a stream
        shipped the first ``S`` tokens in sealed chunks, the list of those chunks' seals and
        the seal of tokens ``[S, end)`` (``omnikv_sealed``): only the tail is hashed here,
        and a consumer that took the chunks as they came checks only the tail now. The chunks
        and their MACs are the stream's own record (what the tail's manifest lists); a chunk
        whose MAC it lacks is hashed again from the blocks. The MAC of what this send carries
        is a :class:`~omnikv.wire.mac.PayloadSeal`: the encoder computes it from the one
        coding it makes of these tokens."""
        secret = self.options.secret
        assert secret is not None
        chunks = self.edge.shipped_chunks(spec.key)
        shipped = chunks[-1][1] if chunks else 0
        if shipped % self.block_size or not 0 < shipped <= spec.num_tokens:
            shipped, chunks = 0, []
        ranges: list[list[Any]] = []
        for start, stop, meta, layers in chunks:
            mac = meta.get(META_MAC)
            if isinstance(mac, PayloadSeal):
                mac = mac.value
            if not isinstance(mac, str):
                ids = spec.block_ids[start // self.block_size :]
                mac = self._mac_of_tokens(spec.key, ids, start, stop - start, layers)
            ranges.append([start, stop, mac, *(layers or ())])
        if shipped == spec.num_tokens:  # the stream shipped every token: no tail to seal
            return {META_SEALED: ranges}
        mac = PayloadSeal(secret, spec.key, shipped)
        if not shipped:
            return {META_MAC: mac}
        return {META_SEALED: [*ranges, [shipped, spec.num_tokens, mac]]}

    # -- consumer ---------------------------------------------------------------------------
    def _load(self, key: str, *, first: bool) -> ReceiveResult:
        """One attempt of the load offered under ``key``, on an admission's thread: the first
        (``first``) bounded by ``load_first_wait_s``, then, if nothing arrived, once more on
        the waiting admission until the deadline. What the admission keeps is only that the
        load ran (it reports its own end)."""
        with self._lock:
            offered = self._offered.get(key)
            abort = None if offered is None else self._aborts.get(offered[0].req_id)
        if offered is None or abort is None:
            return ReceiveResult(key, ReceiveStatus.OK)  # ended already
        spec, deadline = offered
        t0 = time.monotonic()
        reason = self.layout_error
        nbytes = 0
        try:
            if reason is None:
                until = min(deadline, t0 + self.options.load_first_wait_s) if first else deadline
                outcome = self._receive_into_blocks(spec, deadline, until, abort)
                if outcome is None:  # not there yet: wait for it off the first wait
                    assert self._waiting is not None
                    self._waiting.offer(key, deadline=deadline)
                    return ReceiveResult(key, ReceiveStatus.OK)
                reason, nbytes = outcome
        except Exception as exc:  # any failure means: recompute, never use the blocks
            logger.debug("OmniKVConnector: load of %s raised", spec.transfer_id, exc_info=True)
            reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._offered.pop(key, None)
        self._end_load(spec, deadline, reason, nbytes)
        return ReceiveResult(key, ReceiveStatus.OK)

    def _end_load(self, spec: LoadSpec, deadline: float, reason: str | None, nbytes: int) -> None:
        """Record and report a load's end (exactly once per load: ``finished_recving``, and
        ``failed_recving`` with a ``reason``)."""
        ok = reason is None
        end = time.monotonic()
        self.counters.record(
            spec.transfer_id,
            block_ids=list(spec.block_ids),
            num_tokens=spec.end,
            loaded_from=spec.start,
            end=end,
            ok=ok,
            reason=reason,
        )
        if ok:
            self.counters.add("loads_ok")
            self.counters.add("tokens_loaded", spec.end - spec.start)
            self.counters.add("bytes_loaded", nbytes)
            # From admission: the deadline is ``recv_timeout`` after it, on this worker's clock.
            admitted = deadline - self.edge.config.recv_timeout
            self.counters.observe("load_seconds", end - admitted)
        else:
            self.counters.add("loads_failed")
        with self._lock:
            self._aborts.pop(spec.req_id, None)
            self._landing.discard(spec.req_id)
            self._loaded.add(spec.req_id)
            if not ok:
                self._failed.add(spec.req_id)
            self._done()
        if not ok:
            logger.debug(
                "OmniKVConnector: KV of %s (request %s) not loaded: %s",
                spec.transfer_id,
                spec.req_id,
                reason,
            )
            self._warned.warn(
                "OmniKVConnector: %d load(s) failed and recomputed their prefill in the last "
                "%.0f s (see the loads_failed count); latest: %s",
                reason,
            )

    def _receive_into_blocks(
        self, spec: LoadSpec, deadline: float, until: float, abort: threading.Event
    ) -> tuple[str | None, int] | None:
        """Receive ``spec``'s payload until ``until``, check it, write it: (reason, bytes), or
        ``None`` when nothing arrived by ``until`` and the deadline is still ahead."""
        if abort.is_set():
            return "cancelled: the request was aborted", 0
        if time.monotonic() >= deadline:
            return "timeout: recv_timeout passed before the load could start", 0

        written = [0]  # bytes the chunks handed over wrote

        def check(kv: ReceivedKV) -> str | None:
            return self._check_payload(spec, kv)

        def on_chunk(chunk: ReceivedChunk) -> str | None:
            return self._write_chunk(spec, chunk, written)

        def landed(nbytes: int) -> None:
            with self._lock:
                self._landing.add(spec.req_id)

        result = self.edge.receive(
            spec.key,
            deadline=until,
            abort=abort,
            quiet=True,
            on_arrival=landed,
            check=check,
            on_chunk=on_chunk,
        )
        if result.status is ReceiveStatus.TIMEOUT and until < deadline and not abort.is_set():
            return None
        if result.status is ReceiveStatus.REFUSED:  # the producer is told why as well
            return result.reason, 0
        if not result.ok or result.kv is None:
            return f"receive {result.status.value}: {result.reason}", 0
        kv = result.kv
        t_write, cpu_write = time.monotonic(), time.thread_time()
        nbytes = written[0] + self._write(spec, kv.key_cache, kv.value_cache, kv.token_offset)
        t_written, cpu_written = time.monotonic(), time.thread_time()
        handoff = handoff_seconds(kv.metadata.get(META_SENT_AT), time.time())
        if handoff is not None:
            self.counters.observe("handoff_seconds", handoff)
        logger.debug(
            "OmniKVConnector: KV of %s written in %.2f ms (%.2f ms of the load thread's CPU; "
            "%d tokens before it as they came; receive phases %s)",
            spec.transfer_id,
            (t_written - t_write) * 1e3,
            (cpu_written - cpu_write) * 1e3,
            kv.token_offset,
            result.timings_ms,
        )
        return None, nbytes

    def _write(
        self,
        spec: LoadSpec,
        keys: Sequence[torch.Tensor | None],
        values: Sequence[torch.Tensor | None],
        offset: int,
        first_layer: int = 0,
    ) -> int:
        """Write the checked tensors (request tokens from ``offset``, layers from
        ``first_layer``) into the request's blocks, the part of them in
        ``[spec.start, spec.end)``; the bytes written."""
        first = max(spec.start, offset)
        if first >= spec.end:
            return 0
        span = slice(first - offset, spec.end - offset)
        nbytes = 0
        layers = list(self.layers.values())[first_layer : first_layer + len(keys)]
        for layer, k, v in zip(layers, keys, values, strict=True):
            assert k is not None and v is not None  # the checks refused absent layers
            layer.scatter(spec.block_ids, k[span], v[span], first)
            nbytes += k[span].nbytes + v[span].nbytes
        return nbytes

    def _write_chunk(self, spec: LoadSpec, chunk: ReceivedChunk, written: list[int]) -> str | None:
        """The receive's ``on_chunk``: check a streamed chunk as it arrives (layers, heads, head
        size, dtype, finiteness, its own MAC) and write its tokens into the request's blocks,
        so that the finish leaves only the tail to check and write. A reason refuses the load
        (vLLM then recomputes the prefill over whatever was written)."""
        t0 = time.monotonic()
        keys, values, first = chunk.key_cache, chunk.value_cache, chunk.first_layer
        why = None
        if chunk.num_layers != len(self.layers):  # a stream of other layers: refused at once
            why = f"a stream of {chunk.num_layers} layers, the engine {len(self.layers)}"
        why = why or self._check_tensors(spec, keys, values, chunk.stop - chunk.start, group=first)
        secret = self.options.secret
        if why is None and secret is not None:
            mac = chunk.metadata.get(META_MAC)
            pairs = _pairs(keys, values)
            why = kv_mac_refusal(mac, secret, spec.key, pairs, chunk.start, first)
        if why is not None:
            return f"chunk {chunk.index}: {why}"
        written[0] += self._write(spec, keys, values, chunk.start, first)
        self.counters.add("chunks_loaded")
        logger.debug(
            "OmniKVConnector: chunk %d of %s (tokens [%d, %d)) checked and written in %.1f ms",
            chunk.index,
            spec.transfer_id,
            chunk.start,
            chunk.stop,
            (time.monotonic() - t0) * 1e3,
        )
        return None

    def _check_payload(self, spec: LoadSpec, kv: ReceivedKV) -> str | None:
        """Why the received payload must not be written into this request's blocks, or None
        (run by the receive as its ``check``: a reason is the producer's ``refused`` verdict).
        ``kv`` holds the request's tokens from ``kv.token_offset`` on (the chunks before were
        checked and written as they came, by :meth:`_write_chunk`)."""
        meta, keys, values, offset = kv.metadata, kv.key_cache, kv.value_cache, kv.token_offset
        if meta.get(META_BINDING) != spec.binding:
            return "the payload's binding does not match the request"
        why = self._check_tensors(spec, keys, values, max(0, spec.end - offset))
        if why is not None or self.options.secret is None:
            return why
        pairs = _pairs(keys, values)
        if META_SEALED in meta:
            return check_sealed_ranges(
                self.options.secret, spec.key, pairs, meta[META_SEALED], offset
            )
        if offset:
            return "a streamed payload without its sealed ranges"
        why = kv_mac_refusal(meta.get(META_MAC), self.options.secret, spec.key, pairs)
        return None if why is None else f"the payload: {why}"

    def _check_tensors(
        self,
        spec: LoadSpec,
        keys: Sequence[torch.Tensor | None],
        values: Sequence[torch.Tensor | None],
        need: int,
        group: int | None = None,
    ) -> str | None:
        """Why received layers cannot be written into the engine's cache (count, shape,
        dtype, at least ``need`` tokens, finiteness with ``verify_finite``), or None: every
        layer of the engine, or with ``group`` a chunk's layers from that one on (a layer
        group of a stream shipped layer by layer, or every layer)."""
        layers = list(self.layers.values())
        first = group or 0
        if group is None and (len(keys) != len(layers) or len(values) != len(layers)):
            return f"payload has {len(keys)} layers, the engine {len(layers)}"
        if not keys or len(keys) != len(values) or first + len(keys) > len(layers):
            return f"chunk has layers [{first}, {first + len(keys)}), the engine {len(layers)}"
        layers = layers[first : first + len(keys)]
        for at, (layer, k, v) in enumerate(zip(layers, keys, values, strict=True)):
            idx = first + at
            tail = layer.token_shape
            for name, t in (("K", k), ("V", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 1 + len(tail):
                    return f"layer {idx} {name}: not a [tokens, heads, head_size] tensor"
                if tuple(t.shape[1:]) != tail:
                    return f"layer {idx} {name}: shape {tuple(t.shape[1:])}, the engine {tail}"
                if t.dtype != layer.dtype:
                    return f"layer {idx} {name}: dtype {t.dtype}, the engine {layer.dtype}"
                if t.shape[0] < need:
                    return f"layer {idx} {name}: {t.shape[0]} tokens, fewer than {need}"
                if self.options.verify_finite and not bool(torch.isfinite(t).all()):
                    return f"layer {idx} {name}: values that are not finite"
        return None

    def shutdown(self) -> None:
        """Cancel waiting loads, finish what runs, close the edge and its connector."""
        with self._lock:
            for event in self._aborts.values():
                event.set()
        self._send_pool.shutdown(wait=True)
        for admission in (self._first, self._waiting):  # a first wait may move to waiting
            if admission is not None:
                admission.wait(deadline=time.monotonic() + 5.0)
                admission.close()
        self._reap_loads()
        self.edge.close()
        self._connector.close(final=True)


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``[first, stop)`` of each of ``groups`` runs of consecutive layers (as even as they can
    be; at most one per layer), in order."""
    count = max(1, min(groups, num_layers))
    bounds = [round(i * num_layers / count) for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count)]
