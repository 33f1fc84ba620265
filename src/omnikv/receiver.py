"""Receive path: keys -> wait with a deadline -> decode -> merge/slice -> optional device copy.

Called by the manager (``receive_kv_cache_for_request`` and everything built on it), possibly
from several threads at once (CFG companions, prefetch). :meth:`KVReceiver.receive` never raises
for a miss: it returns a :class:`ReceiveResult` whose status says why (ok, timeout, corrupt,
unavailable, peer_gone, skipped). The one exception is :class:`KVPrefetchConsumeError`: the payload
was consumed but could not be made usable (e.g. the device copy failed), so retrying is pointless.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from omnikv.config import TransferOptions
from omnikv.connectors.base import ManagedBuffer, OmniConnectorBase, get_result
from omnikv.errors import (
    ConnectorError,
    ConnectorUnavailableError,
    DecodeError,
    KVPrefetchConsumeError,
    PeerGoneError,
)
from omnikv.payload import decode, decode_device
from omnikv.topology import (
    KVTPTopology,
    PayloadMerger,
    PayloadSlicer,
    RecvKeyBuilder,
    build_recv_keys,
    merge_received_rank_shards,
    rank_port,
    slice_received_rank_shard,
)

__all__ = ["KVReceiver", "ReceiveResult", "ReceiveStatus", "SenderEndpoint"]

logger = logging.getLogger(__name__)

SenderEndpoint = tuple[str, int]
"""``(host, rank-0 port)`` of the sender stage, as the orchestrator reports it."""


class ReceiveStatus(str, Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    CORRUPT = "corrupt"
    UNAVAILABLE = "unavailable"
    PEER_GONE = "peer_gone"
    SKIPPED = "skipped"
    #: The caller aborted the wait (prefetch shutdown); nothing was consumed for the missing key.
    CANCELLED = "cancelled"


@dataclass
class ReceiveResult:
    """Outcome of one request's receive. ``data`` is the decoded dict when ``ok``."""

    request_id: str
    status: ReceiveStatus
    data: dict[str, Any] | None = None
    nbytes: int = 0
    keys: list[str] = field(default_factory=list)
    reason: str | None = None
    waited_s: float = 0.0
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is ReceiveStatus.OK


def _is_layer_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("layer_blocks"), dict)


