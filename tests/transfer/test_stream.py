"""``stream_kv``: full blocks ship while a request decodes, the tail and manifest at the finish.

LocalConnector for the logic (bit-identical results, abort, hostile manifests, TP slicing,
verdicts), and real sender processes over the SharedMemoryConnector for a whole stream and for
a producer killed mid-stream.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from conftest import ManagerFactory, make_paged_caches
from omnikv import ReceiveStatus
from omnikv.connectors.local import LocalConnector
from omnikv.topology.keys import legacy_kv_key
from omnikv.transfer.edge import KVCaches
from omnikv.transfer.results import StreamProgress
from omnikv.transfer.send import SendStatus
from omnikv.transfer.stream.manifest import chunk_key
from omnikv.wire.decode import decode_kv
from omnikv.wire.encode import PackedPayload
from support.polling import until

BS = 4
DTYPE_NAMES = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16"}
F32 = "torch.float32"


def _caches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return make_paged_caches(layers=3, blocks=12, block_size=BS, heads=2, dim=8, dtype=dtype)


def _entry(ids: list[int], seq_len: int) -> dict[str, Any]:
    return {"block_ids": ids, "seq_len": seq_len, "custom_metadata": {"note": "x"}}


#: Layer groups a runner ships in turn (the caches have 3 layers); ``None``: whole chunks.
GROUPS: list[list[tuple[int, int]] | None] = [None, [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]]
GROUP_IDS = ["whole-chunks", "groups-1-2", "layer-by-layer"]


def _step(mgr: Any, rid: str, *args: Any, **kw: Any) -> StreamProgress:
    """One ``stream_kv_blocks`` call, then its step awaited: the call's own refusal, or what
    the worker published for it (the synchronous step these tests check the logic of; the
    tests of the worker itself call ``stream_kv_blocks`` alone)."""
    called = mgr.stream_kv_blocks(rid, *args, **kw)
    if called.reason is not None:
        return called
    done = mgr.wait_kv_stream(rid, 10.0)
    assert done.pending == 0, done
    return done


def _decode_steps(
    mgr: Any,
    rid: str,
    ids: list[int],
    seq_len: int,
    caches: list[torch.Tensor],
    dtype: str,
    groups: list[tuple[int, int]] | None = None,
    **kw: Any,
) -> None:
    """The runner's per-step calls as decode grows: tokens 1..seq_len written in turn; with
    ``groups`` one call per layer group, in order, as the forward pass writes them."""
    for t in range(1, seq_len + 1):
        for layers in groups or [None]:
            _step(mgr, rid, _entry(ids, t), caches, BS, dtype, layers=layers, **kw)


def _finish(mgr: Any, rid: str, ids: list[int], seq_len: int, caches: Any, dtype: str) -> Any:
    return mgr.edge.send(rid, _entry(ids, seq_len), KVCaches(caches, BS, dtype))


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["request_id"] == want["request_id"]
    assert got["block_ids"] == want["block_ids"]
    assert got["metadata"] == want["metadata"]
    for cache in ("key_cache", "value_cache"):
        a, b = got["layer_blocks"][cache], want["layer_blocks"][cache]
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))  # bit for bit


def _connector(mgr: Any) -> LocalConnector:
    conn = mgr.connector
    assert isinstance(conn, LocalConnector)
    return conn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seq_len", [1, BS - 1, BS, BS + 1, 3 * BS, 3 * BS + 1])
@pytest.mark.parametrize("groups", GROUPS, ids=GROUP_IDS)
def test_streamed_and_whole_sends_give_bit_identical_kv(
    make_manager: ManagerFactory,
    dtype: torch.dtype,
    seq_len: int,
    groups: list[tuple[int, int]] | None,
) -> None:
    caches, name = _caches(dtype), DTYPE_NAMES[dtype]
    ids = [7, 2, 9, 0, 5]
    whole, streamed = make_manager("sender"), make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    assert _finish(whole, "r1", ids, seq_len, caches, name).ok
    want, _ = receiver.receive_kv_cache_for_request("r1")
    assert want is not None

    _decode_steps(streamed, "r1", ids, seq_len, caches, name, groups)
    res = _finish(streamed, "r1", ids, seq_len, caches, name)
    assert res.ok, res.reason
    chunks = [k for k in res.keys if "#c" in k]
    # one chunk per step that filled a block, or one per layer group of it
    assert len(chunks) == seq_len // BS * len(groups or [None])
    got, _ = receiver.receive_kv_cache_for_request("r1")
    assert got is not None, receiver.get_receive_result("r1")
    _assert_same(got, want)
    assert streamed.wait_delivered("r1", 5).status is SendStatus.DELIVERED
    assert _connector(receiver).pending_keys() == []


def test_only_the_tail_moves_at_the_finish(make_manager: ManagerFactory) -> None:
    caches, ids = _caches(), list(range(10))
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    progress = _step(sender, "r1", _entry(ids, 8 * BS + 1), caches, BS, "torch.float32")
    assert (progress.shipped, progress.chunks, progress.new) == (8 * BS, 1, 8 * BS)
    again = _step(sender, "r1", _entry(ids, 8 * BS + 2), caches, BS, "torch.float32")
    assert (again.shipped, again.chunks, again.new) == (8 * BS, 1, 0)  # no new full block
    res = _finish(sender, "r1", ids, 8 * BS + 2, caches, "torch.float32")
    tail_bytes = 3 * 2 * 2 * 2 * 8 * 4  # 2 tokens x layers x K,V x heads x dim x fp32
    assert res.ok and res.nbytes < tail_bytes + 8192  # header and padding, not 34 tokens
    assert receiver.receive_kv_cache_result("r1").ok


def test_streaming_off_makes_the_per_step_call_a_no_op(make_manager: ManagerFactory) -> None:
    sender = make_manager("sender")
    progress = _step(sender, "r1", _entry([0, 1], 8), _caches(), BS, "torch.float32")
    assert progress.chunks == 0 and progress.reason == "stream_kv is off"
    assert _connector(sender).pending_keys() == []
    assert sender.abort_kv_stream("r1") == 0


def test_an_aborted_stream_leaves_nothing_in_the_pool(make_manager: ManagerFactory) -> None:
    caches, ids = _caches(), [3, 4, 5, 6]
    sender = make_manager("sender", stream_kv=True)
    _decode_steps(sender, "r1", ids, 3 * BS + 2, caches, "torch.float32")
    conn = _connector(sender)
    assert len(conn.pending_keys()) == 3 and conn.health()["pool_used"] > 0
    assert sender.abort_kv_stream("r1") == 3
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0
    assert sender.abort_kv_stream("r1") == 0  # idempotent


@pytest.mark.slow
def test_a_range_missing_its_last_layers_is_dropped_and_the_stream_stops(
    make_manager: ManagerFactory,
) -> None:
    """A layer group out of order drops its range's groups already published and stops the
    stream; the finish sends the rest with the tail, bit for bit what a whole send gives, and
    leaves nothing in the pool. An abort drops a range's groups too."""
    caches, ids, seq_len = _caches(), [3, 4, 5, 6], 3 * BS + 2
    whole, sender = make_manager("sender"), make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    conn = _connector(sender)
    assert _finish(whole, "w", ids, seq_len, caches, F32).ok
    want, _ = receiver.receive_kv_cache_for_request("w")
    _decode_steps(sender, "r1", ids, BS, caches, F32, [(0, 1), (1, 3)])
    assert len(conn.pending_keys()) == 2
    p = _step(sender, "r1", _entry(ids, 2 * BS), caches, BS, F32, layers=(0, 1))
    assert (p.shipped, p.new, len(conn.pending_keys())) == (BS, 0, 3)  # a group in flight
    p = _step(sender, "r1", _entry(ids, 2 * BS), caches, BS, F32, layers=(2, 3))
    assert p.reason is not None and "layer 1 was due" in p.reason
    assert len(conn.pending_keys()) == 2  # the range's group went; what was whole stays
    p = _step(sender, "r1", _entry(ids, 3 * BS), caches, BS, F32, layers=(0, 1))
    assert p.new == 0 and p.shipped == BS  # stopped: nothing more ships
    res = _finish(sender, "r1", ids, seq_len, caches, F32)
    assert res.ok and len([k for k in res.keys if "#c" in k]) == 2
    got, _ = receiver.receive_kv_cache_for_request("r1")
    assert got is not None and want is not None
    _assert_same({**got, "request_id": "w"}, want)
    assert sender.wait_delivered("r1", 5).status is SendStatus.DELIVERED
    del got, want
    gc.collect()  # the whole send's KV was received as views of the pool
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0
    _decode_steps(sender, "r2", ids, BS, caches, F32, [(0, 1)])
    assert len(conn.pending_keys()) == 1
    assert sender.abort_kv_stream("r2") == 1
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0


