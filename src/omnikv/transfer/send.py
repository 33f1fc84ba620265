"""Send path: validate -> extract a request's blocks -> encode into connector memory -> put.

Called by the transfer edge (``send`` / ``send_many``, behind the manager's
``handle_finished_requests_kv_transfer``) on the model-runner thread, once per batch. Every
request gets a :class:`SendResult` (sent, skipped, or failed and why); one bad request never
affects another, and nothing here raises for a request's failure.

Input is checked, never coerced: block ids are integers (``1.7`` is not block 1, ``"12"`` is not
blocks 1 and 2), ``block_size`` is a positive int, ``custom_metadata`` is a dict that may not
contradict ``seq_len``/``block_size``/``num_layers``/``dtype``, K and V agree on heads and dtype,
and a ``cache_dtype`` that names a torch dtype (``"bfloat16"``, ``"torch.float16"``, ``"fp8"``...)
must match the tensors (``"auto"`` and other names are recorded as given).

KV that requires grad (computed outside ``torch.no_grad()``) is detached: the values are sent,
the autograd graph is not.

Every put of a call shares one absolute deadline (``send_timeout`` from the facade). A failed put
is retried only for errors marked transient (:func:`omnikv.errors.is_transient`) or a refused
put, with the policy's back-off, and never once the next attempt would start past the deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from omnikv._logging import RateLimitedLog
from omnikv.config import RetryPolicy, TransferOptions
from omnikv.connectors.base import OmniConnectorBase
from omnikv.connectors.factory import LazyConnector
from omnikv.deadline import remaining
from omnikv.errors import OmniKVError, is_transient
from omnikv.layouts.cache import LayerCache
from omnikv.layouts.gather import BlockGather, plan_request_kv
from omnikv.layouts.specs import HF_HINT
from omnikv.topology.keys import TransferHooks, build_send_keys
from omnikv.topology.tp import KVTPTopology, head_range, head_slice_tag
from omnikv.transfer.results import SendResult, SendStatus
from omnikv.transfer.sessions import SenderStamps
from omnikv.transfer.stream.manifest import reserved_key
from omnikv.wire.codec import Coded, encode_rows
from omnikv.wire.encode import PackedPayload
from omnikv.wire.format import DTYPE_TO_NAME

if TYPE_CHECKING:
    from omnikv.transfer.delivery import DeliveryBook

__all__ = [
    "KVSender",
    "SendBatch",
    "SendRefused",
    "SendResult",
    "SendStatus",
    "TailPlan",
    "TailSource",
    "put_with_retry",
]

logger = logging.getLogger(__name__)
_outsider = RateLimitedLog(logger)  # lines a peer, client or forger can cause

_RESERVED_METADATA = ("block_size", "num_layers", "dtype", "seq_len")
_DTYPE_ALIASES = {
    "float": torch.float32,
    "fp32": torch.float32,
    "half": torch.float16,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


class _Refused(Exception):
    """A request cannot be sent as given; the message is its :attr:`SendResult.reason`."""


def put_with_retry(
    connector: OmniConnectorBase,
    stages: tuple[str, str],
    key: str,
    payload: PackedPayload,
    policy: RetryPolicy,
    *,
    deadline: float,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[bool, int, str | None]:
    """Publish ``payload`` under ``key``: up to ``policy.attempts`` tries before ``deadline``.

    Each try encodes straight into connector memory (``put_packed``). A refused put and
    transient errors are retried; other errors end the loop at once. Returns
    ``(ok, size, last_error)``.
    """
    last_error: str | None = None
    for attempt in range(policy.attempts):
        try:
            ok, size, _meta = connector.put_packed(
                *stages, key, payload.nbytes, payload, deadline=deadline
            )
            if ok:
                return True, size, None
            last_error = "connector refused the put"
        except OmniKVError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
            if not is_transient(exc):
                return False, 0, last_error
        except Exception as exc:  # a backend bug or a misuse: recorded, never retried
            logger.debug("connector put raised for key %s", key, exc_info=True)
            return False, 0, f"{type(exc).__name__}: {exc}"
        delay = policy.delay(attempt)
        if attempt + 1 >= policy.attempts or delay >= remaining(deadline):
            break
        _outsider.warning(
            "Transfer attempt %d/%d for %s failed (%s); retrying in %.2fs",
            attempt + 1,
            policy.attempts,
            key,
            last_error,
            delay,
        )
        sleep(delay)
    return False, 0, last_error


#: What a block id may be (a tuple, built once: ``int | np.integer`` builds a union per test).
_INTEGER = (int, np.integer)
#: A list of layers or of block ids, and an array of block ids (built once, as ``_INTEGER``).
_SEQUENCE = (list, tuple)
_ARRAY = (np.ndarray, torch.Tensor)


# -- validation (each returns the value to use or raises _Refused with the reason) ---------------
def _is_cache_object(kv_caches: Any) -> bool:
    return not isinstance(kv_caches, _SEQUENCE) and (
        hasattr(kv_caches, "layers") or hasattr(kv_caches, "key_cache")
    )


def _check_batch(kv_caches: Any, block_size: Any, cache_dtype: Any) -> torch.dtype | None:
    """The torch dtype ``cache_dtype`` names (``None``: not checked); raises :class:`_Refused`."""
    if _is_cache_object(kv_caches):
        raise _Refused(
            f"kv_caches is a {type(kv_caches).__name__}, not a list of layers; " + HF_HINT
        )
    if not isinstance(kv_caches, _SEQUENCE):
        raise _Refused(
            f"kv_caches must be a list of per-layer caches, got {type(kv_caches).__name__}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, _INTEGER):
        raise _Refused(f"block_size must be an int, got {block_size!r}")
    if block_size <= 0:
        raise _Refused(f"block_size must be > 0, got {block_size}")
    if not isinstance(cache_dtype, str):
        raise _Refused(f"cache_dtype must be a str, got {cache_dtype!r}")
    name = cache_dtype.strip().lower().removeprefix("torch.")
    want = _DTYPE_ALIASES.get(name) or getattr(torch, name, None)
    return want if isinstance(want, torch.dtype) else None


def _check_block_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, _SEQUENCE):
        raise _Refused(f"block_ids must be a list of ints, got {type(value).__name__}")
    if all(type(b) is int for b in value):  # the common case, one pass (bool is not int here)
        return tuple(value)
    bad = [b for b in value if isinstance(b, bool) or not isinstance(b, _INTEGER)]
    if bad:
        raise _Refused(f"block_ids must be ints; got {bad[0]!r} ({type(bad[0]).__name__})")
    return tuple(int(b) for b in value)


def _is_count(value: Any) -> bool:
    """Whether ``value`` is a token count a stream's tail can be cut from (an int >= 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _metadata(entry: Mapping[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    custom = entry.get("custom_metadata")
    if custom is None:
        return base
    if not isinstance(custom, Mapping):
        raise _Refused(f"custom_metadata must be a dict, got {type(custom).__name__}")
    clash = [k for k in _RESERVED_METADATA if k in custom and custom[k] != base[k]]
    if clash:
        k = clash[0]
        raise _Refused(f"custom_metadata[{k!r}]={custom[k]!r} contradicts {k}={base[k]!r}")
    return {**custom, **base}


