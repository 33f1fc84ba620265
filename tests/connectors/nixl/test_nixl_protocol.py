"""NixlSettings: strict configuration of the NIXL connector (no NIXL needed)."""

from __future__ import annotations

from typing import Any

import pytest

from omnikv.connectors.nixl.config import NixlSettings
from omnikv.connectors.pull.connector import transfer_budget_s
from omnikv.errors import ConfigError


def _settings(**cfg: Any) -> NixlSettings:
    return NixlSettings.from_config({"role": "sender", "zmq_port": 5555, **cfg})


def test_defaults_match_the_transfer_engine_connector() -> None:
    s = _settings(host="127.0.0.1")
    assert s.host == "127.0.0.1" and s.backends == ("UCX",) and s.pool_size == 1 << 30
    assert (s.ttl_s, s.peer_timeout_s, s.quarantine_dead_s) == (300.0, 5.0, 60.0)
    assert s.secret is None and s.default_sender is None
    assert s.max_leases == 8
    lim = s.limits
    assert (lim.max_connections, lim.max_connections_per_peer) == (1024, 64)
    assert (lim.handshake_timeout_s, lim.idle_timeout_s, lim.heartbeat_s) == (5.0, 300.0, 10.0)


def test_admission_and_lease_keys_are_read() -> None:
    s = _settings(
        max_connections=10,
        max_connections_per_peer=2,
        handshake_timeout_seconds=0.5,
        idle_timeout_seconds=60,
        heartbeat_seconds=3,
        max_leases_per_entry=2,
    )
    assert s.limits.max_connections == 10 and s.limits.max_connections_per_peer == 2
    assert (s.limits.handshake_timeout_s, s.limits.idle_timeout_s) == (0.5, 60.0)
    assert s.limits.heartbeat_s == 3.0 and s.max_leases == 2


def test_receiver_needs_no_port_and_takes_a_default_sender() -> None:
    s = NixlSettings.from_config(
        {"role": "receiver", "sender_host": "10.0.0.2", "sender_zmq_port": "6000"}
    )
    assert s.zmq_port is None and s.default_sender == ("10.0.0.2", 6000)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("role", "both"),
        ("zmq_port", 70000),
        ("zmq_port", True),
        ("backends", []),
        ("backends", ["UCX; rm"]),
        ("auth_secret", ""),
        ("auth_secret", 42),
        ("memory_pool_size", 0),
        ("buffer_ttl_seconds", -1),
        ("peer_timeout_seconds", 0),
        ("peer_timeout_seconds", "nan"),
        ("quarantine_dead_seconds", True),
        ("auth_window_seconds", 0),
        ("put_timeout_s", -1),
        ("max_connections", 0),
        ("max_connections", "ten"),
        ("max_connections_per_peer", True),
        ("handshake_timeout_seconds", 0),
        ("idle_timeout_seconds", float("inf")),
        ("heartbeat_seconds", -1),
        ("max_leases_per_entry", 0),
        ("max_leases_per_entry", 2.5),
    ],
)
def test_bad_values_are_config_errors(key: str, value: Any) -> None:
    with pytest.raises(ConfigError):
        _settings(**{key: value})


def test_a_sender_needs_a_port() -> None:
    with pytest.raises(ConfigError, match="zmq_port"):
        NixlSettings.from_config({"role": "sender"})


def test_string_sizes_and_one_backend_name() -> None:
    s = _settings(memory_pool_size="512MB", backends="UCX", auth_secret="s")
    assert s.pool_size == 512 << 20 and s.backends == ("UCX",) and s.secret == b"s"


def test_transfer_budget_grows_with_size() -> None:
    assert transfer_budget_s(1) == 30.0
    assert transfer_budget_s(224 << 20) == 40.0
