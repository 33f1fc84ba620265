"""KV moved along a reshard plan: each source rank sends each target rank exactly its piece.

The plan (:func:`omnikv.topology.reshard.plan_reshard`) is computed on every rank from the two
placements and the request's token count, so nobody negotiates: a source rank puts one payload
per target it serves (the KV format of :mod:`omnikv.wire`, one copy into the connector's slot),
under :func:`piece_key`; a target rank waits for one payload per source in its piece list,
checks each against the plan (its box, layer count, shapes, dtype: a payload is hostile until
it matches what the plan says it must be) and copies it into its own KV (one copy). The stage
layouts that divide (TP 2 -> 4, 4 -> 2) keep using the rank-aware keys of the seed path; this
path serves every other placement pair (any TP to any TP, TP x PP, SP, CFG) and any target rank
that receives its own pieces directly instead of through its stage's leader.

The local KV of a rank is per layer of its box: ``[tokens, heads, head_dim]`` tensors covering
exactly its box (``Placement.box``), K and V alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnikv.connectors.base import OmniConnectorBase
from omnikv.deadline import remaining
from omnikv.errors import DecodeError, OmniKVError, ReceiveTimeout
from omnikv.topology.reshard import Box, Piece, Placement, ReshardPlan, plan_reshard
from omnikv.wire.decode import decode_kv
from omnikv.wire.encode import PackedPayload

__all__ = ["PieceReceiver", "PieceSender", "RankKV", "piece_key", "rank_kv_of"]

logger = logging.getLogger(__name__)

#: The header metadata key that carries a piece's box ``[l0, l1, h0, h1, t0, t1]``.
PIECE_META = "reshard_piece"


def piece_key(request_id: str, from_stage: str, to_stage: str, source: int, target: int) -> str:
    """``omni_{from}_to_{to}_kv_piece_{source}_{target}_{request_id}``: one payload per
    source-target pair; never equal to a legacy key (``..._kv_cache_...``) of any id."""
    return f"omni_{from_stage}_to_{to_stage}_kv_piece_{source}_{target}_{request_id}"


def _box_list(box: Box) -> list[int]:
    return [*box.layers, *box.heads, *box.tokens]


def _local(t: torch.Tensor, box: Box, within: Box) -> torch.Tensor:
    """The ``[tokens, heads, dim]`` view of ``box`` inside a layer tensor covering ``within``."""
    t0, h0 = box.tokens[0] - within.tokens[0], box.heads[0] - within.heads[0]
    return t[t0 : t0 + box.tokens[1] - box.tokens[0], h0 : h0 + box.heads[1] - box.heads[0]]


@dataclass
class RankKV:
    """One rank's KV of one request: per layer of ``box``, ``[tokens, heads, head_dim]``."""

    box: Box
    key_cache: list[torch.Tensor]
    value_cache: list[torch.Tensor]


def _check_covers(kv: RankKV, what: str) -> None:
    """``ValueError`` unless ``kv`` holds one K and one V ``[tokens, heads, dim]`` tensor per
    layer of its box, of exactly the box's tokens and heads, K and V alike: slicing anything
    else would put a piece of the wrong heads or too few tokens."""
    b = kv.box
    layers = b.layers[1] - b.layers[0]
    extent = (b.tokens[1] - b.tokens[0], b.heads[1] - b.heads[0])
    if len(kv.key_cache) != layers or len(kv.value_cache) != layers:
        raise ValueError(
            f"{what} has {len(kv.key_cache)} K and {len(kv.value_cache)} V layers, its box {layers}"
        )
    for i, (k, v) in enumerate(zip(kv.key_cache, kv.value_cache, strict=True)):
        if k.dim() != 3 or tuple(k.shape[:2]) != extent or k.shape != v.shape:
            raise ValueError(
                f"{what}: layer {i} K {tuple(k.shape)}, V {tuple(v.shape)}; its box needs"
                f" [tokens, heads, head_dim] = [{extent[0]}, {extent[1]}, d] for both"
            )


class _RankSide:
    """What both sides of a reshard hold: the connector, both placements, this rank (checked
    against its own side's placement: ``ValueError`` outside it) and the stage pair."""

    def __init__(
        self,
        connector: OmniConnectorBase,
        source: Placement,
        target: Placement,
        rank: int,
        stages: tuple[str, str],
    ) -> None:
        self._own_placement(source, target).coords(rank)
        self._connector = connector
        self.source, self.target, self.rank = source, target, rank
        self._stages = stages

    @staticmethod
    def _own_placement(source: Placement, target: Placement) -> Placement:
        raise NotImplementedError


