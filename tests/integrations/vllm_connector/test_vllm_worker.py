"""The worker half: sends and loads on their pools, checks before writes, streamed chunks and layer
groups, early hand-off, verdicts, pacing of idle steps, threads off the engine's pinned core.
"""

from __future__ import annotations

import os
import threading
import time
from importlib.util import find_spec
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from support import vllm_halves as halves
from support.vllm_fixtures import edge_fixture, secure_fixture  # noqa: F401 (fixtures)
from support.vllm_halves import BLOCKS, BS, DIM, HEADS, PROMPT

pytestmark = pytest.mark.skipif(
    find_spec("vllm") is None, reason="vLLM not installed (make test-vllm builds .venv-vllm)"
)


def test_free_blocks_on_verdict_holds_the_blocks_until_the_consumer_answers(edge: Any) -> None:
    """With ``free_blocks_on: verdict`` the producer reports the send finished (vLLM frees the
    blocks) only once the consumer's verdict is in; by default it does at once."""
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": edge.conn}
    producer = halves.pair("kv_producer", omni, free_blocks_on="verdict")
    edge.made.append(producer)
    request = halves.make_request("p9", {"do_remote_decode": True}, computed=len(PROMPT))
    _, params = producer.sched.request_finished(request, [3, 5, 1])
    assert params is not None
    assert halves.step(producer, {"p9"}).finished_sending == set()  # staged, no verdict yet
    assert producer.sched.has_pending_push_work()
    assert halves.step(producer, set()).finished_sending == set()
    results = halves.load(edge.consumer, dict(params), "c9", [6, 2, 7])
    assert results.finished_recving == {"c9"}
    assert halves.step(producer, set()).finished_sending == {"p9"}  # delivered: blocks go back
    assert not producer.sched.has_pending_push_work()
    assert producer.worker.stats()["sends_delivered"] == 1


def test_free_blocks_on_verdict_frees_an_untaken_payloads_blocks_at_its_ttl(edge: Any) -> None:
    conn = {**edge.conn, "buffer_ttl_seconds": 0.2}
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    producer = halves.pair("kv_producer", omni, free_blocks_on="verdict")
    edge.made.append(producer)
    request = halves.make_request("p8", {"do_remote_decode": True}, computed=len(PROMPT))
    producer.sched.request_finished(request, [3, 5, 1])
    assert halves.step(producer, {"p8"}).finished_sending == set()
    deadline = time.monotonic() + 10
    while not halves.step(producer, set()).finished_sending:  # steps, as an idle engine runs them
        assert time.monotonic() < deadline, "the blocks were never given back"
        time.sleep(0.05)
    assert producer.worker.stats()["sends_expired"] == 1
    assert not producer.sched.has_pending_push_work()


