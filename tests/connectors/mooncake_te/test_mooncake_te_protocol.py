"""connectors/mooncake_te/protocol.py: the TE connector's configuration and message schema
(pure: no engine, no sockets).
"""

from __future__ import annotations

import pytest

from omnikv.connectors.mooncake_te.config import TEConfig
from omnikv.connectors.mooncake_te.protocol import SCHEMA
from omnikv.connectors.mooncake_te.sending import (
    MAX_SESSION_RESPELLINGS,
    SessionNames,
    respell_session,
)
from omnikv.connectors.pull.connector import transfer_budget_s
from omnikv.connectors.pull.control import ControlCodec
from omnikv.connectors.pull.host import detect_local_address
from omnikv.errors import ConfigError, ProtocolError


def _sender(**extra: object) -> dict[str, object]:
    return {"role": "sender", "zmq_port": 50151, "host": "127.0.0.1", **extra}


def test_defaults_follow_the_reference() -> None:
    cfg = TEConfig.parse(_sender())
    assert (cfg.workers, cfg.ttl_s, cfg.peer_timeout_s, cfg.window_s) == (4, 300.0, 5.0, 30.0)
    assert cfg.pool_size == 1 << 30 and cfg.secret is None and cfg.protocol == "tcp"
    assert not cfg.tcp_connection_pool and not cfg.metadata_cache
    assert TEConfig.parse(_sender(metadata_cache="true", tcp_connection_pool=True)).metadata_cache


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"workers": 0}, "workers"),
        ({"workers": 2.5}, "workers"),
        ({"auth_secret": ""}, "auth_secret"),
        ({"zmq_port": 70000}, "zmq_port"),
        ({"zmq_port": None}, "zmq_port"),
        ({"peer_timeout_seconds": 0}, "peer_timeout_seconds"),
        ({"buffer_ttl_seconds": -1}, "buffer_ttl_seconds"),
        ({"role": "both"}, "role"),
        ({"memory_pool_size": 0}, "memory_pool_size"),
        ({"memory_pool_device": "cuda"}, "memory_pool_device"),
        ({"tcp_connection_pool": "yes"}, "tcp_connection_pool"),
        ({"metadata_cache": 1}, "metadata_cache"),
        ({"max_connections_per_peer": 0}, "max_connections_per_peer"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TEConfig.parse(_sender(**extra))


def test_a_receiver_binds_nothing_so_its_port_is_not_used() -> None:
    cfg = TEConfig.parse({"role": "receiver", "zmq_port": "${UNSET}", "host": "127.0.0.1"})
    assert cfg.zmq_port is None


@pytest.mark.parametrize("host", [None, "", "auto", "0.0.0.0"])
def test_an_unset_or_wildcard_host_is_the_detected_address(host: object) -> None:
    extra = {} if host is None else {"host": host}
    cfg = TEConfig.parse({"role": "sender", "zmq_port": 50151, **extra})
    assert cfg.host == detect_local_address()


def test_the_transfer_budget_is_the_references() -> None:
    assert transfer_budget_s(1) == 30.0 and transfer_budget_s(250 << 20) == 40.0


def test_a_pull_must_name_its_destination_and_capacity() -> None:
    codec = ControlCodec(SCHEMA, None)
    _, frames = codec.encode({"op": "pull", "key": "k", "xid": "x", "budget_ms": 1})
    with pytest.raises(ProtocolError, match="dst"):
        codec.decode_request(frames)


def test_a_hello_must_declare_session_and_pool() -> None:
    codec = ControlCodec(SCHEMA, None)
    _, frames = codec.encode({"op": "hello", "peer": {"sess": "h:1", "inc": b"t", "base": 4096}})
    with pytest.raises(ProtocolError, match="len"):
        codec.decode_request(frames)


def test_a_hello_must_carry_the_receivers_token() -> None:
    codec = ControlCodec(SCHEMA, None)
    peer = {"sess": "h:1", "base": 4096, "len": 1}
    _, frames = codec.encode({"op": "hello", "peer": peer})
    with pytest.raises(ProtocolError, match="inc"):
        codec.decode_request(frames)


def test_a_session_name_is_respelt_in_its_port_only() -> None:
    assert respell_session("10.0.0.5:15321", 0) == "10.0.0.5:15321"
    assert respell_session("10.0.0.5:15321", 2) == "10.0.0.5:0015321"
    assert respell_session("[::1]:15321", 1) == "[::1]:015321"


def _write(names: SessionNames, session: str, token: bytes, ident: bytes = b"") -> str:
    """What a sender does for a pull that succeeds: ask the spelling, then record the write."""
    spelling, generation = names.name_for(session, token)
    if spelling:
        names.wrote(session, token, ident or token, generation)
    return spelling


def test_a_session_name_is_respelt_each_time_a_new_receiver_has_it() -> None:
    names = SessionNames(live=lambda ident: False)  # every earlier receiver is gone
    assert _write(names, "h:15000", b"a") == "h:15000"
    assert _write(names, "h:15000", b"a") == "h:15000"  # the same receiver: the same name
    assert _write(names, "h:16000", b"b") == "h:16000"  # another session: its own count
    assert _write(names, "h:15000", b"c") == "h:015000"
    assert _write(names, "h:15000", b"c") == "h:015000"
    assert _write(names, "h:15000", b"a") == "h:0015000"  # never back to a name once used


def test_a_session_name_respelt_too_often_is_refused() -> None:
    names = SessionNames(live=lambda ident: False)
    for i in range(MAX_SESSION_RESPELLINGS + 1):
        assert _write(names, "h:15000", bytes([i % 256, i // 256]))
    assert names.name_for("h:15000", b"one more") == ("", MAX_SESSION_RESPELLINGS + 1)


def test_claims_spend_nothing_until_a_write_succeeds() -> None:
    """Issue 39 item 2: saying a name (and failing to write to it) costs nothing."""
    names = SessionNames(live=lambda ident: False)
    for i in range(200):
        _, generation = names.name_for("h:15000", i.to_bytes(2, "big"))
        names.failed("h:15000", i.to_bytes(2, "big"), generation)
    assert len(names) == 0
    assert _write(names, "h:15000", b"genuine") == "h:15000"


def test_a_live_receivers_name_is_shared_never_respelt_by_others() -> None:
    live = {b"conn-a"}
    names = SessionNames(live=lambda ident: ident in live)
    assert _write(names, "h:15000", b"a", b"conn-a") == "h:15000"
    for i in range(MAX_SESSION_RESPELLINGS * 2):  # strangers claiming the name, writes succeed
        assert _write(names, "h:15000", i.to_bytes(2, "big")) == "h:15000"
    assert _write(names, "h:15000", b"a", b"conn-a") == "h:15000"
    live.clear()  # the receiver went away; the next one at the name gets a fresh spelling
    assert _write(names, "h:15000", b"b", b"conn-b") == "h:015000"


def test_a_failed_write_moves_its_claimant_to_the_next_spelling() -> None:
    live = {b"conn-a"}
    names = SessionNames(live=lambda ident: ident in live)
    _write(names, "h:15000", b"a", b"conn-a")
    spelling, generation = names.name_for("h:15000", b"b")  # old channel not noticed gone yet
    assert spelling == "h:15000"
    names.failed("h:15000", b"b", generation)  # the engine's segment is the old receiver's
    assert names.name_for("h:15000", b"b") == ("h:015000", 1)


def test_the_name_table_is_bounded_sparing_live_receivers() -> None:
    live = {b"keep"}
    names = SessionNames(live=lambda ident: ident in live, max_names=8, max_failed=4)
    _write(names, "h:1", b"t", b"keep")
    for port in range(2, 40):
        _write(names, f"h:{port}", b"t")
        names.failed(f"x:{port}", b"t", 0)
    assert len(names) == 8
    assert names.name_for("h:1", b"t") == ("h:1", 0)  # the live one was kept