def test_the_chunk_limit_reached_mid_range_drops_that_ranges_groups(
    make_manager: ManagerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the stream's chunk limit the stream stops; a range whose first groups were published
    before it is dropped (its keys leave the pool), the ranges shipped whole stay."""
    import omnikv.transfer.stream.sending as stream_mod

    monkeypatch.setattr(stream_mod, "MAX_STREAM_CHUNKS", 3)
    caches, ids = _caches(), [3, 4, 5]
    sender = make_manager("sender", stream_kv=True)
    conn = _connector(sender)
    _decode_steps(sender, "r1", ids, BS, caches, F32, [(0, 1), (1, 3)])
    p = _step(sender, "r1", _entry(ids, 2 * BS), caches, BS, F32, layers=(0, 1))
    assert p.shipped == BS and len(conn.pending_keys()) == 3  # chunk 2: the limit's last
    p = _step(sender, "r1", _entry(ids, 2 * BS), caches, BS, F32, layers=(1, 3))
    assert p.reason is not None and "3 chunks shipped" in p.reason
    assert len(conn.pending_keys()) == 2 and len(sender.kv_stream_chunks("r1")) == 2


def test_a_bad_layer_group_ships_nothing_and_raises_nothing(make_manager: ManagerFactory) -> None:
    caches, ids = _caches(), [3, 4]
    sender = make_manager("sender", stream_kv=True)
    for bad, why in [
        ((2, 1), "is not within the 3 layers"),
        ((0, 4), "is not within the 3 layers"),
        ("ab", "layers must be (first, stop)"),
        ((0, 1, 2), "layers must be (first, stop)"),
    ]:
        p = _step(sender, "r1", _entry(ids, BS), caches, BS, F32, layers=bad)
        assert p.new == 0 and why in (p.reason or ""), (bad, p)
    assert _connector(sender).pending_keys() == []
    p = _step(sender, "r1", _entry(ids, BS), caches, BS, F32, layers=(0, 3))
    assert p.new == BS and sender.kv_stream_chunks("r1")[0].layers is None  # every layer: whole


def test_a_failed_finish_drops_the_chunks(make_manager: ManagerFactory) -> None:
    caches, ids = _caches(), [3, 4, 5, 6]
    sender = make_manager("sender", stream_kv=True)
    _decode_steps(sender, "r1", ids, 2 * BS, caches, "torch.float32")
    assert len(_connector(sender).pending_keys()) == 2
    res = _finish(sender, "r1", ids, 2 * BS, caches, "float16")  # contradicts the caches
    assert res.status is SendStatus.FAILED
    assert _connector(sender).pending_keys() == []


def test_changed_blocks_restart_the_stream_and_a_changed_finish_sends_whole(
    make_manager: ManagerFactory,
) -> None:
    caches = _caches()
    sender, receiver = make_manager("sender", stream_kv=True), make_manager("receiver")
    _step(sender, "r1", _entry([1, 2, 3], 2 * BS), caches, BS, "torch.float32")
    # preempted and rescheduled on other blocks: what was shipped is dropped, shipping restarts
    p = _step(sender, "r1", _entry([8, 9, 10], 2 * BS), caches, BS, "torch.float32")
    assert (p.shipped, p.chunks) == (2 * BS, 1)
    assert len(_connector(sender).pending_keys()) == 1
    # the finish names yet other blocks: the stream is dropped, the request goes whole
    res = _finish(sender, "r1", [4, 5, 6], 2 * BS + 1, caches, "torch.float32")
    assert res.ok and not any("#c" in k for k in res.keys)
    got, _ = receiver.receive_kv_cache_for_request("r1")
    assert got is not None
    want = torch.cat([caches[0][0, b] for b in (4, 5, 6)])[: 2 * BS + 1]
    assert torch.equal(got["layer_blocks"]["key_cache"][0], want)
    assert _connector(sender).pending_keys() == []


def test_the_stream_keeps_each_chunks_seal_beside_its_range(make_manager: ManagerFactory) -> None:
    """``kv_stream_chunks`` lists what the tail's manifest will: each shipped chunk's range and
    its seal's metadata. A restart starts the list afresh (a finish never vouches for chunks
    of an earlier stream), an abort or a settled finish empties it."""
    caches = _caches()
    sender = make_manager("sender", stream_kv=True)
    for t in (BS, 2 * BS + 1, 3 * BS):
        _step(sender, "r1", _entry([1, 2, 3], t), caches, BS, "float32", seal=_seal)
    assert sender.kv_stream_chunks("r1") == [
        (0, BS, {"seal": [0, BS, [1]]}, None),
        (BS, 2 * BS, {"seal": [BS, 2 * BS, [2]]}, None),
        (2 * BS, 3 * BS, {"seal": [2 * BS, 3 * BS, [3]]}, None),
    ]
    _step(sender, "r1", _entry([8, 9, 10], BS), caches, BS, "float32", seal=_seal)
    assert sender.kv_stream_chunks("r1") == [(0, BS, {"seal": [0, BS, [8]]}, None)]  # restarted
    _step(sender, "r2", _entry([4], BS), caches, BS, "float32")  # no seal
    assert sender.kv_stream_chunks("r2") == [(0, BS, {}, None)]
    assert sender.abort_kv_stream("r1") == 1 and sender.kv_stream_chunks("r1") == []
    assert _finish(sender, "r2", [4], BS, caches, "float32").ok
    assert sender.kv_stream_chunks("r2") == []
    assert make_manager("sender").kv_stream_chunks("r2") == []  # stream_kv off


@pytest.mark.parametrize("groups", GROUPS[:2], ids=GROUP_IDS[:2])
def test_receiving_tp_above_sending_tp_assembles_each_rank_slice(
    make_manager: ManagerFactory, groups: list[tuple[int, int]] | None
) -> None:
    from omnikv.ranks.context import ParallelContext

    tp = {"rank_mapping": {"from_tp": 1, "to_tp": 2}}
    caches, ids = _caches(), [0, 1, 2]
    whole = make_manager("sender", **tp)
    streamed = make_manager("sender", stream_kv=True, **tp)
    ranks = [
        make_manager("receiver", parallel_context=ParallelContext(local_rank=r), **tp)
        for r in (0, 1)
    ]
    assert _finish(whole, "r1", ids, 2 * BS + 3, caches, "torch.float32").ok
    wants = [r.receive_kv_cache_for_request("r1")[0] for r in ranks]
    _decode_steps(streamed, "r1", ids, 2 * BS + 3, caches, "torch.float32", groups)
    res = _finish(streamed, "r1", ids, 2 * BS + 3, caches, "torch.float32")
    per_range = len(groups or [None])
    assert res.ok and len(res.keys) == 2 * (2 * per_range + 1)  # chunks and the tail, per rank
    for rank, want in zip(ranks, wants, strict=True):
        got, _ = rank.receive_kv_cache_for_request("r1")
        assert got is not None and want is not None
        assert got["layer_blocks"]["key_cache"][0].shape[1] == 1  # this rank's head
        _assert_same(got, want)
    assert streamed.wait_delivered("r1", 5).status is SendStatus.DELIVERED


def test_a_stream_piece_is_a_future_format_version() -> None:
    """A tail is format version 3: readers before streaming refuse it (never read it as KV)."""
    t = torch.zeros(2, 1, 4)
    mark = {"k": "tail", "id": "abc", "n": 1, "r": [[0, 4]]}
    raw = PackedPayload("r1", [t], [t], [0, 1], {"seq_len": 6}, stream=mark).to_bytes()
    assert b'"v":3' in raw and decode_kv(raw).stream is not None
    older = raw.replace(b'"sm":{', b'"xx":{', 1)  # what a reader that ignores sm sees
    with pytest.raises(ValueError, match="unsupported format version 3"):
        decode_kv(older)


# -- hostile manifests ---------------------------------------------------------------------------
def _put(conn: LocalConnector, key: str, payload: PackedPayload) -> None:
    ok, _, _ = conn.put_packed(
        "stage1", "stage2", key, payload.nbytes, payload, deadline=time.monotonic() + 5
    )
    assert ok


def _piece(tokens: int, mark: dict[str, Any], layers: int = 2, seq_len: int = 0) -> PackedPayload:
    t = torch.ones(tokens, 2, 4)
    meta = {"seq_len": seq_len} if seq_len else {}
    return PackedPayload("r1", [t] * layers, [t] * layers, [0], meta, stream=mark)


def _tail(n: int, ranges: list[list[int]], seq_len: int, layers: int = 2) -> PackedPayload:
    mark = {"k": "tail", "id": "s1", "n": n, "r": ranges}
    return _piece(seq_len - (ranges[-1][1] if ranges else 0), mark, layers, seq_len)


def _chunk(index: int, start: int, stop: int, layers: int = 2) -> PackedPayload:
    return _piece(
        stop - start, {"k": "chunk", "id": "s1", "n": index, "r": [[start, stop]]}, layers
    )


def _group(index: int, start: int, stop: int, first: int, end: int, lc: int = 2) -> PackedPayload:
    mark = {"k": "chunk", "id": "s1", "n": index, "r": [[start, stop]], "l": [[first, end]]}
    return _piece(stop - start, {**mark, "lc": lc}, end - first)


def _layered_tail(spans: list[list[int]], ranges: list[list[int]], seq_len: int) -> PackedPayload:
    mark = {"k": "tail", "id": "s1", "n": len(ranges), "r": ranges, "l": spans, "lc": 2}
    return _piece(seq_len - ranges[-1][1], mark, 2, seq_len)


KEY = legacy_kv_key("stage1", "stage2", "r1")


@pytest.mark.parametrize(
    ("pieces", "match"),
    [
        pytest.param(
            lambda: [(KEY, _piece(1, {"k": "tail", "id": "s1", "n": 10**6, "r": [[0, 4]]}))],
            "`int` <= 4096 - at `$.sm.n`",
            id="a million chunks",
        ),
        pytest.param(
            lambda: [(KEY, _tail(2, [[0, 4], [6, 8]], 9))], "expected to start at 4", id="gap"
        ),
        pytest.param(
            lambda: [(KEY, _tail(2, [[0, 4]], 9))], "claims 2 chunks with 1 ranges", id="count"
        ),
        pytest.param(
            lambda: [(chunk_key(KEY, 0), _chunk(0, 0, 4, layers=3)), (KEY, _tail(1, [[0, 4]], 6))],
            "chunk has 3 layers, the tail 2",
            id="layers",
        ),
        pytest.param(
            lambda: [(chunk_key(KEY, 0), _chunk(0, 0, 3)), (KEY, _tail(1, [[0, 4]], 6))],
            "chunk covers",
            id="ranges disagree",
        ),
        pytest.param(
            lambda: [
                (chunk_key(KEY, 0), _chunk(0, 0, 4)),
                (KEY, _piece(2, {"k": "tail", "id": "s1", "n": 1, "r": [[0, 4]]}, seq_len=9)),
            ],
            "chunks and tail hold 6 tokens, metadata seq_len=9",
            id="seq_len",
        ),
        pytest.param(
            lambda: [(KEY, _chunk(0, 0, 4))], "stream chunk was published under", id="chunk"
        ),
        pytest.param(
            lambda: [(KEY, _layered_tail([[0, 1]], [[0, 4], [0, 4]], 6))],
            "1 layer spans of 2 layers do not fit its 2 chunks",
            id="spans count",
        ),
        pytest.param(
            lambda: [(KEY, _layered_tail([[0, 1], [2, 2]], [[0, 4], [0, 4]], 6))],
            "holds layers [2, 2), expected from 1",
            id="span gap",
        ),
        pytest.param(
            lambda: [(KEY, _layered_tail([[0, 1], [1, 2], [0, 1]], [[0, 4], [0, 4], [4, 8]], 9))],
            "the last chunk's range lacks its layers from 1",
            id="range lacks layers",
        ),
        pytest.param(
            lambda: [(KEY, _layered_tail([[0, 1], [1, 2]], [[0, 4], [0, 5]], 6))],
            "chunk 1 covers [0, 5), not its range's layers",
            id="group range moved",
        ),
        pytest.param(
            lambda: [
                (chunk_key(KEY, 0), _group(0, 0, 4, 0, 2)),
                (chunk_key(KEY, 1), _group(1, 0, 4, 1, 2)),
                (KEY, _layered_tail([[0, 1], [1, 2]], [[0, 4], [0, 4]], 6)),
            ],
            "chunk holds layers [0, 2], the manifest says [0, 1]",
            id="chunk span disagrees",
        ),
        pytest.param(
            lambda: [
                (chunk_key(KEY, 0), _group(0, 0, 4, 0, 1, lc=3)),
                (KEY, _layered_tail([[0, 1], [1, 2]], [[0, 4], [0, 4]], 6)),
            ],
            "chunk has 3 layers, the tail 2",
            id="chunk layer count",
        ),
        pytest.param(
            lambda: [(KEY, _piece(2, {"k": "tail", "id": "s1", "n": 1, "r": [[0, 4]], "lc": 2}))],
            "layer count without layer spans",
            id="count without spans",
        ),
    ],
)
@pytest.mark.slow
def test_a_hostile_manifest_is_a_clean_corrupt_and_holds_nothing(
    make_manager: ManagerFactory, pieces: Any, match: str, caplog: pytest.LogCaptureFixture
) -> None:
    # a log record would keep the error, whose frames keep views of the payload, alive
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer.receive")
    receiver = make_manager("receiver")
    conn = _connector(receiver)
    for key, payload in pieces():
        _put(conn, key, payload)
    t0 = time.monotonic()
    result = receiver.receive_kv_cache_result("r1")
    assert result.status is ReceiveStatus.CORRUPT, result
    assert match in (result.reason or "")
    assert time.monotonic() - t0 < 0.9  # refused at once, not at the deadline
    gc.collect()  # an adopted buffer goes with its last view
    for key in conn.pending_keys():  # chunks never taken stay for their sender (or the TTL)
        assert "#c" in key
        conn.cleanup(key.rsplit("@", 1)[0])
    assert conn.health()["pool_used"] == 0  # nothing taken is held


@pytest.mark.slow
def test_a_missing_chunk_is_a_timeout_and_the_taken_chunks_are_refused(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer.receive")  # see above
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", recv_timeout=0.3)
    caches, ids = _caches(), [0, 1, 2]
    _decode_steps(sender, "r1", ids, 2 * BS + 1, caches, "torch.float32")
    conn = _connector(sender)
    conn.cleanup(chunk_key(KEY, 1))  # lost on the way
    assert _finish(sender, "r1", ids, 2 * BS + 1, caches, "torch.float32").ok
    result = receiver.receive_kv_cache_result("r1")
    assert result.status is ReceiveStatus.TIMEOUT and "#c1" in (result.reason or "")
    verdict = sender.wait_delivered("r1", 5)
    assert verdict.status is SendStatus.REFUSED
    gc.collect()
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0


@pytest.mark.parametrize("withdraws", [True, False])
def test_chunks_of_a_refused_stream_go_at_the_refusal_or_the_senders_next_step(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture, withdraws: bool
) -> None:
    """A receiver that refuses a stream's tail before it took the chunks (here: the header
    is over its bound) leaves them unclaimed; the refusal takes them back (``withdraw``), or,
    with a connector that cannot, the sender drops them at its next stream step instead of
    holding them until their TTL."""
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer.receive")
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", max_header_bytes=64, recv_timeout=2.0)
    conn = _connector(sender)
    if not withdraws:
        conn.withdraw = lambda *_: False  # type: ignore[method-assign]
    caches, ids = _caches(), [0, 1, 2]
    _decode_steps(sender, "r1", ids, 2 * BS + 1, caches, "torch.float32")
    assert _finish(sender, "r1", ids, 2 * BS + 1, caches, "torch.float32").ok
    assert receiver.receive_kv_cache_result("r1").status is ReceiveStatus.CORRUPT
    assert sender.wait_delivered("r1", 5).status is SendStatus.REFUSED
    # withdrawn with the refusal, or not taken and not yet dropped
    assert any("#c" in k for k in conn.pending_keys()) is not withdraws, conn.pending_keys()
    _step(sender, "r2", _entry([5, 6], 1), caches, BS, "torch.float32")
    assert not any("r1#c" in k for k in conn.pending_keys()), conn.pending_keys()


# -- a receiver that takes the chunks as they come (stream_kv on the receiving stage) ----------
def _chunk_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("omnikv-chunks")]


def _until(cond: Any, timeout: float = 5.0) -> bool:
    return bool(until(lambda: bool(cond()), timeout))


def test_a_streaming_receiver_takes_the_chunks_before_the_tail_is_sent(
    make_manager: ManagerFactory,
) -> None:
    """With ``stream_kv`` on the receiving stage, each chunk leaves the sender while the
    request still decodes (on a link: its bytes cross then), and the result is bit-identical
    to a whole send's."""
    caches, ids, seq_len = _caches(), [7, 2, 9, 0, 5], 4 * BS + 1
    whole, streamed = make_manager("sender"), make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=10.0)
    assert _finish(whole, "w", ids, seq_len, caches, "torch.float32").ok
    want, _ = receiver.receive_kv_cache_for_request("w")
    assert want is not None
    want["request_id"] = "r1"
    conn = _connector(streamed)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(r=receiver.receive_kv_cache_result("r1")))
    t.start()
    try:
        for step in range(1, seq_len + 1):
            _step(streamed, "r1", _entry(ids, step), caches, BS, "torch.float32")
            # every chunk published so far is taken before the next step (the tail is not sent)
            assert _until(lambda: conn.pending_keys() == []), conn.pending_keys()
        assert streamed.get_send_result("r1") is None  # not finished: nothing but chunks moved
        res = _finish(streamed, "r1", ids, seq_len, caches, "torch.float32")
        assert res.ok and len([k for k in res.keys if "#c" in k]) == seq_len // BS
    finally:
        t.join(15)
    result = got["r"]
    assert result.ok, result.reason
    _assert_same(_seed_dict(result), want)
    # the chunks were joined as they arrived: each layer is the start of the tensor grown then
    # (a join at the finish would have allocated exactly the request's tokens)
    k0 = result.kv.key_cache[0]
    assert k0.untyped_storage().nbytes() > k0.numel() * k0.element_size()
    assert streamed.wait_delivered("r1", 5).status is SendStatus.DELIVERED
    assert _until(lambda: _chunk_threads() == [], 2.0), _chunk_threads()


