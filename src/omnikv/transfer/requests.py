"""Applying KV to, and collecting it from, duck-typed request objects.

A request has ``request_id``, optionally ``sampling_params`` and ``kv_sender_info``. After apply,
the pipeline finds the KV at ``req.past_key_values`` and ``req.sampling_params.past_key_values``
(a ``SimpleNamespace(key_cache=[...], value_cache=[...])``), metadata at ``req.kv_metadata`` and
``sampling_params.kv_metadata``, and CFG companions at ``sampling_params.cfg_*`` attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from omnikv._logging import RateLimitedLog
from omnikv.transfer.received import ReceivedKV

__all__ = [
    "CFG_EXTRA_FIELDS",
    "MAX_COMPANIONS",
    "MAX_COMPANION_ID_CHARS",
    "apply_kv_cache_to_request",
    "apply_received_kv",
    "apply_request_kv_payload",
    "cfg_companion_ids",
    "checked_companions",
    "collect_cfg_companions",
    "collect_request_kv_payload",
    "companion_refusal",
    "kv_namespace",
    "move_to_device",
    "request_id_of",
]

logger = logging.getLogger(__name__)
_refused_companions = RateLimitedLog(logger)

#: CFG companions one request may have (Bagel has two: ``cfg_text``, ``cfg_img``).
MAX_COMPANIONS = 8
#: Longest companion request id accepted.
MAX_COMPANION_ID_CHARS = 512

CFG_EXTRA_FIELDS = (
    "cfg_kv_request_ids",
    "cfg_active_branch",
    "cfg_branch_roles",
    "cfg_branch_past_key_values",
    "cfg_branch_kv_metadata",
)


def request_id_of(req: Any) -> str | None:
    """The id KV is received under: ``req.request_id``, else ``req.request_ids[0]`` (the
    diffusion request shape); a plain string is its own id; ``None`` when there is none."""
    if isinstance(req, str):
        return req
    rid = getattr(req, "request_id", None)
    if rid is None:
        ids = getattr(req, "request_ids", None)
        if isinstance(ids, list | tuple) and ids:
            rid = ids[0]
    return None if rid is None or rid == "" else str(rid)


def kv_namespace(data: Mapping[str, Any]) -> SimpleNamespace:
    """The ``SimpleNamespace(key_cache, value_cache)`` pipelines read from a decoded payload."""
    blocks = data.get("layer_blocks") or {}
    return SimpleNamespace(
        key_cache=list(blocks.get("key_cache") or []),
        value_cache=list(blocks.get("value_cache") or []),
    )


def apply_kv_cache_to_request(req: Any, data: Any) -> None:
    """Set ``past_key_values`` / ``kv_metadata`` on ``req`` and its ``sampling_params``.

    Does nothing for data without ``layer_blocks``; moves nothing between devices.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("layer_blocks"), Mapping):
        return
    kv = kv_namespace(data)
    sp = getattr(req, "sampling_params", None)
    req.past_key_values = kv
    if sp is not None:
        sp.past_key_values = kv
    if "metadata" in data:
        req.kv_metadata = data["metadata"]
        if sp is not None:
            sp.kv_metadata = data["metadata"]


def apply_received_kv(req: Any, kv: ReceivedKV) -> None:
    """:func:`apply_kv_cache_to_request` for a :class:`ReceivedKV` (same attributes set)."""
    ns = SimpleNamespace(key_cache=list(kv.key_cache), value_cache=list(kv.value_cache))
    sp = getattr(req, "sampling_params", None)
    req.past_key_values = ns
    req.kv_metadata = kv.metadata
    if sp is not None:
        sp.past_key_values = ns
        sp.kv_metadata = kv.metadata


def _is_cfg_field(name: str) -> bool:
    if name in CFG_EXTRA_FIELDS:
        return True
    return name.startswith("cfg_") and (
        name.endswith("_past_key_values") or name.endswith("_kv_metadata")
    )


def collect_request_kv_payload(req: Any) -> dict[str, Any]:
    """Everything KV-related on ``req``: ``past_key_values``, ``kv_metadata`` and ``sp.<field>``.

    ``sp.*`` entries come from ``sampling_params``: ``past_key_values``, ``kv_metadata`` and the
    CFG fields (``cfg_*_past_key_values``, ``cfg_*_kv_metadata``, :data:`CFG_EXTRA_FIELDS`).
    Only non-None values are collected.
    """
    out: dict[str, Any] = {}
    for name in ("past_key_values", "kv_metadata"):
        value = getattr(req, name, None)
        if value is not None:
            out[name] = value
    sp = getattr(req, "sampling_params", None)
    if sp is None:
        return out
    names = vars(sp).keys() if hasattr(sp, "__dict__") else ()
    for name in sorted(names):
        if name in ("past_key_values", "kv_metadata") or _is_cfg_field(name):
            value = getattr(sp, name, None)
            if value is not None:
                out["sp." + name] = value
    return out


