"""The scheduler half (admission, transfer ids, block bookkeeping, deadlines) through the facade's
scheduler hooks: client input refused at once, never waited for; keys bound to the request and
the engine; router ids only for their own producer.
"""

from __future__ import annotations

import time
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest

from support import vllm_halves as halves
from support.vllm_fixtures import edge_fixture, secure_fixture  # noqa: F401 (fixtures)
from support.vllm_halves import PROMPT

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def test_transfer_ids_are_fresh_and_unguessable(edge: Any) -> None:
    from omnikv.integrations.vllm.binding import check_transfer_id, producer_tag

    ids = set()
    for i in range(50):
        request = halves.make_request(f"r{i}", {"do_remote_decode": True}, computed=len(PROMPT))
        _, params = edge.producer.sched.request_finished(request, [1])
        ids.add(params["omnikv_transfer_id"])
    assert len(ids) == 50
    tag = producer_tag(edge.conn["namespace"])
    for tid in ids:
        assert check_transfer_id(tid, frozenset({tag}), "0" * 32, None) is None
        assert tid.startswith(f"okv1-{tag}-") and len(tid.split("-")[2]) == 32
    halves.step(edge.producer, {f"r{i}" for i in range(50)})


@pytest.mark.timing
@pytest.mark.parametrize(
    "change",
    [
        {"omnikv_transfer_id": ""},
        {"omnikv_transfer_id": 12},
        {"omnikv_transfer_id": "never-sent"},
        {"omnikv_transfer_id": "okv1-" + "a" * 200},
        {"omnikv_transfer_id": "okv1-0000000g-" + "0" * 32},
        {"omnikv_transfer_id": "okv1-deadbeef-" + "0" * 32},  # a foreign producer tag
        {"omnikv_transfer_id": "OKV1-deadbeef-" + "0" * 32},
        {"omnikv_binding": "0" * 32},  # the client's binding is not this request's
        {"omnikv_binding": "not-hex"},
        {"omnikv_num_tokens": True},
        {"omnikv_num_tokens": 0},
        {"omnikv_num_tokens": "10"},
    ],
)
def test_params_that_cannot_be_ours_are_refused_at_once(edge: Any, change: dict[str, Any]) -> None:
    ns = edge.consumer_omni["connector_config"]["namespace"]
    from omnikv.integrations.vllm.binding import new_transfer_id, producer_tag

    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
        "omnikv_num_tokens": len(PROMPT),
    }
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(halves.make_request("ok", params), 0) == (
        len(PROMPT),
        True,
    )
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(halves.make_request("x", params | change), 0) == (
        0,
        False,
    )
    assert time.monotonic() - t0 < 0.05
    assert sched.stats() == {"loads_refused": 1}
    stats = sched.get_kv_connector_stats()
    assert stats is not None and stats.data["loads_refused"] == 1
    assert sched.get_kv_connector_stats() is None  # one interval each


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": False}, ["x"], "x"])
def test_requests_without_remote_prefill_are_left_alone(edge: Any, params: Any) -> None:
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(halves.make_request("a", params), 0) == (0, False)
    assert sched.stats() == {}


