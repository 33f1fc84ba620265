"""The stage configurations of one transport edge (sender stage "0" -> receiver stage "1"), for
scenarios that start stage processes (:mod:`support.kill_stage`) over every cross-process
transport: shared memory, Mooncake Transfer Engine, NIXL and Mooncake Store.

Each process gets its own index ``i`` (the Store keeps a client's segment by name; the pull
transports give each sender its own ports); :func:`open_edge` starts a ``mooncake_master`` for the
Store and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from support.mooncake_peers import Master, run_scenario
from support.pull_engine import free_base_port, kv_config

MiB = 1 << 20

#: Each transport's connector type and settings (``None``: built in :meth:`Edge.connector`).
TRANSPORTS: dict[str, dict[str, Any] | None] = {
    "shm": None,
    "te": {"type": "MooncakeTransferEngineConnector", "protocol": "tcp"},
    "nixl": {"type": "NixlConnector", "backends": ["UCX"]},
    "store": None,
}


class Edge:
    """One transport's stage configs: ``sender(i)`` / ``receiver(i)`` and the endpoint
    ``info(i)`` a receiver needs for sender ``i`` (pull transports; ``None`` elsewhere).
    ``extra`` is added to every connector config (expiry settings, ...); ``recv_s`` is each
    receiver's ``recv_timeout``."""

    def __init__(
        self,
        transport: str,
        store: Any = None,
        extra: dict[str, Any] | None = None,
        recv_s: float = 3.0,
    ) -> None:
        self.transport = transport
        self.namespace = f"k{uuid.uuid4().hex[:10]}"
        self.store = store
        self.extra = dict(extra or {})
        self.recv_s = recv_s
        self.ports: dict[int, int] = {}

    def connector(self, i: int) -> dict[str, Any]:
        """The connector config of process ``i``."""
        if self.transport == "shm":
            return {
                "type": "SharedMemoryConnector",
                "namespace": self.namespace,
                "pool_size_bytes": 4 * MiB,
                **self.extra,
            }
        if self.transport == "store":
            return {
                "type": "MooncakeStoreConnector",
                # a name no earlier client had (the Store keeps peers' segments by name)
                "host": f"127.0.0.1:{21000 + i}",
                "metadata_server": self.store.metadata_url,
                "master_server_address": self.store.address,
                "global_segment_size": 16 * MiB,
                "local_buffer_size": 4 * MiB,
                "memory_pool_size": 8 * MiB,
                **self.extra,
            }
        return {**(TRANSPORTS[self.transport] or {}), **self.extra}

    def _pull(self, role: str, i: int) -> dict[str, Any]:
        base = self.ports.setdefault(i, free_base_port(1))
        cfg = kv_config(self.connector(i), role, base, 1, 1)
        cfg["connector_config"]["memory_pool_size"] = 16 * MiB
        cfg["recv_timeout"] = self.recv_s
        return cfg

    def sender(self, i: int) -> dict[str, Any]:
        if self.transport in ("te", "nixl"):
            return self._pull("sender", i)
        return {
            "connector_config": self.connector(i),
            "omni_from_stage": "0",
            "omni_to_stage": "1",
            "need_send_cache": True,
        }

    def receiver(self, i: int) -> dict[str, Any]:
        if self.transport in ("te", "nixl"):
            return self._pull("receiver", 1000 + i)
        return {
            "connector_config": self.connector(1000 + i),
            "stage_id": 1,
            "engine_input_source": [0],
            "need_recv_cache": True,
            "recv_timeout": self.recv_s,
        }

    def info(self, i: int) -> dict[str, Any] | None:
        if self.transport not in ("te", "nixl"):
            return None
        return {"0": {"host": "127.0.0.1", "zmq_port": self.ports[i] + 100}}


@contextlib.contextmanager
def open_edge(
    transport: str, extra: dict[str, Any] | None = None, recv_s: float = 3.0
) -> Iterator[Edge]:
    """An :class:`Edge` for ``transport``, with a ``mooncake_master`` for the Store."""
    if transport == "store":
        with Master() as master:
            yield Edge(transport, master, extra, recv_s)
    else:
        yield Edge(transport, None, extra, recv_s)


def unavailable_reason(transport: str) -> str | None:
    """Why ``transport``'s engine cannot run here, or ``None``."""
    if transport in ("te", "store"):
        from omnikv.connectors.mooncake_te.engine import unavailable_reason as mooncake

        return mooncake()
    if transport == "nixl":
        from omnikv.connectors.nixl.agent import unavailable_reason as nixl

        return nixl()
    return None


def transport_scenario(file: str, scenario: str, transport: str, timeout: float) -> dict[str, Any]:
    """``scenario(transport=...)`` of test module ``file``, isolated
    (:func:`support.mooncake_peers.run_scenario`), its result with ``"transport"`` added; the
    test is skipped when ``transport``'s engine is not installed."""
    import pytest

    why = unavailable_reason(transport)
    if why is not None:
        pytest.skip(why)
    result: dict[str, Any] = run_scenario(file, scenario, {"transport": transport}, timeout=timeout)
    result["transport"] = transport
    return result
