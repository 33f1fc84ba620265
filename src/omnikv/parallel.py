"""Parallel state of a receiving stage: process groups, receive roles, bounded group operations.

Who uses it: the manager builds a :class:`TopoConfig` from a :class:`ParallelContext` on first
use (``OmniKVTransferManager.topo_config``) and :mod:`omnikv.distribution` moves KV over the
groups it names. Without an injected context, :meth:`ParallelContext.default` takes the groups
from the host framework, else the ``torch.distributed`` world, else one rank
(:mod:`omnikv.parallel_discovery`). Guarantees:

* every group operation here is bounded by an absolute monotonic deadline (gloo per-operation
  timeouts), so no rank waits on a dead or hung peer past its deadline;
* a group whose operation timed out or failed is marked broken in its :class:`ParallelContext`
  (gloo closes the pairs of a timed-out operation, and peers may be out of step), and every later
  operation on it fails at once with :class:`DistributionError` until
  :meth:`ParallelContext.reset_broken` (after the job rebuilt its groups) or a new context;
* agreement is one ``all_reduce(MIN)`` of a small int64 vector: a status flag, the request's hash
  (and its negation, so a mismatch between ranks shows), the remaining deadline in milliseconds
  and, for data phases, the leader's message size per rank.

No pickle and no ``*_object_list`` anywhere: only tensor collectives.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from omnikv.deadline import remaining
from omnikv.errors import OmniKVError

__all__ = [
    "Agreement",
    "DistributionError",
    "GroupLink",
    "ParallelContext",
    "ReceiveRole",
    "TopoConfig",
    "agree",
    "build_topo_config",
    "decide_role",
    "request_key",
]

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup
_BIG = 1 << 62
_MIN_OP_TIMEOUT_S = 0.05


class DistributionError(OmniKVError):
    """A group operation failed or timed out; the group is marked broken."""


class ReceiveRole(str, Enum):
    """How a receiving rank gets its KV (reference §5.1)."""

    LOCAL = "local"  # pulls its own shard from the connector; no intra-stage distribution
    LEADER = "leader"  # pulls from the connector, then distributes to followers
    FOLLOWER = "follower"  # never pulls; receives from its leader over a group


@dataclass(eq=False)
class ParallelContext:
    """The process groups of this rank's stage, injectable (tests, custom launchers).

    ``world_group``: all ranks of the stage (``None``: single rank). ``cfg_group`` /
    ``sp_group``: this rank's CFG-parallel and sequence-parallel groups (``None``: size 1).
    ``tp_group``: the group whose ranks must agree in pure TP (default: ``world_group``).
    ``local_rank`` / ``tp_size`` satisfy the manager's ``RankInfo`` protocol. ``grace_s`` is the
    small constant a follower waits beyond the receive timeout (its leader first spends up to the
    receive timeout pulling). ``max_message_bytes`` bounds what a follower allocates.
    ``buffer_cache``: how many message buffers (already faulted in) this rank keeps for reuse;
    a buffer is reused only once nothing references it any more (0: always allocate).
    ``source``: where the groups came from (``"injected"``, or what :meth:`default` found).
    """

    world_group: ProcessGroup | None = None
    cfg_group: ProcessGroup | None = None
    sp_group: ProcessGroup | None = None
    tp_group: ProcessGroup | None = None
    local_rank: int = 0
    tp_size: int = 1
    grace_s: float = 2.0
    max_message_bytes: int = 1 << 36
    buffer_cache: int = 2
    source: str = "injected"
    _buffers: list[tuple[torch.Tensor, int]] = field(default_factory=list, repr=False)
    _broken: dict[int, str] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def default(cls, local_rank: int | None = None, tp_size: int | None = None) -> ParallelContext:
        """The parallel state discovered from the host (no context was injected).

        Groups: vllm-omni's diffusion parallel state > the initialised ``torch.distributed``
        world > a single rank; TP group, rank and size: vLLM's TP group > ``LOCAL_RANK`` > 0
        (:mod:`omnikv.parallel_discovery`). ``local_rank`` / ``tp_size`` override the discovered
        values (the manager passes the ones its topology already uses). ``source`` says where
        each part came from.
        """
        from omnikv.parallel_discovery import discover_groups, discover_tp

        groups, tp = discover_groups(), discover_tp()
        return cls(
            world_group=groups.world,
            cfg_group=groups.cfg,
            sp_group=groups.sp,
            tp_group=tp.group,
            local_rank=tp.local_rank if local_rank is None else local_rank,
            tp_size=tp.tp_size if tp_size is None else tp_size,
            source=f"groups: {groups.source}; tp: {tp.source}",
        )

    def message_buffer(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor of ``nbytes``: a cached buffer nobody else holds, or a new one.

        Called by :mod:`omnikv.distribution` for every message it packs or receives. Decoded
        payloads are views into the buffer, so a buffer whose memory is still referenced (its
        storage's use count is above the one it had when cached) is never handed out again.
        """
        with self._lock:
            for i, (buf, base) in enumerate(self._buffers):
                if buf.numel() >= nbytes and _use_count(buf) == base:
                    self._buffers.append(self._buffers.pop(i))
                    return buf[:nbytes]
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            if self.buffer_cache > 0 and _use_count(fresh) >= 0:
                self._buffers.append((fresh, _use_count(fresh)))
                while len(self._buffers) > self.buffer_cache:
                    self._buffers.pop(0)
            return fresh[:nbytes]  # a view: holding it raises the storage's use count

    def broken_reason(self, group: ProcessGroup) -> str | None:
        with self._lock:
            return self._broken.get(id(group))

    def mark_broken(self, group: ProcessGroup, reason: str) -> None:
        with self._lock:
            self._broken.setdefault(id(group), reason)

    def reset_broken(self) -> None:
        """Forget broken groups (call after the job rebuilt or re-synchronised them)."""
        with self._lock:
            self._broken.clear()


