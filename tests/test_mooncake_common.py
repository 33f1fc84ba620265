"""connectors/_mooncake_common.py: host resolution, the unauthenticated-bind warning, sizes.

Tests run in a network namespace where only loopback may exist, so detection is tested by its
contract (an address of this host that a socket can bind, 127.0.0.1 where nothing else
routes), not by a particular address.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest

from omnikv.connectors import _mooncake_common as common
from omnikv.errors import ConfigError


def test_the_detected_address_belongs_to_this_host() -> None:
    addr = common.detect_local_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, 0))  # only a local address can be bound


def test_detection_is_the_kernels_route_choice() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            expected = probe.getsockname()[0]
        except OSError:
            expected = "127.0.0.1"
    assert common.detect_local_address() == expected


@pytest.mark.parametrize("host", [None, "", "auto", "0.0.0.0", "::", "*", " auto "])
def test_missing_empty_auto_and_wildcards_advertise_the_detected_address(
    host: str | None,
) -> None:
    assert common.resolve_host(host) == common.detect_local_address()


def test_an_explicit_host_is_used_as_given() -> None:
    assert common.resolve_host("10.1.2.3") == "10.1.2.3"
    assert common.resolve_host("127.0.0.1") == "127.0.0.1"


def test_binding_a_non_loopback_address_without_a_secret_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=common.__name__)
    common.warn_unauthenticated("10.9.8.7", "Transfer Engine sender")
    common.warn_unauthenticated("10.9.8.7", "Transfer Engine sender")
    common.warn_unauthenticated("127.0.0.1", "Transfer Engine sender")
    common.warn_unauthenticated("localhost", "Transfer Engine sender")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10.9.8.7" in warnings[0].getMessage()
    assert "auth_secret" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("text", "expected"), [("64MB", 64 << 20), ("1GiB", 1 << 30), (4096, 4096)]
)
def test_sizes_accept_suffixes(text: object, expected: int) -> None:
    assert common.parse_size(text, "memory_pool_size") == expected


@pytest.mark.parametrize("bad", [0, -1, "lots", True])
def test_bad_sizes_are_config_errors_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="memory_pool_size"):
        common.parse_size(bad, "memory_pool_size")


def test_config_values_are_strict_and_name_their_key() -> None:
    with pytest.raises(ConfigError, match="peer_timeout_seconds"):
        common.config_seconds({"peer_timeout_seconds": 0}, "peer_timeout_seconds", 5.0)
    with pytest.raises(ConfigError, match="buffer_ttl_seconds"):
        common.config_seconds({"buffer_ttl_seconds": -1}, "buffer_ttl_seconds", 300.0)
    with pytest.raises(ConfigError, match="workers"):
        common.config_count({"workers": 0}, "workers", 4)
    with pytest.raises(ConfigError, match="zmq_port"):
        common.config_port(70000, "zmq_port")
    with pytest.raises(ConfigError, match="remove_after_get"):
        common.config_flag({"remove_after_get": "no"}, "remove_after_get", True)


def test_flags_accept_booleans_and_their_names() -> None:
    assert common.config_flag({"f": "False"}, "f", True) is False
    assert common.config_flag({"f": True}, "f", False) is True
    assert common.config_flag({}, "f", True) is True
    assert common.config_port("50051", "zmq_port") == 50051


def test_engine_defaults_leave_the_operator_s_environment_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MC_TCP_ENABLE_CONNECTION_POOL", raising=False)
    monkeypatch.delenv("MC_DISABLE_METACACHE", raising=False)
    common.set_tcp_connection_pool(False)
    common.set_metadata_cache(False)
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "0"
    assert os.environ["MC_DISABLE_METACACHE"] == "1"
    monkeypatch.setenv("MC_TCP_ENABLE_CONNECTION_POOL", "1")
    common.set_tcp_connection_pool(False)  # the operator's value wins
    assert os.environ["MC_TCP_ENABLE_CONNECTION_POOL"] == "1"