def test_partial_local_hit_loads_the_rest(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    sched, worker = edge.consumer.sched, edge.consumer.worker
    req = halves.make_request("c2", params)
    assert sched.get_num_new_matched_tokens(req, 4) == (6, True)  # one block computed locally
    sched.update_state_after_alloc(req, halves.allocated([0, 4, 6]), 6)
    assert halves.step(edge.consumer, set()).finished_recving == {"c2"}
    got, want = halves.tokens(worker, [0, 4, 6]), halves.tokens(edge.producer.worker, [3, 5, 1])
    for g, w in zip(got, want, strict=True):
        assert not g[:4].any()  # tokens of the local hit are not written
        assert torch.equal(g[4:], w[4:])


def test_sends_run_concurrently(edge: Any) -> None:
    """One stuck send does not hold back the others (max_concurrent_sends threads)."""
    from omnikv.connectors.factory import OmniConnectorFactory
    from omnikv.connectors.local import LocalConnector

    gate = threading.Event()
    stuck_ids: list[str] = []

    class _Gated(LocalConnector):
        def put_packed(
            self, from_stage: str, to_stage: str, put_key: str, *a: Any, **k: Any
        ) -> Any:
            if any(t in put_key for t in stuck_ids):
                gate.wait(10)
            return super().put_packed(from_stage, to_stage, put_key, *a, **k)

    OmniConnectorFactory.register_connector("GatedLocalConnector", _Gated)
    conn = {"type": "GatedLocalConnector", "namespace": edge.conn["namespace"] + "g"}
    producer = halves.pair(
        "kv_producer", {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
    )
    edge.made.append(producer)
    stuck_req = halves.make_request("stuck", {"do_remote_decode": True}, computed=len(PROMPT))
    _, stuck = producer.sched.request_finished(stuck_req, [1, 2, 3])
    stuck_ids.append(stuck["omnikv_transfer_id"])
    ok_req = halves.make_request("ok", {"do_remote_decode": True}, computed=len(PROMPT))
    producer.sched.request_finished(ok_req, [4, 5, 6])
    producer.worker.bind_connector_metadata(producer.sched.build_connector_meta(None))
    producer.worker.start_load_kv(None)
    producer.worker.wait_for_save()
    deadline = time.monotonic() + 10
    sent: set[str] = set()
    while "ok" not in sent and time.monotonic() < deadline:
        sent |= producer.worker.get_transfer_results({"stuck", "ok"}).finished_sending
    assert sent == {"ok"}  # the stuck send is still in flight
    gate.set()
    assert producer.worker.wait_transfers(10)
    assert producer.worker.get_transfer_results(set()).finished_sending == {"stuck"}


def test_missing_kv_is_a_counted_failed_receive(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    tid = params["omnikv_transfer_id"]
    never = tid[:-6] + ("000000" if not tid.endswith("000000") else "111111")
    params = dict(params, omnikv_transfer_id=never)
    results = halves.load(edge.consumer, params, "c3", [1, 2, 3])
    assert results.finished_recving == {"c3"} and results.failed_recving == {"c3"}
    assert edge.consumer.worker.stats() == {"loads_failed": 1}
    assert "timeout" in edge.consumer.worker.transfer_record(never)["reason"]
    assert not any(t.any() for t in edge.consumer.caches.values())


def test_payload_that_does_not_fit_the_engine_is_refused(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    other = halves.pair("kv_consumer", edge.consumer_omni, layers=3)
    edge.made.append(other)
    results = halves.load(other, params, "c4", [1, 2, 3])
    assert results.failed_recving == {"c4"}
    reason = other.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "2 layers, the engine 3" in reason
    assert not any(t.any() for t in other.caches.values())


def test_payload_of_another_dtype_is_refused_not_cast(edge: Any) -> None:
    params = halves.send(edge.producer, [3, 5, 1])
    other = halves.pair("kv_consumer", edge.consumer_omni, dtype=torch.bfloat16)
    edge.made.append(other)
    assert halves.load(other, params, "c5", [1, 2, 3]).failed_recving == {"c5"}
    reason = other.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "dtype torch.float32, the engine torch.bfloat16" in reason
    assert not any(t.any() for t in other.caches.values())


def test_bogus_loads_do_not_delay_a_genuine_one(edge: Any) -> None:
    """Three admitted loads that will never arrive, then a genuine one, on ONE main load thread:
    each bogus load leaves it after ``load_first_wait_s`` to wait on the waiting pool."""
    from omnikv.integrations.vllm.binding import new_transfer_id

    ns = edge.consumer_omni["connector_config"]["namespace"]
    conn = dict(edge.conn)
    slow = {"stage_id": 1, "recv_timeout": 5.0, "connector_config": conn}
    consumer = halves.pair("kv_consumer", slow, max_concurrent_loads=1, load_first_wait_s=0.1)
    edge.made.append(consumer)
    from omnikv.integrations.vllm.binding import producer_tag

    sched = consumer.sched
    for i in range(3):
        bogus = {
            "do_remote_prefill": True,
            "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
            "omnikv_num_tokens": len(PROMPT),
        }
        req = halves.make_request(f"bogus{i}", bogus)
        assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
        sched.update_state_after_alloc(req, halves.allocated([i, i, i]), len(PROMPT))
    consumer.worker.bind_connector_metadata(sched.build_connector_meta(None))
    consumer.worker.start_load_kv(None)
    params = halves.send(edge.producer, [3, 5, 1])
    req = halves.make_request("genuine", params)
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, halves.allocated([6, 7, 4]), len(PROMPT))
    t0 = time.monotonic()
    consumer.worker.bind_connector_metadata(sched.build_connector_meta(None))
    consumer.worker.start_load_kv(None)
    done: set[str] = set()
    while "genuine" not in done and time.monotonic() - t0 < 5:
        results = consumer.worker.get_transfer_results(set())
        assert not results.failed_recving
        done |= results.finished_recving
    assert done == {"genuine"}
    assert time.monotonic() - t0 < 2.0  # not after the bogus ones' 5 s
    for side in (consumer,):
        side.worker.shutdown()  # cancels the bogus waits


def test_an_aborted_request_stops_its_load(edge: Any) -> None:
    from omnikv.integrations.vllm.binding import new_transfer_id, producer_tag

    ns = edge.consumer_omni["connector_config"]["namespace"]
    slow = {"stage_id": 1, "recv_timeout": 30.0, "connector_config": edge.conn}
    consumer = halves.pair("kv_consumer", slow)
    edge.made.append(consumer)
    params = {
        "do_remote_prefill": True,
        "omnikv_transfer_id": new_transfer_id(producer_tag(ns), "0" * 32, None),
        "omnikv_num_tokens": len(PROMPT),
    }
    req = halves.make_request("gone", params)
    sched, worker = consumer.sched, consumer.worker
    assert sched.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    sched.update_state_after_alloc(req, halves.allocated([1, 2, 3]), len(PROMPT))
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    req.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert sched.request_finished(req, [1, 2, 3]) == (False, None)
    t0 = time.monotonic()
    worker.bind_connector_metadata(sched.build_connector_meta(None))  # carries the cancel
    assert worker.wait_transfers(5.0)
    assert time.monotonic() - t0 < 2.0
    assert worker.get_transfer_results(set()).failed_recving == {"gone"}
    assert "cancel" in worker.transfer_record(params["omnikv_transfer_id"])["reason"]


def test_with_a_secret_ids_and_payloads_are_authenticated(secure: Any) -> None:
    params = halves.send(secure.producer, [3, 5, 1])
    assert len(params["omnikv_transfer_id"].split("-")) == 4  # carries its MAC
    results = halves.load(secure.consumer, params, "c1", [6, 2, 7])
    assert results.finished_recving == {"c1"} and not results.failed_recving


@pytest.mark.parametrize(
    ("mac", "why"),
    [
        ("omnikv-kv-v4:" + "0" * 32, "the MAC does not match"),
        ("0" * 32, "omnikv-kv-v3"),  # an older producer's construction (bare HMAC-SHA256 hex)
    ],
    ids=["forged", "older-construction"],
)
def test_with_a_secret_forged_kv_under_the_right_key_is_refused(
    secure: Any, mac: str, why: str
) -> None:
    """Someone who can write into the namespace but lacks the secret cannot inject KV; a MAC
    of an older construction is refused by its name, before any byte is hashed (the load
    fails and vLLM recomputes)."""
    from omnikv.config import config_from_dict, options_from_dict
    from omnikv.manager import OmniKVTransferManager

    params = halves.send(secure.producer, [3, 5, 1])
    key = f"{params['omnikv_transfer_id']}.{params['omnikv_binding']}"
    consumer_cfg = {
        "stage_id": 1,
        "recv_timeout": 2.0,
        "need_recv_cache": True,
        "connector_config": secure.conn,
    }
    with OmniKVTransferManager(
        config_from_dict(consumer_cfg), options=options_from_dict(consumer_cfg)
    ) as thief:
        assert thief.receive_kv_cache_result(key).ok  # take the genuine payload away
    caches = halves.forged_caches()
    with halves.attacker(secure.conn) as attacker:
        attacker.handle_finished_requests_kv_transfer(
            {
                key: {
                    "block_ids": [3, 5, 1],
                    "seq_len": len(PROMPT),
                    "custom_metadata": {
                        "omnikv_binding": params["omnikv_binding"],
                        "omnikv_mac": mac,
                    },
                }
            },
            kv_caches=caches,
            block_size=BS,
            cache_dtype="float32",
        )
        assert attacker.get_send_result(key).ok
        results = halves.load(secure.consumer, params, "c1", [6, 2, 7])
        # the forger learns its KV was refused, and why
        verdict = attacker.wait_delivered(key, timeout=5)
        assert verdict is not None and verdict.status.value == "refused"
        assert "MAC" in (verdict.reason or "")
    assert results.failed_recving == {"c1"}
    reason = secure.consumer.worker.transfer_record(params["omnikv_transfer_id"])["reason"]
    assert "MAC" in reason and why in reason, reason
    assert not any(t.any() for t in secure.consumer.caches.values())


_PINNED_WORKER = r"""
import json, os, sys, threading, time
from types import SimpleNamespace
os.sched_setaffinity(0, {0})  # what vLLM's CPU backend does to its worker's thread
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from omnikv.integrations.vllm import OmniKVConnector
conn = {"type": "SharedMemoryConnector", "namespace": sys.argv[1], "pool_size_bytes": 4 << 20}
omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": conn}
ktc = KVTransferConfig(kv_connector="OmniKVConnector", kv_role="kv_producer",
    kv_connector_module_path="omnikv.integrations.vllm",
    kv_connector_extra_config={"omni_kv_config": omni, "vllm_kv_layout": "vllm_cpu"})
cfg = SimpleNamespace(kv_transfer_config=ktc, cache_config=SimpleNamespace(block_size=4))
worker = OmniKVConnector(cfg, KVConnectorRole.WORKER, None)
out = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list"))
    out[tid] = line.split(":")[1].strip()
worker.shutdown()
print(json.dumps({"main": out.pop(str(os.getpid())), "others": sorted(set(out.values()))}))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_transfer_threads_are_not_pinned_to_the_engines_core(namespace: str) -> None:
    """vLLM's CPU backend pins its worker's thread to a compute core and threads inherit it:
    omnikv's transport threads (here a shared-memory sender's) run on every allowed CPU."""
    import json
    import subprocess
    import sys

    from omnikv.integrations.vllm.worker import transfer_cpus

    proc = subprocess.run(
        [sys.executable, "-c", _PINNED_WORKER, namespace],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["main"] == "0"
    cpus = transfer_cpus()
    assert cpus is not None and len(cpus) >= 2
    assert report["others"] and "0" not in report["others"]  # no thread left on the pinned core


def _streaming_producer(edge: Any, rid: str, blocks: list[int], tokens: int) -> tuple[Any, Any]:
    """A ``stream_kv`` producer over the edge's connector (random KV in its cache) whose
    ``do_remote_decode`` request ``rid`` holds ``blocks``, after the step that computed its first
    ``tokens`` prompt tokens: ``(producer, request)``."""
    omni = {
        "omni_from_stage": 0,
        "omni_to_stage": 1,
        "connector_config": edge.conn,
        "stream_kv": True,
    }
    producer = halves.pair("kv_producer", omni)
    edge.made.append(producer)
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = halves.make_request(rid, {"do_remote_decode": True})
    producer.sched.update_state_after_alloc(request, halves.allocated(blocks), 0)
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=0)
    halves.step_with(producer, halves.output([new], [], {rid: tokens}), set())
    return producer, request


def test_a_streaming_producer_ships_blocks_during_chunked_prefill(edge: Any) -> None:
    """vLLM's call sequence for a prompt prefilled in two chunks (4 then 6 tokens, blocks of
    4): each chunk's full blocks ship after its forward pass, the finish sends the partial
    block and the manifest under the same transfer id; the consumer writes the same tokens."""
    producer, request = _streaming_producer(edge, "s1", [3, 5, 1], 4)
    assert producer.worker.stats()["chunks_streamed"] == 1  # block 3, after the first chunk
    halves.step_with(producer, halves.output([], [("s1", 4, None)], {"s1": 6}), set())
    assert producer.worker.stats()["chunks_streamed"] == 2  # block 5; block 1 is partial
    request.num_computed_tokens = len(PROMPT)
    delay, params = producer.sched.request_finished(request, [3, 5, 1])
    assert delay and params is not None
    results = halves.step_with(producer, halves.output([], [], {}), {"s1"})
    assert results.finished_sending == {"s1"}
    record = producer.worker.transfer_record(params["omnikv_transfer_id"])
    assert record is not None and record["ok"], record
    load = halves.load(edge.consumer, dict(params), "c1", [6, 2, 7])
    assert load.finished_recving == {"c1"} and not load.failed_recving
    got = halves.tokens(edge.consumer.worker, [6, 2, 7])
    want = halves.tokens(producer.worker, [3, 5, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_streamed_request_that_is_aborted_leaves_no_chunk(edge: Any) -> None:
    conn = edge.conn
    producer, request = _streaming_producer(edge, "s2", [0, 1, 2], 8)
    assert producer.worker.stats()["chunks_streamed"] == 1
    from omnikv.connectors.local import LocalConnector

    probe = LocalConnector(conn)
    try:
        assert any("#c0" in k for k in probe.pending_keys())
        request.status = SimpleNamespace(name="FINISHED_ABORTED")
        assert producer.sched.request_finished(request, [0, 1, 2]) == (False, None)
        halves.step_with(producer, halves.output([], [], {}), set())  # the abort reaches the worker
        assert probe.pending_keys() == []
    finally:
        probe.close()


def test_a_preempted_streaming_request_drops_its_chunks_before_its_blocks_are_reused(
    edge: Any,
) -> None:
    """vLLM frees a preempted request's blocks in the schedule that preempts it and may give
    them to another request's forward pass in that same step, while the stream worker could
    still hold a step that reads them: the step naming the request preempted drops its stream
    before the forward pass, and the resumed request streams afresh from its new blocks (the
    consumer gets the resumed blocks' tokens, never the reused ones)."""
    from omnikv.connectors.local import LocalConnector

    conn = edge.conn
    producer, request = _streaming_producer(edge, "s3", [3, 5, 1], 4)
    probe = LocalConnector(conn)
    try:
        assert any("#c0" in k for k in probe.pending_keys())
        preempting = halves.output([], [], {})
        preempting.preempted_req_ids = {"s3"}
        meta = producer.sched.build_connector_meta(preempting)
        assert len(meta.stream_aborts) == 1
        producer.worker.bind_connector_metadata(meta)  # before the step's forward pass
        assert probe.pending_keys() == []  # nothing of the old blocks is left to take
        producer.worker.clear_connector_metadata()
    finally:
        probe.close()
    for layer in producer.caches.values():  # another request's forward pass reuses them
        layer[[3, 5, 1]] = 7.0
    resumed = halves.output([], [("s3", 0, [2, 6, 4])], {"s3": 10})
    resumed.scheduled_cached_reqs.resumed_req_ids = {"s3"}
    halves.step_with(producer, resumed, set())
    request.num_computed_tokens = len(PROMPT)
    delay, params = producer.sched.request_finished(request, [2, 6, 4])
    assert delay and params is not None
    assert halves.step_with(producer, halves.output([], [], {}), {"s3"}).finished_sending == {"s3"}
    load = halves.load(edge.consumer, dict(params), "c3", [6, 2, 7])
    assert load.finished_recving == {"c3"} and not load.failed_recving
    got = halves.tokens(edge.consumer.worker, [6, 2, 7])
    want = halves.tokens(producer.worker, [2, 6, 4])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_an_early_hand_off_loads_what_the_producer_streams_under_the_routers_id(
    edge: Any,
) -> None:
    """A router issues the id and sends both requests at once: the consumer is admitted and
    waits while the producer prefills in two chunks; it takes the chunks as they are published
    and, after the producer's finish, writes the producer's tokens."""
    from omnikv.connectors.local import LocalConnector
    from omnikv.integrations.vllm import early_handoff_params

    pair = halves.early_edge(edge)
    tid = halves.router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    halves.start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    producer = pair.producer
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    request = halves.make_request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    halves.step_with(producer, halves.output([new], [], {"s1": 4}), set())
    probe = LocalConnector(pair.conn)
    try:  # the waiting consumer takes the first chunk before the producer goes on
        deadline = time.monotonic() + 10
        while any("#c0" in k for k in probe.pending_keys()) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not any("#c0" in k for k in probe.pending_keys())
    finally:
        probe.close()
    worker = pair.consumer.worker
    # ... checks it (its own MAC) and writes it into the request's first block at once
    deadline = time.monotonic() + 10
    while worker.stats().get("chunks_loaded", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    first = [k for k, _ in worker.layer_tokens([6], BS)]
    assert all(
        torch.equal(a, b)
        for a, b in zip(first, [k for k, _ in producer.worker.layer_tokens([3], BS)], strict=True)
    )
    halves.step_with(producer, halves.output([], [("s1", 4, None)], {"s1": 6}), set())
    assert producer.worker.stats()["chunks_streamed"] == 2
    halves.finish_early_hand_off(producer, request, tid, pair.consumer)
    assert producer.sched.stats().get("router_ids_refused", 0) == 0
    assert worker.stats()["chunks_loaded"] == 2  # at the finish only the tail was checked


def test_a_forged_chunk_ends_an_early_load_at_once(edge: Any) -> None:
    """Someone who can publish into the namespace but lacks the secret puts a chunk under the
    key an early consumer waits on: the consumer checks it as it arrives, refuses it (its MAC),
    fails the load at once instead of at its deadline, and writes nothing."""
    from omnikv.integrations.vllm import early_handoff_params

    pair = halves.early_edge(edge, recv_timeout=30.0)
    tid = halves.router_id(pair.conn)
    _, to_consumer = early_handoff_params(tid, len(PROMPT))
    t0 = time.monotonic()
    halves.start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    with halves.attacker(pair.conn, stream_kv=True) as attacker:
        progress = attacker.stream_kv_blocks(
            halves.payload_key_for(tid, to_consumer),
            {"block_ids": [0, 1], "seq_len": 2 * BS},
            halves.forged_caches(),
            BS,
            "float32",
            seal=lambda start, stop, ids: {"omnikv_mac": "omnikv-kv-v4:" + "0" * 32},
        )
        assert progress.reason is None, progress
        progress = attacker.wait_kv_stream(halves.payload_key_for(tid, to_consumer), 10.0)
        assert progress.new == 2 * BS
        worker = pair.consumer.worker
        assert worker.wait_transfers(10.0)
    assert time.monotonic() - t0 < 10.0  # not recv_timeout (30 s)
    assert worker.get_transfer_results(set()).failed_recving == {"c1"}
    reason = worker.transfer_record(tid)["reason"]
    assert "chunk 0: the MAC does not match" in reason, reason
    assert worker.stats().get("chunks_loaded", 0) == 0
    assert not any(t.any() for t in pair.consumer.caches.values())


def _forge(spec: dict[str, Any]) -> Any:
    """Start :mod:`support.forger` (its own process) on ``spec``; returns it once its forged
    chunks are published."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "support" / "forger.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "sent", line
    return proc


@pytest.mark.parametrize("stamp", ["huge epoch", "next sequence numbers"])
def test_a_forgery_refused_for_its_mac_leaves_no_mark(stamp: str, namespace: str) -> None:
    """Check, then remember: a forger in another process, on the engines' shared memory but
    without their secret, publishes chunks under an early consumer's key stamped with the
    producer's instance and a huge epoch, or with the producer's session and its next sequence
    numbers (both readable from any header). The consumer refuses them for their MAC, and the
    producer's next genuine early hand-off still loads: the refused stamps changed nothing."""
    from omnikv.integrations.vllm import early_handoff_params

    conn = {"type": "SharedMemoryConnector", "namespace": namespace, "pool_size_bytes": 4 << 20}
    base = {"connector_config": conn, "stream_kv": True}
    producer_omni = {"omni_from_stage": 0, "omni_to_stage": 1, "instance_id": "prefill-0", **base}
    producer = halves.pair("kv_producer", producer_omni, auth_secret="r0uter")
    consumer = halves.pair(
        "kv_consumer", {"stage_id": 1, "recv_timeout": 30.0, **base}, auth_secret="r0uter"
    )
    proc = None
    try:
        tid = halves.router_id(conn)
        _, to_consumer = early_handoff_params(tid, len(PROMPT))
        halves.start_early_load(consumer, to_consumer, "c0", [0, 4, 1])
        # the producer's stamps, as its worker's transfer edge writes them into every header
        genuine = producer.worker._worker.edge._sender.stamps
        forged = {"session": "f" * 16, "epoch": genuine.epoch + 10**15}
        if stamp == "next sequence numbers":
            forged = {"session": genuine.session, "epoch": genuine.epoch}
        proc = _forge(
            {
                "conn": conn,
                "key": halves.payload_key_for(tid, to_consumer),
                "instance": "prefill-0",
                "seq": 0,  # the producer has sent nothing yet
                **forged,
                **{"block": BS, "heads": HEADS, "dim": DIM, "blocks": BLOCKS, "layers": 2},
                "tokens": 2 * BS,
            }
        )
        worker = consumer.worker
        assert worker.wait_transfers(10.0)
        assert worker.get_transfer_results(set()).failed_recving == {"c0"}
        assert "MAC does not match" in worker.transfer_record(tid)["reason"]
        assert not any(t.any() for t in consumer.caches.values())
        # the producer's next genuine early hand-off, prefilled in two chunks
        tid = halves.router_id(conn)
        to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
        halves.start_early_load(consumer, to_consumer, "c1", [6, 2, 7])
        for t in producer.caches.values():
            t.copy_(torch.randn_like(t))
        request = halves.make_request("s1", to_producer)
        producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
        new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
        halves.step_with(producer, halves.output([new], [], {"s1": 4}), set())
        halves.step_with(producer, halves.output([], [("s1", 4, None)], {"s1": 6}), set())
        halves.finish_early_hand_off(producer, request, tid, consumer)
        assert worker.stats()["chunks_loaded"] == 2
    finally:
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=20)
            finally:
                proc.kill()
        for side in (producer, consumer):
            side.worker.shutdown()


def test_an_early_consumer_whose_producer_aborts_mid_stream_fails_cleanly(edge: Any) -> None:
    """The producer ships a chunk (the waiting consumer takes it), then its request is aborted:
    the consumer's load fails at its deadline (vLLM recomputes), and no chunk is left behind in
    the connector, neither the one taken nor any other."""
    from omnikv.connectors.local import LocalConnector
    from omnikv.integrations.vllm import early_handoff_params

    pair = halves.early_edge(edge, recv_timeout=1.5)
    tid = halves.router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    halves.start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    producer = pair.producer
    request = halves.make_request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    halves.step_with(producer, halves.output([new], [], {"s1": 8}), set())
    assert producer.worker.stats()["chunks_streamed"] == 1
    request.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert producer.sched.request_finished(request, [3, 5, 1]) == (False, None)
    halves.step_with(producer, halves.output([], [], {}), set())  # the abort reaches the worker
    worker = pair.consumer.worker
    assert worker.wait_transfers(10.0)
    results = worker.get_transfer_results(set())
    assert results.finished_recving == {"c1"} and results.failed_recving == {"c1"}
    assert worker.stats()["loads_failed"] == 1
    probe = LocalConnector(pair.conn)
    try:
        assert probe.pending_keys() == []
    finally:
        probe.close()


def test_the_layers_are_cut_into_even_runs(edge: Any) -> None:
    from omnikv.integrations.vllm.options import default_layer_groups
    from omnikv.integrations.vllm.worker import layer_groups

    # unset: 2 groups for a cache in host memory, 1 on a device
    assert default_layer_groups(torch.device("cpu")) == 2
    assert default_layer_groups(torch.device("meta")) == 1
    # so a streaming producer with two layers in host memory ships each layer as it is saved
    producer = halves.early_edge(edge).producer
    request = halves.make_request("s1", {"do_remote_decode": True})
    producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    halves.step_with(producer, halves.output([new], [], {"s1": 4}), set(), by_layer=True)
    assert producer.worker.stats()["layer_groups_streamed"] == 2  # groups (0, 1) and (1, 2)
    assert layer_groups(8, 1) == [(0, 8)]
    assert layer_groups(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert layer_groups(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert layer_groups(3, 8) == [(0, 1), (1, 2), (2, 3)]  # at most one per layer


def test_a_chunk_of_a_stream_of_other_layers_is_refused_before_any_write(edge: Any) -> None:
    """A consumer refuses, before writing, a chunk whose stream has another layer count than
    its engine, even one whose own layers would fit (the first layers of a shorter model).
    Published by someone who holds the secret, so that only the layer count can refuse them."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.integrations.vllm.binding import kv_mac

    pair = halves.early_edge(edge, recv_timeout=30.0)
    worker = pair.consumer.worker
    before = halves.tokens(worker, [6, 2, 7])
    ones = torch.ones(BLOCKS, BS, HEADS, DIM)
    for layers, spans in ((3, [(0, 1)]), (1, [None]), (2, [(0, 1), (1, 2)])):
        tid = halves.router_id(pair.conn)
        _, to_consumer = early_handoff_params(tid, len(PROMPT))
        rid = f"c{layers}"
        halves.start_early_load(pair.consumer, to_consumer, rid, [6, 2, 7])
        key = halves.payload_key_for(tid, to_consumer)

        def seal(
            start: int, stop: int, ids: Any, *, layers: Any = None, key: str = key
        ) -> dict[str, Any]:
            first, end = (0, 1) if layers is None else layers
            tokens = [(ones.reshape(-1, HEADS, DIM)[start:stop],) * 2] * (end - first)
            return {"omnikv_mac": kv_mac(b"r0uter", key, tokens, start, first)}

        with halves.attacker(pair.conn, stream_kv=True) as publisher:
            for span in spans:
                progress = publisher.stream_kv_blocks(
                    key,
                    {"block_ids": [0, 1], "seq_len": 2 * BS},
                    [(ones, ones)] * layers,
                    BS,
                    "float32",
                    seal=seal,
                    layers=span,
                )
                assert progress.reason is None, progress
                assert publisher.wait_kv_stream(key, 10.0).nbytes > 0
            if layers == 2:  # the engine's two layers: each group is checked and written
                deadline = time.monotonic() + 10
                while worker.stats().get("chunks_loaded", 0) < 2:
                    assert time.monotonic() < deadline, "the chunks were never written"
                    time.sleep(0.005)
                got = [k for k, _ in worker.layer_tokens([6, 2], 2 * BS)]
                assert all(torch.equal(k, ones[0:2].reshape(-1, HEADS, DIM)) for k in got)
                continue
            assert worker.wait_transfers(10.0)
        assert worker.get_transfer_results(set()).failed_recving == {rid}
        why = worker.transfer_record(tid)["reason"]
        assert f"a stream of {layers} layers, the engine 2" in why, why
        assert worker.stats().get("chunks_loaded", 0) == 0
        assert all(
            torch.equal(a, b) for a, b in zip(halves.tokens(worker, [6, 2, 7]), before, strict=True)
        )


@pytest.mark.parametrize("by_layer", [True, False], ids=["save_kv_layer", "no-save_kv_layer"])
def test_layer_groups_ship_from_save_kv_layer_and_the_consumer_writes_each_at_once(
    edge: Any, by_layer: bool
) -> None:
    """``stream_layer_groups: 2`` over 4 layers, early hand-off with ``auth_secret``: each
    prefill chunk's first two layers ship as soon as ``save_kv_layer`` saw layer 1, and the
    waiting consumer checks (own MAC) and writes them into its block before the producer's
    forward pass reaches layer 2. Without ``save_kv_layer`` calls (a model whose attention does
    not make them) each step ships one whole chunk at ``wait_for_save``. Either way the
    consumer ends with the producer's tokens."""
    from omnikv.integrations.vllm import early_handoff_params

    pair = halves.early_edge(edge, layers=4, stream_layer_groups=2)
    producer, consumer = pair.producer, pair.consumer
    tid = halves.router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    halves.start_early_load(consumer, to_consumer, "c1", [6, 2, 7])
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    worker = consumer.worker
    written: list[bool] = []

    def first_layers_written(layer: int) -> None:
        if layer != 1:
            return
        deadline = time.monotonic() + 10
        while worker.stats().get("chunks_loaded", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        got = [k for k, _ in worker.layer_tokens([6], BS)][:2]
        want = [k for k, _ in producer.worker.layer_tokens([3], BS)][:2]
        written.append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))

    request = halves.make_request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    first = halves.output([new], [], {"s1": 4})
    second = halves.output([], [("s1", 4, None)], {"s1": 6})
    halves.step_with(producer, first, set(), by_layer=by_layer, between=first_layers_written)
    assert written == ([True] if by_layer else [])  # layers 0-1 there before layer 2 computed
    halves.step_with(producer, second, set(), by_layer=by_layer)
    chunks = 4 if by_layer else 2  # 2 steps x 2 groups, or a whole chunk per step
    assert producer.worker.stats()["chunks_streamed"] == chunks
    assert producer.worker.stats().get("layer_groups_streamed", 0) == (4 if by_layer else 0)
    halves.finish_early_hand_off(producer, request, tid, consumer)
    assert worker.stats()["chunks_loaded"] == chunks


@pytest.mark.timing
def test_an_idle_step_waits_briefly_for_loads_in_flight(edge: Any) -> None:
    """vLLM steps without pause while requests wait for remote KV; a step that schedules no
    tokens while a load runs waits up to ``idle_step_wait_s`` (the load threads get the GIL),
    a step with work or without loads does not."""
    pair = halves.early_edge(edge)
    consumer = halves.pair(
        "kv_consumer",
        {"stage_id": 1, "recv_timeout": 10.0, "connector_config": pair.conn, "stream_kv": True},
        auth_secret="r0uter",
        idle_step_wait_s=0.1,
    )
    edge.made.append(consumer)
    worker = consumer.worker

    def step(scheduled: int) -> float:
        out = halves.output([], [], {})
        out.total_num_scheduled_tokens = scheduled
        worker.bind_connector_metadata(consumer.sched.build_connector_meta(out))
        worker.start_load_kv(None)
        worker.wait_for_save()
        t0 = time.monotonic()
        worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        return time.monotonic() - t0

    assert step(0) < 0.09  # idle, but no load in flight
    from omnikv.integrations.vllm import early_handoff_params

    _, to_consumer = early_handoff_params(halves.router_id(pair.conn), len(PROMPT))
    halves.start_early_load(consumer, to_consumer, "c1", [6, 2, 7])  # its KV never comes
    assert step(0) >= 0.09  # idle while a load runs: paced
    assert step(64) < 0.09  # a step with work never waits


@pytest.mark.timing
def test_an_idle_step_waits_for_a_load_writing_its_payload_and_reports_it(edge: Any) -> None:
    """A load whose payload arrived checks and writes bytes that are here: an idle step whose
    ``idle_step_wait_s`` ends while it writes waits for it once more (at most as long again),
    and reports it, rather than leaving it to the next step."""
    params = halves.send(edge.producer, [3, 5, 1])
    consumer = halves.pair("kv_consumer", edge.consumer_omni, idle_step_wait_s=0.1)
    edge.made.append(consumer)
    side = consumer.worker._worker
    gate, extended = threading.Event(), threading.Event()
    write = side._write

    def gated_write(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)  # opened once the step waits past its idle_step_wait_s
        return write(*args, **kwargs)

    class _Watched(threading.Condition):
        def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
            extended.set()
            return super().wait_for(predicate, timeout)

    side._write = gated_write
    side._transfer_ended = _Watched(side._lock)

    def open_gate() -> None:
        extended.wait(10)
        gate.set()

    opener = threading.Thread(target=open_gate)
    opener.start()
    try:
        request = halves.make_request("c1", params)
        assert consumer.sched.get_num_new_matched_tokens(request, 0) == (len(PROMPT), True)
        consumer.sched.update_state_after_alloc(request, halves.allocated([6, 2, 7]), len(PROMPT))
        out = halves.output([], [], {})
        out.total_num_scheduled_tokens = 0  # the admitting step computes nothing
        consumer.worker.bind_connector_metadata(consumer.sched.build_connector_meta(out))
        consumer.worker.start_load_kv(None)
        consumer.worker.wait_for_save()
        results = consumer.worker.get_transfer_results(set())
        consumer.worker.clear_connector_metadata()
    finally:
        gate.set()
        opener.join(10)
    assert extended.is_set()  # it waited past idle_step_wait_s, for the load writing
    assert results.finished_recving == {"c1"} and not results.failed_recving
    got = halves.tokens(consumer.worker, [6, 2, 7])
    want = halves.tokens(edge.producer.worker, [3, 5, 1])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.timing  # bounds of 90 ms on an idle step: run alone, after the lanes
def test_an_idle_step_waits_for_a_send_in_flight_and_reports_it_at_once(
    edge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer keeps stepping while its sends run (``has_pending_push_work``); a step that
    schedules no tokens then waits up to ``idle_step_wait_s`` (the send threads get the GIL),
    and a send that ends within the wait is reported by that step, not the next. A step with
    work never waits."""
    omni = {"omni_from_stage": 0, "omni_to_stage": 1, "connector_config": edge.conn}
    producer = halves.pair("kv_producer", omni, idle_step_wait_s=0.1)
    edge.made.append(producer)
    side = producer.worker._worker
    gate = threading.Event()
    send = side.edge.send

    def held_send(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)
        return send(*args, **kwargs)

    monkeypatch.setattr(side.edge, "send", held_send)
    request = halves.make_request("p7", {"do_remote_decode": True}, computed=len(PROMPT))
    producer.sched.request_finished(request, [3, 5, 1])

    def step(scheduled: int, finished: set[str]) -> tuple[Any, float]:
        out = halves.output([], [], {})
        out.total_num_scheduled_tokens = scheduled
        producer.worker.bind_connector_metadata(producer.sched.build_connector_meta(out))
        producer.worker.start_load_kv(None)
        producer.worker.wait_for_save()
        t0 = time.monotonic()
        results = producer.worker.get_transfer_results(finished)
        producer.worker.clear_connector_metadata()
        return results, time.monotonic() - t0

    results, took = step(64, {"p7"})  # the send starts; a step with work does not wait
    assert took < 0.09 and not results.finished_sending
    results, took = step(0, set())  # idle while the send is held: paced
    assert took >= 0.09 and not results.finished_sending
    gate.set()  # the send goes on now: it ends within this step's wait, which reports it
    results, took = step(0, set())
    assert results.finished_sending == {"p7"}
    assert took < 0.09


def test_the_producers_stream_step_returns_before_its_chunk_is_sealed_and_put(
    edge: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait_for_save`` only hands the step's chunk to the edge's stream worker: with the
    chunk's MAC held there, the runner's call has returned and nothing is published yet; once
    the MAC is done the chunk goes out, and the early hand-off ends with the producer's
    tokens as before."""
    from omnikv.integrations.vllm import early_handoff_params
    from omnikv.wire.mac import PayloadSeal

    pair = halves.early_edge(edge)
    tid = halves.router_id(pair.conn)
    to_producer, to_consumer = early_handoff_params(tid, len(PROMPT))
    halves.start_early_load(pair.consumer, to_consumer, "c1", [6, 2, 7])
    producer = pair.producer
    for t in producer.caches.values():
        t.copy_(torch.randn_like(t))
    gate, sealed_on = threading.Event(), []
    mac = PayloadSeal.stream  # the encoder starts the chunk's MAC as it writes the chunk

    def held(self: Any, *args: Any, **kw: Any) -> Any:
        sealed_on.append(threading.current_thread().name)
        assert gate.wait(10.0), "the test never let the MAC go on"
        return mac(self, *args, **kw)

    monkeypatch.setattr(PayloadSeal, "stream", held)
    request = halves.make_request("s1", to_producer)
    producer.sched.update_state_after_alloc(request, halves.allocated([3, 5, 1]), 0)
    new = SimpleNamespace(req_id="s1", block_ids=([3, 5, 1],), num_computed_tokens=0)
    worker = producer.worker
    worker.bind_connector_metadata(
        producer.sched.build_connector_meta(halves.output([new], [], {"s1": 4}))
    )
    worker.start_load_kv(None)
    worker.wait_for_save()  # returns with the chunk's MAC held on the stream worker
    assert sealed_on in ([], ["omnikv-stream-send"]) and not gate.is_set()
    assert worker.stats().get("chunks_streamed", 0) == 0
    gate.set()
    assert worker.wait_transfers(10.0)
    assert sealed_on == ["omnikv-stream-send"] and worker.stats()["chunks_streamed"] == 1
    producer.sched.update_connector_output(worker.get_transfer_results(set()))
    worker.clear_connector_metadata()
    halves.step_with(producer, halves.output([], [("s1", 4, None)], {"s1": 6}), set())
    halves.finish_early_hand_off(producer, request, tid, pair.consumer)
    assert pair.consumer.worker.stats()["chunks_loaded"] == 2
