"""CUDA checks of omnikv's device paths, on a CUDA machine: ``python scripts/cuda_check.py``.

Prints one ``PASS``/``FAIL``/``SKIP`` line per check and exits 1 if any check failed (0 when all
passed or CUDA is missing: then a single ``SKIP`` line). Finishes in well under 60 s.

Checks (device ``cuda:0`` unless ``--device``):

1. ``KVCacheTransferData.to_gpu_tensor`` -> ``from_bytes_device`` / ``from_bytes_gpu`` round trip
   (fp16, bf16, fp32; tensors stay on the device; the host decode of the same bytes agrees).
2. A packed device payload through ``LocalConnector`` -> manager receive onto the device.
3. A KV sent from device caches through ``SharedMemoryConnector`` (two connectors, one process)
   -> manager receive with ``target_device`` on the device.
4. ``PinnedStager`` with small chunks (several chunks, event-guarded reuse) on a side stream.
5. Prefetch through the manager with a device target: the copy runs on the ``kv-prefetch``
   thread on a side stream (not the default stream), through pinned staging chunks, before
   consume; consume calls ``record_stream`` on every device tensor; data verified.
6. The free-memory guard with the real ``torch.cuda.mem_get_info``: ratio > 1 skips, a tiny
   ratio prefetches.

``--device cpu`` runs the same code paths on the host as a dry run of this script's own logic
(checks that need CUDA report SKIP); CI on CPU-only machines runs the default (skip) path.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

RESULTS: list[tuple[str, str, str]] = []


def report(status: str, name: str, detail: str = "") -> None:
    RESULTS.append((status, name, detail))
    print(f"{status} {name}{': ' + detail if detail else ''}", flush=True)


def check(name: str, fn: Callable[[], str | None]) -> None:
    """Run one check; an AssertionError or any exception is a FAIL with its message."""
    t0 = time.perf_counter()
    try:
        detail = fn()
    except _Skip as exc:
        report("SKIP", name, str(exc))
        return
    except Exception as exc:
        traceback.print_exc()
        report("FAIL", name, f"{type(exc).__name__}: {exc}")
        return
    ms = (time.perf_counter() - t0) * 1e3
    report("PASS", name, f"{detail + '; ' if detail else ''}{ms:.0f} ms")


class _Skip(Exception):
    pass


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise _Skip("needs a CUDA device (dry run)")


def _layer_caches(device: torch.device, dtype: torch.dtype, layers: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(40, 4, 64, generator=g).to(dtype).to(device) for _ in range(layers)]
    values = [torch.randn(40, 4, 64, generator=g).to(dtype).to(device) for _ in range(layers)]
    return {"key_cache": keys, "value_cache": values}


def _assert_same(got: dict[str, Any], want: dict[str, Any], device: torch.device) -> None:
    for cache in ("key_cache", "value_cache"):
        assert len(got[cache]) == len(want[cache]), f"{cache}: layer count differs"
        for i, (g, w) in enumerate(zip(got[cache], want[cache], strict=True)):
            assert g.device.type == device.type, f"{cache}[{i}] on {g.device}, want {device}"
            assert g.dtype == w.dtype and g.shape == w.shape, f"{cache}[{i}] dtype/shape differ"
            assert torch.equal(g.to(w.device), w), f"{cache}[{i}] values differ"


# -- 1 ----------------------------------------------------------------------------------------
def check_codec(device: torch.device) -> str:
    _need_cuda(device)
    from omnikv.wire.transfer_data import KVCacheTransferData

    n = 0
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        blocks = _layer_caches(device, dtype)
        data = KVCacheTransferData("cuda-check", blocks, [0, 1, 2], {"seq_len": 40})
        packed = data.to_gpu_tensor()
        assert packed.device.type == "cuda" and packed.dtype == torch.uint8 and packed.dim() == 1
        assert packed.numel() == data.packed_size()
        for decode in (KVCacheTransferData.from_bytes_device, KVCacheTransferData.from_bytes_gpu):
            out = decode(packed)
            _assert_same(out["layer_blocks"], blocks, device)
            assert out["metadata"]["seq_len"] == 40
        host = KVCacheTransferData.from_bytes(packed.cpu().numpy().tobytes())
        _assert_same(
            host["layer_blocks"],
            {k: [t.cpu() for t in v] for k, v in blocks.items()},
            torch.device("cpu"),
        )
        n += 1
    torch.cuda.synchronize(device)
    return f"{n} dtypes"


# -- 2, 3 ---------------------------------------------------------------------------------------
def _recv_manager(connector: dict[str, Any], prefetch: bool = False, **kw: Any) -> Any:
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager

    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=connector,
            from_stage="stage1",
            stage_id="stage2",
            need_recv_cache=True,
            recv_timeout=10.0,
            enable_kv_async_prefetch=prefetch,
            **kw,
        ),
        async_prefetch=prefetch,
    )


def _send_manager(connector: dict[str, Any]) -> Any:
    from omnikv import OmniKVCacheConfig, OmniKVTransferManager

    return OmniKVTransferManager(
        OmniKVCacheConfig(
            connector_config=connector,
            from_stage="stage1",
            to_stage="stage2",
            need_send_cache=True,
        )
    )


def _paged(device: torch.device, layers: int = 2, fill: float = 0.0) -> list[Any]:
    # [2 (k, v), num_blocks, block_size, heads, head_dim] per layer, as the tests use
    return [
        (torch.arange(2 * 4 * 8 * 2 * 4, dtype=torch.float32).reshape(2, 4, 8, 2, 4) + fill + i).to(
            device
        )
        for i in range(layers)
    ]


def _send(sender: Any, rid: str, caches: list[Any]) -> None:
    sender.handle_finished_requests_kv_transfer(
        {rid: {"block_ids": [0, 1], "seq_len": 10}}, caches, 8, "torch.float32"
    )
    res = sender.get_send_result(rid)
    assert res is not None and res.ok, f"send of {rid} failed: {res}"


def _expected(caches: list[Any]) -> dict[str, Any]:
    """The KV the receiver should see for block_ids [0, 1], seq_len 10 of ``_paged`` caches."""
    keys = [c[0, :2].reshape(16, 2, 4)[:10].cpu() for c in caches]
    values = [c[1, :2].reshape(16, 2, 4)[:10].cpu() for c in caches]
    return {"key_cache": keys, "value_cache": values}


def check_local_device_payload(device: torch.device) -> str:
    _need_cuda(device)
    from omnikv.connectors.local import LocalConnector
    from omnikv.topology.keys import legacy_kv_key
    from omnikv.wire.transfer_data import KVCacheTransferData

    ns = f"cuda-check-{uuid.uuid4().hex[:8]}"
    blocks = _layer_caches(device, torch.float16)
    packed = KVCacheTransferData("dev-rid", blocks, [0], {"seq_len": 40}).to_gpu_tensor()
    conn = LocalConnector({"namespace": ns})
    ok, size, _ = conn.put("stage1", "stage2", legacy_kv_key("stage1", "stage2", "dev-rid"), packed)
    assert ok and size == packed.numel()
    mgr = _recv_manager({"type": "LocalConnector", "namespace": ns})
    try:
        res = mgr.receive_kv_cache_result("dev-rid", device)
        assert res.ok and res.data is not None, f"receive: {res.status} {res.reason}"
        _assert_same(res.data["layer_blocks"], blocks, device)
    finally:
        mgr.close()
        conn.close()
    return f"{size} bytes"


def check_shm_from_device_caches(device: torch.device) -> str:
    ns = f"cuda-check-{uuid.uuid4().hex[:8]}"
    conn = {"type": "SharedMemoryConnector", "namespace": ns, "pool_size_bytes": 8 << 20}
    sender, mgr = _send_manager(conn), _recv_manager(conn)
    try:
        caches = _paged(device)
        _send(sender, "shm-rid", caches)
        res = mgr.receive_kv_cache_result("shm-rid", device)
        assert res.ok and res.data is not None, f"receive: {res.status} {res.reason}"
        _assert_same(res.data["layer_blocks"], _expected(caches), device)
    finally:
        mgr.close()
        sender.close()
    return f"{res.nbytes} bytes, received onto {device}"


# -- 4 ----------------------------------------------------------------------------------------
def check_stager_chunks(device: torch.device) -> str:
    _need_cuda(device)
    from omnikv.transfer.received import ReceivedKV
    from omnikv.transfer.staging import PinnedStager

    stager = PinnedStager(chunk_bytes=1 << 20)
    src = torch.randn(5 << 18, dtype=torch.float32)  # 5 MiB: 5 chunks, both reused
    pinned_src = torch.randn(1 << 10).pin_memory()
    data = ReceivedKV("r", [], {}, [src, pinned_src], [src])
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        out = stager.to_device(data, device, stream)
    keys, values = out.key_cache, out.value_cache
    assert keys[0] is not None and keys[1] is not None
    assert keys[0].device.type == "cuda" and torch.equal(keys[0].cpu(), src)
    assert torch.equal(keys[1].cpu(), pinned_src)
    assert values[0] is keys[0], "one host tensor named twice is copied once"
    assert stager.pinned_bytes == 2 << 20 and all(c.is_pinned() for c in stager._chunks)
    return "5 chunks through 2 pinned buffers"


# -- 5 ----------------------------------------------------------------------------------------
def check_prefetch_side_stream(device: torch.device) -> str:
    from omnikv.transfer import staging

    ns = f"cuda-check-{uuid.uuid4().hex[:8]}"
    conn = {"type": "LocalConnector", "namespace": ns}
    sender, mgr = _send_manager(conn), _recv_manager(conn, prefetch=True)
    seen: dict[str, Any] = {}
    recorded: list[int] = []
    real_record = staging.record_stream_for

    def counting_record(data: Any) -> int:
        n = real_record(data)
        recorded.append(n)
        return n

    staging.record_stream_for = counting_record  # type: ignore[assignment]
    try:
        caches = _paged(torch.device("cpu"), layers=3, fill=5.0)
        _send(sender, "pf-rid", caches)
        mgr.start_prefetch(
            {"request_id": "pf-rid", "kv_sender_info": {"host": "127.0.0.1", "zmq_port": 1}},
            target_device=device,
        )
        prefetcher = mgr.prefetcher
        assert prefetcher is not None, "prefetch did not start"
        real_to_device = prefetcher._stager.to_device

        def spy(data: Any, dev: torch.device, stream: Any) -> Any:
            seen["thread"] = threading.current_thread().name
            seen["side"] = torch.cuda.current_stream(dev) == stream
            seen["default"] = stream == torch.cuda.default_stream(dev)
            return real_to_device(data, dev, stream)

        prefetcher._stager.to_device = spy  # type: ignore[method-assign]
        # the spy may be installed after the worker already copied: then no stager call is seen
        req = SimpleNamespace(request_id="pf-rid", sampling_params=SimpleNamespace())
        assert mgr.consume_and_distribute_kv_cache(req, target_device=device), "no KV"
        kv = req.past_key_values
        got = {"key_cache": list(kv.key_cache), "value_cache": list(kv.value_cache)}
        _assert_same(got, _expected(caches), device)
        if device.type != "cuda":
            assert recorded == [0], recorded
            return "host dry run (no stream, no record_stream)"
        res = mgr.get_receive_result("pf-rid")
        assert res is not None and res.ok
        assert prefetcher.side_streams, "no side stream was made"
        assert recorded and recorded[-1] == 6, f"record_stream on {recorded} tensors, want 6"
        if seen:
            assert seen["thread"] == "kv-prefetch", seen
            assert seen["side"] and not seen["default"], seen
        assert prefetcher._stager._chunks and all(
            c.is_pinned() for c in prefetcher._stager._chunks
        ), "no pinned staging chunks"
        # a second request with the spy surely in place
        _send(sender, "pf-rid2", caches)
        mgr.start_prefetch(
            {"request_id": "pf-rid2", "kv_sender_info": {"host": "127.0.0.1", "zmq_port": 1}},
            target_device=device,
        )
        req2 = SimpleNamespace(request_id="pf-rid2", sampling_params=SimpleNamespace())
        assert mgr.consume_and_distribute_kv_cache(req2, target_device=device)
        assert seen.get("thread") == "kv-prefetch", f"device copy ran on {seen.get('thread')}"
        assert seen["side"] and not seen["default"], "device copy not on a side stream"
        torch.cuda.synchronize(device)
        return "copy on kv-prefetch thread, side stream, pinned chunks, record_stream x6"
    finally:
        staging.record_stream_for = real_record  # type: ignore[assignment]
        mgr.close()
        sender.close()


# -- 6 ----------------------------------------------------------------------------------------
def check_free_memory_guard(device: torch.device) -> str:
    _need_cuda(device)
    from omnikv.config import OmniKVCacheConfig
    from omnikv.transfer.prefetch import KVPrefetcher, PrefetchStart
    from omnikv.transfer.receive import ReceiveResult, ReceiveStatus

    def receive(request_id: str, target_device: Any, **_: Any) -> ReceiveResult:
        return ReceiveResult(request_id, ReceiveStatus.UNAVAILABLE, reason="guard check")

    def config(ratio: float) -> OmniKVCacheConfig:
        return OmniKVCacheConfig(recv_timeout=1.0, kv_prefetch_min_free_mem_ratio=ratio)

    free, total = torch.cuda.mem_get_info(device)
    high = KVPrefetcher(receive, config=config(1.01))
    low = KVPrefetcher(receive, config=config(1e-6))
    try:
        assert high.start("g", {"h": 1}, device) is PrefetchStart.LOW_MEMORY
        assert low.start("g", {"h": 1}, device) is PrefetchStart.STARTED
    finally:
        high.shutdown()
        low.shutdown()
    return f"free {free / total:.1%} of {total >> 20} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a dry run")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("SKIP cuda_check: CUDA is not available on this machine", flush=True)
        return 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(
            f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}",
            flush=True,
        )
    t0 = time.perf_counter()
    check("to_gpu_tensor / from_bytes_device / from_bytes_gpu", lambda: check_codec(device))
    check("device payload via LocalConnector", lambda: check_local_device_payload(device))
    check(
        "SharedMemoryConnector from device caches to device",
        lambda: check_shm_from_device_caches(device),
    )
    check("PinnedStager chunked copy on a side stream", lambda: check_stager_chunks(device))
    check(
        "prefetch: pinned + side stream + record_stream", lambda: check_prefetch_side_stream(device)
    )
    check("free-memory guard (real mem_get_info)", lambda: check_free_memory_guard(device))
    failed = [r for r in RESULTS if r[0] == "FAIL"]
    print(
        f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks did not fail "
        f"({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
