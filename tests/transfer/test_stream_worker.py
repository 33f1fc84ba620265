"""The stream worker: ``stream_kv_blocks`` hands its step over and returns; the copy, seal and
put run behind it, in order, with back-pressure, and a finish or an abort settles what is
pending.

A seal that holds the worker inside a step (it is called on the worker, before the chunk is
made) stands for a slow copy; LocalConnector records what was published and in which order.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from conftest import ManagerFactory, make_paged_caches
from omnikv.connectors.local import LocalConnector
from omnikv.transfer.send import SendStatus
from omnikv.transfer.stream.manifest import chunk_parts

BS = 4
F32 = "torch.float32"
IDS = [7, 2, 9, 0, 5]


def _caches() -> list[torch.Tensor]:
    return make_paged_caches(layers=3, blocks=12, block_size=BS, heads=2, dim=8)


def _entry(seq_len: int, ids: list[int] = IDS) -> dict[str, Any]:
    return {"block_ids": ids, "seq_len": seq_len}


class _Gate:
    """A seal that holds the stream worker inside a step of ``rid`` until :meth:`open` (at
    most 10 s): the step's copy and put wait behind it; counts the chunks it sealed."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()
        self.sealed: list[tuple[int, int]] = []

    def __call__(self, start: int, stop: int, ids: Any, *, layers: Any = None) -> dict[str, Any]:
        self.entered.set()
        assert self._open.wait(10.0), "the test never opened the gate"
        self.sealed.append((start, stop))
        return {}

    def open(self) -> None:
        self._open.set()


