"""Config parsing, the from_od/vllm fallback chain, retry policy and options."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from omnikv import ConfigError, OmniKVCacheConfig, OmniKVTransferManager, RetryPolicy
from omnikv.config import (
    TransferOptions,
    config_from_dict,
    options_from_dict,
)
from omnikv.deadline import deadline_after, remaining, validate_timeout


def test_config_has_the_seed_fields_and_defaults() -> None:
    cfg = OmniKVCacheConfig()
    assert list(vars(cfg)) == [
        "connector_config",
        "from_stage",
        "to_stage",
        "stage_id",
        "engine_input_source",
        "need_recv_cache",
        "need_send_cache",
        "recv_timeout",
        "from_tp",
        "to_tp",
        "enable_kv_async_prefetch",
        "kv_prefetch_min_free_mem_ratio",
    ]
    assert cfg.recv_timeout == 30.0 and cfg.from_tp == cfg.to_tp == 1


def test_config_from_dict_maps_keys_and_references_connector_config() -> None:
    conn = {"type": "LocalConnector"}
    cfg = config_from_dict(
        {
            "connector_config": conn,
            "omni_from_stage": "0",
            "omni_to_stage": "1",
            "stage_id": 1,
            "engine_input_source": [0],
            "need_recv_cache": True,
            "recv_timeout": "2.5",
            "rank_mapping": {"from_tp": 2, "to_tp": "4"},
            "kv_prefetch_min_free_mem_ratio": 0.2,
        },
        async_prefetch=True,
    )
    assert cfg.connector_config is conn
    assert (cfg.from_stage, cfg.to_stage, cfg.stage_id) == ("0", "1", 1)
    assert cfg.recv_timeout == 2.5 and (cfg.from_tp, cfg.to_tp) == (2, 4)
    assert cfg.enable_kv_async_prefetch and cfg.need_recv_cache and not cfg.need_send_cache
    assert config_from_dict({"rank_mapping": "bad"}).from_tp == 1


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"recv_timeout": -1}, "recv_timeout"),
        ({"recv_timeout": "soon"}, "recv_timeout"),
        ({"recv_timeout": float("inf")}, "recv_timeout"),
        ({"rank_mapping": {"from_tp": "x"}}, "from_tp"),
        ({"rank_mapping": {"from_tp": 0}}, "rank_mapping.from_tp must be >= 1"),
        ({"rank_mapping": {"from_tp": -4}}, "rank_mapping.from_tp must be >= 1"),
        ({"rank_mapping": {"to_tp": 2.0}}, "rank_mapping.to_tp must be an integer"),
        ({"connector_config": "SharedMemoryConnector"}, "connector_config"),
        ({"need_send_cache": "falsey"}, "need_send_cache must be a boolean"),
        ({"need_send_cache": 1}, "need_send_cache must be a boolean"),
        ({"need_recv_cache": "no"}, "need_recv_cache must be a boolean"),
        ({"kv_prefetch_min_free_mem_ratio": -0.1}, "kv_prefetch_min_free_mem_ratio"),
        ({"kv_prefetch_min_free_mem_ratio": 1.5}, "kv_prefetch_min_free_mem_ratio"),
    ],
)
def test_bad_config_values_are_config_errors(cfg: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_dict(cfg)


def test_non_divisible_tp_fails_at_configuration() -> None:
    with pytest.raises(ValueError, match="divisible"):
        OmniKVTransferManager(OmniKVCacheConfig(from_tp=3, to_tp=2))


def test_from_od_config_prefetch_rules() -> None:
    on = {"enable_kv_async_prefetch": True, "need_recv_cache": True}
    assert OmniKVTransferManager.from_od_config(
        SimpleNamespace(omni_kv_config=on)
    ).config.enable_kv_async_prefetch
    off = OmniKVTransferManager.from_od_config(
        SimpleNamespace(omni_kv_config=on, cfg_kv_collect_func=print)
    )
    assert not off.config.enable_kv_async_prefetch
    dev = dict(on, connector_config={"type": "LocalConnector", "memory_pool_device": "cuda"})
    assert not OmniKVTransferManager.from_od_config(
        SimpleNamespace(omni_kv_config=dev)
    ).config.enable_kv_async_prefetch
    assert not OmniKVTransferManager.from_od_config(
        SimpleNamespace(omni_kv_config=None)
    ).config.enable_kv_async_prefetch
    assert (
        OmniKVTransferManager.from_model_config(SimpleNamespace(omni_kv_config={})).config
        == OmniKVCacheConfig()
    )


def test_from_vllm_config_fallback_chain() -> None:
    model = SimpleNamespace(
        omni_kv_config={"need_send_cache": True, "enable_kv_async_prefetch": True}
    )
    m = OmniKVTransferManager.from_vllm_config(SimpleNamespace(), model)
    assert m.config.need_send_cache and not m.config.enable_kv_async_prefetch
    conn = {"type": "LocalConnector", "namespace": "x"}
    ktc = SimpleNamespace(omni_connector_config=conn)
    m = OmniKVTransferManager.from_vllm_config(
        SimpleNamespace(kv_transfer_config=ktc), SimpleNamespace()
    )
    assert m.config.connector_config is conn
    ktc2 = SimpleNamespace(kv_connector_extra_config={"omni_connector_config": conn})
    m = OmniKVTransferManager.from_vllm_config(
        SimpleNamespace(kv_transfer_config=ktc2), SimpleNamespace()
    )
    assert m.config.connector_config is conn
    m = OmniKVTransferManager.from_vllm_config(SimpleNamespace(), SimpleNamespace())
    assert m.config == OmniKVCacheConfig()


def test_retry_policy_schedule_and_validation() -> None:
    assert RetryPolicy().schedule() == pytest.approx([0.1, 0.2])
    assert RetryPolicy(attempts=5, backoff_max=0.3).schedule() == pytest.approx(
        [0.1, 0.2, 0.3, 0.3]
    )
    with pytest.raises(ConfigError):
        RetryPolicy(attempts=0)
    with pytest.raises(ConfigError):
        RetryPolicy(backoff_base=float("nan"))


def test_string_booleans_mean_what_they_say() -> None:
    # bool("false") is True: the strings are parsed, never coerced
    cfg = config_from_dict({"need_send_cache": "false", "need_recv_cache": "TRUE"})
    assert cfg.need_send_cache is False and cfg.need_recv_cache is True
    opts = options_from_dict({"connector_config": {"payload_checksum": "false"}})
    assert opts.payload_checksum is False
    assert options_from_dict({"payload_checksum": "True"}).payload_checksum is True


def test_the_data_check_follows_the_connector_unless_it_is_set() -> None:
    """Unset, the sender asks its connector: on where the bytes cross a link between nodes
    (Transfer Engine, NIXL, the Store), off for shared memory and in-process connectors."""
    from omnikv.connectors.local import LocalConnector
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector
    from omnikv.connectors.mooncake_te.connector import MooncakeTransferEngineConnector
    from omnikv.connectors.nixl.connector import NixlConnector
    from omnikv.connectors.shm.connector import SharedMemoryConnector

    assert options_from_dict({}).payload_checksum is None
    assert TransferOptions().payload_checksum is None
    assert options_from_dict({"payload_checksum": False}).payload_checksum is False
    assert options_from_dict({"payload_checksum": "true"}).payload_checksum is True
    cross_node = (MooncakeTransferEngineConnector, NixlConnector, MooncakeStoreConnector)
    assert all(kind.checks_data for kind in cross_node)
    assert not SharedMemoryConnector.checks_data and not LocalConnector.checks_data


def test_options() -> None:
    opts = options_from_dict(
        {"kv_cache_layout": "blocks_first", "connector_config": {"payload_checksum": True}}
    )
    assert opts.kv_cache_layout == "blocks_first" and opts.payload_checksum
    assert opts.send_timeout == 30.0 and opts.max_header_bytes == 1 << 20
    opts = options_from_dict({"send_timeout": 2.5, "max_header_bytes": 4096})
    assert (opts.send_timeout, opts.max_header_bytes) == (2.5, 4096)
    assert opts.wire_codec == "off"
    assert options_from_dict({"wire_codec": "fp8_e4m3"}).wire_codec == "fp8_e4m3"


def test_every_option_is_a_known_config_key() -> None:
    """A strict config check (``from_config``) accepts every option ``options_from_dict`` reads."""
    import dataclasses

    from omnikv.config import OPTION_KEYS

    fields = {f.name for f in dataclasses.fields(TransferOptions)} - {"retry"}
    assert fields <= OPTION_KEYS
    assert {"put_retry_attempts", "put_retry_backoff"} <= OPTION_KEYS


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kv_cache_layout": "diagonal"}, "kv_cache_layout"),
        ({"receive_copy": "maybe"}, "receive_copy"),
        ({"payload_checksum": "false-ish"}, "payload_checksum must be a boolean"),
        ({"send_timeout": 0}, "send_timeout must be > 0"),
        ({"send_timeout": -1}, "send_timeout must be >= 0"),
        ({"send_timeout": float("nan")}, "send_timeout must be a finite number"),
        ({"max_header_bytes": 0}, "max_header_bytes must be >= 1"),
        ({"max_header_bytes": 1 << 32}, "max_header_bytes must be < 2"),
        ({"put_retry_attempts": 0}, "put_retry_attempts must be >= 1"),
        ({"put_retry_backoff": -0.5}, "put_retry_backoff"),
        ({"connector_retry_interval": "soon"}, "connector_retry_interval"),
        ({"wire_codec": "zstd"}, "wire_codec must be one of"),
    ],
)
def test_bad_options_are_config_errors(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        options_from_dict(options)


def test_options_constructed_directly_are_checked_too() -> None:
    with pytest.raises(ConfigError, match="send_timeout"):
        TransferOptions(send_timeout=0)
    with pytest.raises(ConfigError, match="payload_checksum"):
        TransferOptions(payload_checksum="false")  # type: ignore[arg-type]


def test_deadlines() -> None:
    assert deadline_after(None) == math.inf and remaining(math.inf) == math.inf
    assert 0 < remaining(deadline_after(1.0)) <= 1.0
    for bad in (-1, float("nan"), "x"):
        with pytest.raises(ValueError, match="recv_timeout"):
            validate_timeout(bad, "recv_timeout")  # type: ignore[arg-type]