def _seed_dict(result: Any) -> dict[str, Any]:
    kv = result.kv
    return {
        "request_id": kv.request_id,
        "block_ids": kv.block_ids,
        "metadata": kv.metadata,
        "layer_blocks": {"key_cache": kv.key_cache, "value_cache": kv.value_cache},
    }


@pytest.mark.slow
def test_a_streaming_receiver_retakes_chunks_of_a_stream_restarted_after_it_took_them(
    make_manager: ManagerFactory,
) -> None:
    """The receiver took chunk 0 ahead; then the sender's request moved to other blocks (a
    preemption) and its stream restarted with a new chunk 0. The assembly notices the stale
    chunk, takes the new one and returns what the finish names: the new blocks' tokens."""
    caches = _caches()
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=10.0)
    conn = _connector(sender)
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(r=receiver.receive_kv_cache_result("r1")))
    t.start()
    try:
        _step(sender, "r1", _entry([1, 2, 3], 2 * BS), caches, BS, "torch.float32")
        assert _until(lambda: conn.pending_keys() == []), conn.pending_keys()  # taken ahead
        p = _step(sender, "r1", _entry([8, 9, 10], 2 * BS), caches, BS, "torch.float32")
        assert (p.shipped, p.chunks) == (2 * BS, 1)  # restarted: a new chunk 0
        res = _finish(sender, "r1", [8, 9, 10], 2 * BS + 1, caches, "torch.float32")
        assert res.ok and any("#c0" in k for k in res.keys)
    finally:
        t.join(15)
    result = got["r"]
    assert result.ok, result.reason
    want = torch.cat([caches[0][0, b] for b in (8, 9, 10)])[: 2 * BS + 1]
    assert torch.equal(result.kv.key_cache[0], want)
    gc.collect()
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0