def _detached(layer: Any) -> Any:
    """A layer's cache without autograd history (views; no copy)."""
    if isinstance(layer, torch.Tensor):
        return layer.detach() if layer.requires_grad else layer
    if isinstance(layer, _SEQUENCE) and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in layer
    ):
        return type(layer)(t.detach() if isinstance(t, torch.Tensor) else t for t in layer)
    return layer


def _check_kv(
    keys: Sequence[BlockGather | None],
    values: Sequence[BlockGather | None],
    want: torch.dtype | None,
) -> None:
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k is None or v is None:
            continue
        kb, vb = k.blocks, v.blocks
        if kb.dtype != vb.dtype:
            raise _Refused(f"layer {i}: K dtype {kb.dtype} != V dtype {vb.dtype}")
        k_heads = kb.shape[2] if kb.dim() > 2 else 1
        v_heads = vb.shape[2] if vb.dim() > 2 else 1
        if k_heads != v_heads:
            raise _Refused(f"layer {i}: K has {k_heads} heads, V has {v_heads}")
        if want is not None and kb.dtype != want:
            raise _Refused(f"layer {i}: cache dtype {kb.dtype} does not match cache_dtype {want}")


def _slice_heads(
    sources: Sequence[BlockGather | torch.Tensor | None], start: int, stop: int
) -> list[BlockGather | torch.Tensor | None]:
    """Heads ``[start, stop)`` of each layer: of a gather's blocks, or of a coded
    ``[tokens, heads, head_dim + 4]`` tensor."""
    out: list[BlockGather | torch.Tensor | None] = []
    for g in sources:
        if g is None or isinstance(g, torch.Tensor):
            out.append(None if g is None else g[:, start:stop])
        else:
            out.append(BlockGather(g.blocks[:, :, start:stop], g.block_ids, g.seq_len, g.index))
    return out


