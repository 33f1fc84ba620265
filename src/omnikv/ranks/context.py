"""Parallel state of a receiving stage: its process groups and each rank's receive role.

Who uses it: the manager's :class:`~omnikv.ranks.distribution.StageRanks` builds a
:class:`TopoConfig` from a :class:`ParallelContext` on first use
(``OmniKVTransferManager.topo_config``); :mod:`omnikv.ranks.distribution` moves KV over the groups
it names, through :mod:`omnikv.ranks.collectives`. Without an injected context,
:meth:`ParallelContext.default` takes the groups from the host framework, else the
``torch.distributed`` world, else one rank (:mod:`omnikv.ranks.discovery`).

A :class:`ParallelContext` also keeps what its ranks' group operations share: the groups found
broken (every later operation on one fails at once until :meth:`ParallelContext.reset_broken`),
a bound on message sizes and a small cache of message buffers. The role decision
(:func:`decide_role`) is a pure function of group ranks and sizes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

__all__ = ["ParallelContext", "ReceiveRole", "TopoConfig", "build_topo_config", "decide_role"]

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


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
        (:mod:`omnikv.ranks.discovery`). ``local_rank`` / ``tp_size`` override the discovered
        values (the manager passes the ones its topology already uses). ``source`` says where
        each part came from.
        """
        from omnikv.ranks.discovery import discover_groups, discover_tp

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

        Called by :mod:`omnikv.ranks.distribution` for every message it packs or receives. Decoded
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
