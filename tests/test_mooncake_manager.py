"""The manager end to end over real Mooncake engines, sender and receivers in separate processes.

* 224 MiB (Qwen2.5-7B, 4096 tokens, fp16, paged blocks of 16 in shuffled order) from a sender
  stage's ``handle_finished_requests_kv_transfer`` to a receiver stage's
  ``receive_kv_cache_for_request``, through ``MooncakeTransferEngineConnector`` and through
  ``MooncakeStoreConnector`` (with a real ``mooncake_master``); every tensor is compared with
  what the sender's cache holds, and the outcomes, consume-once and clean close are checked.
* Heterogeneous TP 2 -> 4 through the Transfer Engine connector: two sender ranks, four receiver
  ranks, each receiver must end up with exactly its heads.

Every case runs as a ``scenario_*`` function in an isolated child (``unshare -n`` where possible,
see ``mooncake_helpers``); peers are spawned processes stopped by PID. Managers are built through
the seed API (``from_od_config`` with an ``omni_kv_config`` dict, ``LOCAL_RANK`` for the rank).
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from mooncake_helpers import (
    Master,
    free_ports,
    mooncake_skip_reason,
    omnikv_threads,
    peers,
    queue,
    run_scenario,
    spawn,
    tcp_sockets,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason())),
]

MiB = 1 << 20

#: Qwen2.5-7B: 28 layers x 4 KV heads x 128, fp16; 4096 tokens = 256 blocks of 16 = 224 MiB.
QWEN = {
    "layers": 28,
    "heads": 4,
    "dim": 128,
    "block_size": 16,
    "num_blocks": 272,
    "seq_len": 4096,
    "seed": 11,
}
#: A small cache with 8 heads, for the TP 2 -> 4 case.
SMALL = {
    "layers": 3,
    "heads": 8,
    "dim": 32,
    "block_size": 8,
    "num_blocks": 12,
    "seq_len": 77,
    "seed": 5,
}


# -- the KV cache both sides agree on ------------------------------------------------------------
def block_ids(spec: dict[str, Any]) -> list[int]:
    """The request's blocks: enough for ``seq_len``, in a seeded shuffled order."""
    import torch

    n = -(-spec["seq_len"] // spec["block_size"])
    g = torch.Generator().manual_seed(spec["seed"])
    return [int(b) for b in torch.randperm(spec["num_blocks"], generator=g)[:n]]


def cache_layer(spec: dict[str, Any], layer: int) -> Any:
    """The full paged cache of ``layer``: ``[2, num_blocks, block_size, heads, dim]`` fp16."""
    import torch

    g = torch.Generator().manual_seed(spec["seed"] * 1000 + layer)
    shape = (2, spec["num_blocks"], spec["block_size"], spec["heads"], spec["dim"])
    return torch.randn(shape, generator=g).to(torch.float16)


def expected_kv(spec: dict[str, Any], layer: int, heads: tuple[int, int]) -> tuple[Any, Any]:
    """What a receiver holding heads ``[start, stop)`` must get for ``layer``: (K, V)."""
    full = cache_layer(spec, layer)
    ids = block_ids(spec)
    out = []
    for which in (0, 1):
        seq = full[which][ids].reshape(-1, spec["heads"], spec["dim"])[: spec["seq_len"]]
        out.append(seq[:, heads[0] : heads[1]])
    return out[0], out[1]


def _set_rank(rank: int) -> None:
    os.environ["LOCAL_RANK"] = str(rank)


# -- peers ------------------------------------------------------------------------------------
def peer_sender(
    omni_kv: dict[str, Any], rank: int, tp: int, spec: dict[str, Any], out_q: Any, in_q: Any
) -> None:
    """A sender stage rank: sends ``req`` from its slice of the cache, then waits to close."""
    _set_rank(rank)
    from omnikv import OmniKVTransferManager

    try:
        mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
        per = spec["heads"] // tp
        caches = [
            cache_layer(spec, i)[..., rank * per : (rank + 1) * per, :].contiguous()
            for i in range(spec["layers"])
        ]
        entry = {"block_ids": block_ids(spec), "seq_len": spec["seq_len"]}
        t0 = time.monotonic()
        done = mgr.handle_finished_requests_kv_transfer(
            {"req": entry}, caches, spec["block_size"], "float16"
        )
        send_s = time.monotonic() - t0
        res = mgr.get_send_result("req")
        del caches
        out_q.put(
            (
                "sent",
                rank,
                {
                    "done": done,
                    "status": res.status.value if res else None,
                    "reason": res.reason if res else None,
                    "keys": list(res.keys) if res else [],
                    "nbytes": res.nbytes if res else 0,
                    "send_s": send_s,
                },
            )
        )
        cmd = in_q.get(timeout=120)
        conn = mgr.connector
        health = conn.health() if conn is not None else {}
        mgr.close()
        mgr.close()
        out_q.put(
            (
                "closed",
                rank,
                {
                    "cmd": cmd,
                    "entries": health.get("entries", health.get("tracked_keys")),
                    "pool_used": health.get("pool_used"),
                    "threads": omnikv_threads(),
                    "tcp": tcp_sockets(),
                },
            )
        )
    except Exception as exc:
        out_q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def receive_and_check(
    omni_kv: dict[str, Any], rank: int, tp: int, spec: dict[str, Any], sender_info: Any
) -> dict[str, Any]:
    """A receiver stage rank: receives ``req``, compares every tensor, checks consume-once."""
    _set_rank(rank)
    from omnikv import OmniKVTransferManager

    mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
    if sender_info is not None:
        mgr.update_sender_info(sender_info)
    res: dict[str, Any] = {"rank": rank}
    t0 = time.monotonic()
    data, size = mgr.receive_kv_cache_for_request("req")
    res["recv_s"] = time.monotonic() - t0
    res["size"] = size
    result = mgr.get_receive_result("req")
    res["status"] = result.status.value if result else None
    res["reason"] = result.reason if result else None
    per = spec["heads"] // tp
    heads = (rank * per, (rank + 1) * per)
    mismatches: list[str] = []
    if data is not None:
        blocks = data["layer_blocks"]
        res["layers"] = [len(blocks["key_cache"]), len(blocks["value_cache"])]
        for i in range(spec["layers"]):
            want_k, want_v = expected_kv(spec, i, heads)
            for name, want in (("key_cache", want_k), ("value_cache", want_v)):
                got = blocks[name][i]
                if got is None or got.shape != want.shape or not got.equal(want):
                    mismatches.append(f"{name}[{i}]")
                del got
        res["block_ids"] = data["block_ids"] == block_ids(spec)
        res["seq_len"] = data["metadata"].get("seq_len")
        del data, blocks  # the views die here, and with them the hold on the receive slot
    res["mismatches"] = mismatches
    # consume-once: the same request again finds nothing, within its (short) timeout
    mgr.config.recv_timeout = 1.0
    t0 = time.monotonic()
    again, again_size = mgr.receive_kv_cache_for_request("req")
    res["again"] = [again is None, again_size, time.monotonic() - t0]
    again_result = mgr.get_receive_result("req")
    res["again_status"] = again_result.status.value if again_result else None
    conn = mgr.connector
    res["pool_used"] = conn.health().get("pool_used") if conn is not None else None
    mgr.close()
    res["threads"] = omnikv_threads()
    res["tcp"] = tcp_sockets()
    return res


def peer_receiver(
    omni_kv: dict[str, Any],
    rank: int,
    tp: int,
    spec: dict[str, Any],
    sender_info: Any,
    out_q: Any,
) -> None:
    try:
        out_q.put(("received", rank, receive_and_check(omni_kv, rank, tp, spec, sender_info)))
    except Exception as exc:
        out_q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _collect(out_q: Any, want: int, timeout: float) -> list[tuple[str, int, Any]]:
    got: list[tuple[str, int, Any]] = []
    end = time.monotonic() + timeout
    while len(got) < want:
        msg = out_q.get(timeout=max(0.1, end - time.monotonic()))
        if msg[0] == "error":
            raise AssertionError(f"rank {msg[1]}: {msg[2]}")
        got.append(msg)
    return got


# -- configs ----------------------------------------------------------------------------------
def te_kv_config(role: str, base_port: int, from_tp: int, to_tp: int) -> dict[str, Any]:
    pool = 256 * MiB if from_tp == to_tp == 1 else 16 * MiB
    cfg: dict[str, Any] = {
        "connector_config": {
            "type": "MooncakeTransferEngineConnector",
            "host": "127.0.0.1",
            "zmq_port": base_port,
            "protocol": "tcp",
            "memory_pool_size": pool,
            "auth_secret": "job-secret",
        },
        "rank_mapping": {"from_tp": from_tp, "to_tp": to_tp},
        "recv_timeout": 60.0,
    }
    if role == "sender":
        cfg.update(omni_from_stage="0", omni_to_stage="1", need_send_cache=True, stage_id=0)
    else:
        cfg.update(stage_id=1, engine_input_source=[0], need_recv_cache=True)
    return cfg


def _free_base_port(ranks: int) -> int:
    """A base port whose sender control ports (base + 100 + 16 * rank) are free on loopback."""
    import socket

    for _ in range(100):
        (base,) = free_ports(1)
        base = base % 40000 + 10000
        ports = [base + 100 + 16 * r for r in range(ranks)]
        try:
            socks = []
            for p in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


# -- scenarios (run isolated) -------------------------------------------------------------------
def scenario_te_224() -> dict[str, Any]:
    base = _free_base_port(1)
    out_q, in_q = queue(), queue()
    proc = spawn(peer_sender, te_kv_config("sender", base, 1, 1), 0, 1, QWEN, out_q, in_q)
    res: dict[str, Any] = {}
    with peers(proc, timeout=30):
        # the receiver starts waiting before the sender has sent: it is woken by the put
        res["recv"] = receive_and_check(
            te_kv_config("receiver", base, 1, 1),
            0,
            1,
            QWEN,
            {"0": {"host": "127.0.0.1", "zmq_port": base + 100}},
        )
        res["sent"] = _collect(out_q, 1, 60)[0][2]
        in_q.put("close")
        res["closed"] = _collect(out_q, 1, 60)[0][2]
    return res


def scenario_store_224() -> dict[str, Any]:
    res: dict[str, Any] = {}
    with Master() as master:
        res["metadata_port"] = master.http_port
        conn = {
            "type": "MooncakeStoreConnector",
            "host": "127.0.0.1",
            "metadata_server": master.metadata_url,
            "master_server_address": master.address,
            "global_segment_size": 320 * MiB,
            "local_buffer_size": 16 * MiB,
            "memory_pool_size": 256 * MiB,
        }
        send_cfg = {
            "connector_config": conn,
            "omni_from_stage": "0",
            "omni_to_stage": "1",
            "need_send_cache": True,
        }
        recv_cfg = {
            "connector_config": dict(conn),
            "stage_id": 1,
            "engine_input_source": [0],
            "need_recv_cache": True,
            "recv_timeout": 60.0,
        }
        out_q, in_q = queue(), queue()
        proc = spawn(peer_sender, send_cfg, 0, 1, QWEN, out_q, in_q)
        with peers(proc, timeout=30):
            res["recv"] = receive_and_check(recv_cfg, 0, 1, QWEN, None)
            res["sent"] = _collect(out_q, 1, 60)[0][2]
            in_q.put("close")
            res["closed"] = _collect(out_q, 1, 60)[0][2]
        # nothing was left in the store: a fresh client finds no object under the key
        from omnikv.connectors.mooncake_store import MooncakeStoreConnector

        probe = MooncakeStoreConnector({**conn, "global_segment_size": 16 * MiB})
        assert probe._store is not None
        res["left_in_store"] = int(probe._store.is_exist("req@0_1"))
        probe.close()
    return res


def scenario_te_tp(s: int, t: int) -> dict[str, Any]:
    base = _free_base_port(s)
    out_q, in_q = queue(), queue()
    info = {"host": "127.0.0.1", "zmq_port": base + 100}
    procs = [
        spawn(peer_sender, te_kv_config("sender", base, s, t), r, s, SMALL, out_q, in_q)
        for r in range(s)
    ]
    procs += [
        spawn(peer_receiver, te_kv_config("receiver", base, s, t), r, t, SMALL, info, out_q)
        for r in range(t)
    ]
    res: dict[str, Any] = {"sent": {}, "received": {}, "closed": {}}
    with peers(*procs, timeout=30):
        for kind, rank, body in _collect(out_q, s + t, 90):
            res[kind][str(rank)] = body
        for _ in range(s):
            in_q.put("close")
        for _kind, rank, body in _collect(out_q, s, 60):
            res["closed"][str(rank)] = body
    return res


# -- tests (each scenario runs once per module; each test checks one behaviour) -----------------
def _check_received(r: dict[str, Any], spec: dict[str, Any], heads: int) -> None:
    assert r["status"] == "ok", r
    assert r["mismatches"] == [], r["mismatches"][:5]
    assert r["layers"] == [spec["layers"], spec["layers"]]
    assert r["block_ids"] and r["seq_len"] == spec["seq_len"]
    per_token = 2 * spec["layers"] * heads * spec["dim"] * 2
    assert r["size"] >= per_token * spec["seq_len"]


def _check_consumed_once(r: dict[str, Any]) -> None:
    # the second receive is a (None, 0) timeout within its 1 s deadline
    assert r["again"][:2] == [True, 0] and r["again"][2] < 2.0, r["again"]
    assert r["again_status"] == "timeout"


def _check_receiver_closed(r: dict[str, Any], metadata_port: int = 0) -> None:
    assert r["pool_used"] == 0, "received views released: the receive slot is free again"
    assert r["threads"] == [], r["threads"]
    assert [c for c in r["tcp"] if c[1] != metadata_port] == [], r["tcp"]
    # The store client's engine keeps one process-wide HTTP keep-alive connection to the
    # metadata server after close (library state, reused by the next client; never grows).
    assert len(r["tcp"]) <= (1 if metadata_port else 0), r["tcp"]


def _check_sent_224(sent: dict[str, Any]) -> None:
    assert sent["done"] == ["req"] and sent["status"] == "sent", sent
    assert sent["nbytes"] >= 224 * MiB


def _check_closed_sender(c: dict[str, Any]) -> None:
    assert c["entries"] == 0 and c["pool_used"] == 0, c
    assert c["threads"] == [] and c["tcp"] == [], c


@pytest.fixture(scope="module")
def te_224() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_te_224", timeout=180)


@pytest.fixture(scope="module")
def store_224() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_store_224", timeout=180)


@pytest.fixture(scope="module")
def te_tp() -> dict[str, Any]:
    return run_scenario(__file__, "scenario_te_tp", {"s": 2, "t": 4}, timeout=180)


@pytest.mark.timeout(200)
def test_te_sender_reports_the_224mib_kv_sent(te_224: dict[str, Any]) -> None:
    _check_sent_224(te_224["sent"])


@pytest.mark.timeout(200)
def test_te_receiver_gets_every_tensor_intact(te_224: dict[str, Any]) -> None:
    _check_received(te_224["recv"], QWEN, QWEN["heads"])


@pytest.mark.timeout(200)
def test_te_kv_is_consumed_once(te_224: dict[str, Any]) -> None:
    _check_consumed_once(te_224["recv"])


@pytest.mark.timeout(200)
def test_te_receiver_leaves_nothing_after_close(te_224: dict[str, Any]) -> None:
    _check_receiver_closed(te_224["recv"])


@pytest.mark.timeout(200)
def test_te_sender_leaves_nothing_after_close(te_224: dict[str, Any]) -> None:
    _check_closed_sender(te_224["closed"])


@pytest.mark.timeout(200)
def test_store_sender_reports_the_224mib_kv_sent(store_224: dict[str, Any]) -> None:
    _check_sent_224(store_224["sent"])


@pytest.mark.timeout(200)
def test_store_receiver_gets_every_tensor_intact(store_224: dict[str, Any]) -> None:
    _check_received(store_224["recv"], QWEN, QWEN["heads"])


@pytest.mark.timeout(200)
def test_store_kv_is_consumed_once(store_224: dict[str, Any]) -> None:
    _check_consumed_once(store_224["recv"])
    assert store_224["left_in_store"] != 1, "the consumed object must be removed from the store"


@pytest.mark.timeout(200)
def test_store_receiver_leaves_nothing_after_close(store_224: dict[str, Any]) -> None:
    _check_receiver_closed(store_224["recv"], store_224["metadata_port"])


@pytest.mark.timeout(200)
def test_store_sender_leaves_nothing_after_close(store_224: dict[str, Any]) -> None:
    closed = store_224["closed"]
    # the sender still remembers its put (it learns of consumption lazily, see _track)
    assert closed["pool_used"] == 0 and closed["entries"] == 1, closed
    assert closed["threads"] == [], closed
    assert [c for c in closed["tcp"] if c[1] != store_224["metadata_port"]] == [], closed


@pytest.mark.timeout(200)
def test_tp2_senders_slice_heads_for_their_tp4_receivers(te_tp: dict[str, Any]) -> None:
    sent = te_tp["sent"]
    assert sorted(sent) == ["0", "1"]
    for rank, body in sent.items():
        assert body["status"] == "sent", body
        # sender rank r slices its heads for receivers 2r and 2r + 1: one key each
        first = 2 * int(rank)
        assert body["keys"] == [f"req_0_0_{rank}_{first}", f"req_0_0_{rank}_{first + 1}"]


@pytest.mark.timeout(200)
def test_every_tp4_receiver_gets_its_heads_intact(te_tp: dict[str, Any]) -> None:
    assert sorted(te_tp["received"]) == ["0", "1", "2", "3"]
    for body in te_tp["received"].values():
        _check_received(body, SMALL, SMALL["heads"] // 4)
        _check_consumed_once(body)
        _check_receiver_closed(body)


@pytest.mark.timeout(200)
def test_tp2_senders_leave_nothing_after_close(te_tp: dict[str, Any]) -> None:
    for body in te_tp["closed"].values():
        _check_closed_sender(body)
