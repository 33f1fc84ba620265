"""In-process connector: both stages live in one process (tests, single-process pipelines).

Honours the whole connector contract and is the reference double for tests: consume-once gets,
a ``wait`` woken by ``put`` through a condition variable (no polling), ``cleanup``, ``health`` and
an idempotent ``close``. Connectors created with the same ``namespace`` (config key, default
``"default"``) share one store, so a sender and a receiver manager in the same process meet.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from omnikv.connectors.base import GetResult, OmniConnectorBase, PutResult
from omnikv.deadline import remaining
from omnikv.errors import ConnectorClosedError

__all__ = ["LocalConnector"]

logger = logging.getLogger(__name__)


class _Store:
    def __init__(self) -> None:
        self.items: dict[str, tuple[Any, int]] = {}
        self.cond = threading.Condition()


def _payload_size(data: Any) -> tuple[Any, int]:
    """(stored object, size). In-process, objects (e.g. the dict form) are kept as they are."""
    if isinstance(data, torch.Tensor):
        return data, int(data.numel() * data.element_size())
    if isinstance(data, bytes | bytearray | memoryview):
        return data, memoryview(data).nbytes
    if data is None:
        raise ValueError("cannot put None")
    return data, 0


class LocalConnector(OmniConnectorBase):
    """Keyed in-memory hand-off between managers of one process."""

    supports_raw_data = True
    supports_notify = True
    _stores: ClassVar[dict[str, _Store]] = {}
    _stores_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = dict(config or {})
        self.namespace = str(cfg.get("namespace", "default"))
        with self._stores_lock:
            self._store = self._stores.setdefault(self.namespace, _Store())
        self._counters = {"puts": 0, "gets": 0, "misses": 0, "bytes_put": 0, "bytes_got": 0}

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosedError("LocalConnector is closed")

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
        """Store ``data`` under the edge key; the connector owns it afterwards."""
        if self._closed:
            logger.warning("put on a closed LocalConnector (key %s)", put_key)
            return False, 0, None
        try:
            stored, size = _payload_size(data)
        except (TypeError, ValueError) as exc:
            logger.error("LocalConnector cannot store %s: %s", put_key, exc)
            return False, 0, None
        key = self._make_key(put_key, from_stage, to_stage)
        with self._store.cond:
            self._store.items[key] = (stored, size)
            self._store.cond.notify_all()
        self._counters["puts"] += 1
        self._counters["bytes_put"] += size
        logger.debug("LocalConnector put %s (%d bytes)", key, size)
        return True, size, {"key": key, "size": size}

    def _take(self, key: str) -> GetResult | None:
        item = self._store.items.pop(key, None)
        if item is None:
            return None
        obj, size = item
        self._counters["gets"] += 1
        self._counters["bytes_got"] += size
        return obj, size

    def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Take the payload if present (consume-once); ``None`` otherwise."""
        self._check_open()
        key = self._make_key(get_key, from_stage, to_stage)
        with self._store.cond:
            result = self._take(key)
        if result is None:
            self._counters["misses"] += 1
        return result

    def wait(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        *,
        deadline: float,
        metadata: dict[str, Any] | None = None,
    ) -> GetResult | None:
        """Block on the store's condition until the key is put or ``deadline`` passes."""
        self._check_open()
        key = self._make_key(get_key, from_stage, to_stage)
        with self._store.cond:
            while True:
                result = self._take(key)
                if result is not None:
                    return result
                left = remaining(deadline)
                if left <= 0 or self._closed:
                    self._counters["misses"] += 1
                    return None
                self._store.cond.wait(timeout=min(left, 3600.0))

    def cleanup(self, request_id: str) -> None:
        """Drop unconsumed payloads whose key is, starts with ``id_`` or ends with ``_id``."""
        with self._store.cond:
            for key in list(self._store.items):
                base = key.rsplit("@", 1)[0]
                if (
                    base == request_id
                    or base.startswith(f"{request_id}_")
                    or base.endswith(f"_{request_id}")
                ):
                    del self._store.items[key]

    def pending_keys(self) -> list[str]:
        """Keys published and not yet consumed (tests, diagnostics)."""
        with self._store.cond:
            return list(self._store.items)

    def health(self) -> dict[str, Any]:
        with self._store.cond:
            pending = len(self._store.items)
        return {
            "status": "closed" if self._closed else "healthy",
            "type": "LocalConnector",
            "namespace": self.namespace,
            "pending": pending,
            **self._counters,
        }

    def close(self) -> None:
        """Idempotent; wakes waiters (they return ``None``). Unconsumed data stays for others."""
        if self._closed:
            return
        self._closed = True
        with self._store.cond:
            self._store.cond.notify_all()
