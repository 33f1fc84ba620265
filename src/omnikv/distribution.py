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
from collections.abc import Mapping
from typing import Any

import torch

from omnikv.framing import Frame, decode_frame
from omnikv.parallel import (
    DistributionError,
    GroupLink,
    ParallelContext,
    TopoConfig,
    agree,
    request_key,
)
from omnikv.requests import collect_request_kv_payload, move_to_device, request_id_of

__all__ = [
    "build_cfg_rank_payloads",
    "discover_cfg_branch_roles",
    "distribute",
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
    frame: Frame | None = None
    buf: torch.Tensor | None = None
    if is_src and ok:
        try:
            frame, _ = _encode(payload)
            if frame is not None:
                buf = _packed(frame, link.ctx)  # a failure here is a packing failure
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
    ctx = topo.context
    try:
        if not topo.tp_active:
            if topo.world is None:
                return None
            payload = collect_request_kv_payload(req) if topo.is_leader and received else None
            return _broadcast(
                _link("world", topo.world, ctx),
                payload,
                is_src=topo.is_leader,
                ok=not topo.is_leader or received,
                key=key,
                deadline=deadline,
                device=target_device,
            )
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
                device=target_device,
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
                device=target_device,
            )
        return own or None
    except DistributionError as exc:
        logger.error("KV distribution of %s failed: %s", rid, exc)
        return None
    except Exception:
        logger.exception("KV distribution of %s failed", rid)
        return None
