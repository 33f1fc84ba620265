"""connectors/base.py: the contract's defaults, ManagedBuffer, and the helpers every connector
shares (cleanup key rule, object framing, the one result shape of ``wait``).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import pytest
import torch

from omnikv.connectors.base import (
    ManagedBuffer,
    OmniConnectorBase,
    PutResult,
    Writer,
    as_managed,
    get_result,
    matches_request,
)
from omnikv.wire.serializer import decode_object, encode_object


class _PollOnly(OmniConnectorBase):
    """Implements put_packed / get / close only: wait falls back to bounded polling."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.ready_at = math.inf

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float,
    ) -> PutResult:
        return True, 0, None

    def get(self, *a: Any, **kw: Any) -> Any:
        self.calls += 1
        return (b"ok", 2) if time.monotonic() >= self.ready_at else None

    def close(self) -> None:
        self._closed = True


class _PackedOnly(OmniConnectorBase):
    """Implements put_packed / get / close only: the reference-shaped put comes from base."""

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[str, bytes] = {}
        self.deadlines: list[float] = []

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float,
    ) -> PutResult:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        write(buf)
        self.items[put_key] = bytes(buf.numpy())
        self.deadlines.append(deadline)
        return True, nbytes, None

    def get(self, *a: Any, **kw: Any) -> Any:
        return None

    def close(self) -> None:
        self._closed = True


@pytest.mark.timing
def test_default_wait_polls_finely_and_boundedly() -> None:
    conn = _PollOnly()
    t0 = time.monotonic()
    assert conn.wait("0", "1", "k", deadline=t0 + 0.2) is None
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 0.25
    assert 10 < conn.calls < 200  # neither a busy loop nor a coarse sleep


@pytest.mark.timing
def test_default_wait_returns_a_managed_buffer() -> None:
    conn = _PollOnly()
    conn.ready_at = time.monotonic() + 0.05
    t0 = time.monotonic()
    got = conn.wait("0", "1", "k", deadline=t0 + 5)
    assert time.monotonic() - t0 < 0.07
    assert isinstance(got, ManagedBuffer) and got.to_bytes() == b"ok"


def test_reference_put_copies_raw_data_once_into_put_packed() -> None:
    conn = _PackedOnly()
    t0 = time.monotonic()
    assert conn.put("0", "1", "raw", b"abc") == (True, 3, None)
    assert conn.items["raw"] == b"abc"
    assert t0 <= conn.deadlines[0] <= time.monotonic()  # put_timeout_s 0: try once


def test_reference_put_frames_objects_with_the_one_encoder() -> None:
    conn = _PackedOnly()
    assert conn.put("0", "1", "obj", {"a": [1, 2]})[0]
    assert decode_object(conn.items["obj"]) == {"a": [1, 2]}


def test_reference_put_reports_failures_as_false() -> None:
    conn = _PackedOnly()
    assert conn.put("0", "1", "none", None) == (False, 0, None)
    assert conn.put("0", "1", "empty", b"") == (False, 0, None)
    assert conn.put("0", "1", "odd", object()) == (False, 0, None)


def test_a_reference_connector_with_only_put_gets_put_packed_from_it() -> None:
    """A connector written against the reference defines ``put`` only: it instantiates, and the
    manager's ``put_packed`` reaches its ``put`` with the bytes the writer wrote."""
    seen: dict[str, bytes] = {}

    class PutOnly(OmniConnectorBase):
        def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> PutResult:
            seen[put_key] = bytes(data)
            return True, len(data), None

        def get(self, *a: Any, **kw: Any) -> Any:
            return None

        def close(self) -> None:
            self._closed = True

    def write(dst: torch.Tensor) -> None:
        dst.copy_(torch.arange(5, dtype=torch.uint8))

    ok, size, _ = PutOnly().put_packed("0", "1", "k", 5, write, deadline=time.monotonic() + 1)
    assert ok and size == 5 and seen == {"k": bytes(range(5))}


def test_a_connector_with_neither_put_nor_put_packed_is_refused() -> None:
    class GetOnly(OmniConnectorBase):
        def get(self, *a: Any, **kw: Any) -> Any:
            return None

        def close(self) -> None:
            self._closed = True

    with pytest.raises(TypeError, match="put_packed"):
        GetOnly()  # type: ignore[abstract]


