"""``omnikv bench link``: the cross-node connectors between two emulated nodes on a shaped link.

Cross-node figures measured on loopback say little: there bytes are nearly free. This benchmark
measures Mooncake TE, Mooncake Store and NIXL against a raw TCP stream on one emulated link. It
builds two emulated hosts (:mod:`omnikv.bench.netns`: two network namespaces joined by a veth
pair with addresses of a private /24 that exist only inside them, shaped with ``tc tbf`` at
``--rate`` on both ends, plus a ``netem`` delay of ``--delay-us`` where the kernel has netem)
and moves the same bulk bytes (``--size-mib``, 224 MiB by default: a Qwen2.5-7B KV of 4096
tokens) from a sender in node *a* to a receiver in node *b*:

* *raw TCP stream* (the ceiling): one TCP connection between the nodes, opened once; a sample is
  one ``sendall`` of the whole payload from a pre-faulted buffer, timed from the sender's call to
  the receiver's last ``recv_into`` (a pre-faulted buffer), one clock for the machine.
* *te*: ``MooncakeTransferEngineConnector``, protocol tcp, bound to the veth address (the engine
  binds ``MC_TCP_BIND_ADDRESS``, set to the node's address). The sender publishes the payload
  with ``put_packed`` (its writer's memcpy is reported on its own), then the receiver's
  ``wait`` is timed: query, pull request, the engine's write across the link, done.
* *store*: ``MooncakeStoreConnector`` with a real ``mooncake_master`` in node *a* (RPC and HTTP
  metadata bound to node *a*'s address). The sender contributes Mooncake's smallest segment
  (16 MiB) and the receiver one that takes the payload, so a payload over 16 MiB is placed in
  the receiver's segment: the put crosses the link, the get is local. Timed: ``put_packed``
  less its writer's memcpy, plus the receiver's ``wait`` (size, ``get_into``, remove).
* *nixl*: ``NixlConnector`` over UCX restricted to TCP on the veth (``UCX_TLS=tcp``,
  ``UCX_NET_DEVICES=<veth>``: without them UCX would use shared memory between two processes of
  one machine and never touch the link). Timed: the receiver's ``wait`` (claim, READ, completion).

Both nodes share this machine's CPUs (``--split-cpus``: each gets its own half), so the
sender's and the receiver's CPU work add up as they would not on two hosts: at high rates on a
small machine the figures say as much about CPU as about the link; the load average before and
after the run is printed with them.

Per connector: ``--repeat`` raw-stream samples before its connectors exist; the agents' CPU use
while idle with the connectors set up (a one-second window); then raw and connector samples
alternate (raw first on even rounds), ``--warmup`` rounds discarded. The verdict compares each
connector's median with the faster of its two raw-stream medians (throughput ratio, target >=
0.9): an engine that keeps cores busy while idle, as NIXL's progress thread does, slows the raw
samples of its own rounds and must not lower its own bar. Both are also given against the link
rate (TCP over Ethernet carries at most 1448 payload bytes per 1514 on the wire, 0.956).

Every sample is verified outside the timed region: the receiver checks the size and crc32
against the bytes it generated itself from the same seed, then overwrites its buffer; and the
sender's veth must have sent at least the payload's size during the sample (so no engine
bypassed the link). After the teardown nothing of the link may remain (processes, namespaces).
The connectors run with a random ``auth_secret`` where they take one. Exit code 0 unless a sample
failed verification or (without ``--no-targets``) a connector stayed under 0.9 x raw; an engine
that is not installed is skipped with a note (an error when ``--only`` names it).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from omnikv.bench.common import ChannelError, JsonChannel, Stats, serve_commands, write_json
from omnikv.bench.netns import (
    EmulatedLink,
    LinkError,
    Node,
    Shape,
    dying_with_this_process,
    exit_on_signals,
    format_rate,
    parse_rate,
    unavailable_reason,
)

__all__ = [
    "CASES",
    "CONNECTORS",
    "TARGET",
    "BenchError",
    "CaseResult",
    "LinkRun",
    "Peer",
    "main",
    "pattern",
    "spawn_agent",
]

logger = logging.getLogger(__name__)

MIB = 1 << 20
TARGET = 0.9
CASES = ("te", "store", "nixl")
CONNECTORS = {
    "te": "MooncakeTransferEngineConnector",
    "store": "MooncakeStoreConnector",
    "nixl": "NixlConnector",
}
STAGES = ("0", "1")
SETUP_TIMEOUT_S = 120.0
MIN_SEGMENT = 16 * MIB  # Mooncake Store's smallest global segment
IDLE_PROBE_S = 1.0  # the window in which the agents' idle CPU use is measured
_FILL = 0xA5
_MODULE = "omnikv.bench.link"  # what the agents run (``__name__`` is "__main__" in an agent)


# -- the bytes ---------------------------------------------------------------------------------
def pattern(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` deterministic bytes: a seeded random MiB tiled, every 64 KiB stamped with its
    index (so a misplaced block fails the crc). Both nodes build it from the same seed."""
    block = np.random.default_rng(seed).integers(0, 256, MIB, dtype=np.uint8)
    out: np.ndarray = np.tile(block, -(-nbytes // MIB))[:nbytes].copy()
    stamps = out[:: 64 << 10]
    stamps[:] = (np.arange(stamps.size) % 251).astype(np.uint8)
    return out


def _crc(buf: np.ndarray) -> int:
    return zlib.crc32(buf.data)


def _prefaulted(nbytes: int) -> np.ndarray:
    """A page-aligned view of a fresh numpy buffer, every page already touched (written)."""
    buf = np.empty(nbytes + 4096, dtype=np.uint8)
    offset = (-buf.ctypes.data) % 4096
    view = buf[offset : offset + nbytes]
    view.fill(_FILL)
    return view


# -- the agent: one process per node -----------------------------------------------------------
class _Agent:
    """What runs in a node: the bytes, the raw socket, the connectors, the Store master.

    Started by :meth:`LinkRun.start` as ``python -m omnikv.bench.link --role agent --fd N``
    inside a node; answers JSON-line commands on the socketpair ``fd`` (:meth:`ops`) until
    ``stop`` or EOF, then closes everything it opened (connectors, sockets, the master by PID).
    """

    def __init__(self) -> None:
        self.node = ""
        self.address = ""
        self.n = 0
        self.crc = 0
        self.src: np.ndarray | None = None
        self.rx: np.ndarray | None = None
        self.listener: socket.socket | None = None
        self.sock: socket.socket | None = None
        self.conns: dict[str, Any] = {}
        self.master: subprocess.Popen[bytes] | None = None

    def op_init(self, node: str, address: str, nbytes: int, seed: int) -> list[Any]:
        self.node, self.address, self.n = node, address, int(nbytes)
        data = pattern(self.n, int(seed))
        self.crc = _crc(data)
        if node == "a":
            self.src = data
        else:
            del data
            self.rx = _prefaulted(self.n)
        return ["ready", os.getpid(), self.crc, self.n]

    def op_free_port(self) -> list[Any]:
        with socket.socket() as s:
            s.bind((self.address, 0))
            return ["port", int(s.getsockname()[1])]

    # raw TCP stream
    def op_raw_listen(self) -> list[Any]:
        self.listener = socket.socket()
        self.listener.bind((self.address, 0))
        self.listener.listen(1)
        return ["listening", int(self.listener.getsockname()[1])]

    def op_raw_connect(self, host: str, port: int) -> list[Any]:
        self.sock = socket.create_connection((host, int(port)), timeout=SETUP_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return ["connected"]

    def op_raw_accept(self) -> list[Any]:
        assert self.listener is not None
        self.listener.settimeout(SETUP_TIMEOUT_S)
        self.sock, _ = self.listener.accept()
        self.listener.close()
        self.listener = None
        return ["accepted"]

    def op_raw_send(self) -> list[Any]:
        assert self.sock is not None and self.src is not None
        t0 = time.monotonic()
        self.sock.sendall(self.src.data)
        return ["sent", t0, time.monotonic()]

    def op_raw_recv(self, timeout_s: float) -> list[Any]:
        """Receive one payload; ``["received", size, ok, t_last_byte]`` (crc after the clock)."""
        assert self.sock is not None and self.rx is not None
        self.sock.settimeout(float(timeout_s))
        view, got = self.rx.data, 0
        while got < self.n:
            k = self.sock.recv_into(view[got:], self.n - got)
            if k == 0:
                break
            got += k
        t_end = time.monotonic()
        ok = got == self.n and _crc(self.rx) == self.crc
        self.rx.fill(_FILL)
        return ["received", got, ok, t_end]

    # connectors
    def op_setup(self, case: str, config: dict[str, Any]) -> list[Any]:
        from omnikv.connectors.factory import ConnectorSpec, OmniConnectorFactory

        spec = ConnectorSpec(CONNECTORS[case], config)
        self.conns[case] = OmniConnectorFactory.create_connector(spec)
        return ["set_up"]

    def op_put(self, case: str, key: str, timeout_s: float) -> list[Any]:
        """``put_packed`` the payload: ``["published", t_start, t_end, writer_seconds]``."""
        src = self.src
        assert src is not None
        took: list[float] = []

        def write(dst: Any) -> None:
            t0 = time.monotonic()
            np.copyto(dst.numpy(), src)  # one single-threaded copy: no OpenMP workers left
            took.append(time.monotonic() - t0)

        t0 = time.monotonic()
        ok, _, _ = self.conns[case].put_packed(
            *STAGES, key, self.n, write, deadline=t0 + float(timeout_s)
        )
        t1 = time.monotonic()
        if not ok:
            raise RuntimeError(f"put_packed of {key} returned not ok")
        return ["published", t0, t1, took[0]]

    def op_wait(self, case: str, key: str, timeout_s: float) -> list[Any]:
        """``wait`` for ``key``: ``["got", size, ok, t_call, t_in_hand]`` (crc after the clock)."""
        t0 = time.monotonic()
        got = self.conns[case].wait(*STAGES, key, deadline=t0 + float(timeout_s))
        t1 = time.monotonic()
        if got is None:
            return ["got", 0, False, t0, t1]
        try:
            size = int(got.size)
            data = got.tensor.numpy()
            ok = size == self.n and _crc(data[: self.n]) == self.crc
            data.fill(_FILL)
            del data
        finally:
            got.release()
        return ["got", size, ok, t0, t1]

    def op_close(self, case: str) -> list[Any]:
        conn = self.conns.pop(case, None)
        if conn is not None:
            conn.close()
        return ["closed"]

    # the Store's master (node a)
    def op_master_start(self) -> list[Any]:
        """Start ``mooncake_master`` on this node's address: ``["master", metadata_url,
        master_address]`` once its RPC and HTTP ports accept connections."""
        from omnikv.bench.mooncake_master import master_binary

        ports = []
        socks = [socket.socket() for _ in range(3)]
        try:
            for s in socks:
                s.bind((self.address, 0))
                ports.append(int(s.getsockname()[1]))
        finally:
            for s in socks:
                s.close()
        rpc, http, metrics = ports
        host = self.address
        args = [
            master_binary(),
            f"--rpc_address={host}",
            f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={http}",
            f"--metrics_host={host}",
            f"--metrics_port={metrics}",
        ]
        self.master = subprocess.Popen(
            dying_with_this_process(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        end = time.monotonic() + 30
        for port in (rpc, http):
            while not _accepts(host, port):
                if self.master.poll() is not None or time.monotonic() > end:
                    self.op_master_stop()
                    raise RuntimeError(f"mooncake_master did not listen on {host}:{port}")
                time.sleep(0.02)  # bounded wait for "port accepts", re-checked every 20 ms
        return ["master", f"http://{host}:{http}/metadata", f"{host}:{rpc}"]

    def op_master_stop(self) -> list[Any]:
        proc, self.master = self.master, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        return ["stopped"]

    def ops(self) -> dict[str, Callable[..., list[Any]]]:
        return {
            "init": self.op_init,
            "free_port": self.op_free_port,
            "raw_listen": self.op_raw_listen,
            "raw_connect": self.op_raw_connect,
            "raw_accept": self.op_raw_accept,
            "raw_send": self.op_raw_send,
            "raw_recv": self.op_raw_recv,
            "setup": self.op_setup,
            "put": self.op_put,
            "wait": self.op_wait,
            "close": self.op_close,
            "master_start": self.op_master_start,
            "master_stop": self.op_master_stop,
        }

    def close(self) -> None:
        """Everything this agent opened, once, when its command loop ends."""
        for case in list(self.conns):
            try:
                self.op_close(case)
            except Exception as exc:  # the agent is exiting: say why, close the rest
                logger.warning("node %s: closing the %s connector failed: %s", self.node, case, exc)
        self.op_master_stop()
        for s in (self.sock, self.listener):
            if s is not None:
                s.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _serve(fd: int) -> int:
    """The agent's command loop: replies ``["error", text]`` to a failed command and exits on
    ``stop`` or EOF (a dead parent), closing what it opened."""
    chan = JsonChannel(socket.socket(fileno=fd))
    agent = _Agent()
    table = agent.ops()
    try:
        serve_commands(chan, table)
    finally:
        agent.close()
        chan.close()
    return 0


# -- the orchestrator (this process, outside both nodes) ---------------------------------------
class BenchError(RuntimeError):
    """A step of the benchmark failed (set-up, a transfer, an agent); reported, exit code 1."""


@dataclass
class Peer:
    """One agent process in a node, its control channel and its captured stderr (the engines'
    log lines: shown, the last lines of it, only when the run fails)."""

    node: Node
    proc: subprocess.Popen[bytes]
    chan: JsonChannel
    log: IO[bytes]

    def tail(self, limit: int = 2000) -> str:
        """The end of the agent's stderr."""
        with contextlib.suppress(OSError, ValueError):
            self.log.flush()
            size = self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, size - limit))
            return self.log.read().decode(errors="replace")
        return ""

    def stop(self, grace_s: float) -> None:
        """``stop`` to the agent, up to ``grace_s`` for it to close what it opened (it reads
        ``stop`` once its current command is done), then SIGKILL by PID; its channel and log
        are closed."""
        with contextlib.suppress(OSError):
            self.chan.send("stop")
        self.node.stop(self.proc, grace_s=grace_s)
        self.chan.close()
        self.log.close()

    def ask(self, *msg: Any, tag: str, timeout_s: float = SETUP_TIMEOUT_S) -> list[Any]:
        self.chan.send(*msg)
        return self.expect(tag, timeout_s)

    def expect(self, tag: str, timeout_s: float) -> list[Any]:
        try:
            return self.chan.expect(tag, timeout_s)
        except ChannelError as exc:
            raise BenchError(f"node {self.node.name}: {exc}") from exc


def spawn_agent(node: Node, module: str) -> Peer:
    """Start ``python -m <module> --role agent --fd N`` in ``node``, its engines bound to the
    node's link (``MC_TCP_BIND_ADDRESS``, UCX on TCP over its veth); its stderr goes to a
    temporary file (:meth:`Peer.tail`). Called by the link benchmarks' orchestrators; the
    caller stops it (``stop`` over its channel, then :meth:`Node.stop`)."""
    parent, child = socket.socketpair()
    env = dict(os.environ)
    env.update(
        MC_TCP_BIND_ADDRESS=node.address,
        UCX_NET_DEVICES=node.ifname,
        UCX_TLS="tcp",
    )
    env.setdefault("GLOG_minloglevel", "2")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    cmd = [sys.executable, "-m", module, "--role", "agent", "--fd", str(child.fileno())]
    # owned by the Peer from here on, closed by whoever stops the agent
    log = tempfile.TemporaryFile(prefix=f"omnikv-link-{node.name}-")  # noqa: SIM115
    try:
        proc = node.popen(cmd, pass_fds=[child.fileno()], env=env, stderr=log)
    except BaseException:
        parent.close()
        log.close()
        raise
    finally:
        child.close()
    return Peer(node, proc, JsonChannel(parent), log)


@dataclass
class CaseResult:
    """One connector's samples and the raw stream's, in its rounds and just before them.

    ``raw`` alternates with the connector's samples (drift hits both); ``raw_before`` is taken
    before the connectors exist, so an engine that keeps cores busy while idle (NIXL's progress
    thread) cannot make the ceiling look lower than it is. The verdict uses the faster of the
    two. ``idle_cpu``: each agent's CPU use (cores) over :data:`IDLE_PROBE_S` with the
    connectors set up and nothing moving.
    """

    case: str
    nbytes: int
    transport: Stats
    raw: Stats
    raw_before: Stats
    e2e: Stats
    writer: Stats
    link_bytes: list[int] = field(default_factory=list)
    idle_cpu: dict[str, float] = field(default_factory=dict)
    #: the transport's two parts where the put is part of it (the Store): put less its writer,
    #: then the receiver's ``wait``
    put: Stats | None = None
    wait: Stats | None = None

    @property
    def ceiling(self) -> Stats:
        """The faster of the two raw-stream baselines (by median)."""
        if not self.raw_before.samples:
            return self.raw
        return min(self.raw, self.raw_before, key=lambda st: st.median)

    @property
    def ratio_raw(self) -> float:
        """Throughput of the connector over that of the raw stream (:attr:`ceiling`)."""
        return self.ceiling.median / self.transport.median


@dataclass
class LinkRun:
    """One run of the benchmark on one emulated link: the agents, the raw stream, the cases.

    Used by :func:`main` and by the tests (``LinkRun(link, nbytes).start()`` then
    :meth:`raw_sample` / :meth:`run_case`; :meth:`close` stops the agents, the link's own
    ``close`` everything else). Failed verifications are collected in ``failures``, never
    raised; a failed step raises :class:`BenchError`.
    """

    link: EmulatedLink
    nbytes: int
    seed: int = 7
    secret: str = field(default_factory=lambda: secrets.token_hex(16))
    failures: list[str] = field(default_factory=list)
    raw_samples: list[float] = field(default_factory=list)
    _a: Peer | None = None
    _b: Peer | None = None

    @property
    def sample_timeout_s(self) -> float:
        """Generous bound on one sample: ten times the payload's time at the link rate, >= 60 s."""
        rate = self.link.shape.rate_bps
        return max(60.0, 10 * self.nbytes * 8 / rate) if rate else 60.0

    def _spawn(self, node: Node) -> Peer:
        return spawn_agent(node, _MODULE)

    @property
    def a(self) -> Peer:
        if self._a is None:
            raise BenchError("the agents are not started")
        return self._a

    @property
    def b(self) -> Peer:
        if self._b is None:
            raise BenchError("the agents are not started")
        return self._b

    def start(self) -> LinkRun:
        """Start both agents, have both build the bytes (and agree on their crc32), and open
        the raw stream's connection from node a to node b."""
        self._a, self._b = self._spawn(self.link.a), self._spawn(self.link.b)
        ready = [
            p.ask("init", p.node.name, p.node.address, self.nbytes, self.seed, tag="ready")
            for p in (self.a, self.b)
        ]
        if ready[0][2:] != ready[1][2:]:
            raise BenchError(f"the nodes built different bytes: {ready[0]} vs {ready[1]}")
        print(
            f"nodes ready: agent a pid {self.a.proc.pid}, agent b pid {self.b.proc.pid}",
            flush=True,
        )
        port = self.b.ask("raw_listen", tag="listening")[1]
        self.a.ask("raw_connect", self.link.b.address, port, tag="connected")
        self.b.ask("raw_accept", tag="accepted")
        return self

    def _tx(self) -> int:
        return self.link.a.counters()["tx_bytes"]

    def _crossed(self, label: str, before: int) -> int:
        sent = self._tx() - before
        if sent < self.nbytes:
            self.failures.append(f"{label}: only {sent} bytes crossed the link for {self.nbytes}")
        return sent

    def raw_sample(self, label: str) -> tuple[float, int]:
        """One raw-stream sample: ``(seconds, bytes on the link)``; verified."""
        tx = self._tx()
        self.b.chan.send("raw_recv", self.sample_timeout_s)
        _, t0, _ = self.a.ask("raw_send", tag="sent", timeout_s=self.sample_timeout_s)
        _, size, ok, t_end = self.b.expect("received", self.sample_timeout_s)
        if not ok:
            self.failures.append(f"{label}: received {size} bytes that differ from the payload")
        return float(t_end) - float(t0), self._crossed(label, tx)

    def _configs(self, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The sender's (node a) and receiver's (node b) connector configs of ``case``."""
        a, b = self.link.a.address, self.link.b.address
        pool = self.nbytes + 4 * MIB
        if case == "store":
            _, url, master = self.a.ask("master_start", tag="master")
            common = {
                "metadata_server": url,
                "master_server_address": master,
                "local_buffer_size": 16 * MIB,
                "memory_pool_size": pool,
            }
            sender = {**common, "host": a, "global_segment_size": MIN_SEGMENT}
            segment = max(128 * MIB, 2 * self.nbytes + 64 * MIB)
            return sender, {**common, "host": b, "global_segment_size": segment}
        port = self.a.ask("free_port", tag="port")[1]
        common = {"memory_pool_size": pool, "auth_secret": self.secret}
        if case == "te":
            common["protocol"] = "tcp"
        sender = {**common, "role": "sender", "host": a, "zmq_port": port}
        receiver = {**common, "role": "receiver", "host": b, "sender_host": a}
        return sender, {**receiver, "sender_zmq_port": port}

    def _sample(self, case: str, key: str, result: CaseResult, timed: bool) -> None:
        tx = self._tx()
        timeout = self.sample_timeout_s
        _, t_put, t_put_end, t_writer = self.a.ask("put", case, key, timeout, tag="published")
        _, size, ok, t_call, t_hand = self.b.ask("wait", case, key, timeout, tag="got")
        if not ok:
            self.failures.append(f"{case} {key}: received {size} bytes that differ")
        crossed = self._crossed(f"{case} {key}", tx)
        if not timed:
            return
        took = float(t_hand) - float(t_call)
        if result.put is not None and result.wait is not None:  # the put is in the transport
            put = float(t_put_end) - float(t_put) - float(t_writer)
            result.put.samples.append(put)
            result.wait.samples.append(took)
            took += put
        result.transport.samples.append(took)
        result.e2e.samples.append(float(t_hand) - float(t_put))
        result.writer.samples.append(float(t_writer))
        result.link_bytes.append(crossed)

    def run_case(self, case: str, warmup: int, repeat: int) -> CaseResult:
        """Set up ``case`` on both nodes, alternate raw and connector samples for ``warmup``
        discarded and ``repeat`` timed rounds, close both sides (and the master). Raises
        :class:`BenchError` when a step fails."""
        n = self.nbytes
        result = CaseResult(
            case,
            n,
            Stats(f"{case}: omnikv transport", [], n),
            Stats(f"{case}: raw stream (same rounds)", [], n),
            Stats(f"{case}: raw stream (before set-up)", [], n),
            Stats(f"{case}: put -> in hand (e2e)", [], n),
            Stats(f"{case}: writer memcpy (not timed)", [], n),
        )
        if case == "store":  # the put crosses the link (or fills the sender's own segment)
            result.put = Stats("  store: put_packed less writer", [], n)
            result.wait = Stats("  store: wait (size, get_into, remove)", [], n)
        for i in range(repeat):
            took, _ = self.raw_sample(f"{case} raw before set-up {i}")
            result.raw_before.samples.append(took)
            self.raw_samples.append(took)
        # A failed or interrupted case leaves its connectors (and the master) to the agents'
        # own exit (LinkRun.close stops them at once): no round trip to an agent still busy.
        cfg_a, cfg_b = self._configs(case)
        for peer, cfg in ((self.a, cfg_a), (self.b, cfg_b)):
            peer.ask("setup", case, cfg, tag="set_up")
        print(f"  {case}: set up", flush=True)
        result.idle_cpu = self.idle_cpu()
        for i in range(warmup + repeat):
            timed = i >= warmup
            for which in ("raw", case) if i % 2 == 0 else (case, "raw"):
                if which != "raw":
                    self._sample(case, f"{case}-{i}", result, timed)
                    continue
                took, _ = self.raw_sample(f"{case} raw round {i}")
                if timed:
                    result.raw.samples.append(took)
                    self.raw_samples.append(took)
        for peer in (self.b, self.a):
            peer.ask("close", case, tag="closed")
        if case == "store":
            self.a.ask("master_stop", tag="stopped")
        return result

    def idle_cpu(self) -> dict[str, float]:
        """Each agent's CPU use in cores over :data:`IDLE_PROBE_S` while nothing is asked of it
        (a measurement window, not a wait for anything)."""
        peers = (self.a, self.b)
        before = [_cpu_seconds(p.proc.pid) for p in peers]
        t0 = time.monotonic()
        time.sleep(IDLE_PROBE_S)
        took = time.monotonic() - t0
        after = [_cpu_seconds(p.proc.pid) for p in peers]
        return {p.node.name: (b - a) / took for p, a, b in zip(peers, before, after, strict=True)}

    def close(self, grace_s: float = 30.0) -> None:
        """Stop both agents: ``stop``, up to ``grace_s`` for each to close its connectors (an
        agent reads ``stop`` once its current command is done), then SIGKILL by PID.
        Idempotent."""
        for peer in (self._b, self._a):
            if peer is not None:
                peer.stop(grace_s)
        self._a = self._b = None

    def agent_logs(self) -> str:
        """The tails of both agents' stderr (for a failure report); empty once closed."""
        parts = []
        for peer in (self._a, self._b):
            if peer is not None and (text := peer.tail().strip()):
                parts.append(f"-- node {peer.node.name} agent stderr (tail) --\n{text}")
        return "\n".join(parts)


# -- the report --------------------------------------------------------------------------------
def _ms(sec: float) -> str:
    return f"{sec * 1e3:.1f}"


def _row(st: Stats, *cols: str) -> str:
    lo, hi = st.spread
    return (
        f"{st.name:36} {_ms(st.median):>9} {_ms(st.p99):>9} {_ms(lo) + '..' + _ms(hi):>17} "
        f"{st.gbps():7.3f} " + " ".join(f"{c:>9}" for c in cols)
    )


def _link_gbps(rate_bps: int | None) -> float | None:
    return None if rate_bps is None else rate_bps / 8 / 1e9


def _vs_link(st: Stats, rate_bps: int | None) -> str:
    link = _link_gbps(rate_bps)
    return "-" if link is None else f"{st.gbps() / link:.2f}"


@dataclass
class _Report:
    args: argparse.Namespace
    link: EmulatedLink
    nbytes: int
    load_before: tuple[float, float, float]
    raw: Stats
    cases: list[CaseResult]
    skipped: dict[str, str]
    failures: list[str]
    leftovers: list[str]

    def print(self) -> None:
        rate = self.link.shape.rate_bps
        print(
            f"\nlink {format_rate(rate)}: times in ms (median, p99, min..max), GB/s of the median; "
            "x raw = the faster raw-stream median of the case / its median; "
            "x link = GB/s / link rate"
        )
        head = (
            f"{'case':36} {'median':>9} {'p99':>9} {'min..max':>17} {'GB/s':>7} "
            f"{'x raw':>9} {'x link':>9}"
        )
        print(head)
        print("-" * len(head))
        print(_row(self.raw, "1.00", _vs_link(self.raw, rate)))
        for c in self.cases:
            ceiling = c.ceiling.median
            print(_row(c.transport, f"{c.ratio_raw:.2f}", _vs_link(c.transport, rate)))
            for part in (c.put, c.wait):
                if part is not None:
                    print(_row(part))
            print(_row(c.raw, "", _vs_link(c.raw, rate)))
            print(_row(c.raw_before, "", _vs_link(c.raw_before, rate)))
            print(_row(c.e2e, f"{ceiling / c.e2e.median:.2f}", _vs_link(c.e2e, rate)))
            print(_row(c.writer))
            if c.link_bytes:
                per = min(c.link_bytes) / self.nbytes
                print(f"  {c.case}: bytes on the link per sample >= {per:.3f} x the payload")
            idle = ", ".join(f"{node} {cores:.2f}" for node, cores in c.idle_cpu.items())
            print(f"  {c.case}: agents' CPU use while idle, in cores: {idle}")
        for case, why in self.skipped.items():
            print(f"  skipped {case}: {why}")
        load = os.getloadavg()
        print(
            f"\nload average {self.load_before[0]:.2f} before, {load[0]:.2f} after "
            f"(1 min; {os.cpu_count()} cores)"
        )

    def verdict(self, targets: bool) -> int:
        print(f"Verdict (target: each connector >= {TARGET} x the raw stream's throughput)")
        missed = False
        for c in self.cases:
            ok = c.ratio_raw >= TARGET
            missed = missed or not ok
            print(f"  {'PASS' if ok else 'MISS'}  {c.case}: {c.ratio_raw:.2f} x raw")
        if self.failures:
            print(f"  FAIL  data: {len(self.failures)} bad samples: {'; '.join(self.failures[:5])}")
        else:
            print("  data: OK (every sample crc32-checked and seen crossing the link)")
        self._json(missed)
        if self.failures:
            return 1
        return 1 if missed and targets else 0

    def _json(self, missed: bool) -> None:
        rate = self.link.shape.rate_bps
        link = _link_gbps(rate)
        results: dict[str, Any] = {"raw": {**self.raw.as_dict(), "samples_s": self.raw.samples}}
        ratios: dict[str, dict[str, Any]] = {}
        for c in self.cases:
            pairs = (("", c.transport), ("_raw", c.raw), ("_raw_before", c.raw_before))
            for key, st in (*pairs, ("_e2e", c.e2e)):
                results[c.case + key] = {**st.as_dict(), "samples_s": st.samples}
            results[c.case + "_writer"] = c.writer.as_dict()
            for key, part in (("_put", c.put), ("_wait", c.wait)):
                if part is not None:
                    results[c.case + key] = {**part.as_dict(), "samples_s": part.samples}
            ratios[c.case] = {
                "vs_raw": c.ratio_raw,
                "vs_link": None if link is None else c.transport.gbps() / link,
                "link_bytes_min": min(c.link_bytes) / self.nbytes if c.link_bytes else None,
                "idle_cpu_cores": c.idle_cpu,
            }
        write_json(
            self.args.json,
            {
                "bench": "link",
                "rate": format_rate(rate),
                "rate_bps": rate,
                "shape": self.link.shape.describe(),
                "delay_us": self.link.shape.delay_us,
                "delay_applied": self.link.delay_applied,
                "delay_note": self.link.delay_note,
                "mtu": self.link.mtu,
                "cpus": {n.name: sorted(n.cpus) for n in self.link.nodes if n.cpus is not None},
                "nbytes": self.nbytes,
                "repeat": self.args.repeat,
                "warmup": self.args.warmup,
                "cores": os.cpu_count(),
                "load_before": list(self.load_before),
                "load_after": list(os.getloadavg()),
                "results": results,
                "ratios": ratios,
                "raw_vs_link": None if link is None else self.raw.gbps() / link,
                "skipped": self.skipped,
                "leftovers": self.leftovers,
                "target": TARGET,
                "targets_met": not missed,
                "verified": not self.failures,
                "failures": self.failures,
            },
        )


# -- entry point -------------------------------------------------------------------------------
def _select(only: str | None) -> tuple[list[str], dict[str, str], str | None]:
    """(cases to run, skipped case -> why, error): ``--only`` parsed, engines checked."""
    from omnikv.cli import connector_status

    wanted = list(CASES) if not only else [c.strip() for c in only.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        return [], {}, f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}"
    run: list[str] = []
    skipped: dict[str, str] = {}
    for case in wanted:
        status = connector_status(CONNECTORS[case])
        if status == "ok":
            run.append(case)
        else:
            skipped[case] = status
    if only and skipped:
        why = "; ".join(f"{c}: {w}" for c, w in skipped.items())
        return run, skipped, f"--only names a connector that cannot run here ({why})"
    return run, skipped, None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnikv bench link",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rate", default="10gbit", help="link rate (tc units: 10gbit, 500mbit)")
    parser.add_argument("--delay-us", type=float, default=50.0, help="one-way delay (netem)")
    parser.add_argument("--size-mib", type=int, default=224, help="bytes per sample (MiB)")
    parser.add_argument("--size-kib", type=int, default=0, help="bytes per sample (KiB; tests)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per connector")
    parser.add_argument("--warmup", type=int, default=1, help="discarded rounds per connector")
    parser.add_argument("--only", help="comma-separated subset of te,store,nixl")
    parser.add_argument("--mtu", type=int, default=1500, help="MTU of the link")
    parser.add_argument(
        "--split-cpus",
        action="store_true",
        help="give each node its own half of the CPUs (taskset), as two hosts would have",
    )
    parser.add_argument("--no-targets", action="store_true", help="a missed 0.9 x is not fatal")
    parser.add_argument("--json", help="write results to this file")
    parser.add_argument("--role", default="orchestrator", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    return parser


def _run(args: argparse.Namespace, shape: Shape, cases: list[str], skipped: dict[str, str]) -> int:
    """Build the link, run the raw stream and the cases, report; the link (and every process
    in it) is torn down whatever happens."""
    nbytes = args.size_kib * 1024 if args.size_kib else args.size_mib * MIB
    load_before = os.getloadavg()
    print(
        f"payload {nbytes / MIB:.1f} MiB; {args.repeat} timed rounds after {args.warmup} "
        f"warm-up per connector; cases: {', '.join(cases) or 'raw stream only'}; "
        f"load average {load_before[0]:.2f} ({os.cpu_count()} cores)",
        flush=True,
    )
    link = EmulatedLink(shape, mtu=args.mtu, split_cpus=args.split_cpus)
    run: LinkRun | None = None
    results: list[CaseResult] = []
    error = ""
    grace_s = 1.0  # a failed or interrupted run stops its agents at once
    try:
        link.start()
        print(
            f"link: {link.a.address} ({link.a.ifname}) <-> {link.b.address} ({link.b.ifname}), "
            f"{shape.describe()}, MTU {link.mtu}",
            flush=True,
        )
        if link.delay_note:
            print(f"  note: {link.delay_note}", flush=True)
        if link.a.cpus is not None and link.b.cpus is not None:
            print(f"  CPUs: node a {sorted(link.a.cpus)}, node b {sorted(link.b.cpus)}", flush=True)
        run = LinkRun(link, nbytes).start()
        if not cases:
            for i in range(args.warmup + args.repeat):
                took, _ = run.raw_sample(f"raw round {i}")
                if i >= args.warmup:
                    run.raw_samples.append(took)
        for case in cases:
            results.append(run.run_case(case, args.warmup, args.repeat))
            print(f"  {case}: done", flush=True)
        grace_s = 30.0
    except (BenchError, LinkError) as exc:
        error = f"{exc}\n{run.agent_logs() if run is not None else ''}".strip()
    finally:
        if run is not None:
            run.close(grace_s)
        link.close()
    leftovers = link.leftovers()
    for item in leftovers:
        print(f"FAIL  left behind after teardown: {item}")
    if error or run is None:
        print(f"FAIL  {error}")
        return 1
    raw = Stats("raw TCP stream (all rounds)", run.raw_samples, nbytes)
    failures = run.failures + [f"left behind: {item}" for item in leftovers]
    report = _Report(
        args,
        link,
        nbytes,
        load_before,
        raw=raw,
        cases=results,
        skipped=skipped,
        failures=failures,
        leftovers=leftovers,
    )
    report.print()
    return report.verdict(not args.no_targets)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (``omnikv bench link``); returns the exit code.

    Called by :mod:`omnikv.cli` and by the tests (``main(["--rate", "1gbit", "--size-mib",
    "8", "--repeat", "1", "--no-targets"])``); in a node it is also the agent's entry point
    (``--role agent``). 0 when every sample verified and (unless ``--no-targets``) every
    connector reached 0.9 x the raw stream; 1 otherwise, or when emulated nodes cannot be
    built here (not root, no ``unshare``), with the reason.
    """
    parser = _parser()
    args = parser.parse_args(list(argv or []))
    if args.role == "agent":
        return _serve(args.fd)
    if args.repeat < 1 or args.warmup < 0 or args.size_mib < 1 or args.size_kib < 0:
        parser.error("--repeat and --size-mib must be >= 1, --warmup and --size-kib >= 0")
    try:
        shape = Shape(parse_rate(args.rate), max(0.0, args.delay_us))
    except ValueError as exc:
        parser.error(str(exc))
    reason = unavailable_reason()
    if reason is not None:
        print(f"FAIL  omnikv bench link: {reason}")
        return 1
    cases, skipped, error = _select(args.only)
    if error is not None:
        print(f"FAIL  omnikv bench link: {error}")
        return 1
    with exit_on_signals():
        return _run(args, shape, cases, skipped)


if __name__ == "__main__":  # pragma: no cover - the agent's entry point inside a node
    sys.exit(main(sys.argv[1:]))
