"""Scenario pieces shared by the pull-engine tests (Transfer Engine, NIXL; the Store too).

Connector level (``test_mooncake_te``, ``test_nixl``): a sender peer's command loop
(:func:`serve_sender`), starting it (:func:`start_sender`), asking it (:func:`ask`), the
long-poll round trip (:func:`long_poll`). Manager level (``test_mooncake_manager``,
``test_nixl``): the KV cache both stages agree on (:data:`QWEN`, :data:`SMALL`), the sender and
receiver stage ranks, the two scenarios (224 MiB end to end, TP 2 -> 4) for any pull connector
config, and the checks of their results. Scenarios run isolated through
:func:`mooncake_helpers.run_scenario`; peers are spawned processes stopped by PID.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections.abc import Callable, Mapping
from queue import Empty
from types import SimpleNamespace
from typing import Any

from support.mooncake_peers import (
    crc,
    free_ports,
    omnikv_threads,
    pattern,
    peers,
    queue,
    spawn,
    tcp_sockets,
)

MiB = 1 << 20


# -- connector level: the sender peer -----------------------------------------------------------
def sender_put(conn: Any, key: str, nbytes: int, seed: int, deadline_s: float) -> tuple[Any, ...]:
    """``put_packed`` of :func:`pattern` bytes: ``("put", ok, size, crc)``, or
    ``("put", "PoolExhaustedError", seconds waited, 0)`` when no space freed up in time."""
    from omnikv.errors import PoolExhaustedError

    data = pattern(nbytes, seed)

    def write(dst: Any) -> None:
        dst.numpy()[:] = data

    t0 = time.monotonic()
    try:
        ok, size, _ = conn.put_packed("0", "1", key, nbytes, write, deadline=t0 + deadline_s)
    except PoolExhaustedError:
        return ("put", "PoolExhaustedError", time.monotonic() - t0, 0)
    return ("put", ok, size, crc(data))


def serve_sender(
    conn: Any, out_q: Any, in_q: Any, extra: Mapping[str, Callable[..., tuple[Any, ...]]]
) -> None:
    """A sender peer's loop: answer ``put`` / ``put_obj`` / ``health`` / ``flush`` / ``close``
    (and ``extra``) from ``in_q`` on ``out_q`` until ``close``; a failed command answers
    ``("error", type, message)``."""
    out_q.put(("ready",))
    while True:
        cmd = in_q.get()
        op = cmd[0]
        try:
            if op == "put":
                out_q.put(sender_put(conn, *cmd[1:]))
            elif op == "put_obj":
                out_q.put(("put", *conn.put("0", "1", cmd[1], cmd[2])[:2], 0))
            elif op == "health":
                out_q.put(("health", conn.health()))
            elif op == "flush":
                t0 = time.monotonic()
                left = conn.flush(cmd[1])
                out_q.put(("flushed", left, time.monotonic() - t0))
            elif op == "close":
                conn.close()
                conn.close()
                out_q.put(("closed", conn.health(), omnikv_threads(), tcp_sockets()))
                return
            else:
                out_q.put(extra[op](*cmd[1:]))
        except Exception as exc:
            out_q.put(("error", type(exc).__name__, str(exc)))


def start_sender(peer: Callable[..., None], cfg: dict[str, Any], *queues: Any) -> Any:
    """Spawn ``peer(cfg, out_q, in_q, *queues)`` and wait for its ``ready`` (60 s: importing
    torch and an engine takes long on a loaded 2-core machine): ``(proc, out_q, in_q)``."""
    out_q, in_q = queue(), queue()
    proc = spawn(peer, cfg, out_q, in_q, *queues)
    msg = out_q.get(timeout=60)
    assert msg[0] == "ready", msg
    return proc, out_q, in_q


def ask(in_q: Any, out_q: Any, *cmd: Any) -> Any:
    """Send one command to a sender peer; its reply (30 s at most)."""
    in_q.put(cmd)
    return out_q.get(timeout=30)


def long_poll(recv: Any, in_q: Any, out_q: Any, res: dict[str, Any]) -> None:
    """``wait`` for ``k1`` first, put 20 MiB + 123 bytes while it waits; record what came."""
    got: dict[str, Any] = {}

    def waiter() -> None:
        got["r"] = recv.wait("0", "1", "k1", deadline=time.monotonic() + 20)
        got["t"] = time.monotonic()

    th = threading.Thread(target=waiter)
    th.start()
    _, ok, size, sent_crc = ask(in_q, out_q, "put", "k1", 20 * MiB + 123, 7, 5.0)
    t_put = time.monotonic()
    th.join(timeout=25)
    buf = got["r"]
    res["put_ok"] = ok and size == 20 * MiB + 123
    res["wait_type"] = type(buf).__name__
    res["size"] = buf.size
    res["crc_ok"] = crc(buf.tensor.numpy()) == sent_crc
    res["lag_s"] = got["t"] - t_put
    buf.release()


# -- manager level: the KV cache both sides agree on ---------------------------------------------
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


# -- manager level: the stage ranks --------------------------------------------------------------
#: A stage process still running this long (seconds) prints every thread's stack to stderr
#: (which the scenario's failure report shows), before :func:`scenario_tp` gives up on it.
STACKS_AFTER_S = 280.0


def stage_sender(
    omni_kv: dict[str, Any],
    rank: int,
    tp: int,
    spec: dict[str, Any],
    out_q: Any,
    in_q: Any,
    gated: bool = False,
) -> None:
    """A sender stage rank: sends ``req`` from its slice of the cache, then waits to close.

    ``gated``: once its manager and cache are built, it reports ``ready`` and sends only on
    ``"send"``, so a receiver's deadline covers the send, not the process's start (importing
    torch and the engine can take minutes on a loaded host)."""
    faulthandler.dump_traceback_later(STACKS_AFTER_S)
    _set_rank(rank)
    from omnikv import OmniKVTransferManager
    from omnikv.transfer.edge import KVCaches

    try:
        mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
        per = spec["heads"] // tp
        caches = [
            cache_layer(spec, i)[..., rank * per : (rank + 1) * per, :].contiguous()
            for i in range(spec["layers"])
        ]
        entry = {"block_ids": block_ids(spec), "seq_len": spec["seq_len"]}
        if gated:
            out_q.put(("ready", rank, {}))
            go = in_q.get(timeout=300)
            if go != "send":
                raise RuntimeError(f"expected 'send', got {go!r}")
        t0 = time.monotonic()
        res = mgr.edge.send("req", entry, KVCaches(caches, spec["block_size"], "float16"))
        send_s = time.monotonic() - t0
        del caches
        out_q.put(
            (
                "sent",
                rank,
                {
                    "done": [res.request_id],
                    "status": res.status.value,
                    "reason": res.reason,
                    "keys": list(res.keys),
                    "nbytes": res.nbytes,
                    "send_s": send_s,
                },
            )
        )
        cmd = in_q.get(timeout=360)  # after every rank's report (up to 300 s: scenario_tp)
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
    omni_kv: dict[str, Any],
    rank: int,
    tp: int,
    spec: dict[str, Any],
    sender_info: Any,
    before_wait: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """A receiver stage rank: receives ``req``, compares every tensor, checks consume-once.

    ``before_wait`` runs once the receiving manager is built, just before the wait (a gated
    sender is told to send there: the receiver is waiting when the put comes)."""
    _set_rank(rank)
    from omnikv import OmniKVTransferManager

    mgr = OmniKVTransferManager.from_od_config(SimpleNamespace(omni_kv_config=omni_kv))
    if sender_info is not None:
        mgr.update_sender_info(sender_info)
    res: dict[str, Any] = {"rank": rank}
    if before_wait is not None:
        before_wait()
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


def stage_receiver(
    omni_kv: dict[str, Any],
    rank: int,
    tp: int,
    spec: dict[str, Any],
    sender_info: Any,
    out_q: Any,
) -> None:
    faulthandler.dump_traceback_later(STACKS_AFTER_S)
    try:
        out_q.put(("received", rank, receive_and_check(omni_kv, rank, tp, spec, sender_info)))
    except Exception as exc:
        out_q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def collect(out_q: Any, want: int, timeout: float) -> list[tuple[str, int, Any]]:
    """``want`` reports of the stage processes, within ``timeout`` seconds; an ``error`` report
    raises at once, and a timeout says which reports came (kind and rank)."""
    got: list[tuple[str, int, Any]] = []
    end = time.monotonic() + timeout
    while len(got) < want:
        try:
            msg = out_q.get(timeout=max(0.1, end - time.monotonic()))
        except Empty:
            came = sorted((kind, rank) for kind, rank, _ in got)
            raise AssertionError(f"{len(got)} of {want} reports in {timeout} s: {came}") from None
        if msg[0] == "error":
            raise AssertionError(f"rank {msg[1]}: {msg[2]}")
        got.append(msg)
    return got


# -- manager level: configs and scenarios -------------------------------------------------------
def kv_config(
    connector: dict[str, Any], role: str, base_port: int, from_tp: int, to_tp: int
) -> dict[str, Any]:
    """The ``omni_kv_config`` of one stage, built as a user writes it, for a pull connector
    (``connector``: its type and own keys; host, port, pool and secret are added here)."""
    pool = 256 * MiB if from_tp == to_tp == 1 else 16 * MiB
    cfg: dict[str, Any] = {
        "connector_config": {
            **connector,
            "host": "127.0.0.1",
            "zmq_port": base_port,
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


def free_base_port(ranks: int) -> int:
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


#: The 224 MiB scenarios' bound: the sum of their steps' own (sender built 120 s, the receive's
#: 60 s deadline and its 1 s second try, the sent and closed reports 60 s each) and a minute for
#: comparing 224 MiB on a loaded host, so a slow step fails on its own bound, with its name.
SCENARIO_224_S = 360.0


def hand_off_224(
    send_cfg: dict[str, Any], recv_cfg: dict[str, Any], sender_info: Any
) -> dict[str, Any]:
    """224 MiB from a sender stage process (``send_cfg``) to a receiver stage in this process
    (``recv_cfg``; ``sender_info`` as ``update_sender_info`` takes it, or ``None``): the
    receiver's, the sender's and the closed sender's reports. Prints when each step ended
    (seconds from the start), so an overrun says which step was slow."""
    t0 = time.monotonic()

    def step(what: str) -> None:
        print(f"hand_off_224 +{time.monotonic() - t0:.1f} s: {what}", flush=True)

    out_q, in_q = queue(), queue()
    proc = spawn(stage_sender, send_cfg, 0, 1, QWEN, out_q, in_q, True)
    res: dict[str, Any] = {}
    with peers(proc, timeout=30):
        collect(out_q, 1, 120)  # the sender is built (its start is not the receiver's to wait)
        step("sender built")
        # the receiver starts waiting before the sender has sent: it is woken by the put
        res["recv"] = receive_and_check(
            recv_cfg, 0, 1, QWEN, sender_info, before_wait=lambda: in_q.put("send")
        )
        step(f"received ({res['recv']['status']} after {res['recv']['recv_s']:.1f} s)")
        res["sent"] = collect(out_q, 1, 60)[0][2]
        step(f"sent report ({res['sent']['status']}, send took {res['sent']['send_s']:.1f} s)")
        in_q.put("close")
        res["closed"] = collect(out_q, 1, 60)[0][2]
        step("sender closed")
    return res


def scenario_224(connector: dict[str, Any]) -> dict[str, Any]:
    """224 MiB from one sender stage to one receiver stage through the pull ``connector``."""
    base = free_base_port(1)
    return hand_off_224(
        kv_config(connector, "sender", base, 1, 1),
        kv_config(connector, "receiver", base, 1, 1),
        {"0": {"host": "127.0.0.1", "zmq_port": base + 100}},
    )


def scenario_tp(connector: dict[str, Any], s: int, t: int) -> dict[str, Any]:
    """TP ``s`` -> ``t``: every sender rank sends, every receiver rank checks its heads."""
    base = free_base_port(s)
    out_q, in_q = queue(), queue()
    info = {"host": "127.0.0.1", "zmq_port": base + 100}
    procs = [
        spawn(stage_sender, kv_config(connector, "sender", base, s, t), r, s, SMALL, out_q, in_q)
        for r in range(s)
    ]
    procs += [
        spawn(
            stage_receiver, kv_config(connector, "receiver", base, s, t), r, t, SMALL, info, out_q
        )
        for r in range(t)
    ]
    res: dict[str, Any] = {"sent": {}, "received": {}, "closed": {}}
    with peers(*procs, timeout=30):
        # s + t processes start at once (each imports torch and its engine): on a loaded 2-core
        # host the last report can come minutes later
        for kind, rank, body in collect(out_q, s + t, 300):
            res[kind][str(rank)] = body
        for _ in range(s):
            in_q.put("close")
        for _kind, rank, body in collect(out_q, s, 60):
            res["closed"][str(rank)] = body
    return res


# -- manager level: checks of the scenarios' results ----------------------------------------------
def check_received(r: dict[str, Any], spec: dict[str, Any], heads: int) -> None:
    assert r["status"] == "ok", r
    assert r["mismatches"] == [], r["mismatches"][:5]
    assert r["layers"] == [spec["layers"], spec["layers"]]
    assert r["block_ids"] and r["seq_len"] == spec["seq_len"]
    per_token = 2 * spec["layers"] * heads * spec["dim"] * 2
    assert r["size"] >= per_token * spec["seq_len"]


def check_consumed_once(r: dict[str, Any]) -> None:
    """The second receive of a taken request is a ``(None, 0)`` timeout under its own 1 s
    deadline, not the stage's 60 s ``recv_timeout`` (these scenarios run beside the whole suite,
    where a starved 1 s wait can end seconds late; how close a miss keeps to its deadline is each
    connector's own miss test: ``test_a_miss_is_none_and_quick`` for the Transfer Engine and
    NIXL, ``test_a_key_never_put_is_none_at_the_deadline`` for the Store)."""
    assert r["again"][:2] == [True, 0] and r["again"][2] < 15.0, r["again"]
    assert r["again_status"] == "timeout"


def check_receiver_closed(r: dict[str, Any], metadata_port: int = 0) -> None:
    assert r["pool_used"] == 0, "received views released: the receive slot is free again"
    assert r["threads"] == [], r["threads"]
    assert [c for c in r["tcp"] if c[1] != metadata_port] == [], r["tcp"]
    # The store client's engine keeps one process-wide HTTP keep-alive connection to the
    # metadata server after close (library state, reused by the next client; never grows).
    assert len(r["tcp"]) <= (1 if metadata_port else 0), r["tcp"]


def check_sent_224(sent: dict[str, Any]) -> None:
    # published; a fast receiver may have accepted it already
    assert sent["done"] == ["req"] and sent["status"] in ("sent", "delivered"), sent
    assert sent["nbytes"] >= 224 * MiB


def check_closed_sender(c: dict[str, Any]) -> None:
    assert c["entries"] == 0 and c["pool_used"] == 0, c
    assert c["threads"] == [] and c["tcp"] == [], c
