"""Configuration: ``OmniKVCacheConfig`` and the parsing of ``omni_kv_config`` dicts.

Fallback chain (reference-behaviour.md §7.2):

* ``from_od_config(cfg)`` reads ``cfg.omni_kv_config`` (a dict; anything else means defaults);
* ``from_vllm_config(vllm_config, model_config)`` prefers ``model_config.omni_kv_config``, then
  ``vllm_config.kv_transfer_config.omni_connector_config``, then
  ``kv_transfer_config.kv_connector_extra_config["omni_connector_config"]``, else an inert default.
  A stage that declares no ``kv_cache_layout`` gets the one of the engine's attention backend
  (:func:`vllm_cache_layout`).

omnikv's own options (not part of the seed's 12 fields) are read from the same dict into
:class:`TransferOptions`.

``OmniKVTransferManager.from_config(mapping)`` and ``from_config_file(path)`` (JSON, YAML with
PyYAML, TOML) take the ``omni_kv_config`` itself and check it strictly first
(:func:`check_omni_kv_config`): an unknown key, a wrong type or a connector that is not registered
is a :class:`~omnikv.errors.ConfigError` that names the key and what was expected.

Every value is read through :mod:`omnikv.values`, the one strict parser (connectors read their
own keys with it too).
"""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omnikv.errors import ConfigError
from omnikv.layouts.specs import LAYOUTS
from omnikv.topology.reshard import RANK_MAPPING_KEYS, check_rank_mapping
from omnikv.values import (
    parse_bool,
    parse_choice,
    parse_int,
    parse_number,
    parse_positive,
    parse_ratio,
    redacted,
)
from omnikv.wire.codec import CODECS
from omnikv.wire.format import DEFAULT_MAX_HEADER_BYTES, MAX_INSTANCE_CHARS

logger = logging.getLogger(__name__)

