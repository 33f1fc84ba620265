"""Intra-stage KV distribution: leader -> followers over torch.distributed groups.

Who calls it: the manager's :class:`StageRanks` (``distribute_kv_cache``,
``receive_multi_kv_cache_distributed`` and ``consume_and_distribute_kv_cache``) on every rank of a
receiving stage, after the leader pulled (or failed to pull) the request's KV. Guarantees:

* before any data moves, the ranks that depend on each other agree (one ``all_reduce(MIN)``,
  :func:`omnikv.ranks.collectives.agree`) on whether the leader has the KV and how many bytes
  each rank gets; a leader without KV, or one that failed while packing, makes every rank return
  ``None``;
* every group operation is bounded by the deadline given (the receive timeout plus a grace),
  so a dead or hung leader makes its followers return ``None`` instead of hanging;
* tensors travel as one packed ``uint8`` buffer per message (:mod:`omnikv.wire.frames`), metadata
  as msgpack; no pickle, no ``*_object_list``.

Node-shared reads (``shared_readers`` in the receiving stage's ``connector_config``, equal to its
world size, without TP): the sender published each payload once for that many readers of the
node (:mod:`omnikv.connectors.shm.shared`), so every rank takes it from the connector itself (a
zero-copy view of the one copy) instead of the leader broadcasting it; the ranks then agree on
success as pure TP ranks do (all have the KV, or none counts it). Another value, or a stage
with TP, keeps the leader -> followers path (with a WARNING, once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnikv.config import OmniKVCacheConfig
from omnikv.deadline import deadline_after
from omnikv.errors import ConfigError, DistributionError
from omnikv.ranks.collectives import GroupLink, agree, request_key
from omnikv.ranks.context import ParallelContext, TopoConfig, build_topo_config
from omnikv.topology.placement import RankInfo
from omnikv.topology.tp import KVTPTopology
from omnikv.transfer.requests import (
    apply_request_kv_payload,
    collect_request_kv_payload,
    move_to_device,
    request_id_of,
)
from omnikv.values import parse_int
from omnikv.wire.frames import Frame, decode_frame

__all__ = [
    "StageRanks",
    "StageReceive",
    "build_cfg_rank_payloads",
    "discover_cfg_branch_roles",
    "distribute",
    "shared_readers",
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
            GroupLink("tp", group, ctx),
            ok=ok,
            key=request_key(request_id_of(req)),
            deadline=deadline,
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
            GroupLink("cfg", topo.cfg_group, ctx),
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
            GroupLink("sp", topo.sp_group, ctx),
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
            GroupLink("world", topo.world, topo.context),
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


class StageRanks:
    """One manager's view of its stage's ranks, and the leader -> followers steps it takes.

    Owned by :class:`~omnikv.manager.OmniKVTransferManager` (one per manager). Holds the injected
    parallel context (``None``, or any ``RankInfo`` that is not a :class:`ParallelContext`:
    :meth:`ParallelContext.default` with this rank's TP place), the manager's TP topology and
    its config. The role snapshot (:attr:`topo`) is built on first use and kept until
    :meth:`rebuild`. Every group operation runs under one deadline per call: the config's
    ``recv_timeout``, read at the call (a runner may change it after construction), plus the
    context's ``grace_s``.
    """

    def __init__(
        self, context: RankInfo | None, tp: KVTPTopology, config: OmniKVCacheConfig
    ) -> None:
        self.context, self.tp, self.config = context, tp, config
        self._topo: TopoConfig | None = None
        self._warned_shared = False

    @property
    def topo(self) -> TopoConfig:
        """This rank's role and groups, built on first use."""
        return self._topo or self.rebuild()

    def rebuild(self) -> TopoConfig:
        """Re-snapshot the parallel context (once the runner's groups exist)."""
        ctx = self.context
        if not isinstance(ctx, ParallelContext):
            ctx = ParallelContext.default(self.tp.local_rank, self.tp.source_tp_size)
        active = self.tp.source_tp_size > 1 or self.tp.target_tp_size > 1
        self._topo = build_topo_config(ctx, tp_active=active)
        return self._topo

    def _deadline(self) -> float:
        ctx = self.topo.context
        grace = ctx.grace_s if ctx is not None else 2.0
        return deadline_after(self.config.recv_timeout + grace, "recv_timeout")

    def distribute(
        self, req: Any, target_device: torch.device | str | None = None, *, received: bool
    ) -> dict[str, Any] | None:
        """:func:`distribute` of ``req`` from this rank; the payload this rank should apply.

        ``target_device`` ``None`` places what followers get on the host, as the reference does.
        """
        device = _on_host(target_device)
        return distribute(
            self.topo, req, received=received, deadline=self._deadline(), target_device=device
        )

    @contextlib.contextmanager
    def receiving(
        self,
        req: Any,
        target_device: torch.device | str | None = None,
        *,
        received_counts: bool,
    ) -> Iterator[StageReceive]:
        """This rank's part in receiving ``req`` for the stage: fetch inside, share on exit.

        Called by the manager on every rank of a receiving stage, once per request::

            with ranks.receiving(req, device, received_counts=False) as rank:
                if rank.fetches:  # not a FOLLOWER: pull from the connector
                    rank.received = ...  # whether the fetch applied KV to req
            return rank.has_kv

        On exit this rank tells the others how its fetch went: pure-TP ranks agree (all True or
        all False); the other ranks enter :meth:`distribute` (LOCAL: nothing to do) and apply
        what they get, on ``target_device`` (``None``: the host). A fetch that raises is shared
        as not received before the error propagates, so followers never block in a collective
        their leader skipped. ``received_counts``: a leader that received has the KV even when
        its followers got nothing.
        """
        shared = self.reads_shared()
        rank = StageReceive(fetches=shared or not self.topo.is_follower)
        try:
            yield rank
        except Exception:
            if shared:
                self._agree_world(req, received=False)
            else:
                self._share(req, target_device, received=False, received_counts=received_counts)
            raise
        if shared:
            rank.has_kv = self._agree_world(req, received=rank.received)
            return
        rank.has_kv = self._share(
            req, target_device, received=rank.received, received_counts=received_counts
        )

    def reads_shared(self) -> bool:
        """Whether every rank of this stage takes the request's payload from the connector
        itself (node-shared reads, module docstring): ``shared_readers`` in the connector
        config equals the world size of a stage without TP. A value that does not fit the
        stage is logged once (WARNING) and the leader -> followers path is kept."""
        readers = shared_readers(self.config)
        if readers <= 1:
            return False
        topo = self.topo
        if not topo.tp_active and topo.world is not None and topo.world_size == readers:
            return True
        if not self._warned_shared:
            self._warned_shared = True
            logger.warning(
                "shared_readers is %d but this receiving stage has %d rank(s)%s: its leader"
                " receives and distributes the KV; each payload keeps %d unread claim(s) at"
                " its sender until their TTL",
                readers,
                topo.world_size,
                " with TP" if topo.tp_active else "",
                max(0, readers - 1),
            )
        return False

    def _agree_world(self, req: Any, *, received: bool) -> bool:
        """Node-shared reads: every rank fetched its own; all of them have the KV, or none
        counts it (one bounded ``all_reduce``; a broken group is False)."""
        topo = self.topo
        assert topo.world is not None
        try:
            agreed = agree(
                GroupLink("world", topo.world, topo.context),
                ok=received,
                key=request_key(request_id_of(req)),
                deadline=self._deadline(),
            )
        except DistributionError:
            return False
        return agreed.ok

    def _share(
        self,
        req: Any,
        target_device: torch.device | str | None,
        *,
        received: bool,
        received_counts: bool,
    ) -> bool:
        topo = self.topo
        if topo.is_local and topo.tp_active:
            return tp_agree(topo, req, received, self._deadline())
        device = _on_host(target_device)
        payload = self.distribute(req, device, received=received)
        if payload is not None:
            apply_request_kv_payload(req, payload, device)
        return payload is not None or (received and (received_counts or topo.is_local))


@dataclass
class StageReceive:
    """One rank's receive of one request (:meth:`StageRanks.receiving`).

    ``fetches``: this rank pulls from the connector (it is no FOLLOWER). ``received``: set by
    the caller, whether its fetch applied KV to the request. ``has_kv``: set when the block
    ends, whether this rank has the KV after sharing with the stage.
    """

    fetches: bool
    received: bool = False
    has_kv: bool = False


def shared_readers(config: OmniKVCacheConfig) -> int:
    """``connector_config["shared_readers"]`` (1 when absent or not a valid count: the
    connector refuses an invalid one when it is built)."""
    conn = config.connector_config
    value = conn.get("shared_readers") if isinstance(conn, Mapping) else None
    try:
        return parse_int("shared_readers", value, 1, minimum=1)
    except ConfigError:
        return 1


def _on_host(device: torch.device | str | None) -> torch.device | str:
    """``device``, or the host when none is given (the reference's distribution default)."""
    return torch.device("cpu") if device is None else device
