"""Zero-copy views: decoded tensors alias the buffer (tensor or numpy array) unless asked to
copy, alike tensors are viewed as one run, and bytes at addresses misaligned for their dtype are
copied rather than misread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_payloads import as_array, assert_same, raw_int_view, sample

from omnikv.bench.reference import ref_to_bytes
from omnikv.wire import views
from omnikv.wire.decode import decode, decode_kv
from omnikv.wire.encode import PackedPayload
from omnikv.wire.format import DTYPE_ALLOWLIST, Span
from omnikv.wire.transfer_data import KVCacheTransferData


def test_decode_returns_views_not_copies() -> None:
    data = sample()
    buf = torch.empty(data.packed_size(), dtype=torch.uint8)
    data.pack_into(buf)
    out = decode(buf)
    k0 = out["layer_blocks"]["key_cache"][0]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert lo <= k0.data_ptr() < hi


def test_decode_kv_views_and_copies() -> None:
    data = sample(layers=4)
    buf = torch.empty(data.packed_size(), dtype=torch.uint8)
    data.pack_into(buf)
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    viewed = decode_kv(buf)
    assert all(lo <= t.data_ptr() < hi for t in viewed.key_cache if t is not None)
    copied = decode_kv(buf, copy=True)
    assert all(not lo <= t.data_ptr() < hi for t in copied.key_cache if t is not None)
    buf.zero_()  # the copies are the caller's now; the views see the change
    assert_same(data, copied.to_seed_dict())
    assert viewed.key_cache[0] is not None and not viewed.key_cache[0].any()


def test_misaligned_buffer_address_is_copied_not_misread() -> None:
    data = sample(layers=2, dtype=torch.float32)
    raw = bytearray(1) + data.to_bytes()
    view = memoryview(raw)[1:]  # every tensor now sits at an odd address
    out = decode_kv(view)
    assert all(t.data_ptr() % 4 == 0 for t in out.key_cache if t is not None)
    assert_same(data, out.to_seed_dict())


def test_host_array_decode_views_a_run_of_alike_tensors_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoding from a numpy array (the shared-memory receiver's path): K and V tensors of one
    dtype and shape back to back form a run (seen by a spy on ``HostViewer.views``) and are
    views of the array; mixed shapes, and an array whose address misaligns the run, decode
    through the per-tensor path; every tensor equals what was packed."""
    runs: list[views.Run | None] = []
    viewed = views.HostViewer.views

    def spy(
        self: views.HostViewer, spans: list[Span], run: views.Run | None = None
    ) -> list[torch.Tensor]:
        runs.append(run)
        return viewed(self, spans, run)

    monkeypatch.setattr(views.HostViewer, "views", spy)
    g = torch.Generator().manual_seed(11)
    alike = [torch.randn(6, 2, 8, generator=g).half() for _ in range(6)]
    mixed = [torch.randn(6, 2, 8, generator=g).half(), torch.randn(5, 2, 8, generator=g).half()]
    for k, v, is_run in ((alike[:3], alike[3:], True), (mixed, mixed[::-1], False)):
        raw = PackedPayload("r", k, v, [0], {}).to_bytes()
        for shift in (0, 1):  # 1: the run's address is odd, misaligned for float16
            arr = np.zeros(len(raw) + shift, dtype=np.uint8)[shift:]
            arr[:] = np.frombuffer(raw, dtype=np.uint8)
            runs.clear()
            out = decode_kv(arr)
            assert len(runs) == 1 and (runs[0] is not None) == is_run
            for got, want in zip((*out.key_cache, *out.value_cache), (*k, *v), strict=True):
                assert got is not None and torch.equal(got, want)
                if not shift:
                    assert np.shares_memory(got.numpy(), arr)


@pytest.mark.parametrize("name", sorted(DTYPE_ALLOWLIST))
def test_array_decode_equals_the_tensor_decode_for_every_dtype(name: str) -> None:
    """``decode_kv`` of a numpy array (numpy views, one ``from_numpy`` per dtype; bf16 and
    fp8 through integer bits) gives the same tensors as the tensor path, viewing the array."""
    dtype = DTYPE_ALLOWLIST[name]
    raw = torch.arange(3 * 5 * 2 * 8 * 16, dtype=torch.int64).remainder(251).to(torch.uint8)
    if dtype == torch.bool:
        raw = raw.remainder(2)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 5 * 2 * 8 * itemsize
    layers = [raw[i * n : (i + 1) * n].view(dtype).view(5, 2, 8) for i in range(3)]
    data = KVCacheTransferData("r", {"key_cache": layers, "value_cache": layers[::-1]}, [3], {})
    arr = as_array(data.to_bytes())
    got = decode_kv(arr)
    want = decode_kv(data.to_bytes())
    base = arr.ctypes.data
    pairs = zip(got.key_cache + got.value_cache, want.key_cache + want.value_cache, strict=True)
    for a, b in pairs:
        assert a is not None and b is not None
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(raw_int_view(a), raw_int_view(b))
        assert base <= a.data_ptr() < base + arr.size  # a view of the array, not a copy
    assert got.request_id == "r" and got.block_ids == [3]


def test_array_decode_of_gaps_runs_and_misaligned_addresses() -> None:
    g = torch.Generator().manual_seed(1)
    k = [
        torch.randn(4, 2, 8, generator=g).half(),
        None,
        torch.randn(5, 2, 8, generator=g).float(),
        torch.empty(0, 2, 8, dtype=torch.float16),
        torch.randn(4, 2, 8, generator=g).to(torch.bfloat16),
    ]
    v = [t.clone() if t is not None else None for t in reversed(k)]
    data = KVCacheTransferData("mixed", {"key_cache": k, "value_cache": v})
    for raw in (data.to_bytes(), ref_to_bytes("mixed", k, v)):
        for shift in (0, 1, 2):  # odd addresses: such tensors are copied, never misread
            out = decode_kv(as_array(raw, shift))
            assert_same(data, out.to_seed_dict())
            assert all(t.data_ptr() % t.element_size() == 0 for t in out.key_cache if t is not None)
