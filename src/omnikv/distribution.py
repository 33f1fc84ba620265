"""Intra-stage KV distribution: leader -> followers over torch.distributed groups.

Who calls it: :meth:`omnikv.manager.OmniKVTransferManager.distribute_kv_cache` and
``receive_multi_kv_cache_distributed`` on every rank of a receiving stage, after the leader
pulled (or failed to pull) the request's KV. Guarantees:

* before any data moves, the ranks that depend on each other agree (one ``all_reduce(MIN)``,
  :func:`omnikv.parallel.agree`) on whether the leader has the KV and how many bytes each rank
  gets; a leader without KV, or one that failed while packing, makes every rank return ``None``;
* every group operation is bounded by the deadline given (the receive timeout plus a grace),
  so a dead or hung leader makes its followers return ``None`` instead of hanging;
* tensors travel as one packed ``uint8`` buffer per message (:mod:`omnikv.framing`), metadata
  as msgpack; no pickle, no ``*_object_list``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from omnikv.deadline import deadline_after
from omnikv.errors import KVPrefetchConsumeError
from omnikv.framing import Frame, decode_frame
from omnikv.parallel import (
    DistributionError,
    GroupLink,
    ParallelContext,
    TopoConfig,
    agree,
    build_topo_config,
    request_key,
)
from omnikv.prefetch import PrefetchConsume
from omnikv.received import ReceivedKV
from omnikv.receiver import ReceiveResult
from omnikv.requests import (
    apply_request_kv_payload,
    collect_request_kv_payload,
    move_to_device,
    request_id_of,
)
from omnikv.topology import KVTPTopology

__all__ = [
    "build_cfg_rank_payloads",
    "consume_or_receive",
    "discover_cfg_branch_roles",
    "distribute",
    "receive_distributed",
    "share_outcome",
    "StageRanks",
    "tp_agree",
]

logger = logging.getLogger(__name__)

_MAIN_FIELDS = ("past_key_values", "kv_metadata", "sp.past_key_values", "sp.kv_metadata")


def discover_cfg_branch_roles(req: Any) -> list[str]:
    """CFG branch roles of ``req`` in the reference's order (§5.3): ``cfg_text``, ``cfg_img``,
    then other keys of ``cfg_branch_past_key_values`` with values, then other
    ``cfg_<x>_past_key_values`` attributes with values."""
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return []
    branch_map = getattr(sp, "cfg_branch_past_key_values", None)
    branch_map = branch_map if isinstance(branch_map, Mapping) else {}
    roles: list[str] = []
    for role in ("cfg_text", "cfg_img"):
        if role in branch_map or getattr(sp, f"{role}_past_key_values", None) is not None:
            roles.append(role)
    for key, value in branch_map.items():
        if value is not None and str(key) not in roles:
            roles.append(str(key))
    names = sorted(vars(sp)) if hasattr(sp, "__dict__") else []
    for name in names:
        if not (name.startswith("cfg_") and name.endswith("_past_key_values")):
            continue
        role = name[: -len("_past_key_values")]
        if role == "cfg_branch" or role in roles or getattr(sp, name, None) is None:
            continue
        roles.append(role)
    return roles


def build_cfg_rank_payloads(req: Any, cfg_size: int) -> list[dict[str, Any] | None]:
    """One payload per CFG rank (length ``cfg_size``), as the reference builds them (§5.3).

    Rank 0 gets the main KV; rank ``1 + i`` gets main plus branch ``roles[i]`` marked active
    (``None`` when that branch's KV is missing). With no roles, ``cfg_size == 2`` and a main
    payload, rank 1 gets a shallow copy of main (shared-prefix reuse).
    """
    collected = collect_request_kv_payload(req)
    main: dict[str, Any] = {k: collected[k] for k in _MAIN_FIELDS if k in collected}
    roles = discover_cfg_branch_roles(req)
    if roles:
        main["sp.cfg_branch_roles"] = list(roles)
        main["sp.cfg_active_branch"] = None
    out: list[dict[str, Any] | None] = [main or None]
    sp = getattr(req, "sampling_params", None)
    branch_map = getattr(sp, "cfg_branch_past_key_values", None) if sp is not None else None
    branch_map = branch_map if isinstance(branch_map, Mapping) else {}
    meta_map = getattr(sp, "cfg_branch_kv_metadata", None) if sp is not None else None
    meta_map = meta_map if isinstance(meta_map, Mapping) else {}
    for role in roles:
        kv = branch_map.get(role)
        if kv is None and sp is not None:
            kv = getattr(sp, f"{role}_past_key_values", None)
        if kv is None:
            out.append(None)
            continue
        entry = dict(main)
        entry["sp.cfg_active_branch"] = role
        entry["sp.cfg_branch_roles"] = list(roles)
        entry["sp.cfg_branch_past_key_values"] = {role: kv}
        entry[f"sp.{role}_past_key_values"] = kv
        meta = meta_map.get(role)
        if meta is None and sp is not None:
            meta = getattr(sp, f"{role}_kv_metadata", None)
        if meta is not None:
            entry["sp.cfg_branch_kv_metadata"] = {role: meta}
            entry[f"sp.{role}_kv_metadata"] = meta
        out.append(entry)
    while len(out) < cfg_size:
        if not roles and cfg_size == 2 and main:
            out.append(dict(main))
        else:
            out.append(None)
    return out[:cfg_size]


def _encode(payload: Mapping[str, Any] | None) -> tuple[Frame | None, int]:
    if not payload:
        return None, 0
    frame = Frame(payload)
    return frame, frame.nbytes


def _packed(frame: Frame, ctx: ParallelContext) -> torch.Tensor:
    buf = ctx.message_buffer(frame.nbytes)
    frame.pack_into(buf)
    return buf


def _link(name: str, group: Any, ctx: ParallelContext | None) -> GroupLink:
    return GroupLink(name, group, ctx if ctx is not None else ParallelContext())


def _decode(buf: torch.Tensor, device: torch.device | str | None) -> dict[str, Any] | None:
    payload = decode_frame(buf)
    return move_to_device(payload, device) if device is not None else payload


def _sizes_for(link: GroupLink, first: int) -> list[int]:
    return [first] + [0] * (link.size - 1)


def _broadcast(
    link: GroupLink,
    payload: dict[str, Any] | None,
    *,
    is_src: bool,
    ok: bool,
    key: int,
    deadline: float,
    device: torch.device | str | None,
) -> dict[str, Any] | None:
    """Agree, then broadcast one message from group rank 0 (every rank of ``link`` calls it)."""
    buf: torch.Tensor | None = None
    if is_src and ok:
        try:
            frame, _ = _encode(payload)
            if frame is not None:
                buf = _packed(frame, link.ctx)
        except Exception:
            logger.exception("Packing KV for the %s broadcast failed", link.name)
            ok, buf = False, None
        ok = ok and buf is not None
    sizes = _sizes_for(link, buf.numel() if buf is not None else 0) if is_src else None
    agreed = agree(link, ok=ok, key=key, deadline=deadline, sizes=sizes, with_sizes=True)
    # with_sizes gives one size per group rank; the source wrote its size into slot 0.
    size = agreed.sizes[0] if agreed.sizes else 0
    if not agreed.ok or size <= 0 or size > link.ctx.max_message_bytes:
        return None
    if buf is None:
        buf = link.ctx.message_buffer(size)
    link.broadcast(buf, 0, deadline)
    if is_src:
        return payload
    return _decode(buf, device)


def _cfg_scatter(
    link: GroupLink,
    req: Any,
    *,
    is_src: bool,
    received: bool,
    key: int,
    deadline: float,
    device: torch.device | str | None,
) -> dict[str, Any] | None:
    """Agree on per-rank sizes, then send each CFG rank its own payload from CFG rank 0."""
    ok = True
    bufs: list[torch.Tensor | None] = []
    payloads: list[dict[str, Any] | None] = []
    if is_src:
        ok = received
        if ok:
            try:
                payloads = build_cfg_rank_payloads(req, link.size)
                for p in payloads:
                    frame, _ = _encode(p)
                    bufs.append(_packed(frame, link.ctx) if frame is not None else None)
            except Exception:
                logger.exception("Packing CFG payloads of %s failed", request_id_of(req))
                ok, bufs = False, []
        ok = ok and bool(bufs) and bufs[0] is not None
    sizes = [b.numel() if b is not None else 0 for b in bufs] if is_src and ok else None
    if is_src and sizes is None:
        sizes = [0] * link.size
    agreed = agree(link, ok=ok, key=key, deadline=deadline, sizes=sizes, with_sizes=True)
    if not agreed.ok:
        return None
    if is_src:
        for dst in range(1, link.size):
            b = bufs[dst]
            if b is not None:
                link.send(b, dst, deadline)
        return payloads[0]
    size = agreed.sizes[link.rank]
    if size <= 0:
        logger.warning("CFG rank %d runs without KV (no branch payload)", link.rank)
        return None
    if size > link.ctx.max_message_bytes:
        return None
    buf = link.ctx.message_buffer(size)
    link.recv(buf, 0, deadline)
    return _decode(buf, device)


def tp_agree(topo: TopoConfig, req: Any, ok: bool, deadline: float) -> bool:
    """Pure TP: every TP rank pulled its own shard; all succeed or all fail together."""
    ctx = topo.context
    group = ctx.tp_group if ctx is not None and ctx.tp_group is not None else topo.world
    if group is None or int(group.size()) <= 1:
        return ok
    try:
        agreed = agree(
            _link("tp", group, ctx), ok=ok, key=request_key(request_id_of(req)), deadline=deadline
        )
    except DistributionError:
        return False
    return agreed.ok


def _distribute_tp(
    topo: TopoConfig,
    req: Any,
    received: bool,
    key: int,
    deadline: float,
    device: torch.device | str | None,
) -> dict[str, Any] | None:
    """TP with CFG and/or SP groups: scatter per CFG rank, then broadcast within each SP group."""
    ctx = topo.context
    own: dict[str, Any] | None = None
    ok = True
    if topo.cfg_active and topo.sp_rank == 0 and topo.cfg_group is not None:
        own = _cfg_scatter(
            _link("cfg", topo.cfg_group, ctx),
            req,
            is_src=topo.is_leader,
            received=received,
            key=key,
            deadline=deadline,
            device=device,
        )
        ok = own is not None
    elif topo.is_leader:
        collected = collect_request_kv_payload(req) if received else {}
        own = {k: collected[k] for k in _MAIN_FIELDS if k in collected} or None
        ok = own is not None
    if topo.sp_active and topo.sp_group is not None:
        own = _broadcast(
            _link("sp", topo.sp_group, ctx),
            own,
            is_src=topo.sp_rank == 0,
            ok=ok if topo.sp_rank == 0 else True,
            key=key,
            deadline=deadline,
            device=device,
        )
    return own or None


def distribute(
    topo: TopoConfig,
    req: Any,
    *,
    received: bool,
    deadline: float,
    target_device: torch.device | str | None = None,
) -> dict[str, Any] | None:
    """The payload this rank should apply (``None``: nothing, or a failure every peer sees).

    Called on every rank of the stage with the same request. LOCAL ranks return ``None`` at
    once. Never raises for group failures (logged; ``None``); returns by ``deadline``.
    """
    if topo.is_local:
        return None
    rid = request_id_of(req)
    key = request_key(rid)
    try:
        if topo.tp_active:
            return _distribute_tp(topo, req, received, key, deadline, target_device)
        if topo.world is None:
            return None
        payload = collect_request_kv_payload(req) if topo.is_leader and received else None
        return _broadcast(
            _link("world", topo.world, topo.context),
            payload,
            is_src=topo.is_leader,
            ok=not topo.is_leader or received,
            key=key,
            deadline=deadline,
            device=target_device,
        )
    except DistributionError as exc:
        logger.error("KV distribution of %s failed: %s", rid, exc)
        return None
    except Exception:
        logger.exception("KV distribution of %s failed", rid)
        return None


# --------------------------------------------------------------------------------------------
# The stage-level receive paths (called by the manager on every rank of a receiving stage)
# --------------------------------------------------------------------------------------------
def share_outcome(
    topo: TopoConfig,
    req: Any,
    received: bool,
    failure: BaseException | None,
    *,
    agree_deadline: Callable[[], float],
    distribute_fn: Callable[[bool], dict[str, Any] | None],
    target_device: torch.device | str | None,
    received_counts: bool,
) -> bool:
    """Tell the stage's other ranks how this rank's receive went; whether this rank has the KV.

    Pure-TP ranks agree (all True or all False, bounded by ``agree_deadline()``); other ranks
    enter distribution through ``distribute_fn(received)`` (the manager's
    ``distribute_kv_cache``, i.e. :func:`distribute`; LOCAL: ``None`` at once) and apply what
    they get.
    ``received_counts``: a leader that received reports True even when its followers got
    nothing. Re-raises ``failure`` afterwards, so an error on the leader never strands its
    followers.
    """
    if topo.is_local and topo.tp_active:
        ok = tp_agree(topo, req, received, agree_deadline())
    else:
        payload = distribute_fn(received)
        if payload is not None:
            apply_request_kv_payload(req, payload, target_device)
        ok = payload is not None or (received and (received_counts or topo.is_local))
    if failure is not None:
        raise failure
    return ok


def receive_distributed(
    topo: TopoConfig,
    req: Any,
    fetch: Callable[[], bool],
    distribute_fn: Callable[[bool], dict[str, Any] | None],
    agree_deadline: Callable[[], float],
    *,
    target_device: torch.device | str | None,
    received_counts: bool,
) -> bool:
    """``fetch`` on every non-follower rank, then :func:`share_outcome` on every rank.

    A ``fetch`` that raises still enters the sharing step (then re-raises), so followers never
    block in a collective their leader skipped.
    """
    received = False
    failure: BaseException | None = None
    if not topo.is_follower:
        try:
            received = fetch()
        except Exception as exc:  # shared first, re-raised by share_outcome
            failure = exc
    return share_outcome(
        topo,
        req,
        received,
        failure,
        agree_deadline=agree_deadline,
        distribute_fn=distribute_fn,
        target_device=target_device,
        received_counts=received_counts,
    )


def consume_or_receive(
    req: Any,
    consume: Callable[[], PrefetchConsume] | None,
    receive: Callable[[float | None], ReceiveResult],
    apply: Callable[[ReceivedKV], None],
) -> bool:
    """The prefetch consume path: take the prefetched KV, else receive synchronously; apply.

    ``consume`` (``None``: prefetch is off) takes the prefetch of ``req``; ``receive(deadline)``
    receives it now (``deadline`` ``None``: a fresh ``recv_timeout``; else what is left of the
    prefetch's). A consume error (payload consumed, unusable) is final: no synchronous retry.
    Returns whether KV was applied to ``req``.
    """
    rid = request_id_of(req)
    out = PrefetchConsume(None)
    if consume is not None:
        try:
            out = consume()
        except KVPrefetchConsumeError as exc:
            logger.error("Prefetched KV of %s unusable; request cannot recover: %s", rid, exc)
            return False
        res = out.result
        if res is not None and res.ok and res.kv is not None:
            apply(res.kv)
            return True
        if not out.sync_retry:
            return False
    logger.debug("No prefetched KV for %s; receiving synchronously", rid)
    try:
        result = receive(out.retry_deadline)
    except KVPrefetchConsumeError as exc:
        logger.error("KV of %s consumed but unusable; request cannot recover: %s", rid, exc)
        return False
    if result.ok and result.kv is not None:
        apply(result.kv)
        return True
    return False


class StageRanks:
    """A manager's view of its stage's ranks: the role snapshot, built on first use from the
    injected context (a :class:`ParallelContext`) or a default one, and the deadline of a
    distribution (the receive timeout, read when needed, plus the context's grace)."""

    def __init__(self, context: Any, tp: KVTPTopology, recv_timeout: Callable[[], float]) -> None:
        self.context, self.tp, self.recv_timeout = context, tp, recv_timeout
        self._topo: TopoConfig | None = None

    @property
    def topo(self) -> TopoConfig:
        return self._topo or self.rebuild()

    def rebuild(self) -> TopoConfig:
        """Re-snapshot the parallel context (once the runner's groups exist)."""
        ctx = self.context
        if not isinstance(ctx, ParallelContext):
            ctx = ParallelContext.default(self.tp.local_rank, self.tp.source_tp_size)
        active = self.tp.source_tp_size > 1 or self.tp.target_tp_size > 1
        self._topo = build_topo_config(ctx, tp_active=active)
        return self._topo

    def deadline(self) -> float:
        ctx = self.topo.context
        grace = ctx.grace_s if ctx is not None else 2.0
        return deadline_after(self.recv_timeout() + grace, "recv_timeout")
