"""The connector registry and the lazy connector: what is built, when, and why not."""

from __future__ import annotations

from typing import Any

import pytest

from omnikv import OmniConnectorFactory
from omnikv.connectors.base import OmniConnectorBase, PutResult
from omnikv.connectors.factory import ConnectorSpec, LazyConnector, spec_from_config
from omnikv.connectors.local import LocalConnector


class _FailsFirst(OmniConnectorBase):
    created = 0

    def __init__(self, config: dict) -> None:
        type(self).created += 1
        if type(self).created == 1:
            raise RuntimeError("engine not up yet")
        super().__init__()

    def put_packed(self, *a: Any, **kw: Any) -> PutResult:
        return True, 0, None

    def get(self, *a: Any, **kw: Any) -> None:
        return None

    def close(self) -> None:
        self._closed = True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_creation_is_reported_and_retried_after_the_interval() -> None:
    OmniConnectorFactory.register_connector("TestFailsFirst", _FailsFirst)
    clock = _Clock()
    lazy = LazyConnector(lambda: ConnectorSpec("TestFailsFirst"), retry_interval=5.0, clock=clock)
    assert lazy.get() is None and "engine not up yet" in (lazy.error or "")
    clock.now += 4.9
    assert lazy.get() is None and _FailsFirst.created == 1  # not retried before the interval
    clock.now += 0.2
    conn = lazy.get()
    assert conn is not None and lazy.error is None and lazy.get() is conn
    lazy.close()
    assert conn.closed and lazy.current is None


def test_a_bad_config_is_a_recorded_failure_and_no_config_is_none() -> None:
    def bad() -> ConnectorSpec:
        raise ValueError("zmq_port must be an int")

    lazy = LazyConnector(bad)
    assert lazy.get() is None and "bad connector config" in (lazy.error or "")
    nothing = LazyConnector(lambda: None)
    assert nothing.get() is None and nothing.error is None


def test_an_injected_connector_is_used_as_is(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    lazy = LazyConnector(lambda: None, connector=conn)
    assert lazy.get() is conn and lazy.current is conn
    other = LocalConnector({"namespace": namespace})
    lazy.set(other)
    assert lazy.get() is other


def test_spec_from_config_derives_engine_roles_and_leaves_others_alone() -> None:
    plain = spec_from_config(
        {"type": "LocalConnector", "namespace": "x"},
        from_stage="0",
        to_stage="1",
        sends=True,
        receives=False,
        local_rank=3,
    )
    assert plain == ConnectorSpec("LocalConnector", {"namespace": "x"})
    engine = spec_from_config(
        {"type": "MooncakeTransferEngineConnector", "zmq_port": 50000},
        from_stage=1,
        to_stage=2,
        sends=True,
        receives=False,
        local_rank=1,
    )
    assert engine is not None and engine.extra["role"] == "sender"
    assert engine.extra["zmq_port"] == 50000 + 100 + 16 + 1
    assert (
        spec_from_config(
            {"namespace": "x"}, from_stage=0, to_stage=1, sends=True, receives=False, local_rank=0
        )
        is None
    )


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ValueError, match="LocalConnector"):
        OmniConnectorFactory.create_connector(ConnectorSpec("NoSuchConnector"))
