"""The connector's settings, read strictly from ``kv_connector_extra_config``.

Both halves (scheduler and worker) parse the same dict, once, at construction; a wrong value is
a :class:`~omnikv.errors.ConfigError` naming the key, an unknown key one WARNING.

Keys:

* ``omni_kv_config``: the stage's omnikv configuration (connector, timeouts), as for the manager.
  ``need_send_cache`` / ``need_recv_cache`` default from ``kv_role``.
* ``vllm_kv_layout``: the cache layout, when the attention backend does not say it.
* ``max_concurrent_loads`` (16): loads in flight at once on a consumer worker; more wait in
  order, each still bound by its own deadline (counted from admission).
* ``load_first_wait_s`` (0.5): how long a load waits for its KV on those threads; one whose KV
  has not arrived by then waits out the rest of its deadline on one of ``max_waiting_loads``
  (64) other threads, so ids that never arrive cannot hold up loads whose KV is there. A load
  under a router's id (early hand-off) waits there from the start.
* ``idle_step_wait_s`` (0.002): in an engine step that schedules no tokens while sends or loads
  are in flight, the worker waits up to this long for one to end before the step returns (0:
  never). vLLM's engine loop steps without pause while requests wait for remote KV (a
  consumer) or for their sends (a producer: ``has_pending_push_work``); on the worker's
  thread that spin holds the GIL between steps, and the transfer threads coding, checking and
  writing KV in the same process wait for it. The wait gives them the CPU and ends as soon as
  a transfer ends, which that step then reports (not the next). A load whose payload has
  arrived when the wait ends (it checks and writes bytes that are here) is waited for once
  more, at most as long again: reported a step later, it would wait out vLLM's pause after
  the idle step and a whole step more.
* ``max_concurrent_sends`` (4): sends in flight at once on a producer worker.
* ``stream_layer_groups`` (2 for a cache in host memory, 1 for one on a device): with
  ``stream_kv`` (in ``omni_kv_config``), how many layer groups a producer ships each step's
  newly full blocks in. 1: one chunk per step, after the step's forward pass
  (``wait_for_save``). ``G`` > 1: the layers are cut into ``G`` runs of
  consecutive layers (at most the model's layer count), and each run ships from
  ``save_kv_layer`` as soon as the forward pass has written its last layer, so the step's
  first layers cross the link while the later ones compute (the last step's included, which
  shortens the tail after the finish). Each group is a chunk of its own (a put, a MAC, a
  check and a write at the consumer), shipped on the runner's thread inside the forward pass:
  with a CUDA cache its copy to host waits for those layers' kernels there (hence 1 by
  default on a device, where that cost is not measured). A forward pass that never calls
  ``save_kv_layer`` ships one whole chunk per step, as with 1.
* ``auth_secret``: shared by producer and consumer; transfer ids carry a MAC bound to the
  request and payloads a MAC over their bytes. A router that holds it may issue the transfer
  ids itself (early hand-off: :func:`~omnikv.integrations.vllm.binding.new_router_transfer_id`).
  Falls back to ``omni_kv_config.connector_config.auth_secret``, then to the environment
  variable ``OMNIKV_AUTH_SECRET``. ``auth_secret_file`` (here or in ``connector_config``, in
  place of ``auth_secret``) names a file holding it, so that the secret stays off command lines
  and out of vLLM's logged arguments (:func:`~omnikv.values.resolve_secret`).
* ``model_id``: the model identity in the binding (default: the model's name or path); set it
  on both sides when the same weights live under different paths.
* ``producer_tag``: this producer's tag (8 lowercase hex; default derived from the connector
  namespace). ``accept_producer_tags``: the tags a consumer accepts (default: the one derived
  from its namespace).
* ``verify_finite`` (false): a consumer refuses KV with NaN or infinite values (one pass over
  the payload).
* ``free_blocks_on`` (``"staged"``): when a producer hands a request's blocks back to vLLM.
  ``staged``: once its payload is in the connector's memory (a copy; the blocks are not read
  again, so this is safe and frees them soonest); ``verdict``: once the consumer's verdict is in
  (delivered, refused, or expired by the connector's TTL / ``ack_timeout_s``), for deployments
  that keep the blocks until the consumer has the KV. Connectors without verdicts always free
  at ``staged``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from omnikv.errors import ConfigError
from omnikv.integrations.vllm.binding import is_tag, producer_tag
from omnikv.layouts.blocks import VLLM_BLOCK_LAYOUTS
from omnikv.values import (
    parse_bool,
    parse_choice,
    parse_int,
    parse_number,
    parse_positive,
    resolve_secret,
)

__all__ = [
    "MAX_IDLE_STEP_WAIT_S",
    "MAX_STREAM_LAYER_GROUPS",
    "ConnectorOptions",
    "default_layer_groups",
    "parse_options",
]

#: Longest ``idle_step_wait_s`` (seconds).
MAX_IDLE_STEP_WAIT_S = 0.1
#: Most ``stream_layer_groups`` (a step's chunks; the stream's chunk count is bounded too).
MAX_STREAM_LAYER_GROUPS = 64

logger = logging.getLogger(__name__)

_KNOWN = frozenset(
    {
        "omni_kv_config",
        "vllm_kv_layout",
        "max_concurrent_loads",
        "max_concurrent_sends",
        "max_waiting_loads",
        "load_first_wait_s",
        "idle_step_wait_s",
        "stream_layer_groups",
        "auth_secret",
        "auth_secret_file",
        "model_id",
        "producer_tag",
        "accept_producer_tags",
        "verify_finite",
        "free_blocks_on",
    }
)


@dataclass(frozen=True)
class ConnectorOptions:
    """Parsed ``kv_connector_extra_config`` (see the module doc for each key)."""

    omni_kv_config: dict[str, Any] = field(repr=False)  # may hold the secret
    layout: str | None
    max_concurrent_loads: int
    max_waiting_loads: int
    load_first_wait_s: float
    max_concurrent_sends: int
    secret: bytes | None = field(repr=False)
    model_id: str | None
    tag: str
    accepted_tags: frozenset[str]
    verify_finite: bool
    free_blocks_on: str = "staged"
    idle_step_wait_s: float = 0.002
    #: ``None``: the default for the cache's device (:func:`default_layer_groups`)
    stream_layer_groups: int | None = None


def _omni_kv_config(extra: Mapping[str, Any], producer: bool, consumer: bool) -> dict[str, Any]:
    raw = extra.get("omni_kv_config")
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"omni_kv_config must be a dict, got {type(raw).__name__}")
    cfg = dict(raw or {})
    cfg.setdefault("need_send_cache", producer)
    cfg.setdefault("need_recv_cache", consumer)
    return cfg


def _tag(key: str, value: Any) -> str:
    if not is_tag(value):
        raise ConfigError(f"{key} must be 8 lowercase hex digits, got {value!r:.60}")
    return str(value)


def parse_options(extra: Mapping[str, Any], *, producer: bool, consumer: bool) -> ConnectorOptions:
    """Read ``kv_connector_extra_config``; called by both halves of the connector."""
    unknown = sorted(str(k) for k in extra if k not in _KNOWN)
    if unknown:
        logger.warning("OmniKVConnector: unknown kv_connector_extra_config keys %s", unknown)
    cfg = _omni_kv_config(extra, producer, consumer)
    layout = extra.get("vllm_kv_layout")
    if layout is not None and layout not in VLLM_BLOCK_LAYOUTS:
        raise ConfigError(f"vllm_kv_layout must be one of {VLLM_BLOCK_LAYOUTS}, got {layout!r:.60}")
    conn = cfg.get("connector_config")
    conn = conn if isinstance(conn, Mapping) else {}
    secret = resolve_secret(extra, env=False)
    if secret is None:
        secret = resolve_secret(conn, "connector_config.")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError(f"model_id must be a non-empty string, got {model_id!r:.60}")
    derived = producer_tag(str(conn.get("namespace", "")))
    tag = (
        derived
        if extra.get("producer_tag") is None
        else _tag("producer_tag", extra["producer_tag"])
    )
    accepted = extra.get("accept_producer_tags")
    if accepted is None:
        tags = frozenset({tag})
    elif isinstance(accepted, list | tuple) and accepted:
        tags = frozenset(_tag("accept_producer_tags", t) for t in accepted)
    else:
        raise ConfigError(f"accept_producer_tags must be a non-empty list, got {accepted!r:.60}")
    return ConnectorOptions(
        omni_kv_config=cfg,
        layout=None if layout is None else str(layout),
        max_concurrent_loads=parse_int(
            "max_concurrent_loads", extra.get("max_concurrent_loads"), 16
        ),
        max_waiting_loads=parse_int("max_waiting_loads", extra.get("max_waiting_loads"), 64),
        load_first_wait_s=parse_positive("load_first_wait_s", extra.get("load_first_wait_s"), 0.5),
        max_concurrent_sends=parse_int(
            "max_concurrent_sends", extra.get("max_concurrent_sends"), 4
        ),
        secret=secret,
        model_id=model_id,
        tag=tag,
        accepted_tags=tags,
        verify_finite=parse_bool("verify_finite", extra.get("verify_finite")),
        free_blocks_on=parse_choice(
            "free_blocks_on", extra.get("free_blocks_on"), "staged", ("staged", "verdict")
        ),
        idle_step_wait_s=_idle_wait(extra.get("idle_step_wait_s")),
        stream_layer_groups=_layer_groups(extra.get("stream_layer_groups")),
    )


def _idle_wait(value: Any) -> float:
    """``idle_step_wait_s``: 0 to :data:`MAX_IDLE_STEP_WAIT_S` (longer would delay new work)."""
    out = parse_number("idle_step_wait_s", value, 0.002)
    if out > MAX_IDLE_STEP_WAIT_S:
        raise ConfigError(f"idle_step_wait_s must be <= {MAX_IDLE_STEP_WAIT_S}, got {out}")
    return out


def default_layer_groups(device: torch.device) -> int:
    """``stream_layer_groups`` when not set, for a cache on ``device``: 2 in host memory (where
    ``omnikv bench stream --vllm`` measured it shortest), 1 on a device (a group shipped inside
    the forward pass waits for its layers' kernels)."""
    return 2 if device.type == "cpu" else 1


def _layer_groups(value: Any) -> int | None:
    """``stream_layer_groups``: 1 to :data:`MAX_STREAM_LAYER_GROUPS` (``None``: not set)."""
    if value is None:
        return None
    out = parse_int("stream_layer_groups", value, 1)
    if out > MAX_STREAM_LAYER_GROUPS:
        raise ConfigError(f"stream_layer_groups must be <= {MAX_STREAM_LAYER_GROUPS}, got {out}")
    return out
