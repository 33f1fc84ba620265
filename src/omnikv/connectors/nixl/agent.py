"""The raw NIXL pieces the NIXL connector (and ``omnikv bench nixl``) stand on.

* :func:`unavailable_reason` / :func:`import_nixl`: the lazy import of the wheel's Python API
  (``nixl`` or ``nixl_cu12``), with the install hint when it is missing.
* :class:`NixlAgent`: one NIXL agent with its backends, one registered DRAM region, remote agents
  added from their metadata, READs with a completion notification, and the notifications this
  agent received. Every NIXL error is translated here, at the boundary, into omnikv's errors
  (:func:`nixl_error_map`, the one table for this backend).

Thread safety: the agent is created with NIXL's strict thread synchronisation, so the receiver's
threads may post and poll transfers concurrently.

UCX and ``libnl``: the wheel bundles UCX's InfiniBand transports, which link a ``libnl-route``
whose library destructor crashes (SIGSEGV at process exit) on hosts without InfiniBand devices.
On such hosts, unless the operator set ``UCX_MODULES`` already, the agent leaves those modules
unloaded (``UCX_MODULES=^ib*``): they could not be used there anyway.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from omnikv.connectors.boundary import ErrorMap, ErrorRule
from omnikv.errors import ConnectorError, ConnectorUnavailableError, PeerGoneError

__all__ = [
    "INSTALL_HINT",
    "NixlAgent",
    "Transfer",
    "import_nixl",
    "nixl_error_map",
    "nixl_exception_classes",
    "ucx_defaults",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "NIXL is not importable; install it with pip install 'omnikv[nixl]' "
    "(nixl-cu12; install torch==2.13.0 first so that no CUDA torch is pulled)"
)
_MODULES = ("nixl._api", "nixl_cu12._api")
_IB_SYSFS = "/sys/class/infiniband"


def import_nixl() -> Any:
    """The NIXL Python API module (``nixl_agent`` and friends); ``ImportError`` with the hint."""
    errors: list[str] = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(f"{INSTALL_HINT} ({'; '.join(errors)})")


def unavailable_reason() -> str | None:
    """Why the NIXL connector cannot run here (with the install hint), or ``None``."""
    try:
        import_nixl()
    except (ImportError, OSError) as exc:
        return str(exc)
    return None


def ucx_defaults() -> None:
    """Keep UCX's InfiniBand modules unloaded where no InfiniBand device exists (see above)."""
    if "UCX_MODULES" in os.environ:
        return
    with contextlib.suppress(OSError):
        if os.listdir(_IB_SYSFS):
            return
    os.environ["UCX_MODULES"] = "^ib*"


#: The binding of a remote agent that went away (``PeerGoneError``); every other NIXL error class
#: is ``ConnectorUnavailableError``.
_REMOTE_DISCONNECT = "nixlRemoteDisconnectError"


def nixl_exception_classes(api: Any) -> tuple[type[BaseException], ...]:
    """Every exception class the loaded bindings declare (``nixlBind.nixl*Error``)."""
    bindings = getattr(api, "nixlBind", None)
    return tuple(
        obj
        for name in sorted(dir(bindings))
        if name.startswith("nixl") and name.endswith("Error")
        for obj in (getattr(bindings, name),)
        if isinstance(obj, type) and issubclass(obj, BaseException)
    )


@functools.cache
def nixl_error_map(api: Any) -> ErrorMap:
    """The NIXL boundary for the loaded bindings ``api`` (built once per module).

    ======================================  =============================  =========
    NIXL raises                             omnikv raises                  transient
    ======================================  =============================  =========
    ``nixlRemoteDisconnectError``           ``PeerGoneError``              no
    every other ``nixlBind.nixl*Error``     ``ConnectorUnavailableError``  yes
    ``RuntimeError`` (NIXL's Python layer,  ``ConnectorUnavailableError``  yes
    e.g. no plugin found)
    ======================================  =============================  =========

    The classes are those of the wheel that was imported (``nixl`` or ``nixl_cu12``); a wheel
    without a disconnect class maps every NIXL error to ``ConnectorUnavailableError``.
    """
    classes = nixl_exception_classes(api)
    gone = [
        ErrorRule(cls, PeerGoneError, "lost the remote agent (disconnected)")
        for cls in classes
        if cls.__name__ == _REMOTE_DISCONNECT
    ]
    others = [
        ErrorRule(cls, ConnectorUnavailableError)
        for cls in classes
        if cls.__name__ != _REMOTE_DISCONNECT
    ]
    return ErrorMap(
        "NIXL",
        (*gone, *others, ErrorRule(RuntimeError, ConnectorUnavailableError)),
    )


