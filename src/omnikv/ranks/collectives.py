"""Deadline-bounded tensor collectives on one process group, and the agreement built on them.

Who uses it: :mod:`omnikv.ranks.distribution` (the leader's hand-off of received KV to its
followers, and the pure-TP agreement) on every rank of a receiving stage. Guarantees:

* every group operation is bounded by an absolute monotonic deadline (gloo per-operation
  timeouts), so no rank waits on a dead or hung peer past its deadline;
* a group whose operation timed out or failed is marked broken in its
  :class:`~omnikv.ranks.context.ParallelContext` (gloo closes the pairs of a timed-out operation,
  and peers may be out of step), and every later operation on it fails at once with
  :class:`~omnikv.errors.DistributionError` until ``ParallelContext.reset_broken`` (after the job
  rebuilt its groups) or a new context;
* agreement is one ``all_reduce(MIN)`` of a small int64 vector: a status flag, the request's hash
  and its negation (so a mismatch between ranks shows) and, for data phases, the leader's message
  size per rank.

No pickle and no ``*_object_list`` anywhere: only tensor collectives.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from omnikv.deadline import remaining
from omnikv.errors import DistributionError
from omnikv.ranks.context import ParallelContext

__all__ = ["Agreement", "GroupLink", "agree", "request_key"]

logger = logging.getLogger(__name__)

#: What a rank that contributes no value puts in a slot of the ``all_reduce(MIN)`` vector.
_BIG = 1 << 62
_MIN_OP_TIMEOUT_S = 0.05


def request_key(request_id: str | None) -> int:
    """A 62-bit hash of the request id: ranks compare it to detect being out of step."""
    digest = hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class GroupLink:
    """One process group seen from this rank, with deadline-bounded tensor operations.

    ``ctx`` (``None``: a fresh default :class:`ParallelContext`) records broken groups and hands
    out message buffers. Ranks are group ranks. Every method raises :class:`DistributionError`
    (and marks the group broken) when the operation fails or its deadline passes; none blocks
    past the deadline (plus gloo's own granularity).
    """

    def __init__(self, name: str, group: dist.ProcessGroup, ctx: ParallelContext | None) -> None:
        self.name = name
        self.group = group
        self.ctx = ctx if ctx is not None else ParallelContext()
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
    """The group's reduced view: ``ok`` only if every rank was ok and on the same request;
    ``sizes``: the source's per-rank message sizes (empty without ``with_sizes``)."""

    ok: bool
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

    ``key`` is :func:`request_key` of the request every rank believes it is on. With
    ``with_sizes`` the vector carries one size per group rank: the source passes ``sizes``
    (bytes per rank, 0 for nothing), the others pass ``None`` and learn the source's values.
    Raises :class:`DistributionError` when the operation fails (the group is then broken).
    """
    n = link.size if with_sizes else 0
    vec = torch.full((3 + n,), _BIG, dtype=torch.int64)
    vec[0] = 1 if ok else 0
    vec[1] = key
    vec[2] = -key
    if with_sizes and sizes is not None:
        if len(sizes) != n:
            raise ValueError(f"expected {n} sizes, got {len(sizes)}")
        vec[3:] = torch.tensor(sizes, dtype=torch.int64)
    link.all_reduce_min(vec, deadline)
    values = vec.tolist()
    same = values[1] == -values[2]
    if not same:
        logger.error("ranks of the %s group are on different requests", link.name)
    return Agreement(ok=values[0] == 1 and same, sizes=tuple(int(v) for v in values[3:]))
