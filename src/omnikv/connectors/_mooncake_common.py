"""Pieces shared by the two Mooncake connectors (no Mooncake import here).

* :func:`import_mooncake_engine` / :func:`import_mooncake_store`: the lazy imports, translated
  into an ``ImportError`` that names the extra to install; :func:`unavailable_reason` says up
  front whether they would succeed.
* :func:`resolve_host`: the address to bind and advertise (the reference's detection for a
  missing, empty, ``"auto"`` or wildcard host); :func:`detect_local_address`.
* :func:`warn_unauthenticated`: the one WARNING for a server on a non-loopback address without
  ``auth_secret``.
* :func:`parse_size`, :func:`set_tcp_bind_address`; :func:`set_tcp_connection_pool` and
  :func:`set_metadata_cache` (engine defaults that keep a long-lived engine correct and flat).

Objects, cleanup keys and raw views are the connectors' common helpers (``connectors.base``,
``omnikv.serialization``), not Mooncake's; ``as_host_bytes``, ``matches_request`` and
``encode_object`` are re-exported here for code written against the earlier layout.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from omnikv.connectors.base import as_host_bytes, matches_request
from omnikv.errors import ConfigError
from omnikv.serialization import encode_object

__all__ = [
    "WILDCARDS",
    "as_host_bytes",
    "encode_object",
    "matches_request",
    "config_count",
    "config_flag",
    "config_port",
    "config_seconds",
    "detect_local_address",
    "import_mooncake_engine",
    "import_mooncake_store",
    "is_loopback",
    "parse_size",
    "resolve_host",
    "set_metadata_cache",
    "set_tcp_bind_address",
    "set_tcp_connection_pool",
    "unavailable_reason",
    "warn_unauthenticated",
]

logger = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "::", "*", "[::]"})
_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: a routing lookup only, nothing is ever sent
_MISSING_HINT = (
    "Mooncake is not importable; install it with pip install 'omnikv[mooncake]' "
    "(CPU-only hosts: mooncake-transfer-engine-non-cuda, plus Debian's libibverbs1)"
)


def unavailable_reason() -> str | None:
    """Why the Mooncake connectors cannot run here (with the install hint), or ``None``.

    Imports the engine and the store. Called by ``omnikv bench mooncake`` before it
    starts peers, and by the engine tests to decide whether to skip.
    """
    try:
        import mooncake.engine
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a missing libibverbs
        return f"{_MISSING_HINT}: {exc}"
    return None


def import_mooncake_engine() -> Any:
    """``mooncake.engine.TransferEngine``; ``ImportError`` with the install hint otherwise."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"{_MISSING_HINT}: {exc}") from exc
    return TransferEngine


def import_mooncake_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)``; ``ImportError`` with the hint otherwise."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise ImportError(f"{_MISSING_HINT}: {exc}") from exc
    return MooncakeDistributedStore, ReplicateConfig


