"""The Mooncake Store connector's configuration, parsed and validated once.

:meth:`StoreConfig.parse` reads the connector's config mapping with the one value parser
(:mod:`omnikv.values`) before any engine is imported or any master is probed; a bad value is a
:class:`~omnikv.errors.ConfigError` naming its key. Built by
:class:`~omnikv.connectors.mooncake_store.connector.MooncakeStoreConnector`, as the other
backends build theirs (``ShmConfig``, ``TEConfig``, ``NixlSettings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.delivery import DEFAULT_ACK_TIMEOUT_S
from omnikv.connectors.pull.host import resolve_host
from omnikv.values import parse_bool, parse_int, parse_number, parse_positive, parse_size

__all__ = ["DEFAULT_ACK_LINGER_S", "DEFAULT_BUFFER_TTL_S", "StoreConfig"]

#: ``buffer_ttl_seconds`` by default (the other connectors' default).
DEFAULT_BUFFER_TTL_S = 300.0
#: ``ack_linger_s`` by default: how long a closing receiver waits for its verdicts to be read.
DEFAULT_ACK_LINGER_S = 1.0


@dataclass(frozen=True)
class StoreConfig:
    """Every key of the Store connector (see its module docstring for what each does)."""

    host: str
    metadata_server: str
    master: str
    protocol: str
    device_name: str
    global_segment_size: int
    local_buffer_size: int
    memory_pool_size: int
    remove_after_get: bool
    tcp_connection_pool: bool
    metadata_cache: bool
    prefer_local_segment: bool
    replica_num: int
    master_probe_timeout_s: float
    put_timeout_s: float
    max_tracked_keys: int
    buffer_ttl_s: float
    ack_timeout_s: float
    ack_linger_s: float

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> StoreConfig:
        """Validate ``config``; :class:`~omnikv.errors.ConfigError` names the first bad key."""
        cfg = dict(config or {})

        def size(key: str, default: int) -> int:
            return parse_size(key, cfg.get(key), default)

        def flag(key: str, default: bool) -> bool:
            return parse_bool(key, cfg.get(key), default)

        return cls(
            host=resolve_host(cfg.get("host", "127.0.0.1")),
            metadata_server=str(cfg.get("metadata_server", "P2PHANDSHAKE")),
            master=str(cfg.get("master_server_address", "127.0.0.1:50051")),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            global_segment_size=size("global_segment_size", 512 << 20),
            local_buffer_size=size("local_buffer_size", 64 << 20),
            memory_pool_size=size("memory_pool_size", 512 << 20),
            remove_after_get=flag("remove_after_get", True),
            tcp_connection_pool=flag("tcp_connection_pool", False),
            metadata_cache=flag("metadata_cache", False),
            prefer_local_segment=flag("prefer_local_segment", True),
            replica_num=parse_int("replica_num", cfg.get("replica_num"), 1),
            master_probe_timeout_s=parse_positive(
                "master_probe_timeout_s", cfg.get("master_probe_timeout_s"), 3.0
            ),
            put_timeout_s=parse_number("put_timeout_s", cfg.get("put_timeout_s"), 0.0),
            max_tracked_keys=parse_int("max_tracked_keys", cfg.get("max_tracked_keys"), 4096),
            buffer_ttl_s=parse_number(
                "buffer_ttl_seconds", cfg.get("buffer_ttl_seconds"), DEFAULT_BUFFER_TTL_S
            ),
            ack_timeout_s=parse_positive(
                "ack_timeout_s", cfg.get("ack_timeout_s"), DEFAULT_ACK_TIMEOUT_S
            ),
            ack_linger_s=parse_number(
                "ack_linger_s", cfg.get("ack_linger_s"), DEFAULT_ACK_LINGER_S
            ),
        )
