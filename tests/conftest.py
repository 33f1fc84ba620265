"""Shared test fixtures. Every test gets a default timeout from pyproject (pytest-timeout).

* ``namespace``: a connector namespace unique to the test;
* ``omni_kv``: the ``omni_kv_config`` dict of one stage, as a pipeline's YAML gives it;
* ``make_manager``: one manager from ``omni_kv(role, **extra)``, built as ``from_od_config``
  builds it (optionally with an injected connector or parallel context); closed at teardown;
* ``manager_pair``: a sender and a receiver manager over a ``LocalConnector``, built through
  ``from_od_config`` exactly as a worker builds them;
* ``paged_caches``: a paged KV cache (``[2, blocks, block_size, heads, dim]`` per layer);
* ``senders``: the sending-stage processes a test starts
  (:class:`support.stage_sender.SenderProc`), each killed by PID at teardown.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import OmniKVTransferManager
from omnikv._logging import reset_all as reset_rate_limited_logs
from omnikv.config import config_from_dict, options_from_dict, resolve_async_prefetch
from omnikv.connectors.base import OmniConnectorBase
from omnikv.topology.placement import RankInfo

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

ManagerPair = tuple[OmniKVTransferManager, OmniKVTransferManager]
PairFactory = Callable[..., ManagerPair]
ManagerFactory = Callable[..., OmniKVTransferManager]


@pytest.fixture(autouse=True)
def _fresh_log_limits() -> None:
    """Every test starts with fresh log rate limits (omnikv._logging), so the lines it expects
    do not depend on the tests before it in the same process."""
    reset_rate_limited_logs()


@pytest.fixture
def namespace() -> str:
    """A namespace unique to the test, so connectors of parallel tests never meet."""
    return f"t{uuid.uuid4().hex[:12]}"


def omni_kv_config(namespace: str, role: str, **extra: Any) -> dict[str, Any]:
    """One stage's ``omni_kv_config`` for the edge ``stage1 -> stage2`` over a LocalConnector.

    ``role`` is ``"sender"`` or ``"receiver"``; ``extra`` adds or overrides keys.
    """
    conf: dict[str, Any] = {
        "connector_config": {"type": "LocalConnector", "namespace": namespace},
        "omni_from_stage": "stage1",
    }
    if role == "sender":
        conf.update(omni_to_stage="stage2", need_send_cache=True)
    else:
        conf.update(stage_id="stage2", need_recv_cache=True, recv_timeout=1.0)
    conf.update(extra)
    return conf


@pytest.fixture
def omni_kv(namespace: str) -> Callable[..., dict[str, Any]]:
    """``omni_kv(role, **extra)``: :func:`omni_kv_config` in this test's namespace."""
    return lambda role, **extra: omni_kv_config(namespace, role, **extra)


def build_manager(
    omni_kv_config: dict[str, Any],
    *,
    connector: OmniConnectorBase | None = None,
    parallel_context: RankInfo | None = None,
) -> OmniKVTransferManager:
    """A manager from ``omni_kv_config``: ``from_od_config`` itself, or, with an injected
    ``connector`` (the dict's ``connector_config`` is then dropped) or ``parallel_context``, the
    same steps with those passed to the constructor."""
    if connector is None and parallel_context is None:
        return OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv_config))
    if connector is not None:
        omni_kv_config = {k: v for k, v in omni_kv_config.items() if k != "connector_config"}
    prefetch = resolve_async_prefetch(omni_kv_config, has_companion=False)
    return OmniKVTransferManager(
        config_from_dict(omni_kv_config, async_prefetch=prefetch),
        async_prefetch=prefetch,
        options=options_from_dict(omni_kv_config),
        parallel_context=parallel_context,
        connector=connector,
    )


@pytest.fixture
def make_manager(omni_kv: Callable[..., dict[str, Any]]) -> Iterator[ManagerFactory]:
    """``make_manager(role, *, connector=None, parallel_context=None, **extra)``: a manager
    from ``omni_kv(role, **extra)`` (see :func:`build_manager`); every one is closed at
    teardown."""
    made: list[OmniKVTransferManager] = []

    def make(
        role: str,
        *,
        connector: OmniConnectorBase | None = None,
        parallel_context: RankInfo | None = None,
        **extra: Any,
    ) -> OmniKVTransferManager:
        conf = omni_kv(role, **extra)
        mgr = build_manager(conf, connector=connector, parallel_context=parallel_context)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.close()


@pytest.fixture
def manager_pair(make_manager: ManagerFactory) -> PairFactory:
    """``manager_pair(**receiver_extra)``: (sender, receiver) made by ``from_od_config``."""

    def make(**receiver_extra: Any) -> ManagerPair:
        return make_manager("sender"), make_manager("receiver", **receiver_extra)

    return make


def make_paged_caches(
    layers: int = 2,
    blocks: int = 8,
    block_size: int = 8,
    heads: int = 4,
    dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Seeded random ``[2, blocks, block_size, heads, dim]`` caches, one per layer."""
    g = torch.Generator().manual_seed(1)
    shape = (2, blocks, block_size, heads, dim)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(layers)]


@pytest.fixture
def paged_caches() -> list[torch.Tensor]:
    """Two layers of 8 blocks x 8 tokens x 4 heads x 16 dims (float32)."""
    return make_paged_caches()


@pytest.fixture
def senders() -> Iterator[list[Any]]:
    started: list[Any] = []
    try:
        yield started
    finally:
        for s in started:
            with contextlib.suppress(AssertionError):
                s.kill()
