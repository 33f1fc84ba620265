"""Each backend's error table (connectors/boundary.py): no backend exception escapes as itself.

As httpx checks that every httpcore exception is mapped: walk every exception class a backend
exposes (the classes its module declares, the ones pybind11 turns a C++ exception into, the
socket errors of the control plane) and check that its table maps each one to an omnikv
``ConnectorError``, raised ``from`` the original. A backend release that adds an exception
class fails here until the table says what it means.
"""

from __future__ import annotations

import builtins
import importlib
from types import ModuleType
from typing import Any

import pytest

from omnikv.connectors.boundary import CodeRule, ErrorMap, ErrorRule
from omnikv.connectors.factory import OmniConnectorFactory
from omnikv.connectors.local import LocalConnector
from omnikv.connectors.mooncake_store.connector import STORE_ERRORS
from omnikv.connectors.mooncake_te.engine import TE_ERRORS
from omnikv.connectors.pull.control import CONTROL_ERRORS
from omnikv.errors import (
    ConfigError,
    ConnectorError,
    ConnectorUnavailableError,
    PeerGoneError,
    PoolExhaustedError,
)

#: What pybind11 raises for a C++ exception the bindings do not translate themselves.
PYBIND11_DEFAULT = RuntimeError
SOCKET_ERRORS = sorted(
    (obj for obj in vars(builtins).values() if isinstance(obj, type) and issubclass(obj, OSError)),
    key=lambda cls: cls.__name__,
)


def _instance(cls: type[BaseException]) -> BaseException:
    try:
        return cls("boom")
    except TypeError:  # a binding class that takes other arguments
        return cls.__new__(cls)


def _declared_exceptions(module: ModuleType) -> list[type[BaseException]]:
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    ]


def _assert_mapped(table: ErrorMap, classes: list[type[BaseException]]) -> None:
    unmapped = [cls.__name__ for cls in classes if table.rule_for(_instance(cls)) is None]
    assert not unmapped, f"{table.backend}: unmapped backend exceptions {unmapped}"
    for cls in classes:
        original = _instance(cls)
        with pytest.raises(ConnectorError) as info, table.translate("a call"):
            raise original
        assert info.value.__cause__ is original
        assert type(info.value) is table.rule_for(original).becomes  # type: ignore[union-attr]


def _mooncake(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as exc:
        pytest.skip(f"{name} is not importable here: {exc}")


# -- Mooncake --------------------------------------------------------------------------------------
def test_every_exception_the_transfer_engine_module_declares_is_mapped() -> None:
    _assert_mapped(TE_ERRORS, _declared_exceptions(_mooncake("mooncake.engine")))


def test_every_exception_the_store_module_declares_is_mapped() -> None:
    _assert_mapped(STORE_ERRORS, _declared_exceptions(_mooncake("mooncake.store")))


@pytest.mark.parametrize("table", [TE_ERRORS, STORE_ERRORS], ids=lambda t: t.backend)
def test_a_cpp_exception_and_every_socket_error_of_mooncake_are_mapped(table: ErrorMap) -> None:
    _assert_mapped(table, [PYBIND11_DEFAULT, *SOCKET_ERRORS])
    assert all(rule.transient for rule in table.exceptions)  # the engine may be back


def test_every_socket_error_of_the_control_plane_is_mapped() -> None:
    _assert_mapped(CONTROL_ERRORS, SOCKET_ERRORS)


def test_the_store_s_transfer_fail_means_the_sender_is_gone() -> None:
    with pytest.raises(PeerGoneError, match="TRANSFER_FAIL"):
        STORE_ERRORS.check(-800, "get_into of k")
    with pytest.raises(ConnectorUnavailableError, match="returned -1"):
        STORE_ERRORS.check(-1, "put_from of k")
    with pytest.raises(ConnectorUnavailableError, match="returned 3"):
        TE_ERRORS.check(3, "register_memory")
    STORE_ERRORS.check(0, "setup")
    TE_ERRORS.check(0, "initialize")


# -- NIXL ------------------------------------------------------------------------------------------
def _nixl() -> tuple[Any, Any]:
    try:
        from omnikv.connectors.nixl import agent
    except (ImportError, OSError) as exc:
        pytest.skip(f"NIXL is not importable here: {exc}")
    return agent, agent.import_nixl()


def test_every_nixl_binding_error_is_mapped() -> None:
    agent, api = _nixl()
    classes = list(agent.nixl_exception_classes(api))
    assert classes, "the NIXL bindings declare no error classes: the walk would check nothing"
    table = agent.nixl_error_map(api)
    _assert_mapped(table, [*classes, RuntimeError])


def test_a_disconnected_remote_agent_is_peer_gone_and_not_retried() -> None:
    agent, api = _nixl()
    gone = getattr(api.nixlBind, "nixlRemoteDisconnectError", None)
    if gone is None:
        pytest.skip("this NIXL wheel has no disconnect error")
    rule = agent.nixl_error_map(api).rule_for(_instance(gone))
    assert rule is not None and rule.becomes is PeerGoneError and not rule.transient


# -- the helper and the connectors -----------------------------------------------------------------
def test_omnikv_errors_and_unmapped_exceptions_pass_unchanged() -> None:
    table = ErrorMap("x", (ErrorRule(OSError, ConnectorUnavailableError),))
    for exc in (PoolExhaustedError("full"), ConfigError("bad"), ValueError("bug")):
        with pytest.raises(type(exc)) as info, table.translate("a call"):
            raise exc
        assert info.value is exc


def test_the_first_matching_row_wins_and_names_the_call() -> None:
    table = ErrorMap(
        "engine",
        (
            ErrorRule(ConnectionResetError, PeerGoneError, "lost the peer"),
            ErrorRule(OSError, ConnectorUnavailableError),
        ),
        codes=(CodeRule(-5, PeerGoneError, "GONE"),),
    )
    gone = pytest.raises(PeerGoneError, match=r"^get of k: engine lost the peer: Connection")
    with gone, table.translate("get of k"):
        raise ConnectionResetError("reset")
    failed = pytest.raises(ConnectorUnavailableError, match="engine failed: TimeoutError")
    with failed, table.translate("get of k"):
        raise TimeoutError("slow")
    with pytest.raises(PeerGoneError, match=r"returned -5 \(GONE\)"):
        table.check(-5, "read")
    assert table.handled == (ConnectionResetError, OSError)


def test_every_engine_connector_declares_its_table() -> None:
    assert LocalConnector.error_map is None  # no backend of its own
    tables = {
        "MooncakeTransferEngineConnector": TE_ERRORS,
        "MooncakeStoreConnector": STORE_ERRORS,
        "MooncakeConnector": STORE_ERRORS,
    }
    for name, table in tables.items():
        assert OmniConnectorFactory.get_connector_class(name).error_map is table
    try:
        nixl = OmniConnectorFactory.get_connector_class("NixlConnector")
    except ImportError:
        return
    assert nixl.error_map is CONTROL_ERRORS
