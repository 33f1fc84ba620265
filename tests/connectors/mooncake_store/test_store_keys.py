"""MooncakeStoreConnector's configuration keys: checked by the one value parser before any
engine is imported or any master is probed (no Mooncake needed)."""

from __future__ import annotations

import pytest

from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector
from omnikv.errors import ConfigError


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("remove_after_get", "no"),
        ("tcp_connection_pool", 1),
        ("global_segment_size", 0),
        ("memory_pool_size", 1.5),
        ("replica_num", 0),
        ("max_tracked_keys", 2.9),
        ("master_probe_timeout_s", 0),
        ("put_timeout_s", -1),
        ("put_timeout_s", "nan"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(key: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=key):
        MooncakeStoreConnector({key: bad})
