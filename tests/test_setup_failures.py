"""Set-up failures surface where the user can act: ``from_config`` creates the connector and
raises the error naming the config key; the lazy, reference-shaped factories log the same text
once at ERROR; ``manager.health()`` reports it."""

from __future__ import annotations

import logging
import socket
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from omnikv import OmniKVTransferManager
from omnikv.errors import ConnectorUnavailableError
from omnikv.topology.placement import kv_zmq_port

TE = "MooncakeTransferEngineConnector"


def _te_sender(base: int, **extra: Any) -> dict[str, Any]:
    conn = {"type": TE, "host": "127.0.0.1", "zmq_port": base, **extra}
    return {
        "need_send_cache": True,
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "connector_retry_interval": 0,
        "connector_config": conn,
    }


@pytest.fixture
def no_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake as on a host without it: importing its engine fails."""
    for name in ("mooncake", "mooncake.engine", "mooncake.store"):
        monkeypatch.setitem(sys.modules, name, None)


def test_from_config_names_the_connector_type_when_its_engine_is_missing(
    no_mooncake: None,
) -> None:
    with pytest.raises(ConnectorUnavailableError) as info:
        OmniKVTransferManager.from_config(_te_sender(47000))
    text = str(info.value)
    assert text.startswith(f"connector_config.type {TE!r} cannot run here")
    assert "omnikv[mooncake]" in text and "omnikv doctor" in text


def test_the_lazy_factory_logs_the_same_text_once_and_health_reports_it(
    no_mooncake: None, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConnectorUnavailableError) as info:
        OmniKVTransferManager.from_config(_te_sender(47000))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="omnikv.connectors.factory"):
        manager = OmniKVTransferManager.from_od_config(
            SimpleNamespace(omni_kv_config=_te_sender(47000))
        )
        try:
            for _ in range(3):  # retries (connector_retry_interval 0) say it again at DEBUG
                assert manager.connector is None
            health = manager.health()
        finally:
            manager.close()
    failures = [r for r in caplog.records if "Connector creation failed" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.ERROR] + [logging.DEBUG] * 3
    assert str(info.value) in failures[0].getMessage()
    assert health["status"] == "unavailable" and health["sends"] is True
    assert str(info.value) in health["error"]


def test_health_of_working_managers(namespace: str) -> None:
    conn = {"type": "LocalConnector", "namespace": namespace}
    receiver_kv = {
        "need_recv_cache": True,
        "stage_id": 1,
        "omni_from_stage": 0,
        "connector_config": conn,
    }
    lazy = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=receiver_kv))
    strict = OmniKVTransferManager.from_config(receiver_kv)
    idle = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config={}))
    try:
        assert lazy.health()["status"] == "pending"  # a receiver creates it on first use
        assert lazy.connector is not None and lazy.health()["status"] == "ok"
        ready = strict.health()
        assert ready["status"] == "ok" and ready["receives"] is True
        assert ready["error"] is None and isinstance(ready["connector"], dict)
        assert idle.health()["status"] == "not_configured"
    finally:
        for m in (lazy, strict, idle):
            m.close()


@pytest.mark.engine
@pytest.mark.timeout(120)
def test_a_taken_control_port_is_named_as_zmq_port() -> None:
    from omnikv.connectors.mooncake_te.engine import unavailable_reason

    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        base = port - kv_zmq_port(0, 0, 0)  # the base whose stage-0 rank-0 port is taken
        with pytest.raises(ConnectorUnavailableError) as info:
            OmniKVTransferManager.from_config(_te_sender(base))
    text = str(info.value)
    assert text.startswith(f"connector_config.zmq_port: the control port {port} this rank binds")
    assert "is taken by another process" in text