def test_flush_default_has_nothing_unconsumed() -> None:
    assert _PollOnly().flush(timeout=1.0) == []


def test_serialize_obj_helpers_use_the_serializer() -> None:
    data = OmniConnectorBase.serialize_obj({"t": torch.arange(3)})
    assert torch.equal(OmniConnectorBase.deserialize_obj(data)["t"], torch.arange(3))


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("req@0_1", True),
        ("req_r1@0_1", True),
        ("omni_0_to_1_req@0_1", True),
        ("reqx@0_1", False),
        ("xreq@0_1", False),
        ("other@0_1", False),
    ],
)
def test_matches_request_is_the_reference_cleanup_rule(key: str, expected: bool) -> None:
    assert matches_request(key, "req") is expected


def test_as_managed_wraps_every_result_kind() -> None:
    t = torch.arange(4, dtype=torch.uint8)
    assert as_managed(t).tensor.data_ptr() == t.data_ptr()  # no copy
    assert as_managed(b"xy").to_bytes() == b"xy"
    assert as_managed(bytearray(b"xy")).to_bytes() == b"xy"
    assert decode_object(as_managed({"k": 1}).tensor) == {"k": 1}
    buf = ManagedBuffer(t)
    assert as_managed(buf) is buf


def test_get_result_decodes_objects_and_releases_their_buffer() -> None:
    raw = bytearray(encode_object({"k": 1}))
    released: list[int] = []
    buf = ManagedBuffer(torch.frombuffer(raw, dtype=torch.uint8), lambda: released.append(1))
    assert get_result(buf) == ({"k": 1}, len(raw))
    assert released == [1]
    plain = ManagedBuffer(torch.zeros(8, dtype=torch.uint8))
    assert get_result(plain) == (plain, 8)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_host_managed_buffer_needs_no_tensor_and_keeps_every_contract(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ManagedBuffer.host`` (the shared-memory receiver's form): same size, contents and
    release rules as a tensor-backed buffer; the torch view is made only when asked for, and
    ``adopt`` ties the release to the adopted tensor's views without making one first."""
    import numpy as np

    made: list[int] = []
    from_numpy = torch.from_numpy
    monkeypatch.setattr(torch, "from_numpy", lambda a: made.append(1) or from_numpy(a))
    backing = np.arange(64, dtype=np.uint8)
    released: list[int] = []
    buf = ManagedBuffer.host(backing[8:40], release=lambda: released.append(1))
    assert buf.size == 32 and buf.device == torch.device("cpu") and not buf.released
    host = buf.host_array
    assert host is not None and host.tolist() == list(range(8, 40))
    assert made == []  # no torch view made yet
    assert buf.tensor.tolist() == list(range(8, 40))
    assert made == [1]
    owned = buf.adopt()
    assert owned is not None and buf.released and buf.size == 0
    with pytest.raises(RuntimeError):
        _ = buf.host_array
    with pytest.raises(RuntimeError):
        _ = buf.tensor
    part = owned[4:8].view(torch.int32)
    del owned
    gc.collect()
    assert released == []
    del part
    gc.collect()
    assert released == [1]

    other = ManagedBuffer.host(backing[:16], release=lambda: released.append(2))
    other.release()
    other.release()
    assert released == [1, 2]
    with pytest.raises(RuntimeError):
        other.adopt()
    for bad in (backing.astype(np.int16), backing.reshape(8, 8), backing[::2]):
        with pytest.raises(ValueError):
            ManagedBuffer.host(bad)


@pytest.mark.slow
def test_adopt_array_releases_when_the_last_array_or_tensor_made_from_it_dies() -> None:
    import numpy as np

    released: list[int] = []
    buf = ManagedBuffer.host(np.zeros(64, dtype=np.uint8), release=lambda: released.append(1))
    arr = buf.adopt_array()
    assert arr is not None and buf.released and arr.size == 64
    typed = torch.from_numpy(arr[16:32].view(np.float32))  # what the receiver's decode makes
    del arr
    gc.collect()
    assert released == []
    del typed
    gc.collect()
    assert released == [1]
