"""The CUDA targets of prefetch on a CPU-only machine: no-ops, and the free-memory guard's logic
with a mocked free-memory query. The real device paths are exercised by scripts/cuda_check.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from omnikv import OmniKVCacheConfig, OmniKVTransferManager
from omnikv.transfer.prefetch import KVPrefetcher, PrefetchStart
from omnikv.transfer.receive import ReceiveResult, ReceiveStatus
from omnikv.transfer.received import ReceivedKV
from omnikv.transfer.staging import PinnedStager, device_memory_ok, record_stream_for
from support import paths

pytestmark = pytest.mark.timeout(30)

GIB = 1 << 30


def _mem(free: int, total: int) -> Any:
    calls: list[torch.device] = []

    def info(dev: torch.device) -> tuple[int, int]:
        calls.append(dev)
        return free, total

    info.calls = calls  # type: ignore[attr-defined]
    return info


def _data() -> ReceivedKV:
    return ReceivedKV(
        "r",
        [],
        {"seq_len": 4},
        [torch.ones(4, 2), torch.ones(4, 2)],
        [torch.zeros(4, 2), None],
        nbytes=96,
    )


def _receive_ok(seen: list[Any]) -> Any:
    def receive(
        request_id: str,
        target_device: torch.device | None,
        *,
        sender_info: dict[str, Any] | None,
        deadline: float,
        abort: threading.Event,
        on_arrival: Any = None,
    ) -> ReceiveResult:
        rid, device = request_id, target_device
        seen.append((rid, device, threading.current_thread().name))
        return ReceiveResult(rid, ReceiveStatus.OK, kv=_data(), nbytes=96)

    return receive


# -- free-memory guard ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "ratio", "free", "total", "ok"),
    [
        ("cuda:0", 0.2, 1 * GIB, 10 * GIB, False),  # 10% free < 20%
        ("cuda:0", 0.1, 1 * GIB, 10 * GIB, True),  # exactly at the ratio
        ("cuda:0", 0.05, 1 * GIB, 10 * GIB, True),
        ("cuda:1", 0.5, 6 * GIB, 10 * GIB, True),
        ("cuda:0", 0.0, 0, 10 * GIB, True),  # ratio 0: guard off
        ("cuda:0", 0.5, 0, 0, True),  # total 0: cannot judge
        ("cpu", 0.9, 0, 10 * GIB, True),  # host targets never guarded
        (None, 0.9, 0, 10 * GIB, True),
    ],
)
def test_free_memory_guard(
    device: str | None, ratio: float, free: int, total: int, ok: bool
) -> None:
    info = _mem(free, total)
    assert device_memory_ok(device, ratio, info) is ok
    if device is not None and device != "cpu" and ratio > 0:
        assert info.calls == [torch.device(device)]
    else:
        assert info.calls == []


def test_free_memory_guard_allows_when_the_query_fails() -> None:
    def broken(dev: torch.device) -> tuple[int, int]:
        raise RuntimeError("no driver")

    assert device_memory_ok("cuda:0", 0.5, broken)


def test_prefetcher_skips_below_the_ratio_and_starts_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", _mem(1 * GIB, 10 * GIB))
    seen: list[Any] = []
    config = OmniKVCacheConfig(recv_timeout=5.0, kv_prefetch_min_free_mem_ratio=0.3)
    low = KVPrefetcher(_receive_ok(seen), config=config)
    assert low.start("A", {"host": "h"}, "cuda:0") is PrefetchStart.LOW_MEMORY
    assert low.tracked() == {} and low.thread is None and seen == []
    # host target: the guard does not apply
    assert low.start("B", {"host": "h"}, None) is PrefetchStart.STARTED
    assert low.consume("B").result is not None
    low.shutdown()


def test_manager_guard_uses_the_configured_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", _mem(1 * GIB, 10 * GIB))
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config={"type": "LocalConnector", "namespace": "guard"},
            from_stage="stage1",
            stage_id="stage2",
            need_recv_cache=True,
            enable_kv_async_prefetch=True,
            kv_prefetch_min_free_mem_ratio=0.5,
        ),
        async_prefetch=True,
    )
    mgr.start_prefetch(
        {"request_id": "A", "kv_sender_info": {"host": "127.0.0.1", "zmq_port": 1}},
        target_device=torch.device("cuda:0"),
    )
    pf = mgr.prefetcher
    assert pf is not None and pf.min_free_mem_ratio == 0.5
    assert pf.tracked() == {} and pf.thread is None
    mgr.close()


# -- CPU no-ops -------------------------------------------------------------------------------
def test_record_stream_is_a_noop_for_host_tensors() -> None:
    assert record_stream_for(_data()) == 0
    assert record_stream_for(None) == 0


def test_host_prefetch_makes_no_stream_and_no_pinned_memory() -> None:
    seen: list[Any] = []
    stager = PinnedStager(chunk_bytes=1 << 16)
    pf = KVPrefetcher(_receive_ok(seen), config=OmniKVCacheConfig(recv_timeout=5.0), stager=stager)
    assert pf.start("A", {"host": "h"}, torch.device("cpu")) is PrefetchStart.STARTED
    out = pf.consume("A", target_device="cpu")
    assert out.result is not None and out.result.ok and out.result.kv is not None
    assert all(t.device.type == "cpu" for t in out.result.kv.tensors())
    assert seen == [("A", torch.device("cpu"), "kv-prefetch")]
    assert pf.side_streams == 0 and stager.pinned_bytes == 0
    pf.shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_cuda_target_without_cuda_takes_the_plain_path() -> None:
    """No stream, no set_device, no staging: the receive itself is asked for the device."""
    seen: list[Any] = []
    stager = PinnedStager()
    pf = KVPrefetcher(_receive_ok(seen), config=OmniKVCacheConfig(recv_timeout=5.0), stager=stager)
    assert pf.start("A", {"host": "h"}, "cuda:0") is PrefetchStart.STARTED
    assert pf.consume("A").result is not None
    assert seen == [("A", torch.device("cuda:0"), "kv-prefetch")]
    assert pf.side_streams == 0 and stager.pinned_bytes == 0
    pf.shutdown()


def test_pinned_stager_rejects_a_bad_chunk_size() -> None:
    with pytest.raises(ValueError):
        PinnedStager(chunk_bytes=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only skip path")
@pytest.mark.slow
@pytest.mark.timeout(150)  # a fresh interpreter importing torch took over 30 s on a loaded host
def test_cuda_check_script_skips_cleanly_without_cuda() -> None:
    import subprocess
    import sys

    script = paths.SCRIPTS / "cuda_check.py"
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("SKIP cuda_check"), out.stdout