def apply_request_kv_payload(
    req: Any, payload: Mapping[str, Any], target_device: torch.device | str | None = None
) -> None:
    """Set every collected field back on ``req`` (moving tensors to ``target_device``)."""
    sp = getattr(req, "sampling_params", None)
    for name, value in payload.items():
        moved = move_to_device(value, target_device) if target_device is not None else value
        if name.startswith("sp."):
            if sp is not None:
                setattr(sp, name[3:], moved)
        elif name in ("past_key_values", "kv_metadata"):
            setattr(req, name, moved)


def move_to_device(obj: Any, device: torch.device | str | None) -> Any:
    """``obj`` with every tensor on ``device``; containers are rebuilt, not mutated.

    Tensors already there are returned as they are, and so is a container none of whose
    contents moved (the same object). ``SimpleNamespace``, dicts, lists and tuples are rebuilt
    when something in them moved; other objects are returned unchanged.
    """
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        dev = torch.device(device)
        return obj if obj.device == dev else obj.to(dev).contiguous()
    if isinstance(obj, SimpleNamespace):
        fields = vars(obj)
        moved = {k: move_to_device(v, device) for k, v in fields.items()}
        return obj if _same(fields.values(), moved.values()) else SimpleNamespace(**moved)
    if isinstance(obj, dict):
        out = {k: move_to_device(v, device) for k, v in obj.items()}
        return obj if _same(obj.values(), out.values()) else out
    if isinstance(obj, list | tuple):
        items = [move_to_device(v, device) for v in obj]
        if _same(obj, items):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _same(before: Iterable[Any], after: Iterable[Any]) -> bool:
    return all(a is b for a, b in zip(before, after, strict=True))


def companion_refusal(request_id: str, companion: Any) -> str | None:
    """Why ``companion`` cannot be a CFG companion of ``request_id`` (``None``: it can).

    Companions are the caller's own: a companion id is its request's id, ``__`` and a suffix
    (the reference's form, ``<request id>__cfg_text``), a ``str`` of at most
    :data:`MAX_COMPANION_ID_CHARS` printable characters. An id of another request (another
    tenant's) is refused, so that listing it cannot capture that request's KV."""
    if not isinstance(companion, str):
        return f"a companion id is a {type(companion).__name__}, not a string"
    if len(companion) > MAX_COMPANION_ID_CHARS or not companion.isprintable():
        return f"a companion id longer than {MAX_COMPANION_ID_CHARS} or not printable"
    if not companion.startswith(f"{request_id}__") or len(companion) <= len(request_id) + 2:
        return f"companion {companion!r:.80} is not {request_id!r:.80} + '__' + a suffix"
    return None


def checked_companions(request_id: str, companions: Mapping[Any, Any]) -> dict[str, str]:
    """``{role: companion id}`` of ``companions`` (client input: a request's
    ``cfg_kv_request_ids``) that :func:`companion_refusal` admits, at most
    :data:`MAX_COMPANIONS`; empty entries are skipped, refused ones logged (rate-limited)."""
    out: dict[str, str] = {}
    for role, rid in companions.items():
        if rid is None or rid == "":
            continue
        why = companion_refusal(request_id, rid)
        if why is None and len(out) >= MAX_COMPANIONS:
            why = f"more than {MAX_COMPANIONS} companions"
        if why is not None:
            _refused_companions.warning("CFG companion of %.80r refused: %s", request_id, why)
            continue
        out[str(role)] = rid
    return out


def cfg_companion_ids(req: Any) -> dict[str, str]:
    """``sampling_params.cfg_kv_request_ids`` (``{role: companion request id}``) as
    :func:`checked_companions` admits them, or ``{}``."""
    sp = getattr(req, "sampling_params", None)
    ids = getattr(sp, "cfg_kv_request_ids", None)
    rid = request_id_of(req)
    if not isinstance(ids, Mapping) or rid is None:
        return {}
    return checked_companions(rid, ids)


def collect_cfg_companions(req: Any, collect: Callable[..., Any], *args: Any) -> None:
    """Call the model's ``cfg_kv_collect_func(request_id, cfg_ids, *args)`` and set every entry
    of its result on ``req.sampling_params``. ``cfg_ids`` are the request's companions as
    :func:`cfg_companion_ids` admits them (so the collector never receives another request's
    KV). Its failure is logged: the companions are lost, the primary KV stays."""
    sp = getattr(req, "sampling_params", None)
    rid = request_id_of(req)
    try:
        out = collect(rid, cfg_companion_ids(req), *args)
    except Exception:  # model code
        logger.exception("CFG KV collection failed for %s", rid)
        return
    if isinstance(out, Mapping) and sp is not None:
        for key, value in out.items():
            setattr(sp, key, value)
        logger.debug("Applied CFG KV caches for %s: %s", rid, sorted(out))
