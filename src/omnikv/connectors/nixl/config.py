"""The NIXL connector's configuration, checked once (no NIXL import here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.pull.connector import PullSettings
from omnikv.errors import ConfigError
from omnikv.values import parse_int

__all__ = ["MAX_BACKENDS", "NixlSettings"]

MAX_BACKENDS = 8


def _backends(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items or len(items) > MAX_BACKENDS:
        raise ConfigError(f"backends must be a non-empty list of NIXL backend names, got {value!r}")
    if not all(isinstance(b, str) and b.isalnum() for b in items):
        raise ConfigError(f"backends must be NIXL backend names such as 'UCX', got {value!r}")
    return tuple(items)


@dataclass(frozen=True)
class NixlSettings(PullSettings):
    """The NIXL connector's configuration, checked once (``ConfigError`` names the key): the
    pull connectors' keys (:class:`~omnikv.connectors.pull.connector.PullSettings`), ``backends``
    (``["UCX"]``) and ``max_leases_per_entry`` (8: how often a sender leases one entry before
    it drops it unconsumed)."""

    backends: tuple[str, ...]
    max_leases: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> NixlSettings:
        return cls(
            **PullSettings.common(cfg),
            backends=_backends(cfg.get("backends", ["UCX"])),
            max_leases=parse_int("max_leases_per_entry", cfg.get("max_leases_per_entry"), 8),
        )