def _use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (-1 where torch does not expose it: no caching then)."""
    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:
        return -1
    try:
        return int(fn(t.untyped_storage()._cdata))
    except Exception:
        return -1


def _rank_size(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return int(group.rank()), int(group.size())


@dataclass(frozen=True)
class TopoConfig:
    """Snapshot of this rank's role and groups (the reference's ``_TransferTopoConfig``)."""

    role: ReceiveRole
    tp_active: bool
    cfg_size: int = 1
    cfg_rank: int = 0
    cfg_group: ProcessGroup | None = None
    sp_size: int = 1
    sp_rank: int = 0
    sp_group: ProcessGroup | None = None
    world: ProcessGroup | None = None
    world_size: int = 1
    world_rank: int = 0
    context: ParallelContext | None = None

    @property
    def is_leader(self) -> bool:
        return self.role is ReceiveRole.LEADER

    @property
    def is_follower(self) -> bool:
        return self.role is ReceiveRole.FOLLOWER

    @property
    def is_local(self) -> bool:
        return self.role is ReceiveRole.LOCAL

    @property
    def cfg_active(self) -> bool:
        return self.cfg_size > 1

    @property
    def sp_active(self) -> bool:
        return self.sp_size > 1


def decide_role(
    *,
    tp_active: bool,
    world_size: int,
    world_rank: int,
    cfg_size: int = 1,
    cfg_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> ReceiveRole:
    """The reference's decision table (§5.2), as a pure function.

    World ≤ 1 → LOCAL; pure TP (no CFG, no SP) → LOCAL; TP with CFG or SP → LEADER iff CFG rank
    and SP rank are 0 (one leader per TP rank); no TP, world > 1 → LEADER iff world rank 0.
    """
    if world_size <= 1:
        return ReceiveRole.LOCAL
    if tp_active:
        if cfg_size <= 1 and sp_size <= 1:
            return ReceiveRole.LOCAL
        return ReceiveRole.LEADER if cfg_rank == 0 and sp_rank == 0 else ReceiveRole.FOLLOWER
    return ReceiveRole.LEADER if world_rank == 0 else ReceiveRole.FOLLOWER


def build_topo_config(ctx: ParallelContext | None, *, tp_active: bool) -> TopoConfig:
    """Snapshot ``ctx`` (``None``: :meth:`ParallelContext.default`); never raises.

    Groups whose rank/size lookup raises count as absent (size 1), as in the reference.
    """
    if ctx is None:
        ctx = ParallelContext.default()
    try:
        world_rank, world_size = _rank_size(ctx.world_group)
    except Exception:
        logger.exception("World group unavailable; defaulting to LOCAL")
        return TopoConfig(ReceiveRole.LOCAL, tp_active, context=ctx)
    sizes: dict[str, tuple[int, int, ProcessGroup | None]] = {}
    for name, group in (("cfg", ctx.cfg_group), ("sp", ctx.sp_group)):
        try:
            rank, size = _rank_size(group)
            sizes[name] = (rank, size, group if size > 1 else None)
        except Exception:
            logger.warning("%s group lookup failed; treating it as size 1", name, exc_info=True)
            sizes[name] = (0, 1, None)
    cfg_rank, cfg_size, cfg_group = sizes["cfg"]
    sp_rank, sp_size, sp_group = sizes["sp"]
    role = decide_role(
        tp_active=tp_active,
        world_size=world_size,
        world_rank=world_rank,
        cfg_size=cfg_size,
        cfg_rank=cfg_rank,
        sp_size=sp_size,
        sp_rank=sp_rank,
    )
    return TopoConfig(
        role,
        tp_active,
        cfg_size,
        cfg_rank,
        cfg_group,
        sp_size,
        sp_rank,
        sp_group,
        ctx.world_group if world_size > 1 else None,
        world_size,
        world_rank,
        ctx,
    )


def request_key(request_id: str | None) -> int:
    """A 62-bit hash of the request id: ranks compare it to detect being out of step."""
    digest = hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class GroupLink:
    """One process group seen from this rank, with deadline-bounded tensor operations.

    Ranks are group ranks. Every method raises :class:`DistributionError` (and marks the group
    broken) when the operation fails or its deadline passes; none blocks past the deadline (plus
    gloo's own granularity).
    """

    def __init__(self, name: str, group: ProcessGroup, ctx: ParallelContext) -> None:
        self.name = name
        self.group = group
        self.ctx = ctx
        self.rank = int(group.rank())
        self.size = int(group.size())

    def _timeout(self, deadline: float) -> timedelta | None:
        left = remaining(deadline)
        if math.isinf(left):
            return None
        return timedelta(seconds=max(_MIN_OP_TIMEOUT_S, left))

    def _fail(self, what: str, exc: BaseException) -> DistributionError:
        reason = f"{what} on {self.name} group failed: {type(exc).__name__}: {exc}"
        self.ctx.mark_broken(self.group, reason)
        logger.error("%s; the group is now marked broken", reason)
        return DistributionError(reason)

    def check(self) -> None:
        """Raise at once if the group is known to be broken."""
        reason = self.ctx.broken_reason(self.group)
        if reason is not None:
            raise DistributionError(f"{self.name} group is broken ({reason})")

    def all_reduce_min(self, t: torch.Tensor, deadline: float) -> None:
        self.check()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        timeout = self._timeout(deadline)
        if timeout is not None:
            opts.timeout = timeout
        try:
            self.group.allreduce([t], opts).wait()
        except Exception as exc:
            raise self._fail("all_reduce", exc) from exc

    def _broadcast_options(self, src: int, deadline: float) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        timeout = self._timeout(deadline)
        if timeout is not None:
            opts.timeout = timeout
        return opts

    def _wait(self, work: Any, deadline: float) -> None:
        """Wait for ``work`` at most until ``deadline`` (no bound when there is none)."""
        timeout = self._timeout(deadline)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)

    def broadcast(self, t: torch.Tensor, src: int, deadline: float) -> None:
        self.check()
        opts = self._broadcast_options(src, deadline)
        try:
            self.group.broadcast([t], opts).wait()
        except Exception as exc:
            raise self._fail("broadcast", exc) from exc

    def send(self, t: torch.Tensor, dst: int, deadline: float, tag: int = 0) -> None:
        self.check()
        try:
            self._wait(self.group.send([t], dst, tag), deadline)
        except Exception as exc:
            raise self._fail(f"send to rank {dst}", exc) from exc

    def recv(self, t: torch.Tensor, src: int, deadline: float, tag: int = 0) -> None:
        self.check()
        try:
            self._wait(self.group.recv([t], src, tag), deadline)
        except Exception as exc:
            raise self._fail(f"recv from rank {src}", exc) from exc


@dataclass(frozen=True)
class Agreement:
    """The group's reduced view: ``ok`` only if every rank was ok and on the same request."""

    ok: bool
    same_request: bool
    remaining_s: float
    sizes: tuple[int, ...]


def agree(
    link: GroupLink,
    *,
    ok: bool,
    key: int,
    deadline: float,
    sizes: list[int] | None = None,
    with_sizes: bool = False,
) -> Agreement:
    """All ranks of ``link`` reduce their status (one ``all_reduce(MIN)``).

    With ``with_sizes`` the vector carries one size per group rank: the source passes ``sizes``
    (bytes per rank, 0 for nothing), the others pass ``None`` and learn the source's values.
    ``remaining_s`` is the smallest remaining deadline of the group. Raises
    :class:`DistributionError` when the operation fails (the group is then broken).
    """
    n = link.size if with_sizes else 0
    vec = torch.full((4 + n,), _BIG, dtype=torch.int64)
    left = remaining(deadline)
    vec[0] = 1 if ok else 0
    vec[1] = key
    vec[2] = -key
    vec[3] = _BIG if math.isinf(left) else int(left * 1000)
    if with_sizes and sizes is not None:
        if len(sizes) != n:
            raise ValueError(f"expected {n} sizes, got {len(sizes)}")
        vec[4:] = torch.tensor(sizes, dtype=torch.int64)
    link.all_reduce_min(vec, deadline)
    values = vec.tolist()
    same = values[1] == -values[2]
    if not same:
        logger.error("ranks of the %s group are on different requests", link.name)
    left_ms = values[3]
    return Agreement(
        ok=values[0] == 1 and same,
        same_request=same,
        remaining_s=math.inf if left_ms >= _BIG else left_ms / 1000.0,
        sizes=tuple(int(v) for v in values[4:]),
    )
