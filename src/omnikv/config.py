"""Configuration: ``OmniKVCacheConfig`` and the parsing of ``omni_kv_config`` dicts.

Fallback chain (reference-behaviour.md §7.2):

* ``from_od_config(cfg)`` reads ``cfg.omni_kv_config`` (a dict; anything else means defaults);
* ``from_vllm_config(vllm_config, model_config)`` prefers ``model_config.omni_kv_config``, then
  ``vllm_config.kv_transfer_config.omni_connector_config``, then
  ``kv_transfer_config.kv_connector_extra_config["omni_connector_config"]``, else an inert default.

omnikv's own options (not part of the seed's 12 fields) are read from the same dict into
:class:`TransferOptions`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omnikv.errors import ConfigError
from omnikv.layouts import LAYOUTS

__all__ = [
    "OmniKVCacheConfig",
    "RetryPolicy",
    "TransferOptions",
    "config_from_dict",
    "options_from_dict",
    "receiver_pool_on_device",
    "resolve_async_prefetch",
    "vllm_omni_kv_dict",
]


@dataclass
class OmniKVCacheConfig:
    """Configuration for OmniKVTransferManager."""

    connector_config: dict[str, Any] | None = None
    from_stage: str | None = None
    to_stage: str | None = None
    stage_id: str | int | None = None
    engine_input_source: list[str | int] | None = None
    need_recv_cache: bool = False
    need_send_cache: bool = False
    recv_timeout: float = 30.0
    from_tp: int = 1
    to_tp: int = 1
    enable_kv_async_prefetch: bool = False
    kv_prefetch_min_free_mem_ratio: float = 0.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often a put is tried and how long to back off between tries.

    The delay before retry ``k`` (``k = 0`` after the first failure) is
    ``min(backoff_max, backoff_base * backoff_factor ** k)``; with the defaults:
    0.1 s, 0.2 s (three attempts, no sleep after the last). A frozen value: pass a new policy,
    never mutate the default.
    """

    attempts: int = 3
    backoff_base: float = 0.1
    backoff_factor: float = 2.0
    backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        for name in ("backoff_base", "backoff_factor", "backoff_max"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value < 0:
                raise ConfigError(f"RetryPolicy.{name} must be >= 0, got {value!r}")

    def delay(self, retry_index: int) -> float:
        """Seconds to wait before retry number ``retry_index`` (0-based)."""
        return float(min(self.backoff_max, self.backoff_base * self.backoff_factor**retry_index))

    def schedule(self) -> list[float]:
        """All delays, in order (``attempts - 1`` entries)."""
        return [self.delay(k) for k in range(self.attempts - 1)]


@dataclass(frozen=True)
class TransferOptions:
    """omnikv-specific options read from ``omni_kv_config`` (all optional).

    * ``kv_cache_layout``: ``"auto"`` (default), ``"kv_first"`` or ``"blocks_first"``.
    * ``payload_checksum``: add a crc32 of the data section to every payload (default False).
    * ``receive_copy``: ``"auto"`` (default: zero-copy views whose lifetime holds the connector
      buffer when the transport allows, else a copy), ``"copy"`` (always copy out and release).
    * ``retry``: a :class:`RetryPolicy` (``put_retry_attempts``, ``put_retry_backoff``).
    * ``connector_retry_interval``: seconds before a failed connector creation is retried.
    """

    kv_cache_layout: str = "auto"
    payload_checksum: bool = False
    receive_copy: str = "auto"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    connector_retry_interval: float = 5.0

    def __post_init__(self) -> None:
        if self.kv_cache_layout not in LAYOUTS:
            raise ConfigError(
                f"kv_cache_layout must be one of {LAYOUTS}, got {self.kv_cache_layout!r}"
            )
        if self.receive_copy not in ("auto", "copy"):
            raise ConfigError(f"receive_copy must be 'auto' or 'copy', got {self.receive_copy!r}")
        if math.isnan(self.connector_retry_interval) or self.connector_retry_interval < 0:
            raise ConfigError("connector_retry_interval must be >= 0")


def _int(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from exc


def _float(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    try:
        out = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} must be a number, got {value!r}") from exc
    if math.isnan(out):
        raise ConfigError(f"{name} must be a number, got NaN")
    return out


def config_from_dict(
    cfg: Mapping[str, Any] | None, *, async_prefetch: bool = False
) -> OmniKVCacheConfig:
    """Map an ``omni_kv_config`` dict onto :class:`OmniKVCacheConfig`.

    A missing or empty dict gives the defaults (with ``enable_kv_async_prefetch`` =
    ``async_prefetch``). The connector-config dict is referenced, not copied (the reference
    behaves so; ``update_sender_info`` writes the sender endpoint into it).
    """
    if not isinstance(cfg, Mapping) or not cfg:
        return OmniKVCacheConfig(enable_kv_async_prefetch=async_prefetch)
    rank_mapping = cfg.get("rank_mapping")
    if not isinstance(rank_mapping, Mapping):
        rank_mapping = {}
    connector_config = cfg.get("connector_config")
    if connector_config is not None and not isinstance(connector_config, dict):
        raise ConfigError(f"connector_config must be a dict, got {type(connector_config).__name__}")
    timeout = _float(cfg.get("recv_timeout"), "recv_timeout", 30.0)
    if timeout < 0:
        raise ConfigError(f"recv_timeout must be >= 0, got {timeout}")
    sources = cfg.get("engine_input_source")
    return OmniKVCacheConfig(
        connector_config=connector_config,
        from_stage=cfg.get("omni_from_stage"),
        to_stage=cfg.get("omni_to_stage"),
        stage_id=cfg.get("stage_id"),
        engine_input_source=list(sources) if isinstance(sources, list | tuple) else [],
        need_recv_cache=bool(cfg.get("need_recv_cache", False)),
        need_send_cache=bool(cfg.get("need_send_cache", False)),
        recv_timeout=timeout,
        from_tp=_int(rank_mapping.get("from_tp"), "rank_mapping.from_tp", 1),
        to_tp=_int(rank_mapping.get("to_tp"), "rank_mapping.to_tp", 1),
        enable_kv_async_prefetch=async_prefetch,
        kv_prefetch_min_free_mem_ratio=_float(
            cfg.get("kv_prefetch_min_free_mem_ratio"), "kv_prefetch_min_free_mem_ratio", 0.0
        ),
    )


def options_from_dict(cfg: Mapping[str, Any] | None) -> TransferOptions:
    """Read omnikv's own options from an ``omni_kv_config`` dict (see :class:`TransferOptions`)."""
    if not isinstance(cfg, Mapping):
        return TransferOptions()
    conn = cfg.get("connector_config")
    conn = conn if isinstance(conn, Mapping) else {}

    def pick(name: str, default: Any) -> Any:
        return cfg.get(name, conn.get(name, default))

    retry = RetryPolicy(
        attempts=_int(pick("put_retry_attempts", None), "put_retry_attempts", 3),
        backoff_base=_float(pick("put_retry_backoff", None), "put_retry_backoff", 0.1),
    )
    return TransferOptions(
        kv_cache_layout=str(pick("kv_cache_layout", "auto")),
        payload_checksum=bool(pick("payload_checksum", False)),
        receive_copy=str(pick("receive_copy", "auto")),
        retry=retry,
        connector_retry_interval=_float(
            pick("connector_retry_interval", None), "connector_retry_interval", 5.0
        ),
    )


def receiver_pool_on_device(cfg: Mapping[str, Any] | None) -> bool:
    """True when the connector's ``memory_pool_device`` is not ``"cpu"``."""
    if not isinstance(cfg, Mapping):
        return False
    conn = cfg.get("connector_config")
    if not isinstance(conn, Mapping):
        return False
    return str(conn.get("memory_pool_device", "cpu")).lower() != "cpu"


def resolve_async_prefetch(cfg: Mapping[str, Any] | None, *, has_companion: bool) -> bool:
    """Prefetch is on iff requested, no CFG companion collector, and the pool is on the host."""
    if not isinstance(cfg, Mapping):
        return False
    requested = bool(cfg.get("enable_kv_async_prefetch", False))
    return requested and not has_companion and not receiver_pool_on_device(cfg)


def vllm_omni_kv_dict(vllm_config: Any) -> dict[str, Any] | None:
    """The connector-only fallback of ``from_vllm_config``: a dict with ``connector_config``."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return None
    direct = getattr(ktc, "omni_connector_config", None)
    if isinstance(direct, dict) and direct:
        return {"connector_config": direct}
    extra = getattr(ktc, "kv_connector_extra_config", None)
    if isinstance(extra, Mapping):
        nested = extra.get("omni_connector_config")
        if isinstance(nested, dict) and nested:
            return {"connector_config": nested}
    return None
