"""Which address a pull connector binds and advertises, and the warning when it is exposed.

Shared by the two pull connectors (Mooncake Transfer Engine, NIXL) and by the Mooncake Store
connector, which advertises its client the same way:

* :func:`resolve_host`: the address to bind and advertise (the reference's detection for a
  missing, empty, ``"auto"`` or wildcard host); :func:`detect_local_address`, :func:`is_loopback`.
* :func:`warn_unauthenticated`: the one WARNING for a server on a non-loopback address without
  ``auth_secret``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from typing import Any

__all__ = [
    "WILDCARDS",
    "detect_local_address",
    "is_loopback",
    "resolve_host",
    "warn_unauthenticated",
]

logger = logging.getLogger(__name__)

WILDCARDS = frozenset({"0.0.0.0", "::", "*", "[::]"})
_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: a routing lookup only, nothing is ever sent


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
    Called by the pull connectors' senders at construction.
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
