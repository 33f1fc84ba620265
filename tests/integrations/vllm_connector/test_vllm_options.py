"""``kv_connector_extra_config`` parsing: unknown keys warned about, wrong values refused."""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

import pytest

from support.vllm_fixtures import edge_fixture  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def test_unknown_and_wrong_settings(edge: Any, caplog: pytest.LogCaptureFixture) -> None:
    from omnikv.errors import ConfigError
    from omnikv.integrations.vllm.options import parse_options

    with caplog.at_level("WARNING"):
        parse_options({"max_concurent_loads": 3}, producer=False, consumer=True)
    assert "max_concurent_loads" in caplog.text
    for bad in (
        {"max_concurrent_loads": 0},
        {"max_concurrent_sends": "many"},
        {"producer_tag": "xyz"},
        {"accept_producer_tags": []},
        {"auth_secret": ""},
        {"verify_finite": "yes"},
        {"vllm_kv_layout": "nope"},
        {"omni_kv_config": ["x"]},
        {"idle_step_wait_s": 1.0},
        {"idle_step_wait_s": -0.001},
        {"stream_layer_groups": 0},
        {"stream_layer_groups": 65},
        {"stream_layer_groups": "two"},
    ):
        with pytest.raises(ConfigError):
            parse_options(bad, producer=False, consumer=True)