def test_a_streaming_receiver_takes_a_whole_send_as_before_and_stops_looking(
    make_manager: ManagerFactory,
) -> None:
    sender = make_manager("sender")
    receiver = make_manager("receiver", stream_kv=True)
    assert _finish(sender, "r1", [0, 1, 2], 2 * BS + 1, _caches(), "torch.float32").ok
    result = receiver.receive_kv_cache_result("r1")
    assert result.ok and result.kv is not None and result.kv.key_cache[0].shape[0] == 2 * BS + 1
    assert _until(lambda: _chunk_threads() == [], 2.0), _chunk_threads()
    assert sender.wait_delivered("r1", 5).status is SendStatus.DELIVERED


@pytest.mark.slow
def test_a_streaming_receiver_that_times_out_refuses_the_chunks_it_took(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer that streamed and never finished: the receive times out at its deadline,
    the chunks it took ahead are released and refused, and its threads end."""
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer.receive")
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=0.5)
    caches, ids = _caches(), [0, 1, 2]
    _decode_steps(sender, "r1", ids, 2 * BS + 1, caches, "torch.float32")
    result = receiver.receive_kv_cache_result("r1")
    assert result.status is ReceiveStatus.TIMEOUT
    conn = _connector(sender)
    gc.collect()
    assert conn.pending_keys() == [] and conn.health()["pool_used"] == 0
    assert _until(lambda: _chunk_threads() == [], 2.0), _chunk_threads()


# -- a caller that takes each chunk as it arrives (on_chunk) -------------------------------------
class _Taker:
    """An ``on_chunk`` that keeps copies of what it is handed (refusing chunk ``refuse``)."""

    def __init__(self, refuse: int | None = None, raises: bool = False) -> None:
        self.chunks: list[Any] = []
        self.layer_counts: list[int] = []
        self.threads: list[str] = []
        self.refuse = refuse
        self.raises = raises

    def __call__(self, chunk: Any) -> str | None:
        self.threads.append(threading.current_thread().name)
        if self.raises:
            raise RuntimeError("taker broke")
        if chunk.index == self.refuse:
            return "not this one"
        copy = [t.clone() for t in chunk.key_cache], [t.clone() for t in chunk.value_cache]
        meta = dict(chunk.metadata)
        self.chunks.append((chunk.index, chunk.start, chunk.stop, meta, copy, chunk.first_layer))
        self.layer_counts.append(chunk.num_layers)
        return None


def _seal(
    start: int, stop: int, block_ids: Any, *, layers: tuple[int, int] | None = None
) -> dict[str, Any]:
    seal: list[Any] = [start, stop, list(block_ids)]
    return {"seal": seal if layers is None else [*seal, list(layers)]}


@pytest.mark.parametrize("ahead", [True, False], ids=["taken-ahead", "at-the-finish"])
def test_on_chunk_gets_each_chunk_in_order_and_the_result_holds_only_the_tail(
    make_manager: ManagerFactory, ahead: bool
) -> None:
    """Each chunk reaches ``on_chunk`` once, in order, with the sender's per-chunk metadata
    (``seal``); chunks plus the returned tail are bit for bit the whole send's KV. Taken ahead
    (``stream_kv`` on the receiver), every chunk is handed over before the finish is sent."""
    caches, ids, seq_len = _caches(torch.bfloat16), [7, 2, 9, 0, 5], 4 * BS + 2
    whole, streamed = make_manager("sender"), make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=ahead, recv_timeout=10.0)
    assert _finish(whole, "w", ids, seq_len, caches, "torch.bfloat16").ok
    want, _ = receiver.receive_kv_cache_for_request("w")
    assert want is not None
    taker = _Taker()
    got: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: got.update(r=receiver.receive_kv_cache_result("r1", on_chunk=taker))
    )
    t.start()
    try:
        for step in range(1, seq_len + 1):
            _step(streamed, "r1", _entry(ids, step), caches, BS, "torch.bfloat16", seal=_seal)
        if ahead:  # handed over while the request still decodes
            assert _until(lambda: len(taker.chunks) == seq_len // BS), taker.chunks
        assert _finish(streamed, "r1", ids, seq_len, caches, "torch.bfloat16").ok
    finally:
        t.join(15)
    result = got["r"]
    assert result.ok, result.reason
    kv = result.kv
    assert kv.token_offset == 4 * BS and kv.key_cache[0].shape[0] == 2  # the tail only
    assert [c[:3] for c in taker.chunks] == [(i, i * BS, (i + 1) * BS) for i in range(4)]
    assert [c[3]["seal"] for c in taker.chunks] == [
        [i * BS, (i + 1) * BS, [ids[i]]] for i in range(4)
    ]
    for layer in range(3):
        for which, cache in enumerate(("key_cache", "value_cache")):
            parts = [c[4][which][layer] for c in taker.chunks]
            joined = torch.cat([*parts, getattr(kv, cache)[layer]])
            wanted = want["layer_blocks"][cache][layer]
            assert torch.equal(joined.view(torch.uint8), wanted.view(torch.uint8))
    assert all(name.startswith("omnikv-chunks") == ahead for name in taker.threads)
    assert streamed.wait_delivered("r1", 5).status is SendStatus.DELIVERED
    assert _connector(streamed).pending_keys() == []


@pytest.mark.parametrize("ahead", [True, False], ids=["taken-ahead", "at-the-finish"])
def test_layer_groups_reach_on_chunk_in_order_and_join_to_the_whole_kv(
    make_manager: ManagerFactory, ahead: bool
) -> None:
    """A stream shipped layer group by layer group: each group reaches ``on_chunk`` once, in
    order, with its first layer and its own seal (taken ahead: before the finish); the groups
    plus the returned tail are bit for bit the whole send's KV. Without ``on_chunk`` the
    receive joins them into exactly the whole send's KV."""
    caches, ids, seq_len = _caches(torch.bfloat16), [7, 2, 9, 0, 5], 4 * BS + 2
    groups, name = [(0, 1), (1, 3)], "torch.bfloat16"
    whole, streamed = make_manager("sender"), make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=ahead, recv_timeout=10.0)
    assert _finish(whole, "w", ids, seq_len, caches, name).ok
    want, _ = receiver.receive_kv_cache_for_request("w")
    assert want is not None
    taker = _Taker()
    got: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: got.update(r=receiver.receive_kv_cache_result("r1", on_chunk=taker))
    )
    t.start()
    try:
        _decode_steps(streamed, "r1", ids, seq_len, caches, name, groups, seal=_seal)
        if ahead:  # handed over while the request still decodes
            assert _until(lambda: len(taker.chunks) == 8), taker.chunks
        assert _finish(streamed, "r1", ids, seq_len, caches, name).ok
    finally:
        t.join(15)
    result = got["r"]
    assert result.ok, result.reason
    kv = result.kv
    assert kv.token_offset == 4 * BS and kv.key_cache[0].shape[0] == 2  # the tail only
    order = [
        (2 * i + g, i * BS, (i + 1) * BS, f) for i in range(4) for g, (f, _) in enumerate(groups)
    ]
    assert [(c[0], c[1], c[2], c[5]) for c in taker.chunks] == order
    assert [c[3]["seal"][3] for c in taker.chunks] == [list(g) for g in groups] * 4
    assert taker.layer_counts == [3] * 8  # the stream's layer count, with every group
    for layer in range(3):
        for which, cache in enumerate(("key_cache", "value_cache")):
            parts = [
                c[4][which][layer - c[5]]
                for c in taker.chunks
                if c[5] <= layer < c[5] + len(c[4][which])
            ]
            joined = torch.cat([*parts, getattr(kv, cache)[layer]])
            wanted = want["layer_blocks"][cache][layer]
            assert torch.equal(joined.view(torch.uint8), wanted.view(torch.uint8))
    _decode_steps(streamed, "r2", ids, seq_len, caches, name, groups)
    assert _finish(streamed, "r2", ids, seq_len, caches, name).ok
    joined_kv, _ = receiver.receive_kv_cache_for_request("r2")
    assert joined_kv is not None
    _assert_same({**joined_kv, "request_id": "w"}, want)