class Transfer:
    """One posted READ: poll :meth:`state` until ``"DONE"`` or ``"ERR"``, then :meth:`release`.

    ``release`` of a transfer still running asks NIXL to cancel it; it returns ``False`` when
    NIXL refuses (the transfer may still write into the local memory: keep it quarantined).
    """

    __slots__ = ("_agent", "_handle", "_released", "nbytes")

    def __init__(self, agent: NixlAgent, handle: Any, nbytes: int) -> None:
        self._agent = agent
        self._handle = handle
        self._released = False
        self.nbytes = nbytes

    def state(self) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (a disconnected peer reads as ``"ERR"``)."""
        if self._released:
            return "ERR"
        return self._agent.xfer_state(self._handle)

    def release(self) -> bool:
        """Free the transfer handle (cancelling it if running); ``True`` once it is freed."""
        if self._released:
            return True
        try:
            with self._agent.errors.translate("releasing a NIXL transfer"):
                self._handle.release()
        except ConnectorError as exc:
            logger.debug("NIXL transfer release refused: %s", exc)
            return False
        self._released = True
        return True


class NixlAgent:
    """One NIXL agent: backends, one registered DRAM region, remote agents, READs, notifications.

    ``register(address, nbytes)`` registers the connector's pool once; ``metadata()`` is what a
    peer needs to READ from it (pass it to the peer's :meth:`add_remote`). :meth:`close`
    deregisters, forgets remote agents and drops the agent. Not usable after ``close``.
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",)) -> None:
        ucx_defaults()
        self.api = import_nixl()
        #: This backend's error table (:func:`nixl_error_map`), applied around every NIXL call.
        self.errors = nixl_error_map(self.api)
        self.name = name
        self.backends = list(backends)
        self._lock = threading.Lock()
        self._regs: list[Any] = []
        self._remotes: set[str] = set()
        api = self.api
        with self.errors.translate(f"creating NIXL agent {name}"):
            sync = api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            conf = api.nixl_agent_config(backends=self.backends, sync_mode=sync)
            self._agent: Any = api.nixl_agent(name, conf)
        missing = [b for b in self.backends if b not in self._agent.backends]
        if missing:
            have = ", ".join(self._agent.get_plugin_list()) or "none"
            self._agent = None
            raise ConnectorUnavailableError(
                f"NIXL backend(s) {missing} unavailable (plugins here: {have})"
            )

    @property
    def agent(self) -> Any:
        agent = self._agent
        if agent is None:
            raise ConnectorUnavailableError(f"NIXL agent {self.name} is closed")
        return agent

    # -- memory ------------------------------------------------------------------------------
    def register(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)`` (host DRAM) with the agent's backends."""
        with self.errors.translate("registering memory with NIXL"):
            reg = self.agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        with self._lock:
            self._regs.append(reg)

    @property
    def registered_regions(self) -> int:
        with self._lock:
            return len(self._regs)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered regions) for its peers."""
        with self.errors.translate("reading NIXL agent metadata"):
            md: bytes = self.agent.get_agent_metadata()
        return md

    # -- remote agents -----------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name (NIXL returns bytes: decoded here)."""
        with self.errors.translate("loading a remote NIXL agent"):
            raw = self.agent.add_remote_agent(metadata)
        name = raw.decode() if isinstance(raw, bytes | bytearray) else str(raw)
        with self._lock:
            self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (after it restarted or went away). Unknown names are ignored."""
        with self._lock:
            if name not in self._remotes:
                return
            self._remotes.discard(name)
        try:
            with self.errors.translate("removing a remote NIXL agent"):
                self.agent.remove_remote_agent(name)
        except ConnectorError as exc:
            logger.debug("removing remote agent %s: %s", name, exc)

    # -- transfers ---------------------------------------------------------------------------
    def read(
        self, remote: str, local_addr: int, remote_addr: int, nbytes: int, notif: bytes
    ) -> Transfer:
        """Post a READ of ``nbytes`` from ``remote_addr`` at ``remote`` into ``local_addr``.

        ``notif`` reaches the remote agent's notifications when the READ completes.
        """
        agent = self.agent
        with self.errors.translate(f"posting a NIXL READ from {remote}"):
            local = agent.get_xfer_descs([(local_addr, nbytes, 0)], "DRAM")
            far = agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
            handle = agent.initialize_xfer("READ", local, far, remote, notif)
            xfer = Transfer(self, handle, nbytes)
            state = agent.transfer(handle)
        if state == "ERR":
            xfer.release()
            raise ConnectorUnavailableError(f"NIXL refused to post a READ from {remote}")
        return xfer

    def xfer_state(self, handle: Any) -> str:
        try:
            with self.errors.translate("polling a NIXL transfer"):
                state: str = self.agent.check_xfer_state(handle)
        except ConnectorError:
            return "ERR"
        return state

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call: ``{remote agent name: [messages]}``."""
        with self.errors.translate("reading NIXL notifications"):
            got: dict[str, list[bytes]] = self.agent.get_new_notifs()
        return got

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Deregister every region, forget remote agents, drop the agent. Idempotent."""
        agent = self._agent
        if agent is None:
            return
        with self._lock:
            regs, self._regs = self._regs, []
            remotes, self._remotes = list(self._remotes), set()
        for name in remotes:
            with contextlib.suppress(Exception):  # best effort: the peer may be gone
                agent.remove_remote_agent(name)
        for reg in regs:
            try:
                agent.deregister_memory(reg)
            except Exception:  # logged, not swallowed: the agent goes away just below
                logger.warning("NIXL deregister_memory failed", exc_info=True)
        self._agent = None