def _coded(gathers: Sequence[BlockGather | None], codec: str) -> list[torch.Tensor | None]:
    """Each layer's tokens gathered and coded with ``codec``."""
    return [None if g is None else encode_rows(g.materialize(), codec) for g in gathers]


def _num_heads(gathers: Sequence[BlockGather | None]) -> int:
    for g in gathers:
        if g is not None:
            return int(g.blocks.shape[2]) if g.blocks.dim() >= 3 else 1
    return 1


class _Batch(NamedTuple):
    """What every request of one ``handle_finished_requests_kv_transfer`` call (or one
    ``stream_kv_blocks`` step) shares (a tuple: one is built per call; :meth:`KVSender.prepare`)."""

    kv_caches: Sequence[Any]
    block_size: int
    cache_dtype: str
    want_dtype: torch.dtype | None
    resolver: Callable[[str], str] | None
    deadline: float


#: The public names of a call's checked inputs and of a refusal (:mod:`omnikv.transfer.stream`).
SendBatch = _Batch
SendRefused = _Refused


class TailPlan(NamedTuple):
    """What a streamed request's finish sends
    (:meth:`~omnikv.transfer.stream.sending.KVStreams.tail`): the tail's blocks
    (:meth:`blocks`), its manifest (the header's ``sm``) and the chunk keys it refers to."""

    first_block: int
    manifest: dict[str, Any]
    chunk_keys: list[str]

    def blocks(
        self, block_ids: Sequence[int], seq_len: int, block_size: int
    ) -> tuple[Sequence[int], int]:
        """The block ids and token count of the tail (tokens after the last chunk). An empty
        tail still names one block (the planner needs one; zero tokens are read from it)."""
        ids = block_ids[self.first_block :] or block_ids[self.first_block - 1 : self.first_block]
        return ids, seq_len - self.first_block * block_size


class TailSource(Protocol):
    """Where a finish learns that its request was streamed (the edge's
    :class:`~omnikv.transfer.stream.sending.KVStreams`, passed to :meth:`KVSender.send_batch`):
    the :class:`TailPlan` to send instead of the whole request, or ``None``."""

    def tail(
        self,
        request_id: str,
        transfer_id: str,
        keys: list[str],
        block_ids: Sequence[int],
        seq_len: int,
        batch: SendBatch,
    ) -> TailPlan | None: ...