def test_a_receiver_that_slices_joins_the_chunks_instead_of_handing_them_over(
    make_manager: ManagerFactory,
) -> None:
    """With a slicer hook the shard is not returned as it came: chunks handed over unsliced
    would not be what the receive returns, so ``on_chunk`` is not used and the KV is whole."""
    caches, ids, seq_len = _caches(), [0, 1, 2], 2 * BS + 1
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=True)
    receiver.kv_payload_slicer = lambda payload: payload
    _decode_steps(sender, "r1", ids, seq_len, caches, "torch.float32")
    assert _finish(sender, "r1", ids, seq_len, caches, "torch.float32").ok
    taker = _Taker()
    result = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert result.ok, result.reason
    assert taker.threads == []
    assert result.kv.token_offset == 0 and result.kv.key_cache[0].shape[0] == seq_len


@pytest.mark.parametrize("raises", [False, True], ids=["refuses", "raises"])
def test_a_chunk_refused_by_on_chunk_refuses_the_receive_and_nothing_after_it_is_handed(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture, raises: bool
) -> None:
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer")
    """The request is still decoding (no tail sent): the refusal ends the receive at once, not
    at its deadline; the finish then learns its stream was refused."""
    caches, ids, seq_len = _caches(), [0, 1, 2, 3], 3 * BS + 1
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=30.0)
    _decode_steps(sender, "r1", ids, seq_len, caches, "torch.float32")
    taker = _Taker(refuse=1, raises=raises)
    t0 = time.monotonic()
    result = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert time.monotonic() - t0 < 10.0  # not the 30 s deadline
    assert result.status is ReceiveStatus.REFUSED, result
    assert ("on_chunk raised RuntimeError" if raises else "not this one") in (result.reason or "")
    assert len(taker.threads) == (1 if raises else 2)  # chunk 0 (taken), chunk 1 (refused)
    assert _until(lambda: _chunk_threads() == [], 2.0), _chunk_threads()
    # the refusal came before the finish and was kept: no tail is published for nobody, the
    # send is refused at once, and chunk 2 (never taken) leaves the pool (issue 39 item 4)
    finish = _finish(sender, "r1", ids, seq_len, caches, "torch.float32")
    assert finish.status is SendStatus.REFUSED and "#c" in (finish.reason or ""), finish
    assert _connector(sender).pending_keys() == []


