"""The send path: one deadline, transient-only retries, and one bad request never sinks a batch.

Each attack test hands ``handle_finished_requests_kv_transfer`` a batch with a good request
around the bad one: the good ones are sent, the bad one fails alone with a reason, and every id
comes back.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest
import torch

from conftest import PairFactory, make_paged_caches
from omnikv import OmniKVCacheConfig, OmniKVTransferManager, RetryPolicy, SendStatus
from omnikv.connectors.base import PutResult, Writer
from omnikv.connectors.local import LocalConnector
from omnikv.errors import (
    ConnectorClosedError,
    ConnectorUnavailableError,
    PeerGoneError,
    PoolExhaustedError,
)
from omnikv.transfer.send import put_with_retry
from omnikv.wire.transfer_data import KVCacheTransferData

POLICY = RetryPolicy(attempts=3, backoff_base=0.1)


class _Scripted(LocalConnector):
    """A connector whose ``put_packed`` follows a script: an exception, False, or True."""

    def __init__(self, script: list[Any], namespace: str) -> None:
        super().__init__({"namespace": namespace})
        self.script = list(script)
        self.deadlines: list[float] = []

    def put_packed(
        self,
        from_stage: str,
        to_stage: str,
        put_key: str,
        nbytes: int,
        write: Writer,
        *,
        deadline: float = math.inf,
    ) -> PutResult:
        self.deadlines.append(deadline)
        step = self.script.pop(0) if self.script else True
        if isinstance(step, BaseException):
            raise step
        if step is False:
            return False, 0, None
        return super().put_packed(from_stage, to_stage, put_key, nbytes, write, deadline=deadline)


def _payload() -> Any:
    return KVCacheTransferData("r", {"key_cache": [torch.ones(2, 1, 1)]}).plan()


def _put(conn: _Scripted, deadline: float = math.inf) -> tuple[tuple[bool, int, Any], list[float]]:
    slept: list[float] = []
    out = put_with_retry(
        conn, ("0", "1"), "k", _payload(), POLICY, deadline=deadline, sleep=slept.append
    )
    return out, slept


# -- retries ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error", [False, ConnectorUnavailableError("down"), PoolExhaustedError("full")]
)
def test_refused_and_transient_puts_are_retried_with_backoff(namespace: str, error: Any) -> None:
    (ok, size, _), slept = _put(_Scripted([error, error], namespace))
    assert ok and size > 0
    assert slept == pytest.approx([0.1, 0.2])


def test_a_put_refused_every_time_fails_after_the_policys_attempts(namespace: str) -> None:
    conn = _Scripted([False, False, False], namespace)
    (ok, size, reason), slept = _put(conn)
    assert (ok, size, reason) == (False, 0, "connector refused the put")
    assert len(conn.deadlines) == 3 and slept == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize(
    "error",
    [ConnectorClosedError("closed"), PeerGoneError("gone"), RuntimeError("bug"), ValueError("x")],
)
def test_other_errors_are_never_retried(namespace: str, error: BaseException) -> None:
    conn = _Scripted([error], namespace)
    (ok, _, reason), slept = _put(conn)
    assert not ok and type(error).__name__ in (reason or "")
    assert slept == [] and len(conn.deadlines) == 1


def test_no_retry_that_would_start_past_the_deadline(namespace: str) -> None:
    conn = _Scripted([PoolExhaustedError("full")] * 3, namespace)
    (ok, _, reason), slept = _put(conn, deadline=time.monotonic() + 0.05)
    assert not ok and "PoolExhaustedError" in (reason or "")
    assert slept == [] and len(conn.deadlines) == 1  # a 0.1 s back-off would pass the deadline


def test_every_put_of_a_call_gets_the_same_send_deadline(
    namespace: str, paged_caches: list[torch.Tensor]
) -> None:
    conn = _Scripted([], namespace)
    mgr = OmniKVTransferManager(
        OmniKVCacheConfig(from_stage="0", to_stage="1", need_send_cache=True), connector=conn
    )
    t0 = time.monotonic()
    reqs = {f"r{i}": {"block_ids": [0], "seq_len": 3} for i in range(3)}
    mgr.handle_finished_requests_kv_transfer(reqs, paged_caches, 8, "float32")
    assert len(set(conn.deadlines)) == 1
    assert t0 + 29.0 < conn.deadlines[0] <= time.monotonic() + 30.0  # send_timeout default


def test_numpy_integer_block_ids_are_block_ids(manager_pair: PairFactory) -> None:
    sender, receiver = manager_pair()
    ids = [np.int64(1), np.int32(2)]
    sender.handle_finished_requests_kv_transfer(
        {"np": {"block_ids": ids, "seq_len": 16}}, make_paged_caches(), 8, "float32"
    )
    data, _ = receiver.receive_kv_cache_for_request("np")
    assert data is not None and data["block_ids"] == [1, 2]


# -- one bad request fails alone ------------------------------------------------------------------
GOOD = {"block_ids": [0, 1], "seq_len": 10}


def _batch(
    manager_pair: PairFactory,
    bad: Any,
    *,
    caches: Any = "paged",
    block_size: Any = 8,
    cache_dtype: Any = "float32",
) -> tuple[OmniKVTransferManager, list[str]]:
    sender, _ = manager_pair()
    reqs = {"before": dict(GOOD), "bad": bad, "after": dict(GOOD)}
    caches = make_paged_caches() if caches == "paged" else caches
    ids = sender.handle_finished_requests_kv_transfer(reqs, caches, block_size, cache_dtype)
    return sender, ids


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"block_ids": [0, None], "seq_len": 10}, "block_ids must be ints"),
        ({"block_ids": [0, 1.7], "seq_len": 10}, "1.7"),
        ({"block_ids": [0, True], "seq_len": 10}, "block_ids must be ints"),
        ({"block_ids": [0, "1"], "seq_len": 10}, "block_ids must be ints"),
        ({"block_ids": [0, torch.tensor(1)], "seq_len": 10}, "Tensor"),
        ({"block_ids": "12", "seq_len": 10}, "list of ints"),
        ({"block_ids": torch.tensor([0, 1]), "seq_len": 10}, "list of ints"),
        ({"block_ids": [0, 1], "seq_len": 10, "custom_metadata": {"x": object()}}, "JSON"),
        (
            {"block_ids": [0, 1], "seq_len": 10, "custom_metadata": {"seq_len": torch.ones(2)}},
            "Tensor",
        ),
        ({"block_ids": [0, 1], "seq_len": 10.0}, "seq_len"),
        ({"block_ids": [0, 1], "seq_len": 10, "custom_metadata": {"seq_len": 99}}, "seq_len"),
        ({"block_ids": [0, 1], "seq_len": 10, "custom_metadata": {"block_size": 4}}, "block_size"),
        ({"block_ids": [0, 1], "seq_len": 10, "custom_metadata": [1]}, "custom_metadata"),
        ({"block_ids": [0, 99], "seq_len": 10}, "outside"),
        ("not a dict", "no block_ids"),
    ],
)
def test_a_bad_request_fails_alone_with_its_reason(
    manager_pair: PairFactory, bad: Any, reason: str
) -> None:
    sender, ids = _batch(manager_pair, bad)
    assert ids == ["before", "bad", "after"]
    got = {r.request_id: r for r in sender.last_send_results}
    assert got["before"].ok and got["after"].ok
    assert not got["bad"].ok and reason in (got["bad"].reason or "")


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"block_size": "8"}, "block_size must be an int"),
        ({"block_size": 8.0}, "block_size must be an int"),
        ({"caches": None}, "kv_caches must be a list"),
        ({"cache_dtype": "bfloat16"}, "does not match cache_dtype"),
        ({"cache_dtype": 5}, "cache_dtype must be a str"),
    ],
)
def test_a_bad_batch_argument_fails_every_request_and_returns_every_id(
    manager_pair: PairFactory, kwargs: dict[str, Any], reason: str
) -> None:
    sender, ids = _batch(manager_pair, dict(GOOD), **kwargs)
    assert ids == ["before", "bad", "after"]
    results = sender.last_send_results
    assert [r.status for r in results] == [SendStatus.FAILED] * 3
    assert all(reason in (r.reason or "") for r in results)


@pytest.mark.parametrize(
    ("v_shape", "v_dtype", "reason"),
    [((8, 8, 2, 16), torch.float32, "heads"), ((8, 8, 4, 16), torch.float16, "dtype")],
)
def test_k_and_v_that_disagree_fail_that_request(
    manager_pair: PairFactory, v_shape: tuple[int, ...], v_dtype: Any, reason: str
) -> None:
    k = torch.zeros(8, 8, 4, 16)
    layer = (k, torch.zeros(v_shape, dtype=v_dtype))
    sender, _ = manager_pair()
    sender.handle_finished_requests_kv_transfer({"r": dict(GOOD)}, [layer], 8, "auto")
    res = sender.get_send_result("r")
    assert res is not None and not res.ok and reason in (res.reason or "")


def test_cache_dtype_names_are_checked_and_auto_is_not(
    manager_pair: PairFactory,
) -> None:
    sender, _ = manager_pair()
    bf16 = make_paged_caches(dtype=torch.bfloat16)
    for name, ok in (("torch.bfloat16", True), ("bf16", True), ("auto", True), ("half", False)):
        sender.handle_finished_requests_kv_transfer({name: dict(GOOD)}, bf16, 8, name)
        assert sender.get_send_result(name).ok is ok, name


def test_kv_that_requires_grad_is_detached_and_sent_once(
    manager_pair: PairFactory,
) -> None:
    sender, receiver = manager_pair()
    caches = [c.requires_grad_() for c in make_paged_caches()]
    sender.handle_finished_requests_kv_transfer({"g": dict(GOOD)}, caches, 8, "float32")
    res = sender.get_send_result("g")
    assert res is not None and res.ok
    data, _ = receiver.receive_kv_cache_for_request("g")
    assert data is not None
    k = data["layer_blocks"]["key_cache"][0]
    assert not k.requires_grad and torch.equal(k, caches[0][0, :2].detach().reshape(16, 4, 16)[:10])


class _HFLikeCache:
    """Duck-typed stand-in for a transformers cache (``.layers`` of keys/values)."""

    def __init__(self) -> None:
        self.layers = [torch.zeros(1, 4, 3, 16)]


def test_a_transformers_cache_is_refused_with_a_pointer_to_send_hf_cache(
    manager_pair: PairFactory,
) -> None:
    sender, _ = manager_pair()
    sender.handle_finished_requests_kv_transfer({"h": dict(GOOD)}, _HFLikeCache(), 8, "float32")
    reason = sender.get_send_result("h").reason or ""
    assert "send_hf_cache" in reason and "_HFLikeCache" in reason


def test_a_layout_error_names_the_shape_and_the_layouts_accepted(
    manager_pair: PairFactory,
) -> None:
    sender, _ = manager_pair()
    seq_first = [torch.zeros(1, 4, 16, 16)]  # [batch, heads, seq, dim]: not a paged layout
    sender.handle_finished_requests_kv_transfer({"l": dict(GOOD)}, seq_first, 8, "float32")
    reason = sender.get_send_result("l").reason or ""
    assert "(1, 4, 16, 16)" in reason and "kv_first" in reason and "blocks_first" in reason


def test_finished_reqs_that_is_not_a_dict_fails_each_id(manager_pair: PairFactory) -> None:
    sender, _ = manager_pair()
    not_a_dict: Any = ["a", "b"]
    ids = sender.handle_finished_requests_kv_transfer(not_a_dict, make_paged_caches(), 8, "f")
    assert ids == ["a", "b"]
    assert all("must be a dict" in (r.reason or "") for r in sender.last_send_results)
