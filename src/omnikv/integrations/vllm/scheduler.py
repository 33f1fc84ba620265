"""The scheduler half of :class:`OmniKVConnector`: admission, block bookkeeping, metadata.

vLLM calls it from the engine core's scheduler loop, one thread, once per request event:

* producer: ``request_finished`` picks requests marked ``do_remote_decode``, keeps their blocks
  and returns the ``kv_transfer_params`` for the client; ``update_connector_output`` learns when
  a send is done; ``has_pending_push_work`` keeps the engine stepping until then. With
  ``stream_kv``, ``update_state_after_alloc`` fixes such a request's transfer id when it is
  first scheduled and ``build_connector_meta`` (reading vLLM's scheduler output) names each
  step's requests whose prefill completes a block, for the worker to ship after the forward.
  A request may offer a router's id (``omnikv_transfer_id``, early hand-off): used when it is
  a router id for this producer under its ``auth_secret`` that no other request used, else
  replaced by a fresh id (counted in ``router_ids_refused``).
* consumer: ``get_num_new_matched_tokens`` admits or refuses a request's ``kv_transfer_params``
  (client input: checked before anything waits), ``update_state_after_alloc`` turns an admitted
  request into a load; ``update_connector_output`` learns when a load has ended.

Admission refuses at once (``(0, False)``: vLLM computes the prefill) what cannot be a payload
of ours for this request: a malformed or over-long id, a foreign producer tag, a binding the
client sent that differs from the one this engine computes, an id whose MAC does not fit (with
``auth_secret``), an id whose payload was already loaded or failed. Requests with the same
transfer id (``n > 1``: vLLM copies the parameters to every child) load once: while one of them
loads, the others are answered ``None`` (vLLM asks again next step) and, once it has loaded,
they find its blocks in vLLM's prefix cache (with prefix caching off they recompute). Nothing
here blocks or raises for a request's parameters.

With DEBUG logging on, the consumer logs one line per hand-off when the request is scheduled
after its load (``hand-off timeline of request ...``): when it was admitted, when its load left
in a step's metadata, when the worker's report of the load's end came back and when the
scheduler scheduled its remaining tokens (monotonic seconds; ``omnikv bench vllm`` reads them
for its per-step breakdown).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnikv.config import options_from_dict
from omnikv.integrations.vllm.binding import (
    PARAM_BINDING,
    PARAM_NUM_TOKENS,
    PARAM_TRANSFER_ID,
    check_transfer_id,
    is_router_id,
    new_transfer_id,
    payload_key,
    request_binding,
)
from omnikv.integrations.vllm.metadata import (
    LoadSpec,
    OmniKVConnectorMetadata,
    SendSpec,
    StreamSpec,
)
from omnikv.integrations.vllm.options import ConnectorOptions
from omnikv.integrations.vllm.stats import OmniKVConnectorStats, TransferCounters

__all__ = [
    "PARAM_BINDING",
    "PARAM_NUM_TOKENS",
    "PARAM_TRANSFER_ID",
    "SchedulerSide",
]

logger = logging.getLogger(__name__)

#: Transfer keys remembered as loaded or failed (a later request with one is refused at once).
SETTLED_KEPT = 65536
#: Producer requests streamed at once (``stream_kv``); more are sent whole at their finish.
STREAMS_KEPT = 65536
#: Router ids a producer remembers as used (one offered again for another request is refused).
ROUTER_IDS_KEPT = 65536
#: Hand-off timelines kept at once (DEBUG only; each ends when its request is scheduled).
TIMELINES_KEPT = 4096


@dataclass(frozen=True)
class _Admitted:
    """A consumer request whose parameters passed admission."""

    transfer_id: str
    key: str
    binding: str
    num_tokens: int
    deadline: float


@dataclass
class _Streaming:
    """A producer request marked ``do_remote_decode`` whose prompt KV ships while it is
    prefilled (``stream_kv``): its transfer id and key, fixed at its first schedule, and the
    blocks and prompt tokens known so far."""

    transfer_id: str
    key: str
    binding: str
    prompt_len: int
    block_ids: list[int]
    shipped_to: int = 0  # prompt tokens covered by the streams emitted so far


class SchedulerSide:
    """Per-engine scheduler state (single-threaded: vLLM's scheduler loop). Its public
    methods are the scheduler-side hooks of vLLM's ``KVConnectorBase_V1``, under their names,
    called by :class:`~omnikv.integrations.vllm.OmniKVConnector` on the scheduler's instance.

    ``clock`` (``time.monotonic`` unless a test steps it) reads the time that admission
    deadlines count from."""

    def __init__(
        self,
        options: ConnectorOptions,
        *,
        producer: bool,
        consumer: bool,
        fingerprint: str,
        recv_timeout: float,
        prefix_caching: bool,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self.producer = producer
        self.consumer = consumer
        self.fingerprint = fingerprint
        self.recv_timeout = recv_timeout
        self.prefix_caching = prefix_caching
        self._clock = clock
        self._sends: list[SendSpec] = []
        self._loads: list[tuple[LoadSpec, float]] = []  # with the absolute deadline
        self._cancels: list[str] = []
        #: ``loads_refused`` (reported through vLLM's scheduler-side connector stats).
        self.counters = TransferCounters()
        self._sending: set[str] = set()
        # consumer state
        self._admitted: dict[str, _Admitted | None] = {}  # req id -> admission (None: refused)
        self._loading: dict[str, str] = {}  # transfer key -> req id loading it
        self._load_of: dict[str, str] = {}  # req id -> transfer key it loads
        self._settled: OrderedDict[str, bool] = OrderedDict()  # key -> loaded ok
        self._told_no_sharing = False
        # producer streaming (stream_kv): req id -> its stream; keys to drop
        self.stream = bool(options_from_dict(options.omni_kv_config).stream_kv) and producer
        self._streaming: dict[str, _Streaming] = {}
        self._stream_aborts: list[str] = []
        #: the engine's block size (a stream step is emitted per full block)
        self._block_size = int(block_size)
        self._router_ids: OrderedDict[str, str] = OrderedDict()  # router id -> its request
        #: DEBUG only: consumer req id -> (transfer id, event -> monotonic time)
        self._timelines: OrderedDict[str, tuple[str, dict[str, float]]] = OrderedDict()

    # -- consumer ---------------------------------------------------------------------------
    def _refuse(self, request: Any, why: str) -> None:
        self._admitted[request.request_id] = None
        self.counters.add("loads_refused")
        logger.debug("Request %s: kv_transfer_params refused: %s", request.request_id, why)

    def _admit(self, request: Any, params: Mapping[str, Any]) -> _Admitted | None:
        tid, num = params.get(PARAM_TRANSFER_ID), params.get(PARAM_NUM_TOKENS)
        prompt = getattr(request, "prompt_token_ids", None)
        if isinstance(num, bool) or not isinstance(num, int) or num <= 0:
            self._refuse(request, f"{PARAM_NUM_TOKENS} must be a positive int, got {num!r:.40}")
            return None
        if prompt is None:
            self._refuse(request, "the request has no prompt token ids")
            return None
        available = min(num, len(prompt))
        binding = request_binding(self.fingerprint, request, available)
        if binding is None:
            self._refuse(request, "nothing to bind the KV to")
            return None
        claimed = params.get(PARAM_BINDING)
        if claimed is not None and claimed != binding:  # a malformed one never equals it
            self._refuse(request, "the binding differs from this request's and engine's")
            return None
        why = check_transfer_id(tid, self.options.accepted_tags, binding, self.options.secret)
        if why is not None:
            self._refuse(request, why)
            return None
        assert isinstance(tid, str)
        admitted = _Admitted(
            tid,
            payload_key(tid, binding),
            binding,
            available,
            self._clock() + self.recv_timeout,
        )
        self._admitted[request.request_id] = admitted
        if logger.isEnabledFor(logging.DEBUG):
            self._timelines[request.request_id] = (tid, {"admitted": self._clock()})
            while len(self._timelines) > TIMELINES_KEPT:
                self._timelines.popitem(last=False)
        return admitted

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many prompt tokens this request loads (``(None, False)``: ask again next
        step), and whether asynchronously."""
        if not self.consumer:
            return 0, False
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
            return 0, False
        rid = request.request_id
        known = rid in self._admitted
        admitted = self._admitted[rid] if known else self._admit(request, params)
        if admitted is None or rid in self._load_of:
            return 0, False
        if admitted.key in self._settled:
            self._no_sharing_note(admitted)
            return 0, False
        if admitted.key in self._loading:
            # A sibling (n > 1) loads this payload: ask again next step, until our deadline.
            if self._clock() >= admitted.deadline:
                return 0, False
            return None, False
        count = admitted.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _no_sharing_note(self, admitted: _Admitted) -> None:
        if not self.prefix_caching and not self._told_no_sharing:
            self._told_no_sharing = True
            logger.info(
                "OmniKVConnector: requests sharing transfer %s (n > 1) recompute their prefill: "
                "a payload is loaded once, and the others find it in the prefix cache only "
                "with enable_prefix_caching",
                admitted.transfer_id,
            )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """An admitted request with external tokens loads them; a producer request to stream
        (``stream_kv``) gets its transfer id now."""
        if self.stream:
            self._open_stream(request, blocks)
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        admitted = self._admitted.get(rid)
        if admitted is None or rid in self._load_of or admitted.key in self._loading:
            return
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        self._loading[admitted.key] = rid
        self._load_of[rid] = admitted.key
        spec = LoadSpec(
            req_id=rid,
            transfer_id=admitted.transfer_id,
            key=admitted.key,
            binding=admitted.binding,
            block_ids=block_ids,
            start=admitted.num_tokens - num_external_tokens,
            end=admitted.num_tokens,
            remaining_s=0.0,  # set in build_connector_meta(), when the metadata leaves
            early=is_router_id(admitted.transfer_id),
        )
        self._loads.append((spec, admitted.deadline))

    def _settle(self, req_id: str, ok: bool) -> None:
        key = self._load_of.pop(req_id, None)
        if key is None:
            return
        self._loading.pop(key, None)
        self._settled[key] = ok
        self._settled.move_to_end(key)
        while len(self._settled) > SETTLED_KEPT:
            self._settled.popitem(last=False)

    # -- producer ---------------------------------------------------------------------------
    def _open_stream(self, request: Any, blocks: Any) -> None:
        """Fix the transfer id and key of a ``do_remote_decode`` request when it is first
        scheduled, so that its blocks can ship while it is prefilled."""
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None)
        if rid in self._streaming or not isinstance(params, Mapping):
            return
        if not params.get("do_remote_decode"):
            return
        prompt = getattr(request, "prompt_token_ids", None) or ()
        binding = request_binding(self.fingerprint, request, len(prompt)) if prompt else None
        if binding is None:
            return
        if len(self._streaming) >= STREAMS_KEPT:  # every request finishes; this bounds a leak
            return
        tid = self._transfer_id(request, params, binding)
        ids = [int(b) for b in blocks.get_block_ids()[0]]
        self._streaming[rid] = _Streaming(tid, payload_key(tid, binding), binding, len(prompt), ids)

    def _drop_preempted_streams(self, scheduler_output: Any) -> None:
        """Called by :meth:`build_connector_meta` before the step's stream specs: a preempted
        request's blocks are free from this step on (vLLM frees them in the schedule that
        preempts it and may hand them to another request's forward pass in the same step),
        while the stream worker may still hold a step that reads them. Its stream is dropped
        in this step's metadata, which the worker applies before the forward pass; it starts
        over from token 0 when the request resumes."""
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._streaming.get(rid)
            if st is not None:
                st.shipped_to = 0
                self._stream_aborts.append(st.key)

    def _stream_specs(self, scheduler_output: Any) -> list[StreamSpec]:
        """This step's blocks to ship: for each streaming request scheduled now, its block ids
        and the prompt tokens whose KV this step's forward pass completes (emitted only when a
        block more is full)."""
        if not self._streaming or scheduler_output is None:
            return []
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        computed: dict[str, int] = {}  # streaming req id -> tokens computed before this step
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            st = self._streaming.get(new.req_id)
            if st is not None:
                st.block_ids = [int(b) for b in new.block_ids[0]]
                computed[new.req_id] = int(new.num_computed_tokens)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for i, rid in enumerate(cached.req_ids):
                st = self._streaming.get(rid)
                if st is None:
                    continue
                computed[rid] = int(cached.num_computed_tokens[i])
                more = cached.new_block_ids[i]
                if rid in resumed:  # preempted: its blocks and computed tokens start over
                    st.shipped_to = 0
                if more is not None:
                    fresh = [int(b) for b in more[0]]
                    st.block_ids = fresh if rid in resumed else [*st.block_ids, *fresh]
        specs = []
        size = max(1, self._block_size)
        for rid, before in computed.items():
            st = self._streaming[rid]
            if rid not in scheduled:
                continue
            upto = min(st.prompt_len, before + int(scheduled[rid]))
            if upto // size > st.shipped_to // size:  # a block more is full after this step
                st.shipped_to = upto
                specs.append(StreamSpec(rid, st.key, tuple(st.block_ids), upto))
        return specs

    def request_finished(
        self, request: Any, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a finished ``do_remote_decode`` request and send them: whether
        the blocks are kept, and the ``kv_transfer_params`` for the client."""
        rid = request.request_id
        self._admitted.pop(rid, None)
        self._timelines.pop(rid, None)
        if rid in self._load_of:  # aborted while its KV was loading: stop waiting for it
            self._cancels.append(rid)
        stream = self._streaming.pop(rid, None)
        sent = self._finish_send(request, block_ids, stream)
        params = sent[1]
        if stream is not None and (
            params is None or params[PARAM_TRANSFER_ID] != stream.transfer_id
        ):
            self._stream_aborts.append(stream.key)  # its chunks will have no tail
        return sent

    def _finish_send(
        self, request: Any, block_ids: Sequence[int], stream: _Streaming | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """The send of a finished producer request (under its stream's key when the stream
        still covers exactly its prompt), or ``(False, None)``."""
        rid = request.request_id
        params = getattr(request, "kv_transfer_params", None)
        if not self.producer or not isinstance(params, Mapping):
            return False, None
        if not params.get("do_remote_decode") or not block_ids:
            return False, None
        if getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED":
            return False, None
        prompt = getattr(request, "prompt_token_ids", None) or ()
        num = min(len(prompt), int(request.num_computed_tokens))
        binding = request_binding(self.fingerprint, request, num) if num > 0 else None
        if binding is None:
            return False, None
        if stream is not None and stream.binding == binding:
            tid, key = stream.transfer_id, stream.key
        else:
            tid = self._transfer_id(request, params, binding)
            key = payload_key(tid, binding)
        self._sends.append(SendSpec(rid, tid, key, binding, tuple(block_ids), num))
        self._sending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            PARAM_TRANSFER_ID: tid,
            PARAM_NUM_TOKENS: num,
            PARAM_BINDING: binding,
        }

    def _transfer_id(self, request: Any, params: Mapping[str, Any], binding: str) -> str:
        """The transfer id of a producer request: the router id its parameters offer (early
        hand-off) when it is one for this producer, under this ``auth_secret``, and no other
        request used it; else a fresh id (an offered one is then counted as refused, and a
        consumer that waits for it times out and recomputes)."""
        offered = params.get(PARAM_TRANSFER_ID)
        if offered is not None:
            why = self._router_id_problem(offered, request.request_id)
            if why is None:
                assert isinstance(offered, str)
                return offered
            self.counters.add("router_ids_refused")
            logger.debug("Request %s: offered transfer id refused: %s", request.request_id, why)
        return new_transfer_id(self.options.tag, binding, self.options.secret)

    def _router_id_problem(self, offered: Any, req_id: str) -> str | None:
        """Why ``offered`` cannot be request ``req_id``'s transfer id, or ``None`` (it is then
        remembered as this request's)."""
        if not is_router_id(offered):
            return "only a router id (okv1r-...) can be offered to a producer"
        why = check_transfer_id(offered, frozenset({self.options.tag}), "", self.options.secret)
        if why is not None:
            return why
        owner = self._router_ids.setdefault(offered, req_id)
        if owner != req_id:
            return f"the router id was used by request {owner} already"
        self._router_ids.move_to_end(offered)
        while len(self._router_ids) > ROUTER_IDS_KEPT:
            self._router_ids.popitem(last=False)
        return None

    # -- both -------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        """This step's sends, loads, cancels and (``stream_kv``) the blocks of requests in
        prefill to ship after its forward pass; ``scheduler_output`` may be ``None`` (no
        stream step then)."""
        now = self._clock()
        loads = [
            dataclasses.replace(spec, remaining_s=max(0.0, deadline - now))
            for spec, deadline in self._loads
        ]
        if self._timelines:
            self._note_timelines(loads, scheduler_output, now)
        self._drop_preempted_streams(scheduler_output)
        streams = self._stream_specs(scheduler_output)
        scheduled = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        meta = OmniKVConnectorMetadata(
            self._sends,
            loads,
            self._cancels,
            streams,
            self._stream_aborts,
            idle=isinstance(scheduled, int) and scheduled == 0,
        )
        self._sends, self._loads, self._cancels, self._stream_aborts = [], [], [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Sends and loads the workers reported as ended (``finished_sending``,
        ``finished_recving``, of these ``failed_recving``: vLLM's ``KVConnectorOutput``)."""
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        self._sending.difference_update(connector_output.finished_sending or ())
        for rid in connector_output.finished_recving or ():
            self._settle(rid, rid not in failed)
            timeline = self._timelines.get(rid)
            if timeline is not None:
                timeline[1]["reported"] = self._clock()
                timeline[1]["ok"] = float(rid not in failed)

    def _note_timelines(self, loads: Sequence[LoadSpec], scheduler_output: Any, now: float) -> None:
        """DEBUG: note the loads leaving in this step's metadata, and log the timeline of each
        request with a reported load that this step schedules (then forgotten)."""
        for spec in loads:
            timeline = self._timelines.get(spec.req_id)
            if timeline is not None:
                timeline[1]["to_worker"] = now
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            rid = getattr(new, "req_id", None)
            timeline = self._timelines.get(rid) if isinstance(rid, str) else None
            if timeline is None or "reported" not in timeline[1]:
                continue
            assert isinstance(rid, str)
            del self._timelines[rid]
            tid, at = timeline
            logger.debug(
                "OmniKVConnector: hand-off timeline of request %s (transfer %s): %s",
                rid,
                tid,
                " ".join(f"{k}={v:.6f}" for k, v in [*at.items(), ("scheduled", now)]),
            )

    def has_pending_push_work(self) -> bool:
        """Sends queued or in flight (vLLM keeps stepping until they are done)."""
        return bool(self._sending or self._sends)

    def get_kv_connector_stats(self) -> OmniKVConnectorStats | None:
        """The interval's admission counts (``loads_refused``, ``router_ids_refused``)."""
        return self.counters.take_interval()
