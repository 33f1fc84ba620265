"""The Mooncake Transfer Engine as both Mooncake connectors meet it (no Mooncake import here).

The Store connector's client runs a Transfer Engine inside, so the engine's pieces live here and
:mod:`omnikv.connectors.mooncake_store` imports them:

* :func:`import_mooncake_engine`: the lazy import, translated into an ``ImportError`` that names
  the extra to install (:data:`INSTALL_HINT`); :func:`unavailable_reason` says up front whether
  the engine and the store import (``omnikv doctor``, ``omnikv bench mooncake``, the tests).
* :func:`set_tcp_bind_address`, :func:`set_tcp_connection_pool`, :func:`set_metadata_cache`:
  the engine's environment, set before an engine starts (the operator's values win).
* :data:`TE_ERRORS`: the Transfer Engine connector's error table
  (:class:`~omnikv.connectors.boundary.ErrorMap`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omnikv.connectors.boundary import ErrorMap, ErrorRule
from omnikv.errors import ConnectorUnavailableError

__all__ = [
    "INSTALL_HINT",
    "TE_ERRORS",
    "import_mooncake_engine",
    "set_metadata_cache",
    "set_tcp_bind_address",
    "set_tcp_connection_pool",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "Mooncake is not importable; install it with pip install 'omnikv[mooncake]' "
    "(CPU-only hosts: mooncake-transfer-engine-non-cuda, plus Debian's libibverbs1)"
)

#: The Transfer Engine connector's boundary. Mooncake's bindings (pybind11) declare no exception
#: classes: the engine reports failures as return codes (:meth:`ErrorMap.check`; any non-zero
#: code is ``ConnectorUnavailableError``), and a C++ exception escaping it arrives as
#: ``RuntimeError``. ``OSError`` covers the control sockets and the system calls around them.
TE_ERRORS = ErrorMap(
    "Mooncake Transfer Engine",
    (
        ErrorRule(RuntimeError, ConnectorUnavailableError),
        ErrorRule(OSError, ConnectorUnavailableError),
    ),
)


def unavailable_reason() -> str | None:
    """Why the Mooncake connectors cannot run here (with the install hint), or ``None``.

    Imports the engine and the store. Called by ``omnikv doctor`` and ``omnikv bench mooncake``
    before they start peers, and by the engine tests to decide whether to skip.
    """
    try:
        import mooncake.engine  # noqa: F401
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: a missing libibverbs
        return f"{INSTALL_HINT}: {exc}"
    return None


def import_mooncake_engine() -> Any:
    """``mooncake.engine.TransferEngine``; ``ImportError`` with the install hint otherwise."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT}: {exc}") from exc
    return TransferEngine


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
    transfer opens its own connection (one TCP handshake per transfer).
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
    :mod:`omnikv.connectors.mooncake_te.sending`).
    """
    _engine_env("MC_DISABLE_METACACHE", "0" if enabled else "1", "metadata_cache")