class KVSender:
    """Turns finished requests into published payloads for one stage edge.

    Made by the transfer edge, with its ``connector`` (a :class:`LazyConnector`) and its
    delivery book (``deliveries``: fed by the connector's listener, ``None`` without verdicts);
    :meth:`set_hooks` replaces (never mutates) the hooks when the worker installs a send-key
    builder. Knows nothing of streams: a finish is handed its stream's tail
    (:class:`TailSource`).
    """

    def __init__(
        self,
        *,
        stages: tuple[str | None, str | None],
        topology: KVTPTopology,
        options: TransferOptions,
        connector: LazyConnector,
        hooks: TransferHooks | None = None,
        deliveries: DeliveryBook | None = None,
        enabled: bool = True,
        configured: bool = True,
    ) -> None:
        self.stages = stages
        self.topology = topology
        self.options = options
        self.connector = connector
        self.hooks = hooks or TransferHooks()
        #: ``need_send_cache``; ``configured``: the manager sends or receives at all.
        self.enabled, self.configured = enabled, configured
        #: Each cache layer's K/V split and checks, kept across requests (see LayerCache).
        self.layers = LayerCache()
        #: Session, epoch and sequence written into every payload (duplicates, restarts).
        self.stamps = SenderStamps(options.instance_id)
        #: Verdicts of what was sent; fed by the connector's listener.
        self.deliveries = deliveries
        self._listened: OmniConnectorBase | None = None

    def set_hooks(self, hooks: TransferHooks) -> None:
        """Use ``hooks`` from the next send on (the edge's, when the worker sets a slot)."""
        self.hooks = hooks

    def send_batch(
        self,
        finished_reqs: Mapping[str, Any],
        kv_caches: Any,
        block_size: Any,
        cache_dtype: Any,
        request_id_resolver: Callable[[str], str] | None = None,
        *,
        deadline: float,
        tails: TailSource | None = None,
    ) -> list[SendResult]:
        """One :class:`SendResult` per request, in order; never raises for a request's failure.
        ``tails`` (the edge's streams) gives a streamed request's tail to send.

        Not sending at all (``need_send_cache`` false, no connector) is recorded per request:
        ``not_configured`` when the manager neither sends nor receives, else skipped/failed.
        """
        return self._send_all(
            finished_reqs,
            kv_caches,
            block_size,
            cache_dtype,
            request_id_resolver,
            deadline,
            tails=tails,
        )

    def _send_all(
        self,
        finished_reqs: Mapping[str, Any],
        kv_caches: Any,
        block_size: Any,
        cache_dtype: Any,
        resolver: Callable[[str], str] | None,
        deadline: float,
        *,
        tails: TailSource | None,
    ) -> list[SendResult]:
        if type(finished_reqs) is not dict and not isinstance(finished_reqs, Mapping):
            why = f"finished_reqs must be a dict of request entries, got {type(finished_reqs)}"
            return [self._fail(str(rid), why) for rid in finished_reqs]
        if not self.enabled or self.connector.get() is None:
            if self.enabled:
                logger.warning("No connector available, skipping KV transfer but freeing resources")
            return [self._not_sending(str(rid)) for rid in finished_reqs]
        try:
            batch = self.prepare(kv_caches, block_size, cache_dtype, resolver, deadline)
        except _Refused as exc:
            return [self._fail(str(rid), str(exc)) for rid in finished_reqs]
        return [
            self._send_one(str(rid), entry, batch, tails) for rid, entry in finished_reqs.items()
        ]

    @staticmethod
    def prepare(
        kv_caches: Any,
        block_size: Any,
        cache_dtype: Any,
        resolver: Callable[[str], str] | None,
        deadline: float,
    ) -> _Batch:
        """The checked :class:`_Batch` of one call (the finish, or a streaming step); raises
        :class:`SendRefused` with the reason the caches cannot be sent."""
        want = _check_batch(kv_caches, block_size, cache_dtype)
        layers = [_detached(layer) for layer in kv_caches]
        return _Batch(layers, int(block_size), cache_dtype, want, resolver, deadline)

    def _send_one(
        self, request_id: str, entry: Any, batch: _Batch, tails: TailSource | None
    ) -> SendResult:
        try:
            result = self.send(request_id, entry, batch, tails)
        except Exception as exc:  # input nobody foresaw: this request fails, the batch goes on
            logger.debug("sending %s raised", request_id, exc_info=True)
            result = self._fail(request_id, f"{type(exc).__name__}: {exc}")
        book = self.deliveries
        return result if book is None else book.settle(result)

    def _watch(self, connector: OmniConnectorBase, request_id: str, keys: list[str]) -> None:
        """Have ``connector`` report the verdicts of ``keys`` to :attr:`deliveries` (the listener
        is installed once per connector, before its first put)."""
        book = self.deliveries
        if book is None or not connector.acknowledges:
            return
        self.listen(connector)
        book.expect(request_id, keys)

    def listen(self, connector: OmniConnectorBase) -> None:
        """Install :attr:`deliveries`' listener on ``connector`` (once per connector), so that
        what is published from now on reports its verdict (also a stream's chunks, put before
        their request is watched)."""
        book = self.deliveries
        if book is not None and connector.acknowledges and self._listened is not connector:
            connector.set_delivery_listener(book.on_report)
            self._listened = connector

    def send(
        self, request_id: str, entry: Any, batch: _Batch, tails: TailSource | None = None
    ) -> SendResult:
        """Validate, extract, encode and publish one request (a streamed one: its tail, unless
        a receiver already refused one of its chunks: then nothing more is published and the
        send is ``refused`` with that receiver's reason)."""
        t0 = time.perf_counter()
        mapping = type(entry) is dict or isinstance(entry, Mapping)
        block_ids = entry.get("block_ids") if mapping else None
        if not isinstance(block_ids, _ARRAY) and not block_ids:
            logger.warning("Request %s has no block_ids; nothing sent", request_id)
            return SendResult(request_id, SendStatus.SKIPPED, reason="no block_ids")
        from_stage, to_stage = self.stages
        if from_stage is None or to_stage is None:
            return self._fail(request_id, "send stages are not configured (omni_from/to_stage)")
        connector = self.connector.get()
        if connector is None:
            return self._fail(request_id, "no connector available")
        try:
            transfer_id = self.transfer_id(request_id, batch.resolver)
            payloads, keys, shipped = self._plan(
                request_id, transfer_id, entry, batch, (from_stage, to_stage), tails
            )
        except (_Refused, OmniKVError) as exc:
            return self._fail(request_id, str(exc))
        t_plan = time.perf_counter()
        self._watch(connector, request_id, [*shipped, *keys])
        book = self.deliveries
        early = None if not shipped or book is None else book.early(request_id)
        if early is not None:  # a receiver refused a chunk: the tail would go to nobody
            logger.debug("KV tail of %s not published: %s", transfer_id, early.reason)
            return SendResult(request_id, early.status, transfer_id, shipped, 0, early.reason)
        total, failed = self.put_all(
            connector, (from_stage, to_stage), keys, payloads, batch.deadline, self.options.retry
        )
        keys = [*shipped, *keys]  # a streamed request's chunks, then its keys
        t_end = time.perf_counter()
        timings = {"extract_ms": (t_plan - t0) * 1e3, "encode_put_ms": (t_end - t_plan) * 1e3}
        if failed:
            reason = "put failed for " + "; ".join(failed)
            _outsider.error("KV transfer FAILED: %s (%s)", transfer_id, reason)
            return SendResult(
                request_id, SendStatus.FAILED, transfer_id, keys, total, reason, timings
            )
        logger.debug("KV sent for %s: %d bytes, %d key(s)", transfer_id, total, len(keys))
        return SendResult(request_id, SendStatus.SENT, transfer_id, keys, total, None, timings)

    def put_all(
        self,
        connector: OmniConnectorBase,
        stages: tuple[str, str],
        keys: Sequence[str],
        payloads: Sequence[PackedPayload],
        deadline: float,
        policy: RetryPolicy,
    ) -> tuple[int, list[str]]:
        """Put each payload under its key (:func:`put_with_retry`); the bytes published and a
        ``"key: error"`` line per key that failed."""
        total, failed = 0, []
        for key, payload in zip(keys, payloads, strict=True):
            ok, size, err = put_with_retry(
                connector, stages, key, payload, policy, deadline=deadline
            )
            total += size
            if not ok:
                failed.append(f"{key}: {err}")
        return total, failed

    def plan_blocks(
        self,
        transfer_id: str,
        keys: list[str],
        block_ids: Sequence[int],
        batch: _Batch,
        stream: Mapping[str, Any],
        metadata: Mapping[str, Any] | None = None,
    ) -> list[PackedPayload]:
        """One payload per key holding every token of the full blocks ``block_ids``, marked as
        the piece ``stream`` of a streamed send (:mod:`omnikv.transfer.stream`, which calls
        this once per chunk), with the chunk's own ``metadata``. Sliced per target rank as a
        whole send is; raises :class:`SendRefused` / ``OmniKVError`` with the reason it cannot
        be made."""
        ids = _check_block_ids(block_ids)
        keys_g, values_g = plan_request_kv(
            batch.kv_caches,
            ids,
            len(ids) * batch.block_size,
            batch.block_size,
            layout=self.options.kv_cache_layout,
            request_id=transfer_id,
            cache=self.layers,
        )
        _check_kv(keys_g, values_g, batch.want_dtype)
        meta = dict(metadata or {})
        return self._payloads(transfer_id, keys, keys_g, values_g, ids, meta, stream=stream)

    @staticmethod
    def transfer_id(request_id: str, resolver: Callable[[str], str] | None) -> str:
        """The id ``request_id`` travels under (``resolver``'s answer); raises
        :class:`SendRefused` when the resolver fails."""
        if resolver is None:
            return request_id
        try:
            return str(resolver(request_id))
        except Exception as exc:
            raise _Refused(f"request_id_resolver raised {exc!r}") from exc

    def _plan(
        self,
        request_id: str,
        transfer_id: str,
        entry: Mapping[str, Any],
        batch: _Batch,
        stages: tuple[str, str],
        tails: TailSource | None,
    ) -> tuple[list[PackedPayload], list[str], list[str]]:
        """The payloads and keys of one request, and the chunk keys its stream already
        published (a streamed request's payloads then hold only its tail and the manifest:
        its KV is planned once, for the tail alone); raises with the reason it cannot be
        sent."""
        block_ids = _check_block_ids(entry.get("block_ids"))
        seq_len = entry.get("seq_len")
        keys = build_send_keys(self.topology, transfer_id, *stages, self.hooks.send_keys)
        for key in keys:
            why = reserved_key(key)
            if why is not None:
                raise _Refused(why)
        tail = None
        ids: Sequence[int] = block_ids
        tokens: Any = seq_len  # checked by plan_request_kv
        if tails is not None and isinstance(seq_len, int) and _is_count(seq_len):
            tail = tails.tail(request_id, transfer_id, keys, block_ids, seq_len, batch)
            if tail is not None:
                ids, tokens = tail.blocks(block_ids, seq_len, batch.block_size)
        keys_g, values_g = plan_request_kv(
            batch.kv_caches,
            ids,
            tokens,
            batch.block_size,
            layout=self.options.kv_cache_layout,
            request_id=transfer_id,
            cache=self.layers,
        )
        _check_kv(keys_g, values_g, batch.want_dtype)
        assert isinstance(seq_len, int)  # validated by plan_request_kv
        base = {
            "block_size": batch.block_size,
            "num_layers": len(batch.kv_caches),
            "dtype": batch.cache_dtype,
            "seq_len": seq_len,
        }
        metadata = _metadata(entry, base)
        stream = None if tail is None else tail.manifest
        payloads = self._payloads(
            transfer_id, keys, keys_g, values_g, block_ids, metadata, stream=stream
        )
        return payloads, keys, [] if tail is None else tail.chunk_keys

    def _data_check(self) -> bool:
        """Whether this sender's payloads carry the data check: ``payload_checksum`` when set,
        else what the connector's kind calls for (:attr:`OmniConnectorBase.checks_data`)."""
        forced = self.options.payload_checksum
        if forced is not None:
            return forced
        connector = self.connector.get()
        return connector is not None and type(connector).checks_data

    def _payloads(
        self,
        transfer_id: str,
        keys: list[str],
        keys_g: list[BlockGather | None],
        values_g: list[BlockGather | None],
        block_ids: Sequence[int],
        metadata: dict[str, Any],
        *,
        stream: Mapping[str, Any] | None = None,
    ) -> list[PackedPayload]:
        """One payload per key (``stream``: the piece of a streamed send each one is): the
        same one for every key, or, when a smaller sender TP
        feeds a larger receiver TP, each target rank's heads. With ``wire_codec`` the tokens are
        gathered and coded first (:func:`omnikv.wire.codec.encode_rows`); raises
        ``EncodeError`` for KV the codec does not code."""
        topo = self.topology
        codec = self.options.wire_codec
        keys_src: Sequence[BlockGather | torch.Tensor | None] = keys_g
        values_src: Sequence[BlockGather | torch.Tensor | None] = values_g
        extra: dict[str, Any] = {
            "checksum": self._data_check(),
            "stamp": self.stamps.next(),
            "stream": stream,
        }
        if codec != "off":
            present = [g for g in (*keys_g, *values_g) if g is not None]
            original = DTYPE_TO_NAME.get(present[0].dtype) if present else "float16"
            extra["coded"] = Coded(codec, original or "float16")
            keys_src, values_src = _coded(keys_g, codec), _coded(values_g, codec)
        targets = topo.target_ranks()
        slicing = (
            topo.source_tp_size < topo.target_tp_size
            and len(keys) > 1
            and self.hooks.send_keys is None
        )
        if slicing and len(targets) != len(keys):
            logger.warning(
                "TP slicing for %s: %d keys but %d target ranks; sending unsliced",
                transfer_id,
                len(keys),
                len(targets),
            )
            slicing = False
        if not slicing:
            one = PackedPayload(transfer_id, keys_src, values_src, block_ids, metadata, **extra)
            return [one] * len(keys)
        heads = _num_heads(keys_g)
        out: list[PackedPayload] = []
        for target in targets:
            start, stop = head_range(heads, target % topo.ratio, topo.ratio)
            meta = {**metadata, "tp_head_slice": head_slice_tag(topo, target, side="sender")}
            sliced_k, sliced_v = (
                _slice_heads(keys_src, start, stop),
                _slice_heads(values_src, start, stop),
            )
            out.append(PackedPayload(transfer_id, sliced_k, sliced_v, block_ids, meta, **extra))
        return out

    def _not_sending(self, rid: str) -> SendResult:
        if not self.enabled:
            status, reason = SendStatus.SKIPPED, "need_send_cache is false"
        else:
            status = SendStatus.FAILED
            reason = f"no connector available ({self.connector.error or 'not configured'})"
        status = status if self.configured else SendStatus.NOT_CONFIGURED
        return SendResult(rid, status, rid, reason=reason)

    @staticmethod
    def _fail(request_id: str, reason: str) -> SendResult:
        _outsider.error("Failed KV transfer for %s: %s", request_id, reason)
        return SendResult(request_id, SendStatus.FAILED, request_id, [], 0, reason)