def test_a_stolen_id_with_another_prompt_neither_loads_nor_destroys(edge: Any) -> None:
    """Check first, consume only what fits: the thief's key is not the victim's."""
    params = halves.send(edge.producer, [3, 5, 1])
    thief_params = {k: v for k, v in params.items() if k != "omnikv_binding"}
    other_prompt = [t + 1 for t in PROMPT]
    thief = halves.make_request("thief", thief_params, prompt=other_prompt)
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(thief, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(thief, halves.allocated([0, 1, 2]), len(PROMPT))
    assert halves.step(edge.consumer, set()).failed_recving == {"thief"}
    assert not any(t.any() for t in edge.consumer.caches.values())
    # The victim still gets its KV.
    results = halves.load(edge.consumer, params, "victim", [6, 2, 7])
    assert results.finished_recving == {"victim"} and not results.failed_recving
    assert halves.same_tokens(edge, [6, 2, 7], [3, 5, 1])


@pytest.mark.parametrize(
    "change",
    [
        {"lora_request": SimpleNamespace(lora_name="adapter-a")},
        {"cache_salt": "tenant-b"},
        {"mm_features": [SimpleNamespace(identifier="image-hash-1")]},
        {"prompt_token_ids": [*PROMPT[:-1], 999]},
    ],
)
def test_the_binding_covers_adapter_salt_media_and_tokens(
    edge: Any, change: dict[str, Any]
) -> None:
    """KV sent for one request never loads into a request that differs in any bound input."""
    params = halves.send(edge.producer, [3, 5, 1])
    request = halves.make_request("c", {k: v for k, v in params.items() if k != "omnikv_binding"})
    for name, value in change.items():
        setattr(request, name, value)
    sched = edge.consumer.sched
    assert sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(request, halves.allocated([0, 1, 2]), len(PROMPT))
    assert halves.step(edge.consumer, set()).failed_recving == {"c"}
    assert not any(t.any() for t in edge.consumer.caches.values())
    # With the client's binding kept, the mismatch is refused at admission instead.
    request2 = halves.make_request("c2", params)
    for name, value in change.items():
        setattr(request2, name, value)
    assert sched.get_num_new_matched_tokens(request2, 0) == (0, False)


def test_a_different_model_never_loads(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    other = halves.pair("kv_consumer", edge.consumer_omni, model="another-model")
    edge.made.append(other)
    assert other.sched.get_num_new_matched_tokens(halves.make_request("c", params), 0) == (0, False)
    request = halves.make_request("c2", {k: v for k, v in params.items() if k != "omnikv_binding"})
    assert other.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
    other.sched.update_state_after_alloc(request, halves.allocated([0, 1, 2]), len(PROMPT))
    assert halves.step(other, set()).failed_recving == {"c2"}  # its key is not the payload's
    assert not any(t.any() for t in other.caches.values())


def test_with_a_secret_a_forged_id_is_refused_at_admission(secure: Any) -> None:
    params = halves.send(secure.producer, [3, 5, 1])
    tid = params["omnikv_transfer_id"]
    forged = tid[:-1] + ("0" if tid[-1] != "0" else "1")
    sched = secure.consumer.sched
    bad = dict(params, omnikv_transfer_id=forged)
    assert sched.get_num_new_matched_tokens(halves.make_request("x", bad), 0) == (0, False)
    no_mac = dict(params, omnikv_transfer_id=tid.rsplit("-", 1)[0])
    assert sched.get_num_new_matched_tokens(halves.make_request("y", no_mac), 0) == (0, False)
    # Another prompt with the genuine id: the MAC binds the id to its request.
    other = halves.make_request("z", {k: v for k, v in params.items() if k != "omnikv_binding"})
    other.prompt_token_ids = [t + 1 for t in PROMPT]
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
    assert sched.stats() == {"loads_refused": 3}


def test_n_greater_than_one_loads_once_and_shares(edge: Any) -> None:
    """vLLM copies the params to every child: one loads, the others wait, then use the cache."""
    params = halves.send(edge.producer, [3, 5, 1])
    sched = edge.consumer.sched
    first, second = halves.make_request("0_parent", params), halves.make_request("1_parent", params)
    assert sched.get_num_new_matched_tokens(first, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(first, halves.allocated([6, 2, 7]), len(PROMPT))
    assert sched.get_num_new_matched_tokens(second, 0) == (None, False)  # ask again later
    results = halves.step(edge.consumer, set())
    assert results.finished_recving == {"0_parent"} and not results.failed_recving
    # Loaded: the sibling finds the blocks in the prefix cache (vLLM passes its local hit).
    assert sched.get_num_new_matched_tokens(second, 8) == (0, False)
    assert edge.consumer.worker.stats()["loads_ok"] == 1
    assert "loads_failed" not in edge.consumer.worker.stats()


@pytest.mark.timing
def test_a_load_queued_past_its_deadline_fails_without_waiting(edge: Any) -> None:
    """The deadline counts from admission, on the scheduler's clock: a load whose
    ``recv_timeout`` passed before its step's metadata left fails at once on the worker."""
    params = halves.send(edge.producer, [3, 5, 1])
    now = [time.monotonic()]
    sched = halves.scheduler_half(edge.consumer_omni, clock=lambda: now[0])
    consumer = SimpleNamespace(sched=sched, worker=edge.consumer.worker)
    req = halves.make_request("late", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, halves.allocated([6, 2, 7]), len(PROMPT))
    now[0] += 0.6  # the request's recv_timeout (0.5 s) passes before the step runs
    t0 = time.monotonic()
    results = halves.step(consumer, set())
    assert results.failed_recving == {"late"}
    assert time.monotonic() - t0 < 0.3
    reason = edge.consumer.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "before the load could start" in reason


def test_producer_keeps_blocks_only_for_remote_decode(edge: Any) -> None:
    sched = edge.producer.sched
    plain = halves.make_request("a", None, computed=10)
    assert sched.request_finished(plain, [1, 2, 3]) == (False, None)
    aborted = halves.make_request("b", {"do_remote_decode": True}, computed=10)
    aborted.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(aborted, [1, 2, 3]) == (False, None)
    embeds = halves.make_request("e", {"do_remote_decode": True}, computed=10)
    embeds.prompt_token_ids = None
    assert sched.request_finished(embeds, [1, 2, 3]) == (False, None)
    assert not sched.has_pending_push_work()
    # The consumer role never sends.
    consumer_sched = edge.consumer.sched
    assert consumer_sched.request_finished(
        halves.make_request("c", {"do_remote_decode": True}, 10), [1]
    ) == (
        False,
        None,
    )


def test_a_producer_uses_only_its_own_fresh_router_ids(edge: Any) -> None:
    """Offered ids a producer must not use get a fresh id (counted): a producer-style id a
    client made up, a router id with a wrong MAC, one for another producer's tag, one another
    request used; consumers refuse the forged ones at admission."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.integrations.vllm.binding import new_router_transfer_id

    pair = halves.early_edge(edge)
    good = halves.router_id(pair.conn)
    forged = good[:-1] + ("0" if good[-1] != "0" else "1")
    offers = {
        "made-up": "okv1-" + good.split("-")[1] + "-" + "ab" * 16,
        "forged": forged,
        "other-secret": halves.router_id(pair.conn, b"not-the-secret"),
        "other-producer": new_router_transfer_id("0badc0de", b"r0uter"),
    }
    sched = pair.producer.sched
    for name, offered in offers.items():
        request = halves.make_request(
            f"p-{name}", {"do_remote_decode": True, "omnikv_transfer_id": offered}
        )
        request.num_computed_tokens = len(PROMPT)
        _, params = sched.request_finished(request, [1])
        assert params is not None and params["omnikv_transfer_id"] != offered, name
    first = halves.make_request("p-first", {"do_remote_decode": True, "omnikv_transfer_id": good})
    first.num_computed_tokens = len(PROMPT)
    assert sched.request_finished(first, [2])[1]["omnikv_transfer_id"] == good
    again = halves.make_request("p-again", {"do_remote_decode": True, "omnikv_transfer_id": good})
    again.num_computed_tokens = len(PROMPT)
    assert sched.request_finished(again, [3])[1]["omnikv_transfer_id"] != good
    assert sched.stats()["router_ids_refused"] == len(offers) + 1
    consumer = pair.consumer.sched
    for name in ("forged", "other-secret"):
        _, to_consumer = early_handoff_params(offers[name], len(PROMPT))
        assert consumer.get_num_new_matched_tokens(
            halves.make_request(f"c-{name}", to_consumer), 0
        ) == (
            0,
            False,
        ), name


def test_without_a_secret_there_are_no_router_ids(edge: Any) -> None:
    from omnikv.integrations.vllm import early_handoff_params

    pair = halves.early_edge(edge, secret=None)
    tid = halves.router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    request = halves.make_request("p1", to_producer)
    request.num_computed_tokens = len(PROMPT)
    _, params = pair.producer.sched.request_finished(request, [1])
    assert params is not None and params["omnikv_transfer_id"] != tid
    assert pair.producer.sched.stats()["router_ids_refused"] == 1
    assert pair.consumer.sched.get_num_new_matched_tokens(
        halves.make_request("c1", to_consumer), 0
    ) == (
        0,
        False,
    )
