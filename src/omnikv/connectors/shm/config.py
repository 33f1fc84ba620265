"""The ``SharedMemoryConnector`` config (keys and meanings: :mod:`omnikv.connectors.shm.connector`).

Every key goes through the strict parsers of :mod:`omnikv.values` (``prefault``, ``namespace``
and ``role`` through the parsers here, built on them): a wrong value is a
:class:`~omnikv.errors.ConfigError` naming the key, never coerced (``"no"`` is not ``False``,
``-1`` is not a size).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.connectors.delivery import DEFAULT_ACK_TIMEOUT_S
from omnikv.connectors.shm.shared import MAX_SHARED_READERS
from omnikv.errors import ConfigError
from omnikv.values import (
    parse_bool,
    parse_choice,
    parse_int,
    parse_number,
    parse_positive,
    parse_size,
)

__all__ = [
    "AUTO_RESERVE",
    "DEFAULT_BUFFER_TTL_S",
    "DEFAULT_POLL_US",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_THRESHOLD",
    "DEFAULT_UNCLAIMED_GRACE_S",
    "MIN_POOL_SIZE",
    "RESERVE_SLACK",
    "Prefault",
    "ShmConfig",
    "parse_namespace",
    "parse_prefault",
    "parse_role",
    "parse_shared_readers",
]

logger = logging.getLogger(__name__)

DEFAULT_POOL_SIZE = 1 << 30
DEFAULT_THRESHOLD = 65536
#: ``poll_us`` may not exceed this (a wait that polls longer should simply block).
MAX_POLL_US = 100_000
#: ``poll_us`` when the config has none: long enough to cover a peer's round trip and a small
#: put that is under way, short enough that a wait for data not yet made costs ~1 ms of CPU.
DEFAULT_POLL_US = 1000
MIN_POOL_SIZE = 4096
#: ``buffer_ttl_seconds`` when the config has none (the Mooncake TE and NIXL connectors' default).
DEFAULT_BUFFER_TTL_S = 300.0
#: ``unclaimed_grace_seconds`` when the config has none: how long a published payload nobody
#: claimed keeps its space against newer payloads that find the pool full.
DEFAULT_UNCLAIMED_GRACE_S = 10.0
#: ``prefault: "auto"`` when the stage declares nothing about what it sends: a sending connector
#: populates min(pool_size_bytes, this) at start (a few short prompts' KV of a 7B model).
AUTO_RESERVE = 16 << 20
#: Added to a declared payload size for the payload's header and per-tensor alignment.
RESERVE_SLACK = 1 << 20
ROLES = ("sender", "receiver")
MAX_NAMESPACE_CHARS = 255
_KNOWN_CONFIG = frozenset(
    {
        "type",
        "name",
        "namespace",
        "pool_size_bytes",
        "prefault",
        "role",
        "put_timeout_s",
        "get_timeout_s",
        "join_timeout_s",
        "linger_s",
        "shm_threshold_bytes",
        "inline_small_payloads",
        "poll_us",
        "buffer_ttl_seconds",
        "unclaimed_grace_seconds",
        "expected_payload_bytes",
        "kv_bytes_per_token",
        "max_model_len",
        "ack_timeout_s",
        "shared_readers",
        "stage_id",
        "extra",
    }
)


def parse_namespace(value: Any) -> str:
    """A non-empty printable string of at most 255 characters (``None``: ``"default"``)."""
    if value is None:
        return "default"
    if not isinstance(value, str):
        raise ConfigError(f"namespace must be a string, got {type(value).__name__}")
    if not value.strip() or len(value) > MAX_NAMESPACE_CHARS or not value.isprintable():
        raise ConfigError(
            f"namespace must be 1-{MAX_NAMESPACE_CHARS} printable characters, got {value!r:.60}"
        )
    return value


@dataclass(frozen=True)
class Prefault:
    """What the ``prefault`` key asks of the send pool's population (see :func:`parse_prefault`).

    ``ahead``: populate ahead of use (2x the high-water mark), in the background; ``reserve``:
    an explicit start-up reserve in bytes (0: none); ``auto``: reserve what the stage declares
    it sends once it sends (:attr:`ShmConfig.reserve_bytes`).
    """

    ahead: bool = True
    reserve: int = 0
    auto: bool = True


def parse_prefault(value: Any) -> Prefault:
    """``prefault``: ``"auto"`` (default), a boolean, or a byte count (``int`` or ``"64MiB"``).

    ``"auto"``: ahead of use and the automatic reserve; ``True`` / ``False``: ahead of use or
    never, no reserve; a byte count: ahead of use and that reserve (``0`` is ``False``).
    Anything else is a :class:`ConfigError`.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return Prefault()
    if value == 0 and isinstance(value, int) and not isinstance(value, bool):
        return Prefault(ahead=False, auto=False)
    if isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lower() in ("true", "false")
    ):
        return Prefault(ahead=parse_bool("prefault", value, True), auto=False)
    try:
        return Prefault(reserve=parse_size("prefault", value, 0), auto=False)
    except ConfigError as exc:
        raise ConfigError(
            f"prefault must be 'auto', true, false or a byte count, got {value!r:.60}"
        ) from exc


