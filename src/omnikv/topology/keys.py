"""Transfer keys, stage ids and the worker's hooks.

Keys (shared with the reference and its worker connector mixin):

* legacy key, when both sides run TP 1: ``omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}``;
* rank-aware key otherwise: ``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``.

A stage id has one spelling everywhere (:func:`stage_key`: ``1`` and ``"1"`` are the same stage).
The sender and receiver read the worker's hooks as one :class:`TransferHooks` value. Plain values
and pure functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omnikv.topology.tp import KVTPTopology, PayloadMerger, PayloadSlicer, adapt_slicer

__all__ = [
    "RecvKeyBuilder",
    "SendKeyBuilder",
    "TransferHooks",
    "build_recv_keys",
    "build_send_keys",
    "legacy_kv_key",
    "rank_aware_kv_key",
    "recv_stages_of",
    "send_stages_of",
    "stage_key",
    "stage_number",
]

SendKeyBuilder = Callable[[str, str, str], Sequence[str]]
"""``(request_id, from_stage, to_stage) -> keys`` hook for senders."""
RecvKeyBuilder = Callable[[str, str, str], Sequence["str | tuple[str, int | None]"]]
"""``(request_id, from_stage, to_stage) -> keys or (key, from_rank)`` hook for receivers."""


def legacy_kv_key(from_stage: str, to_stage: str, request_id: str) -> str:
    """``omni_{from}_to_{to}_kv_cache_{request_id}`` (TP 1 on both sides)."""
    return f"omni_{from_stage}_to_{to_stage}_kv_cache_{request_id}"


def rank_aware_kv_key(
    request_id: str, from_stage: str, chunk_id: int, from_rank: int, to_rank: int
) -> str:
    """``{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}``."""
    return f"{request_id}_{from_stage}_{chunk_id}_{from_rank}_{to_rank}"


def build_send_keys(
    topo: KVTPTopology,
    request_id: str,
    from_stage: str,
    to_stage: str,
    hook: SendKeyBuilder | None = None,
) -> list[str]:
    """Keys the local sender rank puts ``request_id`` under, one per target rank.

    A hook that returns a non-empty list wins.
    """
    if hook is not None:
        keys = list(hook(request_id, from_stage, to_stage) or [])
        if keys:
            return [str(k) for k in keys]
    if topo.is_legacy:
        return [legacy_kv_key(from_stage, to_stage, request_id)]
    return [
        rank_aware_kv_key(request_id, from_stage, 0, topo.local_rank, to_rank)
        for to_rank in topo.target_ranks()
    ]


def build_recv_keys(
    topo: KVTPTopology,
    request_id: str,
    from_stage: str,
    to_stage: str,
    hook: RecvKeyBuilder | None = None,
) -> list[tuple[str, int | None]]:
    """``(key, from_rank)`` pairs the local receiver rank waits for, in source-rank order.

    A hook that returns a non-empty list wins: tuples are used as given; plain strings are
    paired with the computed source ranks when the counts match, else with ``None``.
    """
    if hook is not None:
        raw = list(hook(request_id, from_stage, to_stage) or [])
        if raw:
            sources = topo.source_ranks() if not topo.is_legacy else [None]
            strings = [k for k in raw if not isinstance(k, tuple)]
            pair_ranks = len(strings) == len(raw) and len(raw) == len(sources)
            out: list[tuple[str, int | None]] = []
            for i, item in enumerate(raw):
                if isinstance(item, tuple):
                    out.append((str(item[0]), item[1]))
                else:
                    out.append((str(item), sources[i] if pair_ranks else None))
            return out
    if topo.is_legacy:
        return [(legacy_kv_key(from_stage, to_stage, request_id), None)]
    return [
        (rank_aware_kv_key(request_id, from_stage, 0, src, topo.local_rank), src)
        for src in topo.source_ranks()
    ]


# --------------------------------------------------------------------------------------------
# Stage ids: "1" and 1 are the same stage everywhere
# --------------------------------------------------------------------------------------------
def stage_key(value: Any) -> str | None:
    """The one spelling of a stage id: ``None``/``""`` -> ``None``; ``1``, ``"1"``, ``" 1"`` ->
    ``"1"``; other names (``"stage2"``) as given. Booleans are not stage ids (``None``)."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    text = str(value).strip()
    if not text:
        return None
    try:
        return str(int(text))
    except ValueError:
        return text


def stage_number(value: Any) -> int | None:
    """The stage id as a number (:func:`stage_key`), or ``None`` for a named stage."""
    key = stage_key(value)
    try:
        return None if key is None else int(key)
    except ValueError:
        return None


def send_stages_of(from_stage: Any, to_stage: Any) -> tuple[str | None, str | None]:
    """``(from, to)`` when both are configured (stage 0 counts), else ``(None, None)``."""
    src, dst = stage_key(from_stage), stage_key(to_stage)
    return (src, dst) if src is not None and dst is not None else (None, None)


def recv_stages_of(
    from_stage: Any, stage_id: Any, engine_input_source: Sequence[Any] | None
) -> tuple[str | None, str | None]:
    """``(source, stage)`` a receiver reads from (reference rule, stage ids normalised).

    The source is ``engine_input_source[0]`` when given; else, for a numeric ``stage_id`` (``3``
    or ``"3"``), the stage before it; else ``from_stage``.
    """
    stage = stage_key(stage_id)
    number = stage_number(stage_id)
    source: Any = from_stage
    if engine_input_source:
        source = engine_input_source[0]
    elif number is not None:
        source = number - 1
    src = stage_key(source)
    return (src, stage) if src is not None and stage is not None else (None, None)


# --------------------------------------------------------------------------------------------
# Hooks: the reference's calling conventions, and omnikv's richer ones
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransferHooks:
    """The worker's optional hooks, as one frozen value the sender and receiver read.

    * ``send_keys(request_id, from_stage, to_stage) -> keys``;
    * ``recv_keys(request_id, from_stage, to_stage) -> keys or (key, from_rank) pairs``;
    * ``merger(payloads) -> payload`` (seed dicts, in source-rank order);
    * ``slicer(payload) -> payload`` as the reference calls it, or ``slicer(payload, topo)``.

    Build it with :meth:`of`, which adapts the reference's one-argument slicer.
    """

    send_keys: SendKeyBuilder | None = None
    recv_keys: RecvKeyBuilder | None = None
    merger: PayloadMerger | None = None
    slicer: PayloadSlicer | None = None

    @classmethod
    def of(
        cls,
        send_keys: Callable[..., Any] | None = None,
        recv_keys: Callable[..., Any] | None = None,
        merger: Callable[..., Any] | None = None,
        slicer: Callable[..., Any] | None = None,
    ) -> TransferHooks:
        return cls(send_keys, recv_keys, merger, adapt_slicer(slicer))