BROKEN = {
    "index": (lambda: [_chunk(3, 0, 4)], "not chunk 0"),
    "header": (lambda: [_chunk(0, 0, 4)], "does not decode"),
    "group order": (lambda: [_group(0, 0, 4, 1, 2)], "holds layers [1, 2), expected from 0"),
    "group range": (
        lambda: [_group(0, 0, 4, 0, 1), _group(1, 0, 5, 1, 2)],
        "covers [0, 5), expected [0, 4]",
    ),
    "group skips a range": (
        lambda: [_group(0, 0, 4, 0, 1), _group(1, 4, 8, 0, 1)],
        "covers [4, 8), expected [0, 4]",
    ),
    "layer count changes": (
        lambda: [_group(0, 0, 4, 0, 1), _group(1, 0, 4, 1, 2, lc=3)],
        "of a stream of 3 layers, not 2",
    ),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_chunk_ends_the_receive_before_any_tail(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """A chunk that is not the next one (index, or layer group out of order), or does not even
    decode (its header is over the receiver's bound), is a clean ``corrupt`` at once: the
    receive does not wait out its deadline for a tail, and ``on_chunk`` is never called for
    it."""
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer")
    limit = {"max_header_bytes": 64} if broken == "header" else {}
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=30.0, **limit)
    chunks, match = BROKEN[broken]
    made = chunks()
    for i, chunk in enumerate(made):
        _put(_connector(receiver), chunk_key(KEY, i), chunk)
    taker = _Taker()
    t0 = time.monotonic()
    result = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert time.monotonic() - t0 < 10.0  # not the 30 s deadline
    assert result.status is ReceiveStatus.CORRUPT, result
    assert match in (result.reason or "")
    assert len(taker.threads) == len(made) - 1  # every chunk before the broken one
    assert _until(lambda: _chunk_threads() == [], 2.0), _chunk_threads()


def test_a_chunk_that_does_not_hold_its_range_never_reaches_on_chunk(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer.receive")
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=2.0)
    conn = _connector(receiver)
    lying = _piece(3, {"k": "chunk", "id": "s1", "n": 0, "r": [[0, 4]]})  # 3 tokens, says 4
    _put(conn, chunk_key(KEY, 0), lying)
    _put(conn, KEY, _tail(1, [[0, 4]], 6))
    taker = _Taker()
    result = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert result.status is ReceiveStatus.CORRUPT, result
    assert "(3, 2, 4)" in (result.reason or "") or "do not hold its 4" in (result.reason or "")
    assert taker.threads == []


def test_a_replayed_chunk_never_reaches_on_chunk(
    make_manager: ManagerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of a chunk this receiver already took (same sender stamp), published again under
    the key a later receive waits on, is refused by the session guard before ``on_chunk`` sees
    it: nothing of it is written, and the receive ends as refused (a duplicate)."""
    caplog.set_level(logging.CRITICAL, logger="omnikv.transfer")
    receiver = make_manager("receiver", stream_kv=True, recv_timeout=30.0)
    conn = _connector(receiver)
    t = torch.ones(4, 2, 4)

    def stamped(mark: dict[str, Any], seq: int, meta: dict[str, Any]) -> PackedPayload:
        stamp = {"s": "5e55101", "e": 1, "q": seq}
        return PackedPayload("r1", [t, t], [t, t], [0], meta, stream=mark, stamp=stamp)

    chunk = {"k": "chunk", "id": "s1", "n": 0, "r": [[0, 4]]}
    _put(conn, chunk_key(KEY, 0), stamped(chunk, 0, {}))
    _put(conn, KEY, stamped({"k": "tail", "id": "s1", "n": 1, "r": [[0, 4]]}, 1, {"seq_len": 8}))
    taker = _Taker()
    first = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert first.ok, first.reason
    assert [c[0] for c in taker.chunks] == [0]
    _put(conn, chunk_key(KEY, 0), stamped(chunk, 0, {}))  # the replay
    t0 = time.monotonic()
    replayed = receiver.receive_kv_cache_result("r1", on_chunk=taker)
    assert time.monotonic() - t0 < 10.0  # ended by the refusal, not the 30 s deadline
    assert replayed.status is ReceiveStatus.REFUSED, replayed
    assert "duplicate" in (replayed.reason or "")
    assert len(taker.threads) == 1  # the replayed chunk was never handed over


# -- real processes over shared memory -----------------------------------------------------------
_CHILD = """
import sys, torch
from omnikv import OmniKVCacheConfig, OmniKVTransferManager
from omnikv.config import TransferOptions

ns, mode, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
mgr = OmniKVTransferManager(
    OmniKVCacheConfig(
        connector_config={"type": "SharedMemoryConnector", "namespace": ns,
                          "pool_size_bytes": 8 << 20},
        from_stage="stage1", to_stage="stage2", need_send_cache=True,
    ),
    options=TransferOptions(stream_kv=True),
)
g = torch.Generator().manual_seed(1)
caches = [torch.randn((2, 12, 4, 2, 8), generator=g).to(torch.bfloat16) for _ in range(2)]
ids = [5, 3, 8, 1, 0]
for t in range(1, seq_len + 1):
    mgr.stream_kv_blocks("r1", {"block_ids": ids, "seq_len": t}, caches, 4, "bfloat16")
    p = mgr.wait_kv_stream("r1", 30.0)
h = mgr.connector.health()
print("streamed", p.chunks, h["published"], flush=True)
if mode == "abort":
    n = mgr.abort_kv_stream("r1")
    h = mgr.connector.health()
    print("aborted", n, h["published"], h["published_bytes"], flush=True)
elif mode == "finish":
    mgr.handle_finished_requests_kv_transfer(
        {"r1": {"block_ids": ids, "seq_len": seq_len}}, caches, 4, "bfloat16")
    print("sent", mgr.get_send_result("r1").ok, flush=True)
sys.stdin.read()  # until the test closes stdin, or kills this process
mgr.close()
"""


def _expected(seq_len: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn((2, 12, 4, 2, 8), generator=g).to(torch.bfloat16) for _ in range(2)]
    ids = [5, 3, 8, 1, 0]
    return [torch.cat([c[0, b] for b in ids])[:seq_len] for c in caches]


class _Child:
    def __init__(self, namespace: str, mode: str, seq_len: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, namespace, mode, str(seq_len)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []

    def line(self, timeout: float = 60.0) -> list[str]:
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        assert got and got[0], f"child said nothing within {timeout}s (rc={self.proc.poll()})"
        return got[0].split()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(20)


@pytest.fixture
def children() -> Any:
    made: list[_Child] = []
    yield made
    for child in made:
        child.kill()


@pytest.mark.slow
def test_a_stream_across_processes_over_shared_memory(namespace: str, children: Any) -> None:
    from support.stage_sender import stage_receiver

    child = _Child(namespace, "finish", 3 * BS + 2)
    children.append(child)
    assert child.line()[:2] == ["streamed", "3"]
    assert child.line() == ["sent", "True"]
    receiver = stage_receiver(namespace, 10.0)
    try:
        got, _ = receiver.receive_kv_cache_for_request("r1")
        assert got is not None, receiver.get_receive_result("r1")
        for layer, want in enumerate(_expected(3 * BS + 2)):
            assert torch.equal(
                got["layer_blocks"]["key_cache"][layer].view(torch.uint8), want.view(torch.uint8)
            )
        assert got["metadata"]["seq_len"] == 3 * BS + 2
    finally:
        receiver.close()
    child.close()
    assert child.proc.returncode == 0


@pytest.mark.slow
def test_an_aborted_stream_leaves_the_shared_pool_empty(namespace: str, children: Any) -> None:
    child = _Child(namespace, "abort", 2 * BS + 1)
    children.append(child)
    assert child.line() == ["streamed", "2", "2"]
    assert child.line() == ["aborted", "2", "0", "0"]
    child.close()


@pytest.mark.slow
def test_a_producer_killed_mid_stream_gives_a_clean_miss(namespace: str, children: Any) -> None:
    from support.stage_sender import stage_receiver

    child = _Child(namespace, "stream", 3 * BS + 1)  # chunks published, never the tail
    children.append(child)
    assert child.line()[:2] == ["streamed", "3"]
    receiver = stage_receiver(namespace, 2.0)
    try:
        results: list[Any] = []
        waiter = threading.Thread(
            target=lambda: results.append(receiver.receive_kv_cache_result("r1"))
        )
        t0 = time.monotonic()
        waiter.start()
        child.kill()
        waiter.join(10)
        assert not waiter.is_alive() and time.monotonic() - t0 < 2.0 + 1.5
        result = results[0]
        assert result.status in (ReceiveStatus.TIMEOUT, ReceiveStatus.PEER_GONE), result
        assert result.kv is None
        health = receiver.connector.health()
        assert health["awaiting_verdicts"] == 0  # nothing taken and held
    finally:
        receiver.close()
