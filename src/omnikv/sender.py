"""Send path: extract a finished request's blocks -> encode into connector memory -> put.

Called by the manager's ``handle_finished_requests_kv_transfer`` on the model-runner thread,
once per finished request. Every request gets a :class:`SendResult` (sent, skipped, or failed
and why); nothing here raises for a single request's failure.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omnikv.config import RetryPolicy, TransferOptions
from omnikv.connectors.base import OmniConnectorBase
from omnikv.errors import OmniKVError
from omnikv.layouts import BlockGather, ExtractionError, plan_request_kv
from omnikv.payload import PackedPayload
from omnikv.topology import KVTPTopology, SendKeyBuilder, build_send_keys, head_range

__all__ = ["KVSender", "SendResult", "SendStatus", "put_with_retry"]

logger = logging.getLogger(__name__)


class SendStatus(str, Enum):
    SENT = "sent"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass
class SendResult:
    """Outcome of one request's send. ``ok`` only when every key was published."""

    request_id: str
    status: SendStatus
    transfer_id: str = ""
    keys: list[str] = field(default_factory=list)
    nbytes: int = 0
    reason: str | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status is SendStatus.SENT


def put_with_retry(
    connector: OmniConnectorBase,
    from_stage: str,
    to_stage: str,
    key: str,
    payload: PackedPayload,
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[bool, int, str | None]:
    """Publish ``payload`` under ``key`` with up to ``policy.attempts`` tries.

    Each try encodes straight into connector memory (``put_packed``). Returns
    ``(ok, size, last_error)``.
    """
    last_error: str | None = None
    for attempt in range(policy.attempts):
        try:
            ok, size, _meta = connector.put_packed(
                from_stage, to_stage, key, payload.nbytes, payload.pack_into, deadline=math.inf
            )
            if ok:
                return True, size, None
            last_error = "connector refused the put"
        except OmniKVError as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a backend bug must not kill the model runner
            logger.exception("connector put raised for key %s", key)
            last_error = f"{type(exc).__name__}: {exc}"
        if attempt + 1 < policy.attempts:
            delay = policy.delay(attempt)
            logger.warning(
                "Transfer attempt %d/%d for %s failed (%s); retrying in %.2fs",
                attempt + 1,
                policy.attempts,
                key,
                last_error,
                delay,
            )
            sleep(delay)
    return False, 0, last_error


def _slice_heads(
    gathers: Sequence[BlockGather | None], start: int, stop: int
) -> list[BlockGather | None]:
    out: list[BlockGather | None] = []
    for g in gathers:
        if g is None:
            out.append(None)
        else:
            out.append(BlockGather(g.blocks[:, :, start:stop], g.block_ids, g.seq_len))
    return out


class KVSender:
    """Turns finished requests into published payloads for one stage edge.

    ``connector`` is a zero-argument callable returning the current connector (the manager
    creates it lazily); ``send_key_builder`` is the manager's hook slot, read on every call.
    """

    def __init__(
        self,
        *,
        stages: tuple[str | None, str | None],
        topology: KVTPTopology,
        options: TransferOptions,
        connector: Callable[[], OmniConnectorBase | None],
        send_key_builder: Callable[[], SendKeyBuilder | None] = lambda: None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.stages = stages
        self.topology = topology
        self.options = options
        self._connector = connector
        self._hook = send_key_builder
        self._sleep = sleep

    def send(
        self,
        request_id: str,
        entry: Mapping[str, Any],
        kv_caches: Sequence[Any],
        block_size: int,
        cache_dtype: str,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> SendResult:
        """Extract, encode and publish one request; never raises for this request's failure."""
        t0 = time.perf_counter()
        block_ids = entry.get("block_ids") if isinstance(entry, Mapping) else None
        if not block_ids:
            logger.warning("Request %s has no block_ids; nothing sent", request_id)
            return SendResult(request_id, SendStatus.SKIPPED, reason="no block_ids")
        from_stage, to_stage = self.stages
        if from_stage is None or to_stage is None:
            return self._fail(request_id, "send stages are not configured (omni_from/to_stage)")
        connector = self._connector()
        if connector is None:
            return self._fail(request_id, "no connector available")
        try:
            transfer_id = request_id_resolver(request_id) if request_id_resolver else request_id
        except Exception as exc:
            return self._fail(request_id, f"request_id_resolver raised {exc!r}")
        transfer_id = str(transfer_id)
        seq_len = entry.get("seq_len")
        try:
            keys_g, values_g = plan_request_kv(
                kv_caches,
                block_ids,
                seq_len,
                block_size,
                layout=self.options.kv_cache_layout,
                request_id=request_id,
            )
        except ExtractionError as exc:
            return self._fail(request_id, str(exc), transfer_id=transfer_id)
        assert isinstance(seq_len, int)  # validated by plan_request_kv
        custom = entry.get("custom_metadata") or {}
        metadata: dict[str, Any] = {
            "block_size": int(block_size),
            "num_layers": len(kv_caches),
            "dtype": str(cache_dtype),
            "seq_len": int(seq_len),
            **(dict(custom) if isinstance(custom, Mapping) else {}),
        }
        t_plan = time.perf_counter()
        hook = self._hook()
        keys = build_send_keys(self.topology, transfer_id, from_stage, to_stage, hook)
        try:
            payloads = self._payloads(
                transfer_id, keys, keys_g, values_g, block_ids, metadata, hook
            )
        except OmniKVError as exc:
            return self._fail(request_id, str(exc), transfer_id=transfer_id, keys=keys)
        total = 0
        failed: list[str] = []
        for key, payload in zip(keys, payloads, strict=True):
            ok, size, err = put_with_retry(
                connector, from_stage, to_stage, key, payload, self.options.retry, sleep=self._sleep
            )
            if ok:
                total += size
            else:
                failed.append(f"{key}: {err}")
        t_end = time.perf_counter()
        timings = {"extract_ms": (t_plan - t0) * 1e3, "encode_put_ms": (t_end - t_plan) * 1e3}
        if failed:
            reason = "put failed for " + "; ".join(failed)
            logger.error("KV transfer FAILED: %s (%s)", transfer_id, reason)
            return SendResult(
                request_id, SendStatus.FAILED, transfer_id, keys, total, reason, timings
            )
        secs = max(t_end - t0, 1e-9)
        logger.debug(
            "KV sent for %s: %d bytes, %d key(s), %.2f ms, %.1f MB/s",
            transfer_id,
            total,
            len(keys),
            secs * 1e3,
            total / secs / 1e6,
        )
        return SendResult(request_id, SendStatus.SENT, transfer_id, keys, total, None, timings)

    def _payloads(
        self,
        transfer_id: str,
        keys: list[str],
        keys_g: list[BlockGather | None],
        values_g: list[BlockGather | None],
        block_ids: Sequence[int],
        metadata: dict[str, Any],
        hook: SendKeyBuilder | None,
    ) -> list[PackedPayload]:
        topo = self.topology
        checksum = self.options.payload_checksum
        slicing = topo.source_tp_size < topo.target_tp_size and len(keys) > 1 and hook is None
        if slicing:
            targets = topo.target_ranks()
            if len(targets) != len(keys):
                logger.warning(
                    "TP slicing for %s: %d keys but %d target ranks; sending unsliced",
                    transfer_id,
                    len(keys),
                    len(targets),
                )
                slicing = False
        if not slicing:
            one = PackedPayload(
                transfer_id, keys_g, values_g, block_ids, metadata, checksum=checksum
            )
            return [one] * len(keys)
        heads = _num_heads(keys_g)
        out: list[PackedPayload] = []
        ratio = topo.ratio
        for target in topo.target_ranks():
            offset = target % ratio
            start, stop = head_range(heads, offset, ratio)
            meta = dict(metadata)
            meta["tp_head_slice"] = {
                "applied": True,
                "side": "sender",
                "target_rank": target,
                "source_rank": topo.local_rank,
                "from_tp": topo.source_tp_size,
                "to_tp": topo.target_tp_size,
                "offset_in_shard": offset,
                "num_slices": ratio,
            }
            out.append(
                PackedPayload(
                    transfer_id,
                    _slice_heads(keys_g, start, stop),
                    _slice_heads(values_g, start, stop),
                    block_ids,
                    meta,
                    checksum=checksum,
                )
            )
        return out

    def _fail(
        self,
        request_id: str,
        reason: str,
        *,
        transfer_id: str = "",
        keys: list[str] | None = None,
    ) -> SendResult:
        logger.error("Failed KV transfer for %s: %s", request_id, reason)
        return SendResult(
            request_id, SendStatus.FAILED, transfer_id or request_id, keys or [], 0, reason
        )


def _num_heads(gathers: Sequence[BlockGather | None]) -> int:
    for g in gathers:
        if g is not None:
            return int(g.blocks.shape[2]) if g.blocks.dim() >= 3 else 1
    return 1
