"""connectors/mooncake_te/engine.py: the engine's environment and the install hint (no engine
is started)."""

from __future__ import annotations

import os

import pytest

from omnikv.connectors.mooncake_te import engine


def test_engine_defaults_leave_the_operator_s_environment_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MC_TCP_ENABLE_CONNECTION_POOL", raising=False)
    monkeypatch.delenv("MC_DISABLE_METACACHE", raising=False)
    engine.set_tcp_connection_pool(False)
    engine.set_metadata_cache(False)
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "0"
    assert os.environ["MC_DISABLE_METACACHE"] == "1"
    monkeypatch.setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    engine.set_tcp_connection_pool(False)  # the operator's value wins
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "1"


def test_the_bind_address_is_set_once_and_the_operator_s_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    engine.set_tcp_bind_address("127.0.0.1")
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    engine.set_tcp_bind_address("10.0.0.1")
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"


def test_a_missing_engine_names_the_extra_to_install() -> None:
    reason = engine.unavailable_reason()
    assert reason is None or "omnikv[mooncake]" in reason
