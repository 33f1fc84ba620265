"""Configuration from plain data: ``from_config(mapping)``, ``from_config_file(path)`` (JSON, YAML,
TOML), the mappings ``from_od_config`` / ``from_vllm_config`` accept, and the construction
warning of a stage whose edge is unset. Called as a user (or a stage file) would call them."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import ConfigError, OmniKVTransferManager


def _sender(namespace: str) -> dict[str, Any]:
    return {
        "need_send_cache": True,
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "connector_config": {"type": "LocalConnector", "namespace": namespace},
    }


def _receiver(namespace: str) -> dict[str, Any]:
    return {
        "need_recv_cache": True,
        "stage_id": 1,
        "engine_input_source": [0],
        "recv_timeout": 5,
        "connector_config": {"type": "LocalConnector", "namespace": namespace},
    }


def _round_trip(sender: OmniKVTransferManager, receiver: OmniKVTransferManager) -> None:
    caches = [torch.full((2, 3, 4, 2, 8), float(i)) for i in range(2)]
    sender.handle_finished_requests_kv_transfer(
        {"req-1": {"block_ids": [0, 1], "seq_len": 6}}, caches, 4, "float32"
    )
    data, size = receiver.receive_kv_cache_for_request("req-1")
    assert data is not None and size > 0
    assert data["layer_blocks"]["key_cache"][1].shape == (6, 2, 8)


def test_from_config_takes_the_omni_kv_config_itself(namespace: str) -> None:
    with (
        OmniKVTransferManager.from_config(_sender(namespace)) as sender,
        OmniKVTransferManager.from_config(_receiver(namespace)) as receiver,
    ):
        assert sender.send_stages == ("0", "1") and receiver.recv_stages == ("0", "1")
        _round_trip(sender, receiver)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"need_recv_cahce": True},
            r"unknown key\(s\) 'need_recv_cahce' \(did you mean 'need_recv_cache'\?\)",
        ),
        ({"stage_id": [1]}, "stage_id must be a stage id"),
        ({"engine_input_source": "0"}, "engine_input_source must be a list"),
        ({"rank_mapping": {"from_tp": 2, "to": 4}}, r"rank_mapping: unknown key\(s\) 'to'"),
        ({"rank_mapping": 2}, "rank_mapping must be a mapping"),
        (
            {"connector_config": {"type": "ShmConnector"}},
            "must name a registered connector .*SharedMemoryConnector",
        ),
        ({"connector_config": "SharedMemoryConnector"}, "connector_config must be a mapping"),
        ({"recv_timeout": "soon"}, "recv_timeout must be a finite number"),
        ({"need_recv_cache": "yes"}, "need_recv_cache must be a boolean"),
        ({"send_timeout": 0}, "send_timeout must be > 0"),
    ],
)
def test_from_config_names_the_key_and_what_it_expected(
    namespace: str, change: dict[str, Any], match: str
) -> None:
    bad = {**_receiver(namespace), **change}
    with pytest.raises(ConfigError, match=match) as info:
        OmniKVTransferManager.from_config(bad)
    assert str(info.value).startswith("from_config")


def test_from_config_refuses_what_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"expects the stage's omni_kv_config as a mapping.*list"):
        OmniKVTransferManager.from_config([("need_send_cache", True)])  # type: ignore[arg-type]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_from_config_file_reads_json_yaml_and_toml(tmp_path: Path, namespace: str) -> None:
    sender_json = _write(tmp_path / "sender.json", json.dumps(_sender(namespace)))
    receiver_yaml = _write(
        tmp_path / "receiver.yaml",
        f"""
# a stage file: the omnikv keys sit under omni_kv_config
model: tiny
omni_kv_config:
  need_recv_cache: true
  stage_id: 1
  engine_input_source: [0]
  recv_timeout: 5
  connector_config:
    type: LocalConnector
    namespace: {namespace}
""",
    )
    with (
        OmniKVTransferManager.from_config_file(sender_json) as sender,
        OmniKVTransferManager.from_config_file(receiver_yaml) as receiver,
    ):
        _round_trip(sender, receiver)
    receiver_toml = _write(
        tmp_path / "stages.toml",
        f"""
[stages.dit.omni_kv_config]
need_recv_cache = true
stage_id = 1
omni_from_stage = 0

