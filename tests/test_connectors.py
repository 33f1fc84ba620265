"""Connector contract (LocalConnector as the double), ManagedBuffer, registry."""

from __future__ import annotations

import gc
import math
import threading
import time
from typing import Any

import pytest
import torch

from omnikv import ConnectorSpec, ManagedBuffer, OmniConnectorBase, OmniConnectorFactory
from omnikv.connectors.base import PutResult
from omnikv.connectors.local import LocalConnector
from omnikv.errors import ConnectorClosedError


def test_local_put_get_consume_once(namespace: str) -> None:
    a, b = LocalConnector({"namespace": namespace}), LocalConnector({"namespace": namespace})
    ok, size, meta = a.put("0", "1", "k", b"hello")
    assert ok and size == 5 and meta is not None
    assert b.get("1", "0", "k") is None  # edges never collide
    assert b.get("0", "1", "k") == (b"hello", 5)
    assert b.get("0", "1", "k") is None
    assert a.health()["puts"] == 1 and b.health()["gets"] == 1


def test_local_wait_is_woken_by_put_and_honours_deadline(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})
    t0 = time.monotonic()
    assert conn.wait("0", "1", "none", deadline=time.monotonic() + 0.1) is None
    assert 0.1 <= time.monotonic() - t0 < 0.15
    got: list[Any] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.append(conn.wait("0", "1", "k", deadline=time.monotonic() + 5))
        got.append(time.monotonic())

    th = threading.Thread(target=waiter)
    th.start()
    started.wait(5)
    t_put = time.monotonic()
    conn.put("0", "1", "k", b"x")
    th.join(5)
    assert got[0] == (b"x", 1) and got[1] - t_put < 0.5


def test_put_packed_default_and_cleanup(namespace: str) -> None:
    conn = LocalConnector({"namespace": namespace})

    def write(buf: torch.Tensor) -> None:
        buf.fill_(3)

    ok, size, _ = conn.put_packed("0", "1", "req_42", 16, write)
    assert ok and size == 16
    conn.put("0", "1", "other_req_42", b"y")
    conn.put("0", "1", "keep", b"z")
    conn.cleanup("req_42")
    assert [k.split("@")[0] for k in conn.pending_keys()] == ["keep"]


def test_closed_connector(namespace: str) -> None:
    with LocalConnector({"namespace": namespace}) as conn:
        pass
    assert conn.closed
    conn.close()  # idempotent
    assert conn.put("0", "1", "k", b"x") == (False, 0, None)
    with pytest.raises(ConnectorClosedError):
        conn.get("0", "1", "k")


class _PollOnly(OmniConnectorBase):
    """Implements only the required methods: wait falls back to bounded polling."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.ready_at = math.inf

    def put(self, *a: Any) -> PutResult:
        return True, 0, None

    def get(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        return (b"ok", 2) if time.monotonic() >= self.ready_at else None

    def close(self) -> None:
        self._closed = True


def test_default_wait_polls_finely_and_boundedly() -> None:
    conn = _PollOnly()
    t0 = time.monotonic()
    assert conn.wait("0", "1", "k", deadline=t0 + 0.2) is None
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 0.25
    assert 10 < conn.calls < 200  # neither a busy loop nor a coarse sleep
    conn.ready_at = time.monotonic() + 0.05
    t0 = time.monotonic()
    assert conn.wait("0", "1", "k", deadline=t0 + 5) == (b"ok", 2)
    assert time.monotonic() - t0 < 0.07


def test_managed_buffer_release_and_views() -> None:
    released: list[int] = []
    buf = ManagedBuffer(torch.zeros(16, dtype=torch.uint8), release=lambda: released.append(1))
    view = buf.as_tensor(torch.float32, (2,), offset=4)
    assert view.shape == (2,)
    with pytest.raises(ValueError, match="aligned"):
        buf.as_tensor(torch.float32, (1,), offset=2)
    with pytest.raises(ValueError, match="exceeds"):
        buf.as_tensor(torch.float32, (5,))
    assert buf.to_bytes() == bytes(16)
    with buf:
        pass
    buf.release()
    assert released == [1] and buf.released
    with pytest.raises(RuntimeError, match="released"):
        _ = buf.tensor
    with pytest.raises(ValueError):
        ManagedBuffer(torch.zeros(4, dtype=torch.float32))


def test_managed_buffer_adopt_ties_release_to_views() -> None:
    released: list[int] = []
    buf = ManagedBuffer(torch.zeros(64, dtype=torch.uint8), release=lambda: released.append(1))
    owned = buf.adopt()
    assert owned is not None and buf.released
    part = owned[8:16].view(torch.float32)
    del owned
    gc.collect()
    assert released == []
    buf.release()  # no-op after adopt
    del part
    gc.collect()
    assert released == [1]


def test_factory_registry() -> None:
    assert "SharedMemoryConnector" in OmniConnectorFactory.list_connectors()
    with pytest.raises(
        ValueError, match=r"Unknown connector 'Nope'; known connectors: .*LocalConnector"
    ):
        OmniConnectorFactory.create_connector(ConnectorSpec("Nope"))
    conn = OmniConnectorFactory.create_connector(
        ConnectorSpec("LocalConnector", {"namespace": "f"})
    )
    assert isinstance(conn, LocalConnector) and conn.namespace == "f"
    OmniConnectorFactory.register_connector("LocalAlias", "omnikv.connectors.local:LocalConnector")
    OmniConnectorFactory.register_connector("LocalAlias", "omnikv.connectors.local:LocalConnector")
    with pytest.raises(ValueError, match="already registered"):
        OmniConnectorFactory.register_connector("LocalAlias", "omnikv.connectors.shm:Other")
    OmniConnectorFactory.register_connector(
        "MissingDep", "omnikv_not_installed.mod:X", extra="fancy"
    )
    with pytest.raises(ImportError, match=r"omnikv\[fancy\]"):
        OmniConnectorFactory.get_connector_class("MissingDep")


def test_factory_wraps_constructor_failures() -> None:
    class Boom(LocalConnector):
        def __init__(self, config: Any) -> None:
            raise OSError("no shm")

    OmniConnectorFactory.register_connector("Boom", Boom)
    with pytest.raises(ValueError, match="Failed to create connector 'Boom': no shm"):
        OmniConnectorFactory.create_connector(ConnectorSpec("Boom"))


def test_import_omnikv_needs_no_optional_backend() -> None:
    import subprocess
    import sys

    code = "import sys, omnikv, omnikv.connectors; print('mooncake' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