class _Recorder:
    """Records each chunk key the connector publishes, in order (then puts it)."""

    def __init__(self, conn: LocalConnector, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        put = conn.put_packed

        def recording(*args: Any, **kw: Any) -> Any:
            self.keys.append(str(args[2]))
            return put(*args, **kw)

        monkeypatch.setattr(conn, "put_packed", recording)

    def chunks(self, base: str) -> list[int]:
        """The chunk numbers published for key ``base``, in order."""
        out = []
        for key in self.keys:
            parts = chunk_parts(key)
            if parts is not None and parts[0].endswith(base):
                out.append(parts[1])
        return out


def _connector(mgr: Any) -> LocalConnector:
    conn = mgr.connector
    assert isinstance(conn, LocalConnector)
    return conn


def _same_kv(got: dict[str, Any] | None, want: dict[str, Any] | None) -> None:
    assert got is not None and want is not None
    for cache in ("key_cache", "value_cache"):
        for x, y in zip(got["layer_blocks"][cache], want["layer_blocks"][cache], strict=True):
            assert x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.fixture
def whole_kv(make_manager: ManagerFactory) -> Iterator[Any]:
    """``whole_kv(rid, seq_len)``: what a whole (not streamed) send of ``IDS`` delivers."""
    caches = _caches()
    sender, receiver = make_manager("sender"), make_manager("receiver")

    def get(rid: str, seq_len: int) -> dict[str, Any] | None:
        assert sender.edge.send(rid, _entry(seq_len), _kv(caches)).ok
        return receiver.receive_kv_cache_for_request(rid)[0]

    yield get


def _kv(caches: list[torch.Tensor]) -> Any:
    from omnikv.transfer.edge import KVCaches

    return KVCaches(caches, BS, F32)


def test_a_step_returns_while_the_worker_is_busy_and_ships_behind_it(
    make_manager: ManagerFactory,
) -> None:
    """The worker held inside r1's step: r2's step still returns at once (nothing of it runs on
    the caller's thread), pending; once the worker goes on, both ship and finish whole."""
    caches, gate = _caches(), _Gate()
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    first = sender.stream_kv_blocks("r1", _entry(2 * BS), caches, BS, F32, seal=gate)
    assert first.reason is None and first.new == 0 and first.pending == 1
    assert gate.entered.wait(10.0)
    p = sender.stream_kv_blocks("r2", _entry(3 * BS), caches, BS, F32)
    assert p.reason is None and (p.new, p.pending) == (0, 1)
    assert _connector(sender).pending_keys() == []  # nothing published yet
    gate.open()
    done = sender.wait_kv_stream("r2", 10.0)
    assert (done.new, done.chunks, done.pending) == (3 * BS, 1, 0)
    assert sender.wait_kv_stream("r1", 10.0).new == 2 * BS
    for rid, n in (("r1", 2 * BS + 1), ("r2", 3 * BS)):
        res = sender.edge.send(rid, _entry(n), _kv(caches))
        assert res.ok and len([k for k in res.keys if "#c" in k]) == 1
        assert receiver.receive_kv_cache_result(rid).ok


def test_an_aborted_streams_pending_work_never_ships(
    make_manager: ManagerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Abort with r1's step running and another queued: the abort waits for the running one
    (its blocks are read before the abort returns), the queued one never runs, and the chunk
    the running step published leaves the pool; r2 is untouched."""
    caches, gate = _caches(), _Gate()
    sender = make_manager("sender", stream_kv=True)
    conn = _connector(sender)
    puts = _Recorder(conn, monkeypatch)
    sender.stream_kv_blocks("r1", _entry(BS), caches, BS, F32, seal=gate)
    assert gate.entered.wait(10.0)
    queued = sender.stream_kv_blocks("r1", _entry(3 * BS), caches, BS, F32, seal=gate)
    assert queued.pending == 2  # one running, one queued
    sender.stream_kv_blocks("r2", _entry(2 * BS), caches, BS, F32)
    dropped: list[int] = []
    abort = threading.Thread(target=lambda: dropped.append(sender.abort_kv_stream("r1")))
    abort.start()
    abort.join(0.3)
    assert abort.is_alive(), "the abort returned while r1's step was still reading its blocks"
    gate.open()
    abort.join(10.0)
    assert not abort.is_alive() and dropped == [1]  # the running step's chunk, dropped
    assert gate.sealed == [(0, BS)]  # the queued step never ran
    assert puts.chunks("r1") == [0]
    assert sender.wait_kv_stream("r2", 10.0).chunks == 1
    left = conn.pending_keys()
    assert len(left) == 1 and "r2" in left[0] and "r1" not in left[0], left
    assert sender.kv_stream_chunks("r1") == []


@pytest.mark.parametrize("groups", [None, [(0, 1), (1, 3)]], ids=["whole", "groups"])
def test_order_is_kept_and_a_finish_after_pending_steps_gives_the_same_bytes(
    make_manager: ManagerFactory,
    monkeypatch: pytest.MonkeyPatch,
    whole_kv: Any,
    groups: list[tuple[int, int]] | None,
) -> None:
    """Steps of two requests pile up behind a held worker, then the finish comes with some of
    them still queued: each request's chunks were published in order (0, 1, 2, ...), the
    finish lists exactly those and the receiver gets, bit for bit, what a whole send gives."""
    import omnikv.transfer.stream.sending as stream_mod

    monkeypatch.setattr(stream_mod, "DEFAULT_MAX_QUEUED", 1000)  # (no back-pressure here)
    caches, gate = _caches(), _Gate()
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    puts = _Recorder(_connector(sender), monkeypatch)
    seq_len = len(IDS) * BS - 1
    for t in range(1, seq_len + 1):
        for rid in ("a", "b"):
            for layers in groups or [None]:
                seal = gate if (rid, t) == ("a", BS) else None
                p = sender.stream_kv_blocks(
                    rid, _entry(t), caches, BS, F32, seal=seal, layers=layers
                )
                assert p.reason is None, p
        if t == BS:
            assert gate.entered.wait(10.0)
    gate.open()
    for rid in ("a", "b"):
        res = sender.edge.send(rid, _entry(seq_len), _kv(caches))
        assert res.ok, res.reason
        shipped = [chunk_parts(k) for k in res.keys if chunk_parts(k) is not None]
        assert [n for _, n in shipped] == list(range(len(shipped)))
        assert puts.chunks(rid)[: len(shipped)] == list(range(len(shipped)))
        got = receiver.receive_kv_cache_for_request(rid)[0]
        _same_kv(got, whole_kv(f"whole-{rid}", seq_len))
        assert sender.wait_delivered(rid, 5).status is SendStatus.DELIVERED
    assert _connector(receiver).pending_keys() == []


def test_back_pressure_refuses_steps_beyond_the_bound_and_never_blocks(
    make_manager: ManagerFactory, monkeypatch: pytest.MonkeyPatch, whole_kv: Any
) -> None:
    """At most ``DEFAULT_MAX_QUEUED`` steps wait (here 2): a new one is refused at once (the
    caller is not blocked; a refused first layer group refuses its step's later groups), a
    request's newer whole step replaces its queued one; every request still finishes bit for
    bit, the refused ones' blocks going with a later step or the tail."""
    import omnikv.transfer.stream.sending as stream_mod

    monkeypatch.setattr(stream_mod, "DEFAULT_MAX_QUEUED", 2)
    caches, gate = _caches(), _Gate()
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    sender.stream_kv_blocks("r1", _entry(BS), caches, BS, F32, seal=gate)
    assert gate.entered.wait(10.0)  # running: not queued
    for rid in ("r2", "r3"):
        assert sender.stream_kv_blocks(rid, _entry(BS), caches, BS, F32).reason is None
    full = sender.stream_kv_blocks("r4", _entry(2 * BS), caches, BS, F32)
    assert full.reason is not None and full.reason.startswith("back-pressure: 2 stream steps")
    again = sender.stream_kv_blocks("r2", _entry(2 * BS), caches, BS, F32)
    assert again.reason is None and again.pending == 1  # replaced its queued step
    g0 = sender.stream_kv_blocks("r5", _entry(BS), caches, BS, F32, layers=(0, 1))
    g1 = sender.stream_kv_blocks("r5", _entry(BS), caches, BS, F32, layers=(1, 3))
    assert g0.reason is not None and g0.reason.startswith("back-pressure")
    assert g1.reason == "its step's first layer group was not queued"
    gate.open()
    assert sender.wait_kv_stream("r2", 10.0).new == 2 * BS  # one chunk: the newer step's
    chunks = {"r1": 1, "r2": 1, "r3": 1, "r4": 0, "r5": 0}
    for rid, n in chunks.items():
        res = sender.edge.send(rid, _entry(2 * BS + 1), _kv(caches))
        assert res.ok and len([k for k in res.keys if "#c" in k]) == n, (rid, res.keys)
        got = receiver.receive_kv_cache_for_request(rid)[0]
        _same_kv(got, whole_kv(f"whole-{rid}", 2 * BS + 1))


def test_a_failure_in_the_background_reaches_the_next_progress(
    make_manager: ManagerFactory, monkeypatch: pytest.MonkeyPatch, whole_kv: Any
) -> None:
    """What goes wrong on the worker is never lost: a seal that raises, a put the connector
    refuses and a step that raises (a bug) each come back in the request's next progress (and
    from ``wait_kv_stream``); the finish still delivers the whole KV."""
    caches = _caches()
    sender = make_manager("sender", stream_kv=True)
    receiver = make_manager("receiver")
    conn = _connector(sender)

    def bad_seal(start: int, stop: int, ids: Any) -> dict[str, Any]:
        raise ValueError("no key")

    assert sender.stream_kv_blocks("s", _entry(BS), caches, BS, F32, seal=bad_seal).reason is None
    assert sender.edge.wait_streams(10.0)  # (ran; its outcome not taken yet)
    told = sender.stream_kv_blocks("s", _entry(BS + 1), caches, BS, F32)
    assert "the stream's seal raised ValueError: no key" in (told.reason or "")

    monkeypatch.setattr(conn, "put_packed", lambda *a, **k: (False, 0, {}))
    sender.stream_kv_blocks("p", _entry(BS), caches, BS, F32)
    refused = sender.wait_kv_stream("p", 10.0)
    assert "chunk 0 not published: " in (refused.reason or "") and refused.chunks == 0
    monkeypatch.undo()

    from omnikv.transfer.send import KVSender

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(KVSender, "plan_blocks", broken)
    sender.stream_kv_blocks("b", _entry(BS), caches, BS, F32)
    assert sender.wait_kv_stream("b", 10.0).reason == "stream step raised RuntimeError: a bug"
    monkeypatch.undo()
    for rid in ("s", "p", "b"):
        assert sender.edge.send(rid, _entry(2 * BS + 1), _kv(caches)).ok
        got = receiver.receive_kv_cache_for_request(rid)[0]
        _same_kv(got, whole_kv(f"whole-{rid}", 2 * BS + 1))


def test_a_stage_that_only_receives_starts_no_stream_worker(make_manager: ManagerFactory) -> None:
    """``stream_kv`` on a receiving stage assembles streams in its receiver: no send thread, and
    a stream step there ships nothing and says why."""
    before = {t.ident for t in threading.enumerate() if t.name == "omnikv-stream-send"}
    receiver = make_manager("receiver", stream_kv=True)
    started = {t.ident for t in threading.enumerate() if t.name == "omnikv-stream-send"}
    assert started == before
    progress = receiver.stream_kv_blocks("r1", _entry(2 * BS), _caches(), BS, F32)
    assert progress.new == 0 and progress.reason == "this stage sends no KV"
    sender = make_manager("sender", stream_kv=True)
    assert sender.stream_kv_blocks("r1", _entry(2 * BS), _caches(), BS, F32).reason is None
