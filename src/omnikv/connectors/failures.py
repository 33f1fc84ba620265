"""What a failed connector creation means for whoever configured it: the error, naming the
configuration key to change.

Called by :class:`~omnikv.connectors.factory.LazyConnector` when a creation fails (it logs the
text once at ERROR and keeps the error for ``manager.health()``), so that the strict factories
(``OmniKVTransferManager.from_config``, which raise it) and the lazy, reference-shaped ones (which
log it) say the same thing.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from omnikv.errors import ConfigError, ConnectorError, ConnectorUnavailableError, OmniKVError

__all__ = ["setup_error"]


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first (bounded: a chain is short, a cycle is cut)."""
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _find(chain: list[BaseException], kind: type[BaseException]) -> Any:
    return next((e for e in chain if isinstance(e, kind)), None)


def setup_error(name: str, config: Mapping[str, Any], exc: BaseException) -> OmniKVError:
    """The error a failed creation of connector ``name`` from ``config`` (what its constructor
    was given) stands for; its text starts with the ``connector_config`` key to change.

    * a bad value: :class:`ConfigError` ``connector_config (<type>): <the value's error>``;
    * the connector's package or engine missing: :class:`ConnectorUnavailableError` naming
      ``connector_config.type`` and what to install;
    * the control port taken: :class:`ConnectorUnavailableError` naming
      ``connector_config.zmq_port`` (the port this rank derives from it);
    * a Mooncake master that does not answer: naming ``master_server_address``;
    * anything else: :class:`ConnectorError` ``connector_config (<type>): <the error>``.

    The original error is the result's ``__cause__`` (set by the caller's ``raise ... from``).
    """
    chain = _chain(exc)
    root = chain[-1]
    bad_value = _find(chain, ConfigError)
    if bad_value is not None:
        return ConfigError(f"connector_config ({name}): {bad_value}")
    missing = _find(chain, ImportError)
    if missing is not None:
        return ConnectorUnavailableError(
            f"connector_config.type {name!r} cannot run here: {missing}; install what it "
            "names, or choose another connector_config.type ('omnikv doctor' lists those "
            "that can)"
        )
    taken = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.EADDRINUSE), None)
    if taken is not None:
        port = config.get("zmq_port")
        return ConnectorUnavailableError(
            f"connector_config.zmq_port: the control port {port} this rank binds (derived from "
            "zmq_port: base + 100 + 16 x rank + stage) is taken by another process; set "
            f"zmq_port to a base whose ports are free, or stop what holds it ({taken.strerror})"
        )
    text = " ".join(str(e) for e in chain)
    if "Mooncake master" in text:
        return ConnectorUnavailableError(
            f"connector_config.master_server_address: {_find(chain, ConnectorError) or root}; "
            "start the master there or point master_server_address at a running one"
        )
    return ConnectorError(f"connector_config ({name}): the connector could not be created: {exc}")