def _map_tensors(data: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    blocks = data["layer_blocks"]
    for cache in ("key_cache", "value_cache"):
        layers = blocks.get(cache)
        if isinstance(layers, list):
            blocks[cache] = [fn(t) if isinstance(t, torch.Tensor) else t for t in layers]


#: Longest single connector wait when the caller passed an ``abort`` event (seconds).
ABORT_SLICE_S = 0.05


class _Aborted(Exception):
    """The ``abort`` event was set between two wait slices."""


def _wait_sliced(
    connector: OmniConnectorBase,
    from_stage: str,
    to_stage: str,
    key: str,
    deadline: float,
    metadata: dict[str, Any] | None,
    abort: threading.Event | None,
) -> Any:
    """``connector.wait`` until ``deadline``, cut into abortable slices when ``abort`` is given.

    A wait that returns ``None`` at its (slice) deadline consumes nothing (connector contract),
    so slicing never loses a payload. Raises :class:`_Aborted` once ``abort`` is set.
    """
    if abort is None:
        return connector.wait(from_stage, to_stage, key, deadline=deadline, metadata=metadata)
    while True:
        if abort.is_set():
            raise _Aborted
        step = min(deadline, time.monotonic() + ABORT_SLICE_S)
        got = connector.wait(from_stage, to_stage, key, deadline=step, metadata=metadata)
        if got is not None or step >= deadline:
            return got


class KVReceiver:
    """Receives one request's KV for the local rank of one stage edge.

    ``connector`` is a zero-argument callable returning the current connector (created lazily by
    the manager); the hook slots are read on every call so the worker may install them late.
    """

    def __init__(
        self,
        *,
        stages: tuple[str | None, str | None],
        topology: KVTPTopology,
        options: TransferOptions,
        connector: Callable[[], OmniConnectorBase | None],
        recv_key_builder: Callable[[], RecvKeyBuilder | None] = lambda: None,
        merger: Callable[[], PayloadMerger | None] = lambda: None,
        slicer: Callable[[], PayloadSlicer | None] = lambda: None,
    ) -> None:
        self.stages = stages
        self.topology = topology
        self.options = options
        self._connector = connector
        self._recv_hook = recv_key_builder
        self._merger = merger
        self._slicer = slicer

    def receive(
        self,
        request_id: str,
        *,
        deadline: float,
        sender: SenderEndpoint | None = None,
        per_call: bool = False,
        target_device: torch.device | str | None = None,
        abort: threading.Event | None = None,
    ) -> ReceiveResult:
        """Wait for every shard of ``request_id`` until ``deadline`` (absolute monotonic).

        ``sender`` is the sender stage's base endpoint; with ``per_call`` it was given for this
        call only and per-rank metadata is always sent. Shards already taken when a later shard
        times out are dropped (they were consumed; the result says so).

        ``abort`` (the prefetcher's stop event): when given, each connector wait is cut into
        slices of at most :data:`ABORT_SLICE_S` and the event is checked before every slice; once
        it is set the receive returns ``CANCELLED`` without calling the connector again.
        """
        t0 = time.monotonic()
        from_stage, to_stage = self.stages
        if from_stage is None or to_stage is None:
            return ReceiveResult(request_id, ReceiveStatus.SKIPPED, reason="recv stages unset")
        connector = self._connector()
        if connector is None:
            return ReceiveResult(
                request_id, ReceiveStatus.UNAVAILABLE, reason="no connector available"
            )
        pairs = build_recv_keys(self.topology, request_id, from_stage, to_stage, self._recv_hook())
        keys = [k for k, _ in pairs]
        raws: list[tuple[Any, int]] = []
        held: list[ManagedBuffer] = []
        try:
            for key, from_rank in pairs:
                metadata = None
                if sender is not None and (from_rank is not None or per_call):
                    metadata = {
                        "source_host": sender[0],
                        "source_port": rank_port(sender[1], from_rank),
                    }
                try:
                    got = _wait_sliced(
                        connector, from_stage, to_stage, key, deadline, metadata, abort
                    )
                except _Aborted:
                    detail = "receive aborted"
                    if raws:
                        detail += f"; {len(raws)} shard(s) already taken were dropped"
                    return self._miss(request_id, ReceiveStatus.CANCELLED, detail, keys, t0)
                except PeerGoneError as exc:
                    return self._miss(request_id, ReceiveStatus.PEER_GONE, str(exc), keys, t0)
                except ConnectorUnavailableError as exc:
                    return self._miss(request_id, ReceiveStatus.UNAVAILABLE, str(exc), keys, t0)
                except ConnectorError as exc:
                    return self._miss(request_id, ReceiveStatus.UNAVAILABLE, str(exc), keys, t0)
                if got is None:
                    waited = time.monotonic() - t0
                    detail = f"key {key} missing after {waited:.3f}s"
                    if raws:
                        detail += f"; {len(raws)} shard(s) already taken were dropped"
                    return self._miss(request_id, ReceiveStatus.TIMEOUT, detail, keys, t0)
                # merge: drop once every wait returns ManagedBuffer
                obj, size = get_result(got) if isinstance(got, ManagedBuffer) else got
                if isinstance(obj, ManagedBuffer):
                    held.append(obj)
                raws.append((obj, int(size)))
            t_wait = time.monotonic()
            try:
                payloads = [self._decode(obj, target_device) for obj, _ in raws]
            except DecodeError as exc:
                return self._miss(request_id, ReceiveStatus.CORRUPT, str(exc), keys, t0)
            # Buffers whose lifetime was handed to the decoded views are no longer ours.
            held[:] = [b for b in held if not b.released]
            t_decode = time.monotonic()
            data = payloads[0] if len(payloads) == 1 else None
            if len(payloads) > 1:
                data = merge_received_rank_shards(payloads, self._merger())
            data = slice_received_rank_shard(data, self.topology, self._slicer())
            if not isinstance(data, dict):
                return self._miss(
                    request_id, ReceiveStatus.CORRUPT, "payload is not a KV dict", keys, t0
                )
            data = self._finish(request_id, data, target_device, held)
            held.clear()
        finally:
            for buf in held:
                buf.release()
        t_end = time.monotonic()
        total = sum(size for _, size in raws)
        result = ReceiveResult(
            request_id,
            ReceiveStatus.OK,
            data,
            total,
            keys,
            None,
            t_wait - t0,
            {
                "wait_ms": (t_wait - t0) * 1e3,
                "decode_ms": (t_decode - t_wait) * 1e3,
                "finish_ms": (t_end - t_decode) * 1e3,
            },
        )
        logger.debug(
            "Received KV for %s: %d bytes across %d key(s), wait=%.3fs, decode=%.2fms",
            request_id,
            total,
            len(keys),
            t_wait - t0,
            (t_decode - t_wait) * 1e3,
        )
        return result

    # -- helpers ------------------------------------------------------------------------------
    def _decode(self, obj: Any, target_device: torch.device | str | None) -> Any:
        verify = True
        if isinstance(obj, ManagedBuffer):
            t = obj.tensor
            if t.device.type != "cpu":
                return decode_device(t, copy=True, verify=verify)
            if target_device is None and self.options.receive_copy == "auto":
                owned = obj.adopt()
                if owned is not None:
                    return decode(owned, verify=verify)
            return decode(t, verify=verify)
        if isinstance(obj, bytes | bytearray | memoryview):
            return decode(obj, verify=verify)
        if isinstance(obj, torch.Tensor):
            if obj.dtype != torch.uint8 or obj.dim() != 1:
                raise DecodeError(
                    f"corrupt KV payload: tensor payload must be 1-D uint8, got {obj.dtype}"
                )
            if obj.device.type != "cpu":
                return decode_device(obj, copy=True, verify=verify)
            return decode(obj, verify=verify)
        if _is_layer_dict(obj):
            return obj
        raise DecodeError(f"corrupt KV payload: unexpected payload type {type(obj).__name__}")

    def _finish(
        self,
        request_id: str,
        data: dict[str, Any],
        target_device: torch.device | str | None,
        held: Sequence[ManagedBuffer],
    ) -> dict[str, Any]:
        """Move to ``target_device`` or detach from pool memory; consume errors are fatal."""
        if not _is_layer_dict(data):
            return data
        try:
            if target_device is not None:
                device = torch.device(target_device)

                def move(t: torch.Tensor) -> torch.Tensor:
                    if t.device == device:
                        return t.clone() if held else t
                    return t.to(device).contiguous()

                _map_tensors(data, move)
                if device.type != "cpu" and torch.cuda.is_available():
                    torch.cuda.current_stream(device).synchronize()
            elif held:
                _map_tensors(data, lambda t: t.clone())
        except Exception as exc:
            logger.exception("Post-get processing failed for %s", request_id)
            raise KVPrefetchConsumeError(
                f"Post-get processing failed for {request_id}: {exc}; payload already consumed"
            ) from exc
        return data

    def _miss(
        self,
        request_id: str,
        status: ReceiveStatus,
        reason: str,
        keys: list[str],
        t0: float,
    ) -> ReceiveResult:
        waited = time.monotonic() - t0
        log = logger.warning if status is ReceiveStatus.TIMEOUT else logger.error
        log("KV receive for %s failed (%s): %s", request_id, status.value, reason)
        return ReceiveResult(request_id, status, None, 0, keys, reason, waited)