def detect_local_address() -> str:
    """The local address this host uses to reach other hosts (the reference's UDP-socket trick).

    ``connect`` on a UDP socket only asks the kernel for a route (no packet is sent); the source
    address it picked is the answer. Where no route exists (a host, or a network namespace, with
    only loopback) the answer is ``127.0.0.1``.
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(_PROBE)
        return str(probe.getsockname()[0])
    except OSError:
        logger.debug("no route to other hosts; the local address is 127.0.0.1")
        return "127.0.0.1"
    finally:
        probe.close()


def resolve_host(host: Any) -> str:
    """The address to bind and advertise: ``host`` as given, or, when it is missing, empty,
    ``"auto"`` or a wildcard, the detected local address (:func:`detect_local_address`), so a
    peer is always told an address it can reach.
    """
    value = "" if host is None else str(host).strip()
    if value in {"", "auto"} or value in WILDCARDS:
        detected = detect_local_address()
        logger.info("host %r: advertising the detected local address %s", value, detected)
        return detected
    return value


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_unauthenticated(host: str, what: str) -> None:
    """One WARNING per process and address when a server binds a non-loopback ``host`` without
    ``auth_secret`` (anyone who reaches it can then read or inject KV; see README, Mooncake).
    """
    if is_loopback(host):
        return
    with _warned_lock:
        if host in _warned:
            return
        _warned.add(host)
    logger.warning(
        "%s binds %s without auth_secret: anyone who reaches this address can pull the KV it "
        "holds; set auth_secret on every peer (see README, Mooncake: trust model)",
        what,
        host,
    )


def set_tcp_bind_address(host: str) -> None:
    """Make the engine's TCP transport bind ``host`` unless the operator set it already.

    Mooncake reads ``MC_TCP_BIND_ADDRESS`` at engine start; without it the TCP transport
    advertises (and listens on) the machine's first non-loopback address.
    """
    current = os.environ.get("MC_TCP_BIND_ADDRESS")
    if current is None:
        os.environ["MC_TCP_BIND_ADDRESS"] = host
    elif current != host:
        logger.warning("MC_TCP_BIND_ADDRESS=%s differs from the configured host %s", current, host)


def _engine_env(name: str, want: str, key: str) -> None:
    """Set the engine's environment variable ``name`` to ``want`` (what config ``key`` asks)
    unless it is set already: the operator's (or an earlier connector's) value wins."""
    current = os.environ.get(name)
    if current is None:
        os.environ[name] = want
    elif current != want:
        logger.info("%s=%s from the environment (%s asks %s)", name, current, key, want)


def set_tcp_connection_pool(enabled: bool) -> None:
    """Make the engine's TCP transport keep (``enabled``) or not keep its connections to peers
    (``MC_TCP_ENABLE_CONNECTION_POOL``). Called by the Mooncake connectors before their engine
    starts (``tcp_connection_pool``, default false).

    A pooled connection is never closed when its peer goes away: a long-lived engine keeps one
    descriptor (in CLOSE_WAIT) per peer it ever wrote to or read from. Without the pool each
    transfer opens its own connection; on loopback that costs about 0.1 ms per transfer.
    """
    _engine_env("MC_TCP_ENABLE_CONNECTION_POOL", "1" if enabled else "0", "tcp_connection_pool")


def set_metadata_cache(enabled: bool) -> None:
    """Make the engine cache (``enabled``) or not cache its peers' segment descriptions
    (``MC_DISABLE_METACACHE``). Called by the Mooncake connectors before their engine starts
    (``metadata_cache``, default false).

    The cache is keyed by the peer's ``host:port``; without it a peer's description is fetched
    afresh when the engine opens its segment, and no measurable time is lost per transfer. It
    does not cover segments the engine already opened: those are kept by name for as long as
    the engine lives (the Transfer Engine connector gives a returning name a new spelling; see
    :mod:`omnikv.connectors.mooncake_te.sender`).
    """
    _engine_env("MC_DISABLE_METACACHE", "0" if enabled else "1", "metadata_cache")


def parse_size(value: Any, name: str) -> int:
    """A positive byte count from an int or a string with an optional KB/MB/GB suffix."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count, got {value!r}")
    if isinstance(value, int | float):
        n = int(value)
    else:
        text = str(value).strip().upper().removesuffix("B").removesuffix("I")
        mult = 1
        for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
            if text.endswith(suffix):
                text, mult = text[:-1], m
                break
        try:
            n = int(float(text) * mult)
        except ValueError as exc:
            raise ConfigError(f"{name} must be a byte count, got {value!r}") from exc
    if n <= 0:
        raise ConfigError(f"{name} must be > 0 bytes, got {value!r}")
    return n


def config_seconds(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """``cfg[key]`` as a positive, finite number of seconds; ``ConfigError`` naming the key."""
    value = cfg.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < float("inf")
    ):
        raise ConfigError(f"{key} must be a positive number of seconds, got {value!r}")
    return float(value)


def config_count(cfg: Mapping[str, Any], key: str, default: int) -> int:
    """``cfg[key]`` as an integer >= 1; ``ConfigError`` naming the key."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def config_flag(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    """``cfg[key]`` as a boolean: ``True``/``False`` or case-insensitive ``"true"``/``"false"``."""
    value = cfg.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"true", "false"}:
        return value.strip().lower() == "true"
    raise ConfigError(f"{key} must be true or false, got {value!r}")


def config_port(value: Any, key: str) -> int:
    """A TCP port in 1..65535 (int or digit string); ``ConfigError`` naming the key."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{key} must be a port number, got {value!r}")
    try:
        port = int(value)
    except ValueError as exc:
        raise ConfigError(f"{key} must be a port number, got {value!r}") from exc
    if not 0 < port < 65536:
        raise ConfigError(f"{key} must be in 1..65535, got {value!r}")
    return port
