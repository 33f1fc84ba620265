"""Connector registry: a name maps to a dotted path, imported on first use.

Built-ins are listed in ``_BUILTINS``; third-party connectors register through the
``omnikv.connectors`` entry-point group (``name = "package.module:Class"``) or by calling
:meth:`OmniConnectorFactory.register_connector`. Registering the same target twice is a no-op;
a different target under a taken name is a ``ValueError``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, ClassVar

from omnikv.connectors.base import OmniConnectorBase
from omnikv.connectors.failures import setup_error
from omnikv.errors import ConfigError
from omnikv.topology.placement import engine_connector_config

__all__ = [
    "TRANSFER_ENGINE_CONNECTOR_NAMES",
    "ConnectorSpec",
    "LazyConnector",
    "OmniConnectorFactory",
    "OmniTransferConfig",
    "spec_for_stage",
    "spec_from_config",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omnikv.connectors"

#: name -> (dotted target, extra that provides its dependencies or None)
_BUILTINS: dict[str, tuple[str, str | None]] = {
    "LocalConnector": ("omnikv.connectors.local:LocalConnector", None),
    "SharedMemoryConnector": ("omnikv.connectors.shm:SharedMemoryConnector", None),
    "MooncakeStoreConnector": (
        "omnikv.connectors.mooncake_store:MooncakeStoreConnector",
        "mooncake",
    ),
    "MooncakeConnector": ("omnikv.connectors.mooncake_store:MooncakeStoreConnector", "mooncake"),
    "MooncakeTransferEngineConnector": (
        "omnikv.connectors.mooncake_te:MooncakeTransferEngineConnector",
        "mooncake",
    ),
    "NixlConnector": ("omnikv.connectors.nixl:NixlConnector", "nixl"),
}

#: Pull-model connectors whose ports and roles the manager derives (reference §2.3).
TRANSFER_ENGINE_CONNECTOR_NAMES: frozenset[str] = frozenset(
    {
        "MooncakeTransferEngineConnector",
        "MoriTransferEngineConnector",
        "NixlConnector",
        "YuanrongTransferEngineConnector",
    }
)


@dataclass(frozen=True)
class ConnectorSpec:
    """What to build: a registered connector ``name`` and its keyword ``extra`` config."""

    name: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class OmniTransferConfig:
    """Per-edge connector specs with a default: ``connectors[(from_stage, to_stage)]``."""

    connectors: dict[tuple[str, str], ConnectorSpec] = field(default_factory=dict)
    default_connector: ConnectorSpec | None = None

    def get_connector_for_edge(self, from_stage: str, to_stage: str) -> ConnectorSpec | None:
        return self.connectors.get((str(from_stage), str(to_stage)), self.default_connector)


class OmniConnectorFactory:
    """Creates connectors by name. Class-level registry shared by the process."""

    _targets: ClassVar[dict[str, tuple[str, str | None]]] = dict(_BUILTINS)
    _classes: ClassVar[dict[str, type[OmniConnectorBase]]] = {}
    _entry_points_loaded: ClassVar[bool] = False
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register_connector(
        cls, name: str, target: str | type[OmniConnectorBase], extra: str | None = None
    ) -> None:
        """Register ``target`` (a class or ``"module:Class"``) under ``name``.

        Registering the same target again is a no-op; another target under a taken name raises
        ``ValueError``.
        """
        with cls._lock:
            if isinstance(target, str):
                existing = cls._targets.get(name)
                if existing is not None:
                    if existing[0] == target:
                        return
                    raise ValueError(f"connector {name!r} is already registered as {existing[0]}")
                if name in cls._classes:
                    raise ValueError(f"connector {name!r} is already registered")
                cls._targets[name] = (target, extra)
                return
            known = cls._classes.get(name)
            if known is target:
                return
            path = f"{target.__module__}:{target.__qualname__}"
            existing = cls._targets.get(name)
            if known is not None or (existing is not None and existing[0] != path):
                raise ValueError(f"connector {name!r} is already registered")
            cls._classes[name] = target
            cls._targets.setdefault(name, (path, extra))

    @classmethod
    def list_connectors(cls) -> list[str]:
        """Names that can be created now (built-ins, registered, entry points)."""
        cls._load_entry_points()
        return sorted(set(cls._targets) | set(cls._classes))

    @classmethod
    def get_connector_class(cls, name: str) -> type[OmniConnectorBase]:
        """Resolve ``name`` to its class, importing it on first use.

        Raises ``ValueError`` listing the known names for an unknown one, and ``ImportError``
        naming the extra to install when an optional dependency is missing.
        """
        cached = cls._classes.get(name)
        if cached is not None:
            return cached
        cls._load_entry_points()
        entry = cls._targets.get(name)
        if entry is None:
            known = ", ".join(cls.list_connectors())
            raise ValueError(f"Unknown connector {name!r}; known connectors: {known}")
        target, extra = entry
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f" (pip install 'omnikv[{extra}]')" if extra else ""
            raise ImportError(
                f"connector {name!r} needs a missing dependency{hint}: {exc}"
            ) from exc
        klass = getattr(module, attr)
        if not (isinstance(klass, type) and issubclass(klass, OmniConnectorBase)):
            raise TypeError(f"{target} is not an OmniConnectorBase subclass")
        with cls._lock:
            cls._classes[name] = klass
        return klass

    @classmethod
    def create_connector(cls, spec: ConnectorSpec) -> OmniConnectorBase:
        """Build the connector ``spec`` names with ``spec.extra`` as its config.

        Unknown names raise ``ValueError``; a missing dependency ``ImportError``; a constructor
        failure ``ValueError("Failed to create connector ...")`` from the original error.
        """
        klass = cls.get_connector_class(spec.name)
        try:
            return klass(dict(spec.extra))  # type: ignore[call-arg]
        except Exception as exc:
            raise ValueError(f"Failed to create connector {spec.name!r}: {exc}") from exc

    @classmethod
    def _load_entry_points(cls) -> None:
        if cls._entry_points_loaded:
            return
        cls._entry_points_loaded = True
        try:
            eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception:  # pragma: no cover - broken metadata
            logger.exception("could not read the %s entry points", ENTRY_POINT_GROUP)
            return
        for ep in eps:
            try:
                cls.register_connector(ep.name, ep.value)
            except ValueError:
                logger.warning(
                    "entry point %s=%s clashes with a registered connector", ep.name, ep.value
                )


def spec_from_config(
    connector_config: Mapping[str, Any] | None,
    *,
    from_stage: Any,
    to_stage: Any,
    sends: bool,
    receives: bool,
    local_rank: int,
) -> ConnectorSpec | None:
    """What a stage's ``connector_config`` asks to build (``None`` without a ``type``).

    Every key but ``type`` is passed on; pull-model (transfer-engine) connectors also get their
    role, stages and this rank's port
    (:func:`omnikv.topology.placement.engine_connector_config`), the shared-memory connector its
    ``role`` (unless the config sets one).
    """
    if not connector_config or not connector_config.get("type"):
        return None
    name = str(connector_config["type"])
    extra = {k: v for k, v in connector_config.items() if k != "type"}
    if name in TRANSFER_ENGINE_CONNECTOR_NAMES:
        extra = engine_connector_config(
            extra,
            from_stage=from_stage,
            to_stage=to_stage,
            sends=sends,
            receives=receives,
            local_rank=local_rank,
        )
    elif name == "SharedMemoryConnector" and (sends or receives):
        # a sender prepares its pool while the stage starts (prefault "auto")
        extra.setdefault("role", "sender" if sends else "receiver")
    return ConnectorSpec(name, extra)


def spec_for_stage(config: Any, local_rank: int) -> ConnectorSpec | None:
    """:func:`spec_from_config` of an ``OmniKVCacheConfig`` (read when called: the manager's
    ``update_sender_info`` writes the sender endpoint into its ``connector_config``)."""
    return spec_from_config(
        config.connector_config,
        from_stage=config.from_stage,
        to_stage=config.to_stage,
        sends=bool(config.need_send_cache),
        receives=bool(config.need_recv_cache),
        local_rank=local_rank,
    )


class LazyConnector:
    """A connector created on first use; a failed creation is retried after ``retry_interval``.

    ``spec`` builds the :class:`ConnectorSpec` when creation is attempted (``None``: nothing is
    configured; ``TypeError``/``ValueError``: a bad configuration, recorded like a failed
    creation). ``get()`` is called by the sender and receiver on every request; it never raises
    and returns ``None`` while no connector exists. :attr:`error` says why the last attempt
    failed. An injected ``connector`` is used as is.
    """

    def __init__(
        self,
        spec: Callable[[], ConnectorSpec | None],
        *,
        retry_interval: float = 5.0,
        connector: OmniConnectorBase | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spec = spec
        self.retry_interval = retry_interval
        self._connector = connector
        self._clock = clock
        self._lock = threading.Lock()
        self._retry_at = 0.0
        #: Why the last creation failed (``None`` after a success or before any attempt).
        self.error: str | None = None
        #: The last creation failure as the error the strict factories raise
        #: (:func:`omnikv.connectors.failures.setup_error`; ``None`` as :attr:`error`).
        self.failure: Exception | None = None
        self._logged: str | None = None  # the failure already logged at ERROR

    @classmethod
    def for_stage(
        cls,
        config: Any,
        local_rank: int,
        *,
        retry_interval: float = 5.0,
        connector: OmniConnectorBase | None = None,
    ) -> LazyConnector:
        """The lazy connector of one stage's ``OmniKVCacheConfig`` on ``local_rank`` (built by
        the manager). The spec is read from ``config`` at each attempt (:func:`spec_for_stage`),
        so an endpoint written into it later is seen."""
        return cls(
            functools.partial(spec_for_stage, config, local_rank),
            retry_interval=retry_interval,
            connector=connector,
        )

    @property
    def current(self) -> OmniConnectorBase | None:
        """The connector if it exists; never creates one."""
        return self._connector

    def set(self, connector: OmniConnectorBase | None) -> None:
        """Use ``connector`` from now on (tests and drop-in code assign ``manager._connector``)."""
        with self._lock:
            self._connector = connector
            self.error = self.failure = None

    def get(self) -> OmniConnectorBase | None:
        """The connector, created now if needed and allowed; ``None`` while unavailable."""
        conn = self._connector
        if conn is not None:
            return conn
        with self._lock:
            if self._connector is None and self._clock() >= self._retry_at:
                self._connector = self._create()
            return self._connector

    def _create(self) -> OmniConnectorBase | None:
        try:
            spec = self._spec()
        except (TypeError, ValueError) as exc:
            bad: Exception = ConfigError(f"connector_config: {exc}")
            bad.__cause__ = exc
            self._failed(f"bad connector config: {exc}", bad)
            return None
        if spec is None:
            return None
        logger.info(
            "Initializing OmniConnector type=%s role=%s", spec.name, spec.extra.get("role", "-")
        )
        try:
            conn = OmniConnectorFactory.create_connector(spec)
        except Exception as exc:  # any backend failure: record the cause, retry later
            failure = setup_error(spec.name, spec.extra, exc)
            failure.__cause__ = exc
            self._failed(f"{type(failure).__name__}: {failure}", failure)
            return None
        self.error = self.failure = self._logged = None
        return conn

    def _failed(self, reason: str, failure: Exception) -> None:
        """Record a failed creation; the first time a reason comes it is logged at ERROR,
        its retries at DEBUG (a stage that cannot create its connector says so once)."""
        self.error, self.failure = reason, failure
        self._retry_at = self._clock() + self.retry_interval
        level = logging.DEBUG if reason == self._logged else logging.ERROR
        self._logged = reason
        logger.log(
            level, "Connector creation failed (%s); retrying in %.1fs", reason, self.retry_interval
        )

    def close(self, *, final: bool = False) -> None:
        """Close the connector if one was created (idempotent).

        A later :meth:`get` recreates it, unless ``final`` (the manager's ``close``): then
        :meth:`get` returns ``None`` from now on and :attr:`error` says the manager was closed.
        """
        with self._lock:
            conn, self._connector = self._connector, None
            if final:
                self._retry_at = math.inf
                self.error = "closed"
        if conn is not None:
            conn.close()
