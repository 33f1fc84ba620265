"""The Transfer Engine connector's configuration, parsed and checked once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.pull.connector import PullSettings
from omnikv.values import parse_bool, parse_choice, parse_int

__all__ = ["TEConfig"]


@dataclass(frozen=True)
class TEConfig(PullSettings):
    """The connector's configuration, parsed and validated once (``ConfigError`` naming the key):
    the pull connectors' keys (:class:`~omnikv.connectors.pull.connector.PullSettings`) and
    ``protocol``
    ("tcp"), ``device_name`` (""), ``workers`` (4), ``memory_pool_device`` ("cpu" only),
    ``tcp_connection_pool`` and ``metadata_cache`` (false: see
    :func:`~omnikv.connectors.mooncake_te.engine.set_tcp_connection_pool` and
    :func:`~omnikv.connectors.mooncake_te.engine.set_metadata_cache`)."""

    protocol: str
    device_name: str
    workers: int
    tcp_connection_pool: bool
    metadata_cache: bool

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> TEConfig:
        cfg = dict(config or {})
        # device pools are not supported yet: "cpu" is the one choice
        parse_choice("memory_pool_device", cfg.get("memory_pool_device"), "cpu", ("cpu",))
        return cls(
            **PullSettings.common(cfg),
            protocol=str(cfg.get("protocol", "tcp")),
            device_name=str(cfg.get("device_name", "") or ""),
            workers=parse_int("workers", cfg.get("workers"), 4),
            tcp_connection_pool=parse_bool(
                "tcp_connection_pool", cfg.get("tcp_connection_pool"), False
            ),
            metadata_cache=parse_bool("metadata_cache", cfg.get("metadata_cache"), False),
        )
