"""What the scheduler half tells the worker half, once per engine step.

The metadata crosses a process boundary in vLLM (engine core -> workers), so it holds plain
values only. Deadlines travel as seconds left, not as clock readings: the worker may run on
another node, whose monotonic clock is not the scheduler's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnikv.integrations.vllm._vllm import KVConnectorMetadata

__all__ = ["LoadSpec", "OmniKVConnectorMetadata", "SendSpec", "StreamSpec"]


@dataclass(frozen=True)
class SendSpec:
    """A finished producer request whose prompt KV is to be sent under ``key``."""

    req_id: str
    transfer_id: str
    key: str
    binding: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class StreamSpec:
    """A producer request still in prefill whose first ``num_tokens`` prompt tokens will have
    their KV written once this step's forward pass ends: its full blocks ship under ``key``
    (``stream_kv``), ahead of the request's finish."""

    req_id: str
    key: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class LoadSpec:
    """A consumer request whose tokens ``[start, end)`` are to be loaded from ``key``.

    ``remaining_s`` is what was left of the request's ``recv_timeout`` when the scheduler
    built this step's metadata (the deadline counts from admission, not from the load's start).
    ``early``: the transfer id is a router's (early hand-off), so the KV is expected to arrive
    while the producer is still computing it.
    """

    req_id: str
    transfer_id: str
    key: str
    binding: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    remaining_s: float
    early: bool = False


@dataclass
class OmniKVConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> worker, once per engine step.

    ``sends`` and ``loads`` to start; ``cancels``: request ids whose load is no longer wanted
    (the request was aborted while waiting for its KV); ``streams``: blocks to ship after this
    step's forward pass (``stream_kv``); ``stream_aborts``: keys of streams to drop (their
    request ended without a send); ``idle``: the step computes nothing.
    """

    sends: list[SendSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    streams: list[StreamSpec] = field(default_factory=list)
    stream_aborts: list[str] = field(default_factory=list)
    #: the step schedules no tokens (every request waits, e.g. for remote KV)
    idle: bool = False