__all__ = [
    "CONNECTOR_KEYS",
    "CONNECTOR_NESTED_KEYS",
    "KNOWN_KEYS",
    "OmniKVCacheConfig",
    "RetryPolicy",
    "TransferOptions",
    "check_omni_kv_config",
    "config_from_dict",
    "load_config_file",
    "od_config_parts",
    "options_from_dict",
    "receiver_pool_on_device",
    "resolve_async_prefetch",
    "unknown_connector_keys",
    "vllm_cache_layout",
    "vllm_config_parts",
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

    def __repr__(self) -> str:
        """The fields, with any ``auth_secret`` in ``connector_config`` shown as
        ``<redacted>`` (a config is logged and shown in errors; its secret never is)."""
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["connector_config"] = redacted(self.connector_config)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


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


# --------------------------------------------------------------------------------------------
# omnikv's own options
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferOptions:
    """omnikv-specific options read from ``omni_kv_config`` (all optional).

    * ``kv_cache_layout``: ``"auto"`` (default: from the shape, or, built by
      ``from_vllm_config``, from the engine's attention backend), ``"kv_first"``,
      ``"blocks_first"``, ``"vllm_bhnc"``, ``"vllm_cpu"`` or ``"vllm_cpu_amx"``
      (:data:`omnikv.layouts.specs.LAYOUTS`; :mod:`omnikv.layouts.specs` says which is which).
    * ``payload_checksum``: give every payload a check of its data section (XXH3-128, header
      ``dc``), which every receiver verifies: damaged data is ``corrupt``, never accepted.
      ``None`` (default): on where the connector moves the bytes between nodes (Transfer
      Engine, NIXL, the Store: :attr:`~omnikv.connectors.base.OmniConnectorBase.checks_data`),
      off for shared memory and in-process connectors, where the receive is a zero-copy view
      and the check would be a whole extra pass over the payload (about +60 % of a 224 MiB
      hand-off); ``True`` / ``False`` force it on or off.
    * ``receive_copy``: ``"auto"`` (default: zero-copy views whose lifetime holds the connector
      buffer when the transport allows, else a copy), ``"copy"`` (always copy out and release).
    * ``retry``: a :class:`RetryPolicy` (``put_retry_attempts``, ``put_retry_backoff``).
    * ``connector_retry_interval``: seconds before a failed connector creation is retried.
    * ``send_timeout``: seconds one send (all its puts, waits for pool space and retries) may
      take (default 30).
    * ``max_header_bytes``: the largest payload header a receiver decodes (default 1 MiB).
    * ``wire_codec``: ``"off"`` (default: the reference format), ``"int8"`` or ``"fp8_e4m3"``:
      a sender codes fp16 / bf16 / fp32 KV to 8 bits with one scale per token and head, half the
      bytes on the link, lossy within the bounds :mod:`omnikv.wire.codec` documents. Receivers
      decode it whatever their own setting.
    * ``instance_id``: a stable name for this sending instance (``"prefill-0"``), the same
      across its restarts. Every payload carries the sender's session, epoch (its start time)
      and a sequence number; a receiver refuses a duplicate always, and, for a named instance,
      a payload from an older epoch of that instance than one it has already seen (a restarted
      sender supersedes its earlier incarnation). Unnamed senders (the default) are never
      ordered against each other: data-parallel producers of one stage and rank are normal.
    * ``stream_kv``: ship a request's full blocks while it decodes (the model runner calls
      ``stream_kv_blocks`` per step), so that only the last partial block and the metadata move
      when it finishes (:mod:`omnikv.transfer.stream`; default False). Receivers assemble the
      pieces whatever their own setting; receivers older than this option refuse them. On a
      receiving stage it takes a stream's chunks as they are published, while the receive
      waits for the tail (:class:`~omnikv.transfer.stream.EagerChunks`).
    """

    kv_cache_layout: str = "auto"
    payload_checksum: bool | None = None
    receive_copy: str = "auto"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    connector_retry_interval: float = 5.0
    send_timeout: float = 30.0
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    wire_codec: str = "off"
    instance_id: str | None = None
    stream_kv: bool = False

    def __post_init__(self) -> None:
        parse_choice("kv_cache_layout", self.kv_cache_layout, "auto", LAYOUTS)
        if self.payload_checksum is not None and not isinstance(self.payload_checksum, bool):
            raise ConfigError(f"payload_checksum must be a bool, got {self.payload_checksum!r:.60}")
        parse_choice("receive_copy", self.receive_copy, "auto", ("auto", "copy"))
        parse_number("connector_retry_interval", self.connector_retry_interval, 5.0)
        parse_positive("send_timeout", self.send_timeout, 30.0)
        parse_int("max_header_bytes", self.max_header_bytes, DEFAULT_MAX_HEADER_BYTES)
        parse_choice("wire_codec", self.wire_codec, "off", ("off", *CODECS))
        parse_instance_id(self.instance_id)
        if not isinstance(self.stream_kv, bool):
            raise ConfigError(f"stream_kv must be a bool, got {self.stream_kv!r:.60}")
        if self.max_header_bytes >= 1 << 32:
            raise ConfigError(f"max_header_bytes must be < 2**32, got {self.max_header_bytes}")


def config_from_dict(
    omni_kv_config: Mapping[str, Any] | None, *, async_prefetch: bool = False
) -> OmniKVCacheConfig:
    """Map an ``omni_kv_config`` dict onto :class:`OmniKVCacheConfig`.

    A missing or empty dict gives the defaults (with ``enable_kv_async_prefetch`` =
    ``async_prefetch``). The connector-config dict is referenced, not copied (the reference
    behaves so; ``update_sender_info`` writes the sender endpoint into it). Every value is
    checked (:class:`ConfigError` naming the key); a non-dict ``rank_mapping`` counts as empty,
    as in the reference.
    """
    kv = omni_kv_config
    if not isinstance(kv, Mapping) or not kv:
        return OmniKVCacheConfig(enable_kv_async_prefetch=async_prefetch)
    rank_mapping = kv.get("rank_mapping")
    if not isinstance(rank_mapping, Mapping):
        rank_mapping = {}
    placement_keys = sorted(str(k) for k in rank_mapping if k not in ("from_tp", "to_tp"))
    if placement_keys:
        logger.warning(
            "rank_mapping keys %s describe a placement that the seed API's send and receive do"
            " not act on (they use from_tp / to_tp); move KV along it with"
            " omnikv.transfer.reshard (PieceSender / PieceReceiver)",
            placement_keys,
        )
    connector_config = kv.get("connector_config")
    if connector_config is not None and not isinstance(connector_config, dict):
        raise ConfigError(f"connector_config must be a dict, got {type(connector_config).__name__}")
    if connector_config is not None:
        _warn_unknown_connector_keys(connector_config)
    sources = kv.get("engine_input_source")
    return OmniKVCacheConfig(
        connector_config=connector_config,
        from_stage=kv.get("omni_from_stage"),
        to_stage=kv.get("omni_to_stage"),
        stage_id=kv.get("stage_id"),
        engine_input_source=list(sources) if isinstance(sources, list | tuple) else [],
        need_recv_cache=parse_bool("need_recv_cache", kv.get("need_recv_cache")),
        need_send_cache=parse_bool("need_send_cache", kv.get("need_send_cache")),
        recv_timeout=parse_number("recv_timeout", kv.get("recv_timeout"), 30.0),
        from_tp=parse_int("rank_mapping.from_tp", rank_mapping.get("from_tp"), 1),
        to_tp=parse_int("rank_mapping.to_tp", rank_mapping.get("to_tp"), 1),
        enable_kv_async_prefetch=async_prefetch,
        kv_prefetch_min_free_mem_ratio=parse_ratio(
            "kv_prefetch_min_free_mem_ratio", kv.get("kv_prefetch_min_free_mem_ratio"), 0.0
        ),
    )


def _optional_bool(key: str, value: Any) -> bool | None:
    """A boolean option whose absence means "the default for this deployment" (``None``)."""
    return None if value is None else parse_bool(key, value)


def options_from_dict(omni_kv_config: Mapping[str, Any] | None) -> TransferOptions:
    """Read omnikv's own options from an ``omni_kv_config`` dict (see :class:`TransferOptions`).

    Each key is looked up at the top level first, then in ``connector_config``.
    """
    if not isinstance(omni_kv_config, Mapping):
        return TransferOptions()
    top = omni_kv_config
    conn = top.get("connector_config")
    conn = conn if isinstance(conn, Mapping) else {}

    def pick(name: str) -> Any:
        return top.get(name, conn.get(name))

    retry = RetryPolicy(
        attempts=parse_int("put_retry_attempts", pick("put_retry_attempts"), 3),
        backoff_base=parse_number("put_retry_backoff", pick("put_retry_backoff"), 0.1),
    )
    return TransferOptions(
        kv_cache_layout=parse_choice("kv_cache_layout", pick("kv_cache_layout"), "auto", LAYOUTS),
        payload_checksum=_optional_bool("payload_checksum", pick("payload_checksum")),
        receive_copy=parse_choice("receive_copy", pick("receive_copy"), "auto", ("auto", "copy")),
        retry=retry,
        connector_retry_interval=parse_number(
            "connector_retry_interval", pick("connector_retry_interval"), 5.0
        ),
        send_timeout=parse_positive("send_timeout", pick("send_timeout"), 30.0),
        max_header_bytes=parse_int(
            "max_header_bytes", pick("max_header_bytes"), DEFAULT_MAX_HEADER_BYTES
        ),
        wire_codec=parse_choice("wire_codec", pick("wire_codec"), "off", ("off", *CODECS)),
        instance_id=parse_instance_id(pick("instance_id")),
        stream_kv=parse_bool("stream_kv", pick("stream_kv")),
    )


def parse_instance_id(value: Any) -> str | None:
    """``instance_id`` checked: ``None``, or 1 to :data:`MAX_INSTANCE_CHARS` printable ASCII
    characters without spaces (it travels in every payload header)."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= MAX_INSTANCE_CHARS
        or not all("!" <= ch <= "~" for ch in value)
    ):
        raise ConfigError(
            f"instance_id must be 1..{MAX_INSTANCE_CHARS} printable ASCII characters without "
            f"spaces, got {value!r:.80}"
        )
    return value


def receiver_pool_on_device(omni_kv_config: Mapping[str, Any] | None) -> bool:
    """True when the connector's ``memory_pool_device`` is not ``"cpu"``."""
    if not isinstance(omni_kv_config, Mapping):
        return False
    conn = omni_kv_config.get("connector_config")
    if not isinstance(conn, Mapping):
        return False
    return str(conn.get("memory_pool_device", "cpu")).lower() != "cpu"


def resolve_async_prefetch(
    omni_kv_config: Mapping[str, Any] | None, *, has_companion: bool
) -> bool:
    """Prefetch is on iff requested, no CFG companion collector, and the pool is on the host."""
    if not isinstance(omni_kv_config, Mapping):
        return False
    requested = parse_bool(
        "enable_kv_async_prefetch", omni_kv_config.get("enable_kv_async_prefetch")
    )
    return requested and not has_companion and not receiver_pool_on_device(omni_kv_config)


def _expect_mapping(value: Any, factory: str, owner: str) -> Mapping[str, Any] | None:
    """``value`` when it is a mapping or ``None``; else a ConfigError saying what was expected."""
    if value is None or isinstance(value, Mapping):
        return value
    raise ConfigError(
        f"{factory}: {owner}.omni_kv_config must be a mapping (the stage's omni_kv_config, "
        f"e.g. {{'need_recv_cache': True, 'stage_id': 1, 'connector_config': {{...}}}}), "
        f"got {type(value).__name__}"
    )


def od_config_parts(config: Any) -> tuple[Mapping[str, Any] | None, bool]:
    """``(omni_kv_config, has a CFG companion collector)`` of what ``from_od_config`` is given:
    an object with those attributes or a mapping with those keys (``cfg_kv_collect_func``)."""
    omni_kv = _expect_mapping(_field(config, "omni_kv_config"), "from_od_config", "config")
    return omni_kv, _field(config, "cfg_kv_collect_func") is not None


def vllm_config_parts(vllm_config: Any, model_config: Any) -> Mapping[str, Any] | None:
    """The ``omni_kv_config`` ``from_vllm_config`` builds from: ``model_config.omni_kv_config``,
    else :func:`vllm_omni_kv_dict`. Objects or mappings; a non-mapping ``omni_kv_config`` is a
    :class:`ConfigError` saying what was expected."""
    raw = _field(model_config, "omni_kv_config")
    omni_kv = _expect_mapping(raw, "from_vllm_config", "model_config")
    return omni_kv if omni_kv is not None else vllm_omni_kv_dict(vllm_config)


def vllm_cache_layout(vllm_config: Any, omni_kv_config: Mapping[str, Any] | None) -> str | None:
    """The ``kv_cache_layout`` ``from_vllm_config`` declares for a stage that declares none
    (absent or ``"auto"``): the layout of the caches of the engine ``vllm_config`` configures,
    from its attention backend (:func:`omnikv.layouts.vllm_backends.attention_backend_layout`:
    ``CPU_ATTN`` by ISA ``vllm_cpu`` / ``vllm_cpu_amx``; ``FLASH_ATTN``, ``FLASHINFER``,
    ``TRITON_ATTN``, ``FLEX_ATTENTION`` ``vllm_bhnc``). ``None`` (the stage's own declaration
    stands) when the stage declares a layout, when ``vllm_config`` is not a ``vllm.config.
    VllmConfig`` of a loaded vLLM, or when the backend's layout is unknown (logged; the sender
    then refuses vLLM's 4-D caches naming the layouts to declare)."""
    if options_from_dict(omni_kv_config).kv_cache_layout != "auto":
        return None
    vllm_module = sys.modules.get("vllm.config")
    config_type = getattr(vllm_module, "VllmConfig", None)
    if not isinstance(config_type, type) or not isinstance(vllm_config, config_type):
        return None
    from omnikv.layouts.vllm_backends import attention_backend_layout

    try:
        layout = attention_backend_layout(vllm_config)
    except Exception as exc:  # vLLM's internals: the stage stays on "auto", reason logged
        logger.warning("from_vllm_config: cannot tell the attention backend's layout: %r", exc)
        return None
    if layout is not None:
        logger.info("from_vllm_config: kv_cache_layout %r from the attention backend", layout)
    return layout


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` for a mapping, ``obj.name`` otherwise (``None`` when absent)."""
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def vllm_omni_kv_dict(vllm_config: Any) -> dict[str, Any] | None:
    """The connector-only fallback of ``from_vllm_config``: a dict with ``connector_config``.

    ``vllm_config`` and its ``kv_transfer_config`` may be objects or mappings.
    """
    ktc = _field(vllm_config, "kv_transfer_config")
    if ktc is None:
        return None
    direct = _field(ktc, "omni_connector_config")
    if isinstance(direct, dict) and direct:
        return {"connector_config": direct}
    extra = _field(ktc, "kv_connector_extra_config")
    if isinstance(extra, Mapping):
        nested = extra.get("omni_connector_config")
        if isinstance(nested, dict) and nested:
            return {"connector_config": nested}
    return None


# --------------------------------------------------------------------------------------------
# Strict checking of a whole omni_kv_config (from_config, from_config_file)
# --------------------------------------------------------------------------------------------
#: The seed's keys (the reference's ``omni_kv_config``).
SEED_KEYS = frozenset(
    {
        "connector_config",
        "omni_from_stage",
        "omni_to_stage",
        "stage_id",
        "engine_input_source",
        "need_recv_cache",
        "need_send_cache",
        "recv_timeout",
        "rank_mapping",
        "enable_kv_async_prefetch",
        "kv_prefetch_min_free_mem_ratio",
    }
)
#: omnikv's own options (:class:`TransferOptions`).
OPTION_KEYS = frozenset(
    {
        "kv_cache_layout",
        "payload_checksum",
        "receive_copy",
        "put_retry_attempts",
        "put_retry_backoff",
        "connector_retry_interval",
        "send_timeout",
        "max_header_bytes",
        "wire_codec",
        "instance_id",
        "stream_kv",
    }
)
#: Keys of the same dict that the host framework reads (the AR scheduler's transfer criteria).
FRAMEWORK_KEYS = frozenset({"kv_transfer_criteria"})
#: Every key :func:`check_omni_kv_config` accepts at the top level.
KNOWN_KEYS = SEED_KEYS | OPTION_KEYS | FRAMEWORK_KEYS

# Keys of ``connector_config``, per built-in connector. Every connector_config may hold its
# ``type``, what the manager injects or writes into it (``role``, the stages, the sender
# endpoint of ``update_sender_info``), the seed's ``memory_pool_device`` (it decides prefetch)
# and omnikv's own options (looked up there too). tests/test_config.py checks each table
# against the keys the connector's source reads.
_CONNECTOR_COMMON = OPTION_KEYS | {
    "type",
    "role",
    "from_stage",
    "to_stage",
    "sender_host",
    "sender_zmq_port",
    "memory_pool_device",
}
_PULL_KEYS = _CONNECTOR_COMMON | {
    "host",
    "zmq_port",
    "memory_pool_size",
    "buffer_ttl_seconds",
    "unclaimed_grace_seconds",
    "ack_timeout_s",
    "peer_timeout_seconds",
    "quarantine_dead_seconds",
    "close_timeout_seconds",
    "auth_window_seconds",
    "put_timeout_s",
    "auth_secret",
    "auth_secret_file",
    "max_connections",
    "max_connections_per_peer",
    "handshake_timeout_seconds",
    "idle_timeout_seconds",
    "heartbeat_seconds",
}
_STORE_KEYS = _CONNECTOR_COMMON | {
    "host",
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "global_segment_size",
    "local_buffer_size",
    "memory_pool_size",
    "remove_after_get",
    "prefer_local_segment",
    "tcp_connection_pool",
    "metadata_cache",
    "replica_num",
    "master_probe_timeout_s",
    "put_timeout_s",
    "max_tracked_keys",
    "buffer_ttl_seconds",
    "ack_timeout_s",
    "ack_linger_s",
}
#: connector type -> every key its ``connector_config`` may hold (built-in connectors).
CONNECTOR_KEYS: dict[str, frozenset[str]] = {
    "LocalConnector": frozenset(
        _CONNECTOR_COMMON
        | {"namespace", "pool_size", "put_timeout_s", "buffer_ttl_seconds", "ack_timeout_s"}
    ),
    "SharedMemoryConnector": frozenset(
        _CONNECTOR_COMMON
        | {
            "namespace",
            "pool_size_bytes",
            "expected_payload_bytes",
            "kv_bytes_per_token",
            "max_model_len",
            "prefault",
            "put_timeout_s",
            "get_timeout_s",
            "join_timeout_s",
            "linger_s",
            "unclaimed_grace_seconds",
            "shm_threshold_bytes",
            "inline_small_payloads",
            "poll_us",
            "buffer_ttl_seconds",
            "ack_timeout_s",
            "shared_readers",  # payloads for several ranks of the node (connectors.shm.shared)
            "stage_id",  # the reference's wakeups: the stage a put wakes
            "extra",  # the reference's nested settings: CONNECTOR_NESTED_KEYS
        }
    ),
    "MooncakeStoreConnector": frozenset(_STORE_KEYS),
    "MooncakeConnector": frozenset(_STORE_KEYS),
    "MooncakeTransferEngineConnector": frozenset(
        _PULL_KEYS | {"protocol", "device_name", "workers", "tcp_connection_pool", "metadata_cache"}
    ),
    "NixlConnector": frozenset(_PULL_KEYS | {"backends", "max_leases_per_entry"}),
}


#: connector type -> {key holding a mapping: the keys that mapping may hold}.
CONNECTOR_NESTED_KEYS: dict[str, dict[str, frozenset[str]]] = {
    "SharedMemoryConnector": {"extra": frozenset({"wakeup_scope"})},
}


def unknown_connector_keys(connector_config: Mapping[str, Any]) -> tuple[str, list[str]]:
    """``(type, the keys of connector_config its connector does not read)``, sorted, nested
    ones as ``"extra.<key>"``; no keys for a connector outside :data:`CONNECTOR_KEYS` (a
    third-party one checks its own)."""
    kind = str(connector_config.get("type"))
    known = CONNECTOR_KEYS.get(kind)
    if known is None:
        return kind, []
    unknown = [str(k) for k in connector_config if k not in known]
    for key, inner in CONNECTOR_NESTED_KEYS.get(kind, {}).items():
        nested = connector_config.get(key)
        if isinstance(nested, Mapping):
            unknown += [f"{key}.{k}" for k in nested if k not in inner]
    return kind, sorted(unknown)


def _all_keys(kind: str) -> frozenset[str]:
    """Every key (nested ones dotted) a built-in connector's config may hold: the suggestions
    of an unknown-key error."""
    nested = CONNECTOR_NESTED_KEYS.get(kind, {})
    dotted = {f"{key}.{k}" for key, inner in nested.items() for k in inner}
    return CONNECTOR_KEYS[kind] | dotted


_warned_connector_keys: set[tuple[str, ...]] = set()


def _warn_unknown_connector_keys(connector_config: Mapping[str, Any]) -> None:
    """The lenient factories (``from_od_config``, ``from_vllm_config``) keep a reference
    config working, but say once per set of keys which ones its connector ignores (a typo such
    as ``namesapce`` would otherwise change behaviour in silence)."""
    kind, unknown = unknown_connector_keys(connector_config)
    if not unknown or (kind, *unknown) in _warned_connector_keys:
        return
    _warned_connector_keys.add((kind, *unknown))
    logger.warning(
        "%s; %s ignores them (from_config refuses them)",
        _unknown_key_error(f"connector_config ({kind})", unknown, _all_keys(kind)),
        kind,
    )


_EXAMPLE = "{'need_send_cache': True, 'connector_config': {'type': 'SharedMemoryConnector'}}"
MAX_CONFIG_FILE_BYTES = 4 << 20


def _unknown_key_error(where: str, unknown: list[str], known: frozenset[str]) -> ConfigError:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    return ConfigError(
        f"{where}: unknown key(s) {', '.join(hints)}; known keys: {', '.join(sorted(known))}"
    )


def _check_stage(where: str, key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int)):
        raise ConfigError(
            f"{where}: {key} must be a stage id (a string or an integer), got {value!r:.60}"
        )


def check_omni_kv_config(omni_kv_config: Any, *, where: str = "omni_kv_config") -> dict[str, Any]:
    """Check a whole ``omni_kv_config`` strictly; returns it as a dict (nested dicts shared).

    Called by ``OmniKVTransferManager.from_config`` / ``from_config_file`` before the manager is
    built (``from_od_config`` / ``from_vllm_config`` keep the reference's leniency for keys).
    Guarantees, each failure a :class:`ConfigError` that starts with ``where`` and names the key:
    the value is a mapping; every top-level key is in :data:`KNOWN_KEYS` (a near miss is
    suggested); stage ids are strings or integers; ``engine_input_source`` is a list of them;
    ``rank_mapping`` holds only ``from_tp`` / ``to_tp`` and the placement keys of
    :data:`~omnikv.topology.reshard.RANK_MAPPING_KEYS`, whose values
    :func:`~omnikv.topology.reshard.check_rank_mapping` checks; ``connector_config`` is a
    mapping whose ``type`` names a registered connector (nothing is imported) and, for a
    built-in connector, holds only the keys that connector reads (:data:`CONNECTOR_KEYS`); every
    value parses as :func:`config_from_dict` and :func:`options_from_dict` parse it.
    """
    if not isinstance(omni_kv_config, Mapping):
        raise ConfigError(
            f"{where} expects the stage's omni_kv_config as a mapping (e.g. {_EXAMPLE}), "
            f"got {type(omni_kv_config).__name__}"
        )
    kv = dict(omni_kv_config)
    unknown = sorted(str(k) for k in kv if k not in KNOWN_KEYS)
    if unknown:
        raise _unknown_key_error(where, unknown, KNOWN_KEYS)
    for key in ("omni_from_stage", "omni_to_stage", "stage_id"):
        _check_stage(where, key, kv.get(key))
    sources = kv.get("engine_input_source")
    if sources is not None:
        if not isinstance(sources, list | tuple):
            raise ConfigError(
                f"{where}: engine_input_source must be a list of stage ids, got {sources!r:.60}"
            )
        for value in sources:
            _check_stage(where, "engine_input_source[]", value)
    rank_mapping = kv.get("rank_mapping")
    if rank_mapping is not None:
        if not isinstance(rank_mapping, Mapping):
            raise ConfigError(
                f"{where}: rank_mapping must be a mapping like {{'from_tp': 2, 'to_tp': 4}}, "
                f"got {rank_mapping!r:.60}"
            )
        extra = sorted(str(k) for k in rank_mapping if k not in RANK_MAPPING_KEYS)
        if extra:
            raise _unknown_key_error(f"{where}: rank_mapping", extra, RANK_MAPPING_KEYS)
        try:
            check_rank_mapping(rank_mapping)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    _check_connector_config(where, kv.get("connector_config"))
    try:
        config_from_dict(kv)
        options_from_dict(kv)
        resolve_async_prefetch(kv, has_companion=False)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return kv


def _check_connector_config(where: str, conn: Any) -> None:
    if conn is None:
        return
    if not isinstance(conn, Mapping):
        raise ConfigError(
            f"{where}: connector_config must be a mapping with a 'type' "
            f"(e.g. {{'type': 'SharedMemoryConnector'}}), got {type(conn).__name__}"
        )
    from omnikv.connectors.factory import OmniConnectorFactory

    known = OmniConnectorFactory.list_connectors()
    kind = conn.get("type")
    if not isinstance(kind, str) or kind not in known:
        close = difflib.get_close_matches(str(kind), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{where}: connector_config.type must name a registered connector "
            f"({', '.join(known)}), got {kind!r:.60}{hint}"
        )
    kind, unknown = unknown_connector_keys(conn)
    if unknown:
        raise _unknown_key_error(f"{where}: connector_config ({kind})", unknown, _all_keys(kind))


def _read_yaml(text: str, path: Path) -> Any:
    try:
        yaml = importlib.import_module("yaml")
    except ImportError as exc:
        raise ImportError(
            f"{path}: reading a YAML config needs PyYAML (pip install pyyaml); "
            "or write the same keys as JSON (.json) or TOML (.toml)"
        ) from exc
    try:
        return yaml.safe_load(text)  # safe_load: plain data only, no Python objects
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def _read_toml(text: str, path: Path) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib as toml
    else:  # pragma: no cover - Python 3.10
        try:
            toml = importlib.import_module("tomli")
        except ImportError as exc:
            raise ImportError(
                f"{path}: reading a TOML config on Python 3.10 needs tomli (pip install tomli)"
            ) from exc
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def _read_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc


_READERS = {".json": _read_json, ".yaml": _read_yaml, ".yml": _read_yaml, ".toml": _read_toml}


def load_config_file(path: str | os.PathLike[str], *, key: str | None = None) -> dict[str, Any]:
    """The ``omni_kv_config`` in a JSON, YAML (``.yaml``/``.yml``) or TOML file, checked.

    Called by ``OmniKVTransferManager.from_config_file``. The file holds the keys at its top
    level, or under ``omni_kv_config`` (a stage file with other sections too); ``key`` picks
    another place, as dotted mapping keys (``"stage_1.omni_kv_config"``). The result passed
    :func:`check_omni_kv_config`. Raises :class:`ConfigError` naming the file for an unknown
    suffix, a file over 4 MiB, unparsable text or a bad value; ``ImportError`` naming the package
    when YAML is asked for without PyYAML (or TOML on Python 3.10 without tomli).
    """
    p = Path(path)
    reader = _READERS.get(p.suffix.lower())
    if reader is None:
        raise ConfigError(
            f"{p}: unsupported config file type {p.suffix!r}; use .json, .yaml, .yml or .toml"
        )
    size = p.stat().st_size
    if size > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(f"{p}: {size} bytes is too large for a config file (max 4 MiB)")
    doc = reader(p.read_text(encoding="utf-8"), p)
    where = str(p)
    if key is not None:
        for part in key.split("."):
            if not isinstance(doc, Mapping) or part not in doc:
                raise ConfigError(f"{p}: no {key!r} in the file (missing {part!r})")
            doc = doc[part]
        where = f"{p} [{key}]"
    elif isinstance(doc, Mapping) and isinstance(doc.get("omni_kv_config"), Mapping):
        doc, where = doc["omni_kv_config"], f"{p} [omni_kv_config]"
    return check_omni_kv_config(doc, where=where)