def _parse_poll_us(value: Any) -> int:
    """``poll_us``: microseconds in ``[0, MAX_POLL_US]`` (``None``: :data:`DEFAULT_POLL_US`;
    0: never poll)."""
    out = parse_int("poll_us", value, DEFAULT_POLL_US, minimum=0)
    if out > MAX_POLL_US:
        raise ConfigError(f"poll_us must be <= {MAX_POLL_US}, got {out}")
    return out


def parse_shared_readers(value: Any) -> int:
    """``shared_readers``: 1 to :data:`~omnikv.connectors.shm.shared.MAX_SHARED_READERS`
    (``None``: 1, each payload for one reader)."""
    out = parse_int("shared_readers", value, 1, minimum=1)
    if out > MAX_SHARED_READERS:
        raise ConfigError(f"shared_readers must be <= {MAX_SHARED_READERS}, got {out}")
    return out


def parse_role(value: Any) -> str | None:
    """``role``: ``"sender"``, ``"receiver"`` or absent (``None``: not known)."""
    return None if value is None else parse_choice("role", value, "", ROLES)


@dataclass(frozen=True)
class ShmConfig:
    """Parsed, validated ``SharedMemoryConnector`` config (see
    :mod:`omnikv.connectors.shm.connector`)."""

    namespace: str = "default"
    pool_size: int = DEFAULT_POOL_SIZE
    prefault: Prefault = Prefault()
    role: str | None = None  # "sender" / "receiver" (the manager's factory says), None: unknown
    put_timeout_s: float = 30.0
    get_timeout_s: float = 0.1
    join_timeout_s: float = 10.0
    linger_s: float = 30.0
    threshold: int = DEFAULT_THRESHOLD
    inline_small_payloads: bool = False
    poll_us: int = DEFAULT_POLL_US  # a blocking wait polls its sockets this long, then sleeps
    buffer_ttl_s: float = DEFAULT_BUFFER_TTL_S  # an unconsumed payload is freed then; 0: never
    # a payload unclaimed this long gives its space to newer ones when the pool is full
    unclaimed_grace_s: float = DEFAULT_UNCLAIMED_GRACE_S
    # what the stage declares it sends (sizes the "auto" reserve; 0: not declared)
    expected_payload_bytes: int = 0
    kv_bytes_per_token: int = 0
    max_model_len: int = 0
    # a payload taken and not acknowledged this long after its offer is reported expired
    ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S
    # every payload put here is published for this many readers of the node (``shared``)
    shared_readers: int = 1

    @classmethod
    def parse(cls, config: Mapping[str, Any] | None) -> ShmConfig:
        """Validate ``config``; :class:`ConfigError` names the first bad key."""
        cfg = dict(config or {})
        unknown = sorted(set(cfg) - _KNOWN_CONFIG)
        if unknown:
            logger.info("SharedMemoryConnector ignores config keys %s", unknown)
        pool_size = parse_size("pool_size_bytes", cfg.get("pool_size_bytes"), DEFAULT_POOL_SIZE)
        if pool_size < MIN_POOL_SIZE:
            raise ConfigError(f"pool_size_bytes must be >= {MIN_POOL_SIZE}, got {pool_size}")
        expected = parse_size("expected_payload_bytes", cfg.get("expected_payload_bytes"), 0)
        if expected > pool_size:
            logger.warning(
                "SharedMemoryConnector: expected_payload_bytes %d exceeds pool_size_bytes %d;"
                " payloads that large can never fit (raise pool_size_bytes)",
                expected,
                pool_size,
            )
        return cls(
            namespace=parse_namespace(cfg.get("namespace")),
            pool_size=pool_size,
            prefault=parse_prefault(cfg.get("prefault")),
            role=parse_role(cfg.get("role")),
            put_timeout_s=parse_number("put_timeout_s", cfg.get("put_timeout_s"), 30.0),
            get_timeout_s=parse_positive("get_timeout_s", cfg.get("get_timeout_s"), 0.1),
            join_timeout_s=parse_positive("join_timeout_s", cfg.get("join_timeout_s"), 10.0),
            linger_s=parse_number("linger_s", cfg.get("linger_s"), 30.0),
            threshold=parse_int(
                "shm_threshold_bytes", cfg.get("shm_threshold_bytes"), DEFAULT_THRESHOLD, minimum=0
            ),
            inline_small_payloads=parse_bool(
                "inline_small_payloads", cfg.get("inline_small_payloads"), False
            ),
            poll_us=_parse_poll_us(cfg.get("poll_us")),
            buffer_ttl_s=parse_number(
                "buffer_ttl_seconds", cfg.get("buffer_ttl_seconds"), DEFAULT_BUFFER_TTL_S
            ),
            unclaimed_grace_s=parse_number(
                "unclaimed_grace_seconds",
                cfg.get("unclaimed_grace_seconds"),
                DEFAULT_UNCLAIMED_GRACE_S,
            ),
            expected_payload_bytes=expected,
            kv_bytes_per_token=parse_int(
                "kv_bytes_per_token", cfg.get("kv_bytes_per_token"), 0, minimum=0
            ),
            max_model_len=parse_int("max_model_len", cfg.get("max_model_len"), 0, minimum=0),
            ack_timeout_s=parse_number(
                "ack_timeout_s", cfg.get("ack_timeout_s"), DEFAULT_ACK_TIMEOUT_S
            ),
            shared_readers=parse_shared_readers(cfg.get("shared_readers")),
        )

    @property
    def declared_payload_bytes(self) -> int:
        """The largest payload the stage declares it sends: ``expected_payload_bytes``, else
        ``kv_bytes_per_token * max_model_len`` when both are given, else 0 (not declared)."""
        if self.expected_payload_bytes:
            return self.expected_payload_bytes
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def reserve_bytes(self) -> int:
        """The start-up reserve: how much of the pool is populated before it is used.

        ``prefault: "auto"`` follows what the stage declares it sends (that size plus
        :data:`RESERVE_SLACK`, so its first payload of that size finds its pages populated), else
        :data:`AUTO_RESERVE`; an explicit byte count is taken as given. Never more than the pool.
        """
        if self.prefault.auto:
            declared = self.declared_payload_bytes
            return min(self.pool_size, declared + RESERVE_SLACK if declared else AUTO_RESERVE)
        return min(self.prefault.reserve, self.pool_size)

    @property
    def reserve_source(self) -> str:
        """Where :attr:`reserve_bytes` comes from, in words (``health()``, ``omnikv doctor``)."""
        if not self.prefault.auto:
            return "prefault" if self.reserve_bytes else "none, prefault off"
        if self.expected_payload_bytes:
            return "expected_payload_bytes"
        if self.declared_payload_bytes:
            return "kv_bytes_per_token x max_model_len"
        return "default, nothing declared"

    def describe_pool(self) -> str:
        """The send pool and its start-up reserve in words, for ``omnikv doctor``."""
        mib = 1 << 20
        text = (
            f"{self.pool_size / mib:g} MiB, committed as used; start-up reserve"
            f" {self.reserve_bytes / mib:g} MiB ({self.reserve_source}"
        )
        if self.prefault.auto and not self.declared_payload_bytes:
            text += (
                "; set expected_payload_bytes, or kv_bytes_per_token and max_model_len, in the"
                " connector_config to size it to what the stage sends"
            )
        return text + ")"

    @property
    def reserve_at_start(self) -> bool:
        """Create the pool and start the reserve in the constructor (else: on the first put).

        A connector known to send does; one known to receive does not; one whose role is not
        known does for an explicit byte count and waits for its first put with ``"auto"``.
        """
        if not self.reserve_bytes or self.role == "receiver":
            return False
        return self.role == "sender" or not self.prefault.auto
