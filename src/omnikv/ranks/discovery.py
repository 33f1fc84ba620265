"""Where a rank's parallel state comes from when nobody injected a :class:`ParallelContext`.

Precedence (reference §2.1, §5.2): an injected context (the caller's; not looked at here) >
the host framework > an initialised ``torch.distributed`` world > a single rank.

* TP: the local TP rank and TP size come from vLLM's TP group
  (``vllm.distributed.parallel_state.get_tp_group()``) when vLLM's groups are initialised, else
  rank ``LOCAL_RANK`` (then 0) of a TP size of 1.
* Groups: world, CFG and SP groups come from vllm-omni's diffusion parallel state
  (``vllm_omni.diffusion.distributed.parallel_state``: ``get_world_group``, ``get_cfg_group``,
  ``get_classifier_free_guidance_world_size/rank``, ``get_sp_group``,
  ``get_sequence_parallel_world_size/rank``). Once that module is in use it is the source, as in
  the reference: a world query that raises means one LOCAL rank; a CFG or SP query that raises
  means size 1.

Discovery never imports vLLM or vllm-omni: a framework whose groups are initialised has already
imported its parallel-state module, so only modules already in ``sys.modules`` are consulted.
Which source was used is logged at DEBUG and shown by ``omnikv doctor``.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = [
    "OMNI_STATE",
    "VLLM_STATE",
    "HostGroups",
    "HostTP",
    "discover_groups",
    "discover_tp",
    "env_local_rank",
]

logger = logging.getLogger(__name__)

VLLM_STATE = "vllm.distributed.parallel_state"
OMNI_STATE = "vllm_omni.diffusion.distributed.parallel_state"


@dataclass(frozen=True)
class HostTP:
    """This rank's place in its TP group and where that came from."""

    local_rank: int
    tp_size: int
    group: dist.ProcessGroup | None
    source: str  # "vllm", "LOCAL_RANK" or "default"


@dataclass(frozen=True)
class HostGroups:
    """The stage's groups as the host reports them (``None``: absent or size 1)."""

    world: dist.ProcessGroup | None
    cfg: dist.ProcessGroup | None
    sp: dist.ProcessGroup | None
    source: str  # "vllm-omni", "vllm-omni (world unavailable)", "torch.distributed", "single rank"


def env_local_rank() -> int | None:
    """``LOCAL_RANK`` as a non-negative int, or ``None`` when unset or not a number."""
    try:
        return max(0, int(os.environ["LOCAL_RANK"]))
    except (KeyError, ValueError):
        return None


def _process_group(coordinator: Any) -> dist.ProcessGroup | None:
    """The host-side (gloo) process group of a vLLM-style group coordinator.

    omnikv's group operations move host tensors, so the coordinator's ``cpu_group`` is the one to
    use; a coordinator without one falls back to its ``device_group``; a bare ``ProcessGroup``
    is taken as it is.
    """
    if isinstance(coordinator, dist.ProcessGroup):
        return coordinator
    for name in ("cpu_group", "device_group"):
        group = getattr(coordinator, name, None)
        if isinstance(group, dist.ProcessGroup):
            return group
    return None


def discover_tp() -> HostTP:
    """Local TP rank and TP size: vLLM's TP group, else ``LOCAL_RANK`` (then 0) of TP 1."""
    state = sys.modules.get(VLLM_STATE)
    if state is not None:
        try:
            tp = state.get_tp_group()
            found = HostTP(int(tp.rank_in_group), int(tp.world_size), _process_group(tp), "vllm")
        except Exception as exc:  # not initialised: vLLM's getters assert; fall back below
            logger.debug("vLLM TP group unavailable (%s: %s)", type(exc).__name__, exc)
        else:
            logger.debug("TP from vLLM: rank %d of %d", found.local_rank, found.tp_size)
            return found
    env = env_local_rank()
    source = "default" if env is None else "LOCAL_RANK"
    logger.debug("TP from %s: rank %d of 1", source, env or 0)
    return HostTP(env or 0, 1, None, source)


def _sized(state: Any, getter: str, size_fn: str, rank_fn: str, name: str) -> Any:
    """One CFG/SP group of the diffusion state; ``None`` when absent, size 1, or raising."""
    try:
        size = int(getattr(state, size_fn)())
        rank = int(getattr(state, rank_fn)())
        group = _process_group(getattr(state, getter)()) if size > 1 else None
    except Exception as exc:  # the reference treats a failing lookup as size 1
        logger.debug("%s group unavailable (%s: %s); size 1", name, type(exc).__name__, exc)
        return None
    if group is None:
        return None
    if (group.size(), group.rank()) != (size, rank):
        logger.warning(
            "%s group: the host reports rank %d of %d, its process group rank %d of %d; "
            "using the process group",
            name,
            rank,
            size,
            group.rank(),
            group.size(),
        )
    return group


def _from_omni(state: Any) -> HostGroups:
    try:
        world = _process_group(state.get_world_group())
    except Exception as exc:  # reference §5.2: world group unavailable -> LOCAL
        logger.debug("vllm-omni world group unavailable (%s: %s); LOCAL", type(exc).__name__, exc)
        return HostGroups(None, None, None, "vllm-omni (world unavailable)")
    cfg = _sized(
        state,
        "get_cfg_group",
        "get_classifier_free_guidance_world_size",
        "get_classifier_free_guidance_rank",
        "cfg",
    )
    sp = _sized(
        state,
        "get_sp_group",
        "get_sequence_parallel_world_size",
        "get_sequence_parallel_rank",
        "sp",
    )
    return HostGroups(world, cfg, sp, "vllm-omni")


def discover_groups() -> HostGroups:
    """World/CFG/SP groups: vllm-omni's diffusion state > torch.distributed world > one rank."""
    state = sys.modules.get(OMNI_STATE)
    if state is not None:
        found = _from_omni(state)
    elif dist.is_available() and dist.is_initialized():
        found = HostGroups(dist.group.WORLD, None, None, "torch.distributed")
    else:
        found = HostGroups(None, None, None, "single rank")
    logger.debug(
        "Parallel groups from %s: world=%s cfg=%s sp=%s",
        found.source,
        _describe(found.world),
        _describe(found.cfg),
        _describe(found.sp),
    )
    return found


def _describe(group: dist.ProcessGroup | None) -> str:
    if group is None:
        return "none"
    try:
        return f"{group.rank()}/{group.size()}"
    except Exception as exc:  # only for the log line
        return f"unreadable ({type(exc).__name__})"
