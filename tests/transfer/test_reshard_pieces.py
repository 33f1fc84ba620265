"""A target rank takes only the pieces its plan names, each checked before anything is written:
a piece with another box, another layer count, shape or dtype is a ``DecodeError``; a missing
piece is a ``ReceiveTimeout`` naming its key. One shared-memory connector in this process (its
local link), so every put and take goes through the real pool."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from omnikv.connectors.shm.connector import SharedMemoryConnector
from omnikv.errors import DecodeError, ReceiveTimeout
from omnikv.topology.reshard import Placement
from omnikv.transfer.reshard import PieceReceiver, PieceSender, piece_key, rank_kv_of
from omnikv.wire.encode import PackedPayload

LAYERS, HEADS, DIM, TOKENS = 2, 6, 4, 9
STAGES = ("0", "1")


@pytest.fixture
def conn() -> Iterator[SharedMemoryConnector]:
    c = SharedMemoryConnector({"namespace": f"pieces-{uuid.uuid4().hex[:8]}", "linger_s": 0})
    try:
        yield c
    finally:
        c.close(linger=False)


def _kv() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(TOKENS, HEADS, DIM, generator=g) for _ in range(LAYERS)]
    return keys, [k * 2 for k in keys]


def test_three_to_two_in_one_process(conn: SharedMemoryConnector) -> None:
    source, target = Placement(LAYERS, HEADS, tp=3), Placement(LAYERS, HEADS, tp=2)
    keys, values = _kv()
    deadline = time.monotonic() + 10
    for r in range(3):
        mine = rank_kv_of(keys, values, source.box(r, TOKENS))
        PieceSender(conn, source, target, r, STAGES).send("a", mine, TOKENS, deadline=deadline)
    for r in range(2):
        got = PieceReceiver(conn, source, target, r, STAGES).receive(
            "a", TOKENS, head_dim=DIM, dtype=torch.float32, deadline=deadline
        )
        want = rank_kv_of(keys, values, target.box(r, TOKENS))
        assert all(torch.equal(a, b) for a, b in zip(got.key_cache, want.key_cache, strict=True))
        assert all(
            torch.equal(a, b) for a, b in zip(got.value_cache, want.value_cache, strict=True)
        )


def _forge(
    conn: SharedMemoryConnector,
    rid: str,
    box: list[int],
    shape: tuple[int, ...],
    layers: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Put, under source 0 -> target 0's key, a payload that claims ``box``."""
    ts = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    packed = PackedPayload(rid, ts, ts, metadata={"reshard_piece": box, "num_tokens": TOKENS})
    key = piece_key(rid, *STAGES, 0, 0)
    conn.put_packed(*STAGES, key, packed.nbytes, packed, deadline=time.monotonic() + 5)


@pytest.mark.parametrize(
    ("box", "shape", "layers", "dtype", "match"),
    [
        ([0, 2, 0, 3, 0, 8], (TOKENS, 3, DIM), 2, torch.float32, "is not the planned"),
        ([0, 2, 0, 3, 0, TOKENS], (TOKENS, 3, DIM), 1, torch.float32, "1 layers"),
        ([0, 2, 0, 3, 0, TOKENS], (TOKENS, 2, DIM), 2, torch.float32, "planned"),
        ([0, 2, 0, 3, 0, TOKENS], (TOKENS, 3, DIM), 2, torch.float16, "planned"),
    ],
)
def test_a_piece_unlike_its_plan_is_refused(
    conn: SharedMemoryConnector,
    box: list[int],
    shape: tuple[int, ...],
    layers: int,
    dtype: torch.dtype,
    match: str,
) -> None:
    # TP 2 -> 1 over 6 heads: target 0 takes heads 0..3 from source 0, 3..6 from source 1
    source, target = Placement(LAYERS, HEADS, tp=2), Placement(LAYERS, HEADS)
    _forge(conn, "f", box, shape, layers, dtype)
    receiver = PieceReceiver(conn, source, target, 0, STAGES)
    with pytest.raises(DecodeError, match=match):
        receiver.receive(
            "f", TOKENS, head_dim=DIM, dtype=torch.float32, deadline=time.monotonic() + 5
        )
    assert conn.health()["held_here"] == 0  # the taken buffer was released


def test_a_missing_piece_names_its_key(conn: SharedMemoryConnector) -> None:
    source, target = Placement(LAYERS, HEADS, tp=2), Placement(LAYERS, HEADS)
    receiver = PieceReceiver(conn, source, target, 0, STAGES)
    with pytest.raises(ReceiveTimeout, match="kv_piece_0_0_m"):
        receiver.receive(
            "m", TOKENS, head_dim=DIM, dtype=torch.float32, deadline=time.monotonic() + 0.3
        )
