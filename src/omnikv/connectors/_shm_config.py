"""The ``SharedMemoryConnector`` config (keys and meanings: :mod:`omnikv.connectors.shm`).

Every key goes through the strict helpers of :mod:`omnikv.config`: a wrong value is a
:class:`~omnikv.errors.ConfigError` naming the key, never coerced (``"no"`` is not ``False``,
``-1`` is not a size).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnikv.config import parse_bool, parse_int, parse_number, parse_positive, parse_size
from omnikv.errors import ConfigError

__all__ = [
    "AUTO_RESERVE",
    "DEFAULT_BUFFER_TTL_S",
    "DEFAULT_POLL_US",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_THRESHOLD",
    "MIN_POOL_SIZE",
    "ShmConfig",
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
#: ``prefault: "auto"``: a sending connector populates min(pool_size_bytes, this) at start.
AUTO_RESERVE = 256 << 20
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


def parse_prefault(value: Any) -> tuple[bool, int, bool]:
    """``prefault``: ``"auto"`` (default), a boolean, or a byte count (``int`` or ``"64MiB"``).

    Returns (populate ahead of use, explicit start-up reserve in bytes, automatic reserve);
    ``0`` is the same as ``False``. Anything else is a :class:`ConfigError`.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return True, 0, True
    if isinstance(value, bool):
        return value, 0, False
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return parse_bool("prefault", value, True), 0, False
    if value == 0 and isinstance(value, int):
        return False, 0, False
    try:
        return True, parse_size("prefault", value, 0), False
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


def parse_role(value: Any) -> str | None:
    """``role``: ``"sender"``, ``"receiver"`` or absent (``None``: not known)."""
    if value is None or (isinstance(value, str) and value in ROLES):
        return value
    raise ConfigError(f"role must be one of {ROLES} or absent, got {value!r:.60}")


@dataclass(frozen=True)
class ShmConfig:
    """Parsed, validated ``SharedMemoryConnector`` config (see :mod:`omnikv.connectors.shm`)."""

    namespace: str = "default"
    pool_size: int = DEFAULT_POOL_SIZE
    prefault: bool = True  # populate ahead of use (2x the high-water mark) in the background
    prefault_bytes: int = 0  # an explicit start-up reserve
    prefault_auto: bool = True  # reserve min(pool_size, AUTO_RESERVE) once the connector sends
    role: str | None = None  # "sender" / "receiver" (the manager's factory says), None: unknown
    put_timeout_s: float = 30.0
    get_timeout_s: float = 0.1
    join_timeout_s: float = 10.0
    linger_s: float = 30.0
    threshold: int = DEFAULT_THRESHOLD
    inline_small_payloads: bool = False
    poll_us: int = DEFAULT_POLL_US  # a blocking wait polls its sockets this long, then sleeps
    buffer_ttl_s: float = DEFAULT_BUFFER_TTL_S  # an unconsumed payload is freed then; 0: never

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
        prefault, prefault_bytes, prefault_auto = parse_prefault(cfg.get("prefault"))
        return cls(
            namespace=parse_namespace(cfg.get("namespace")),
            pool_size=pool_size,
            prefault=prefault,
            prefault_bytes=prefault_bytes,
            prefault_auto=prefault_auto,
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
        )

    @property
    def reserve_bytes(self) -> int:
        """The start-up reserve: how much of the pool is populated before it is used."""
        if self.prefault_auto:
            return min(self.pool_size, AUTO_RESERVE)
        return min(self.prefault_bytes, self.pool_size)

    @property
    def reserve_at_start(self) -> bool:
        """Create the pool and start the reserve in the constructor (else: on the first put).

        A connector known to send does; one known to receive does not; one whose role is not
        known does for an explicit byte count and waits for its first put with ``"auto"``.
        """
        if not self.reserve_bytes or self.role == "receiver":
            return False
        return self.role == "sender" or not self.prefault_auto