[stages.dit.omni_kv_config.connector_config]
type = "LocalConnector"
namespace = "{namespace}"
""",
    )
    with OmniKVTransferManager.from_config_file(
        receiver_toml, key="stages.dit.omni_kv_config"
    ) as manager:
        assert manager.recv_stages == ("0", "1") and manager.config.need_recv_cache


def test_from_config_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"bad\.yaml \[omni_kv_config\]: unknown key"):
        OmniKVTransferManager.from_config_file(
            _write(tmp_path / "bad.yaml", "omni_kv_config:\n  recv_timout: 3\n")
        )
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON"):
        OmniKVTransferManager.from_config_file(_write(tmp_path / "bad.json", "{need"))
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        OmniKVTransferManager.from_config_file(_write(tmp_path / "bad.toml", "need = "))
    with pytest.raises(ConfigError, match=r"unsupported config file type '\.ini'"):
        OmniKVTransferManager.from_config_file(_write(tmp_path / "stage.ini", "[x]"))
    with pytest.raises(ConfigError, match=r"no 'stages\.dit' in the file \(missing 'dit'\)"):
        OmniKVTransferManager.from_config_file(
            _write(tmp_path / "k.json", '{"stages": {}}'), key="stages.dit"
        )
    with pytest.raises(ConfigError, match=r"as a mapping.*list"):
        OmniKVTransferManager.from_config_file(_write(tmp_path / "list.json", "[1, 2]"))


def test_yaml_without_pyyaml_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    path = _write(tmp_path / "stage.yaml", "need_send_cache: true\n")
    with pytest.raises(ImportError, match=r"needs PyYAML \(pip install pyyaml\).*JSON.*TOML"):
        OmniKVTransferManager.from_config_file(path)


def test_from_od_config_accepts_mappings(namespace: str) -> None:
    as_dict = {"omni_kv_config": _receiver(namespace), "cfg_kv_collect_func": None}
    with OmniKVTransferManager.from_od_config(as_dict) as manager:
        assert manager.recv_stages == ("0", "1")
    with OmniKVTransferManager.from_od_config(_receiver(namespace)) as manager:
        assert manager.recv_stages == ("0", "1")
    with pytest.raises(ConfigError, match="from_config: unknown key"):
        OmniKVTransferManager.from_od_config({"need_recv_cahce": True})
    # the reference's object form keeps working, companion collector included
    od = SimpleNamespace(
        omni_kv_config={**_receiver(namespace), "enable_kv_async_prefetch": True},
        cfg_kv_collect_func=lambda *a: {},
    )
    with OmniKVTransferManager.from_od_config(od) as manager:
        assert not manager.prefetch_enabled  # a companion collector turns prefetch off


def test_from_od_config_says_what_it_expected() -> None:
    with pytest.raises(
        ConfigError, match=r"from_od_config: config\.omni_kv_config must be a mapping.*str"
    ):
        OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config="stage.yaml"))


def test_from_vllm_config_accepts_mappings(namespace: str) -> None:
    with OmniKVTransferManager.from_vllm_config(
        None, {"omni_kv_config": _sender(namespace)}
    ) as manager:
        assert manager.send_stages == ("0", "1")
    conn = {"type": "LocalConnector", "namespace": namespace}
    vllm_config = {
        "kv_transfer_config": {"kv_connector_extra_config": {"omni_connector_config": conn}}
    }
    with OmniKVTransferManager.from_vllm_config(vllm_config, {}) as manager:
        assert manager.config.connector_config == conn
    with pytest.raises(
        ConfigError, match=r"from_vllm_config: model_config\.omni_kv_config must be a mapping"
    ):
        OmniKVTransferManager.from_vllm_config(None, SimpleNamespace(omni_kv_config=["x"]))


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_receiver_without_its_edge_warns_once_at_construction(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    conf = {
        k: v
        for k, v in _receiver(namespace).items()
        if k not in ("stage_id", "engine_input_source")
    }
    with caplog.at_level(logging.WARNING, logger="omnikv"):
        manager = OmniKVTransferManager.from_config(conf)
    with manager:
        (msg,) = _warnings(caplog)
        assert "receives KV but its edge is unset" in msg
        assert "stage_id" in msg and "engine_input_source" in msg
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="omnikv"):
            result = manager.receive_kv_cache_result("req-1")
            manager.receive_kv_cache_result("req-2")
        assert result.status.value == "skipped" and _warnings(caplog) == []


def test_a_sender_without_its_edge_warns_once_at_construction(
    namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    conf = {k: v for k, v in _sender(namespace).items() if k != "omni_to_stage"}
    with caplog.at_level(logging.WARNING, logger="omnikv"):
        manager = OmniKVTransferManager.from_config(conf)
    with manager:
        (msg,) = _warnings(caplog)
        assert "sends KV but its edge is unset" in msg and "omni_to_stage" in msg


def test_a_configured_pair_does_not_warn(namespace: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omnikv"):
        with OmniKVTransferManager.from_config(_receiver(namespace)):
            pass
        with OmniKVTransferManager.from_config(_sender(namespace)):
            pass
    assert _warnings(caplog) == []
