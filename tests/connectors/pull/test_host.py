"""connectors/pull/host.py: which address a pull connector binds and advertises, and the
warning when a sender is exposed without a secret.

Tests run in a network namespace where only loopback may exist, so detection is tested by its
contract (an address of this host that a socket can bind, 127.0.0.1 where nothing else
routes), not by a particular address.
"""

from __future__ import annotations

import logging
import socket

import pytest

from omnikv.connectors.pull import host


def test_the_detected_address_belongs_to_this_host() -> None:
    addr = host.detect_local_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((addr, 0))  # only a local address can be bound


def test_detection_is_the_kernels_route_choice() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))
            expected = probe.getsockname()[0]
        except OSError:
            expected = "127.0.0.1"
    assert host.detect_local_address() == expected


@pytest.mark.parametrize("value", [None, "", "auto", "0.0.0.0", "::", "*", " auto "])
def test_missing_empty_auto_and_wildcards_advertise_the_detected_address(
    value: str | None,
) -> None:
    assert host.resolve_host(value) == host.detect_local_address()


def test_an_explicit_host_is_used_as_given() -> None:
    assert host.resolve_host("10.1.2.3") == "10.1.2.3"
    assert host.resolve_host("127.0.0.1") == "127.0.0.1"


def test_loopback_names_and_addresses() -> None:
    assert host.is_loopback("localhost") and host.is_loopback("127.0.0.5")
    assert host.is_loopback("[::1]") and not host.is_loopback("10.0.0.1")
    assert not host.is_loopback("example.org")


def test_binding_a_non_loopback_address_without_a_secret_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=host.__name__)
    host.warn_unauthenticated("10.9.8.7", "Transfer Engine sender")
    host.warn_unauthenticated("10.9.8.7", "Transfer Engine sender")
    host.warn_unauthenticated("127.0.0.1", "Transfer Engine sender")
    host.warn_unauthenticated("localhost", "Transfer Engine sender")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10.9.8.7" in warnings[0].getMessage()
    assert "auth_secret" in warnings[0].getMessage()