class PieceSender(_RankSide):
    """A source rank's side of a reshard: created by the stage with its connector, both
    placements, its rank and the stage pair; :meth:`send` is called once per request."""

    @staticmethod
    def _own_placement(source: Placement, target: Placement) -> Placement:
        return source

    def plan(self, num_tokens: int) -> ReshardPlan:
        return plan_reshard(self.source, self.target, num_tokens)

    def send(self, request_id: str, kv: RankKV, num_tokens: int, *, deadline: float) -> int:
        """Put this rank's piece for every target that takes one from it; the bytes put.

        ``kv`` must cover exactly this rank's box for ``num_tokens`` tokens, one
        ``[tokens, heads, head_dim]`` K and V per layer (else ``ValueError``, nothing put).
        A failed put raises the connector's error after the pieces before it were put.
        """
        box = self.source.box(self.rank, num_tokens)
        if kv.box != box:
            raise ValueError(f"rank {self.rank}'s KV covers {kv.box}, its placement says {box}")
        _check_covers(kv, f"rank {self.rank}'s KV")
        total = 0
        for piece in self.plan(num_tokens).for_source(self.rank):
            total += self._put(request_id, piece, kv, num_tokens, deadline)
        return total

    def _put(
        self, request_id: str, piece: Piece, kv: RankKV, num_tokens: int, deadline: float
    ) -> int:
        first = kv.box.layers[0]
        layers = range(piece.box.layers[0] - first, piece.box.layers[1] - first)
        keys = [_local(kv.key_cache[i], piece.box, kv.box) for i in layers]
        values = [_local(kv.value_cache[i], piece.box, kv.box) for i in layers]
        meta = {PIECE_META: _box_list(piece.box), "num_tokens": num_tokens}
        packed = PackedPayload(request_id, keys, values, metadata=meta)
        key = piece_key(request_id, *self._stages, piece.source, piece.target)
        ok, size, _ = self._connector.put_packed(
            *self._stages, key, packed.nbytes, packed, deadline=deadline
        )
        if not ok:
            raise OmniKVError(f"put of reshard piece {key} failed")
        logger.debug("reshard piece %s: %d bytes", key, size)
        return int(size)


class PieceReceiver(_RankSide):
    """A target rank's side of a reshard: created by the stage with its connector, both
    placements, its rank and the stage pair; :meth:`receive` assembles one request's KV."""

    @staticmethod
    def _own_placement(source: Placement, target: Placement) -> Placement:
        return target

    def receive(
        self,
        request_id: str,
        num_tokens: int,
        *,
        head_dim: int,
        dtype: torch.dtype,
        deadline: float,
    ) -> RankKV:
        """Wait for every piece this rank needs until ``deadline`` and assemble its KV.

        Raises :class:`~omnikv.errors.ReceiveTimeout` naming the first missing piece's key,
        and :class:`~omnikv.errors.DecodeError` for a piece that is not what the plan says it
        must be (box, layers, shapes, dtype); every buffer taken is released either way.
        """
        box = self.target.box(self.rank, num_tokens)
        shape = (box.tokens[1] - box.tokens[0], box.heads[1] - box.heads[0], head_dim)
        layers = box.layers[1] - box.layers[0]
        t_start = time.monotonic()
        out = RankKV(
            box,
            [torch.empty(shape, dtype=dtype) for _ in range(layers)],
            [torch.empty(shape, dtype=dtype) for _ in range(layers)],
        )
        for piece in plan_reshard(self.source, self.target, num_tokens).for_target(self.rank):
            key = piece_key(request_id, *self._stages, piece.source, piece.target)
            buf = None
            if remaining(deadline) > 0:
                buf = self._connector.wait(*self._stages, key, deadline=deadline)
            if buf is None:
                waited = time.monotonic() - t_start
                raise ReceiveTimeout(request_id, waited, f"reshard piece {key} missing")
            try:
                self._place(key, buf.tensor, piece, out, head_dim, dtype)
            finally:
                buf.release()
        return out

    @staticmethod
    def _place(
        key: str,
        payload: torch.Tensor,
        piece: Piece,
        out: RankKV,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        decoded = decode_kv(payload, copy=False)
        b = piece.box
        if decoded.metadata.get(PIECE_META) != _box_list(b):
            raise DecodeError(
                f"reshard piece {key}: box {decoded.metadata.get(PIECE_META)!r:.80}"
                f" is not the planned {_box_list(b)}"
            )
        want = (b.tokens[1] - b.tokens[0], b.heads[1] - b.heads[0], head_dim)
        if decoded.num_layers != b.layers[1] - b.layers[0]:
            raise DecodeError(
                f"reshard piece {key}: {decoded.num_layers} layers, planned"
                f" {b.layers[1] - b.layers[0]}"
            )
        first = out.box.layers[0]
        checked: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, (k, v) in enumerate(zip(decoded.key_cache, decoded.value_cache, strict=True)):
            for name, t in (("K", k), ("V", v)):
                if t is None or tuple(t.shape) != want or t.dtype != dtype:
                    got = None if t is None else (tuple(t.shape), t.dtype)
                    raise DecodeError(
                        f"reshard piece {key}: layer {i} {name} is {got}, planned {(want, dtype)}"
                    )
            assert k is not None and v is not None
            checked.append((k, v))
        for i, (k, v) in enumerate(checked):  # written only once every layer passed
            layer = b.layers[0] + i - first
            _local(out.key_cache[layer], b, out.box).copy_(k)
            _local(out.value_cache[layer], b, out.box).copy_(v)


def rank_kv_of(
    full_key: Sequence[torch.Tensor], full_value: Sequence[torch.Tensor], box: Box
) -> RankKV:
    """A rank's :class:`RankKV` cut from a whole request's per-layer ``[tokens, heads, dim]``
    K and V (tests, benchmarks and single-process stages)."""
    whole = Box((0, len(full_key)), (0, int(full_key[0].shape[1])), (0, int(full_key[0].shape[0])))
    layers = range(*box.layers)
    return RankKV(
        box,
        [_local(full_key[i], box, whole).contiguous() for i in layers],
        [_local(full_value[i], box, whole).contiguous() for i in layers],
    )
