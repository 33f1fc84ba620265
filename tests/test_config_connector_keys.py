"""Strict ``connector_config``: every key a built-in connector does not read is refused by
``from_config`` naming the key and the closest valid one, and warned about by the lenient
factories; the key tables match what each connector's source reads."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from omnikv import ConfigError, OmniKVTransferManager
from omnikv.config import CONNECTOR_KEYS, check_omni_kv_config, unknown_connector_keys

SRC = Path(__file__).resolve().parents[1] / "src" / "omnikv" / "connectors"
#: where each built-in connector reads its connector_config
SOURCES = {
    "LocalConnector": ["local.py"],
    "SharedMemoryConnector": ["shm/config.py", "shm/connector.py"],
    "MooncakeStoreConnector": ["mooncake_store/config.py", "mooncake_store/connector.py"],
    "MooncakeConnector": ["mooncake_store/config.py", "mooncake_store/connector.py"],
    "MooncakeTransferEngineConnector": ["pull/connector.py", "mooncake_te/config.py"],
    "NixlConnector": ["pull/connector.py", "nixl/config.py"],
}
# a key read as cfg.get("k"), cfg["k"], or named as the first argument of a parser
_READ = re.compile(
    r'\b(?:cfg\.get|size|flag|seconds|parse_[a-z_]+)\(\s*"([a-z_]+)"|cfg\["([a-z_]+)"\]'
)


def _keys_read(files: list[str]) -> set[str]:
    return {
        m.group(1) or m.group(2)
        for f in files
        for m in _READ.finditer((SRC / f).read_text(encoding="utf-8"))
    }


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_key_a_connector_reads_is_accepted(kind: str) -> None:
    read = _keys_read(SOURCES[kind])
    assert len(read) >= 5, read  # the scan found the connector's parsing
    assert read <= CONNECTOR_KEYS[kind], sorted(read - CONNECTOR_KEYS[kind])


def test_every_built_in_connector_has_a_key_table() -> None:
    from omnikv.connectors.factory import OmniConnectorFactory

    assert set(SOURCES) == set(CONNECTOR_KEYS)
    assert set(CONNECTOR_KEYS) <= set(OmniConnectorFactory.list_connectors())


@pytest.mark.parametrize(
    ("conn", "typo", "suggestion"),
    [
        ({"type": "SharedMemoryConnector", "namesapce": "pd"}, "namesapce", "namespace"),
        (
            {"type": "SharedMemoryConnector", "pool_size_byte": 1 << 20},
            "pool_size_byte",
            "pool_size_bytes",
        ),
        ({"type": "LocalConnector", "namesapce": "x"}, "namesapce", "namespace"),
        ({"type": "MooncakeTransferEngineConnector", "zmq_prot": 5555}, "zmq_prot", "zmq_port"),
        ({"type": "NixlConnector", "backend": ["UCX"]}, "backend", "backends"),
        (
            {"type": "MooncakeStoreConnector", "master_server": "h:1"},
            "master_server",
            "master_server_address",
        ),
    ],
)
def test_from_config_names_an_unknown_connector_key_and_the_closest(
    conn: dict, typo: str, suggestion: str
) -> None:
    kv = {
        "need_send_cache": True,
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "connector_config": conn,
    }
    with pytest.raises(ConfigError, match=rf"{typo}'.*did you mean '{suggestion}'") as info:
        OmniKVTransferManager.from_config(kv)
    assert conn["type"] in str(info.value)


def test_from_config_file_refuses_a_nested_typo(tmp_path: Path) -> None:
    path = tmp_path / "stage.json"
    path.write_text(
        '{"need_recv_cache": true, "connector_config": '
        '{"type": "SharedMemoryConnector", "namesapce": "pd"}}'
    )
    with pytest.raises(
        ConfigError, match=r"stage.json.*'namesapce' \(did you mean 'namespace'\?\)"
    ):
        OmniKVTransferManager.from_config_file(path)


def test_a_misspelt_connector_type_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'SharedMemoryConnector'"):
        check_omni_kv_config({"connector_config": {"type": "SharedMemoryConector"}})


def test_the_keys_the_manager_writes_and_the_options_are_accepted_everywhere() -> None:
    for kind in CONNECTOR_KEYS:
        conn = {
            "type": kind,
            "role": "sender",
            "sender_host": "h",
            "sender_zmq_port": 1,
            "from_stage": "0",
            "to_stage": "1",
            "wire_codec": "int8",
            "send_timeout": 5,
        }
        assert unknown_connector_keys(conn) == (kind, [])


def test_a_third_party_connector_checks_its_own_keys() -> None:
    assert unknown_connector_keys({"type": "SomeoneElsesConnector", "x": 1}) == (
        "SomeoneElsesConnector",
        [],
    )


def test_the_lenient_factories_warn_once_naming_the_key(
    caplog: pytest.LogCaptureFixture, namespace: str
) -> None:
    kv = {
        "need_recv_cache": True,
        "stage_id": 1,
        "omni_from_stage": 0,
        "connector_config": {"type": "LocalConnector", "namespace": namespace, "pool_siz": 9},
    }
    with caplog.at_level(logging.WARNING, logger="omnikv.config"):
        for _ in range(2):
            OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=kv)).close()
    lines = [r.getMessage() for r in caplog.records if "pool_siz" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "did you mean 'pool_size'" in lines[0]


def test_a_nested_key_is_checked_too() -> None:
    conn = {"type": "SharedMemoryConnector", "extra": {"wakeup_scop": "x"}}
    assert unknown_connector_keys(conn) == ("SharedMemoryConnector", ["extra.wakeup_scop"])
    with pytest.raises(
        ConfigError, match=r"'extra.wakeup_scop' \(did you mean 'extra.wakeup_scope'\?\)"
    ):
        check_omni_kv_config({"connector_config": conn})
    good = {"type": "SharedMemoryConnector", "extra": {"wakeup_scope": "x"}, "stage_id": 1}
    assert unknown_connector_keys(good) == ("SharedMemoryConnector", [])
