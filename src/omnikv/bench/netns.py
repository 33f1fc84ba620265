"""Two emulated nodes joined by a shaped veth link, built from network namespaces.

Used by ``omnikv bench link`` and by its tests (``tests/bench/test_netns.py``,
``tests/bench/test_bench_link.py``) to put a sender and a receiver on two "hosts" with a real
IP link between them, without leaving the machine:

* each node is a fresh network namespace, with a mount namespace of its own whose ``/sys``
  shows that network namespace (``/sys/class/net`` lists the node's devices; UCX picks its
  interface there), held by one small process (``unshare --net --mount``, then ``cat`` on a
  pipe from this process). Nothing is named in ``/run/netns``, so concurrent runs cannot
  collide, and when this process dies, even by SIGKILL, the pipe closes, the holder exits and
  the kernel frees the namespaces with the node's end of the link;
* one veth pair is created straight into the two namespaces (``ip link add ... netns PID``), so
  the namespace this process runs in never sees it; its ends get two addresses of a private /24
  (``10.213.X.0/24``, ``X`` random per run), which exist only inside those namespaces;
* the link is shaped with ``tc`` on both ends (egress): ``tbf`` at the requested rate, with a
  burst of about one millisecond of traffic (at least 128 KiB, so whole GSO packets pass) and,
  when asked, a ``netem`` delay below it. Kernels without ``netem`` (``Specified qdisc kind is
  unknown``) get the rate only: :attr:`EmulatedLink.delay_note` says so (and a WARNING is
  logged) and nothing fails;
* :meth:`Node.popen` / :meth:`Node.run` / :meth:`Node.call` start processes inside a node
  (``nsenter --net --mount``, on the node's CPUs when ``split_cpus`` gave it some), each tied to
  this process (``PR_SET_PDEATHSIG``) and remembered, so :meth:`EmulatedLink.close` stops every
  one of them by PID before it stops the holders; :meth:`EmulatedLink.leftovers` lists what
  would still be there (empty after a close).

Needs root (or ``CAP_SYS_ADMIN`` + ``CAP_NET_ADMIN``), ``unshare``, ``nsenter`` and ``taskset``
(util-linux), ``ip`` and ``tc`` (iproute2); :func:`unavailable_reason` says what is missing. It
works the same in the host's namespace and inside ``unshare -n`` (the test suite's loopback-only
namespace).

``python -m omnikv.bench.netns call MODULE:FUNCTION JSON`` runs ``FUNCTION(**JSON)`` and prints
its JSON result on the last line (:meth:`Node.call` runs it inside a node).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = [
    "CALL_RESULT_PREFIX",
    "EmulatedLink",
    "LinkError",
    "Node",
    "Shape",
    "dying_with_this_process",
    "exit_on_signals",
    "format_rate",
    "namespace_in_use",
    "parse_rate",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

CALL_RESULT_PREFIX = "OMNIKV-NETNS-RESULT "
#: tbf's burst: this much time of traffic at the rate, and never less than ``MIN_BURST``
BURST_S = 0.001
MIN_BURST = 128 << 10
#: tbf's queue: the most a packet may wait in it before it is dropped
TBF_LATENCY_MS = 20
_TOOLS = ("unshare", "nsenter", "ip", "tc", "cat", "mount", "taskset")
_KINDS = ("net", "mnt")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit)?\s*$", re.IGNORECASE)
_STEP_TIMEOUT_S = 20.0
#: the holder, in its new network and mount namespaces: a sysfs of its own network namespace
#: (``/sys/class/net`` lists the node's devices, which UCX reads to pick its interface, as
#: ``ip netns exec`` arranges), one line to say it is ready, then ``cat`` until its stdin closes
_HOLD = "mount -t sysfs sysfs /sys && echo ready && exec cat"

#: ``python -c`` shim run inside a node: SIGKILL me when the process that started me dies
#: (``PR_SET_PDEATHSIG``, kept across exec), then exec argv[2:] (the PID stays the same).
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dying_with_this_process(cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind a shim that makes the kernel SIGKILL it when the thread that starts it
    exits, so when this process dies (``PR_SET_PDEATHSIG``, set before ``cmd`` is exec'd, so the
    PID is ``cmd``'s): start it from a thread that outlives it. Used for every process started
    in a node, and by the benchmark's agent for ``mooncake_master``."""
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


class LinkError(RuntimeError):
    """Building, shaping or using the emulated link failed (a tool's message is included)."""


def unavailable_reason() -> str | None:
    """Why two emulated nodes cannot be built here, or ``None`` when they can.

    Checks root, the tools, and that this process may create network and mount namespaces (a
    one-off ``unshare --net --mount true``). Called by ``omnikv bench link`` before it starts
    and by the tests' skip conditions; cheap enough to call per test module.
    """
    if not sys.platform.startswith("linux"):
        return "emulated nodes need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated nodes need root (network namespaces, veth, tc)"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (apt-get install iproute2 util-linux)"
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--mount", "--propagation", "private", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --net --mount failed: {exc}"
    if probe.returncode != 0:
        why = probe.stderr.decode(errors="replace").strip()
        return f"unshare --net --mount is not permitted: {why}"
    return None


def parse_rate(text: str) -> int | None:
    """A link rate in bits per second from ``tc``'s spelling (``"10gbit"``, ``"500mbit"``,
    ``"1.5gbit"``, a plain number of bits); ``None`` for ``"none"``, ``"off"`` or ``"0"``
    (unshaped). Raises ``ValueError`` naming the accepted forms."""
    value = text.strip().lower()
    if value in {"none", "off", "0", "unshaped"}:
        return None
    match = _RATE.match(value)
    if match is None:
        raise ValueError(
            f"rate must look like 10gbit, 500mbit, 1.5gbit or none, got {text!r} "
            "(tc's 'bps' means bytes per second and is not accepted)"
        )
    bits = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if bits <= 0:
        return None
    return int(bits)


def format_rate(bits_per_s: int | None) -> str:
    """``10gbit``, ``1.5gbit``, ``500mbit``; ``unshaped`` for ``None``."""
    if bits_per_s is None:
        return "unshaped"
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s}bit"


@dataclass(frozen=True)
class Shape:
    """What the link does to traffic: a rate (``None``: unshaped) and a one-way delay.

    The same shape is applied to the egress of both ends, so each direction gets ``rate_bps``
    and ``delay_us`` (a round trip gets twice the delay).
    """

    rate_bps: int | None = None
    delay_us: float = 0.0

    @property
    def burst_bytes(self) -> int:
        """tbf's bucket: ``BURST_S`` of traffic at the rate, at least ``MIN_BURST``."""
        if self.rate_bps is None:
            return 0
        return max(MIN_BURST, round(self.rate_bps / 8 * BURST_S))

    def describe(self) -> str:
        """One line for reports: ``10gbit (tbf, burst 1.2 MiB), delay 50 us``."""
        if self.rate_bps is None:
            text = "unshaped"
        else:
            text = (
                f"{format_rate(self.rate_bps)} (tbf, burst {self.burst_bytes / (1 << 20):.2f} MiB)"
            )
        if self.delay_us > 0:
            text += f", delay {self.delay_us:g} us requested"
        return text


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip()
        raise LinkError(f"{what} failed (exit {proc.returncode}): {detail}")


class Node:
    """One emulated host: a network namespace, its end of the link and its address.

    Built by :class:`EmulatedLink`; ``name`` is ``"a"`` or ``"b"``, ``address`` its IPv4
    address on the link, ``ifname`` its veth end. Processes started with :meth:`popen` run inside
    the namespace and are stopped by PID when the link closes (or earlier with :meth:`stop`).
    Not thread-safe: one thread builds and uses a link.
    """

    def __init__(self, name: str, address: str, ifname: str) -> None:
        self.name = name
        self.address = address
        self.ifname = ifname
        self._holder: subprocess.Popen[bytes] | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        #: ``{"net": inode, "mnt": inode}`` of this node's namespaces, for the leak checks
        self.ns_inodes: dict[str, int] = {}
        #: the CPUs this node's processes may run on (``None``: all of this process's)
        self.cpus: frozenset[int] | None = None

    # -- set-up (by EmulatedLink) -------------------------------------------------------------
    def _hold(self) -> None:
        """Start the holder (``unshare --net --mount``, its own ``/sys``, then ``cat`` on a pipe)
        and wait for its namespaces: it prints one line once it runs inside them."""
        holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c", _HOLD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._holder = holder
        assert holder.stdout is not None
        line = holder.stdout.readline()  # EOF at once if unshare failed
        if line.strip() != b"ready":
            raise LinkError(
                f"node {self.name}: its namespaces were not made (exit {holder.poll()})"
            )
        self.ns_inodes = {k: os.stat(f"/proc/{holder.pid}/ns/{k}").st_ino for k in _KINDS}

    @property
    def pid(self) -> int:
        """The PID of the process that holds this node's namespace."""
        if self._holder is None:
            raise LinkError(f"node {self.name} is not running")
        return self._holder.pid

    @property
    def netns_path(self) -> str:
        """``/proc/<holder>/ns/net``: what ``nsenter --net=`` takes."""
        return f"/proc/{self.pid}/ns/net"

    @property
    def mntns_path(self) -> str:
        """``/proc/<holder>/ns/mnt``: the node's mount namespace (its own ``/sys``)."""
        return f"/proc/{self.pid}/ns/mnt"

    # -- running things inside the node -------------------------------------------------------
    def argv(self, cmd: Sequence[str], *, die_with_parent: bool = True) -> list[str]:
        """``cmd`` wrapped to run inside this node, on its CPUs (:attr:`cpus`) and, by default,
        to die with this process."""
        wrapped = dying_with_this_process(cmd) if die_with_parent else [*cmd]
        if self.cpus is not None:
            wrapped = ["taskset", "--cpu-list", ",".join(map(str, sorted(self.cpus))), *wrapped]
        return [
            "nsenter",
            f"--net={self.netns_path}",
            f"--mount={self.mntns_path}",
            f"--wd={os.getcwd()}",
            "--",
            *wrapped,
        ]

    def run(
        self, cmd: Sequence[str], *, timeout: float = _STEP_TIMEOUT_S, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside the node to completion; ``LinkError`` on a non-zero exit or after
        ``timeout`` seconds (the process is killed then)."""
        try:
            proc = subprocess.run(
                self.argv(cmd, die_with_parent=False),
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise LinkError(f"node {self.name}: {' '.join(cmd)} overran {timeout:.0f} s") from exc
        _check(proc, f"node {self.name}: {' '.join(cmd)}")
        return proc

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside the node (``subprocess.Popen`` keyword arguments pass through).

        The process dies with the thread that called this (``PR_SET_PDEATHSIG``): call it from
        a thread that outlives the process, as the benchmark's main thread does. It is stopped
        by PID at :meth:`EmulatedLink.close` if still running.
        """
        proc: subprocess.Popen[Any] = subprocess.Popen(self.argv(cmd), **kwargs)
        self._procs.append(proc)
        return proc

    def call(self, target: str, params: dict[str, Any], *, timeout: float = 60.0) -> Any:
        """Run ``module:function(**params)`` in a fresh interpreter inside the node; its JSON
        result. ``LinkError`` with the output's tail when it fails or overruns ``timeout``."""
        cmd = [sys.executable, "-m", "omnikv.bench.netns", "call", target, json.dumps(params)]
        proc = self.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(proc)
            out, _ = proc.communicate()
            tail = out[-3000:]
            raise LinkError(
                f"node {self.name}: {target} overran {timeout:.0f} s:\n{tail}"
            ) from None
        self._procs.remove(proc)
        results = [ln for ln in out.splitlines() if ln.startswith(CALL_RESULT_PREFIX)]
        if proc.returncode != 0 or not results:
            raise LinkError(
                f"node {self.name}: {target} failed ({proc.returncode}):\n{out[-3000:]}"
            )
        return json.loads(results[-1][len(CALL_RESULT_PREFIX) :])

    def stop(self, proc: subprocess.Popen[Any], grace_s: float = 0.0) -> None:
        """Stop one process this node started: wait ``grace_s`` for it to exit, then SIGKILL by
        PID and reap it. Idempotent."""
        if proc.poll() is None and grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if proc in self._procs:
            self._procs.remove(proc)

    def pids(self) -> list[int]:
        """PIDs of the processes this node started that still run (the holder excluded)."""
        return [p.pid for p in self._procs if p.poll() is None]

    def counters(self) -> dict[str, int]:
        """``rx_bytes``, ``tx_bytes``, ``rx_packets``, ``tx_packets`` of this node's end of the
        link, read from the holder's ``/proc/<pid>/net/dev`` (its namespace's table)."""
        with open(f"/proc/{self.pid}/net/dev", encoding="ascii") as fh:
            for line in fh:
                name, sep, rest = line.partition(":")
                if sep and name.strip() == self.ifname:
                    cols = [int(c) for c in rest.split()]
                    return {
                        "rx_bytes": cols[0],
                        "rx_packets": cols[1],
                        "tx_bytes": cols[8],
                        "tx_packets": cols[9],
                    }
        raise LinkError(f"node {self.name}: no {self.ifname} in its /proc/net/dev")

    # -- teardown (by EmulatedLink) -----------------------------------------------------------
    def _close(self) -> None:
        """Stop every process started here (SIGKILL by PID), then the holder (EOF on its pipe,
        SIGKILL by PID if it lingers). The kernel then frees the namespace and the veth end."""
        for proc in reversed(list(self._procs)):
            self.stop(proc)
        holder, self._holder = self._holder, None
        if holder is None:
            return
        with contextlib.suppress(OSError):
            if holder.stdin is not None:
                holder.stdin.close()
        try:
            holder.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()


def namespace_in_use(kind: str, inode: int) -> list[int]:
    """PIDs of live processes whose ``kind`` namespace (``"net"``, ``"mnt"``) has ``inode``:
    empty once a node's namespace is gone (a namespace no process uses is freed by the kernel).
    Used by :meth:`EmulatedLink.leftovers` and the tests' leak checks."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}/ns/{kind}").st_ino == inode:
                found.append(int(entry))
    return found


class EmulatedLink:
    """Two nodes, ``a`` (``10.213.X.1``) and ``b`` (``10.213.X.2``), joined by a shaped veth.

    ``with EmulatedLink(Shape(rate_bps=10**10, delay_us=50)) as link:`` builds it (raising
    :class:`LinkError` with nothing left behind when a step fails) and :meth:`close` (also on
    exit from the ``with``) tears it down: every process started in a node is SIGKILLed by PID,
    then the namespace holders stop, and with them the namespaces and the veth. ``subnet_octet``
    picks ``X`` (random in 16..250 by default); names carry a random tag (``okv<tag>a`` /
    ``okv<tag>b``), so concurrent runs never collide. :meth:`reshape` changes the shape in place.
    """

    def __init__(
        self,
        shape: Shape | None = None,
        *,
        subnet_octet: int | None = None,
        mtu: int = 1500,
        split_cpus: bool = False,
    ) -> None:
        self.tag = secrets.token_hex(3)
        octet = subnet_octet if subnet_octet is not None else 16 + secrets.randbelow(235)
        if not 1 <= octet <= 254:
            raise ValueError(f"subnet_octet must be in 1..254, got {octet}")
        self.subnet = f"10.213.{octet}.0/24"
        self.mtu = int(mtu)
        self.a = Node("a", f"10.213.{octet}.1", f"okv{self.tag}a")
        self.b = Node("b", f"10.213.{octet}.2", f"okv{self.tag}b")
        self.shape = Shape() if shape is None else shape
        if split_cpus:
            self._split_cpus()
        #: whether the requested delay is in place; ``delay_note`` says why not
        self.delay_applied = False
        self.delay_note = ""
        self._started = False

    @property
    def nodes(self) -> tuple[Node, Node]:
        return self.a, self.b

    def _split_cpus(self) -> None:
        """Give node a the first half of this process's CPUs and node b the rest, as two hosts
        would each have their own (with one CPU, both share it). Only processes are placed: the
        kernel receives a veth packet on the CPU that sent it, so part of the receiving node's
        network work still runs on the sender's CPUs."""
        cpus = sorted(os.sched_getaffinity(0))
        half = len(cpus) // 2
        if half == 0:
            logger.warning("one CPU: both emulated nodes share it")
            return
        self.a.cpus, self.b.cpus = frozenset(cpus[:half]), frozenset(cpus[half:])

    def start(self) -> EmulatedLink:
        """Create both namespaces, the veth, the addresses and the shape; idempotent."""
        if self._started:
            return self
        self._started = True
        try:
            for node in self.nodes:
                node._hold()
            self._veth()
            for node in self.nodes:
                node.run(
                    ["ip", "-batch", "-"],
                    stdin=(
                        "link set lo up\n"
                        f"link set dev {node.ifname} mtu {self.mtu}\n"
                        f"addr add {node.address}/24 dev {node.ifname}\n"
                        f"link set dev {node.ifname} up\n"
                    ),
                )
            self.reshape(self.shape)
        except BaseException:
            self.close()
            raise
        logger.info(
            "emulated link %s: %s (%s) <-> %s (%s), %s",
            self.subnet,
            self.a.address,
            self.a.ifname,
            self.b.address,
            self.b.ifname,
            self.shape.describe(),
        )
        return self

    def _veth(self) -> None:
        cmd = [
            "ip",
            "link",
            "add",
            self.a.ifname,
            "netns",
            str(self.a.pid),
            "type",
            "veth",
            "peer",
            "name",
            self.b.ifname,
            "netns",
            str(self.b.pid),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=_STEP_TIMEOUT_S, check=False
        )
        _check(proc, "ip link add (veth)")

    def reshape(self, shape: Shape) -> None:
        """Apply ``shape`` to both ends (replacing any earlier one). A delay the kernel cannot
        emulate (no ``netem``) is logged once per link and left out; ``LinkError`` for anything
        else ``tc`` refuses."""
        self.shape = shape
        self.delay_applied = False
        for node in self.nodes:
            with contextlib.suppress(LinkError):  # nothing to delete on a fresh device
                node.run(["tc", "qdisc", "del", "dev", node.ifname, "root"])
            if shape.rate_bps is None:
                if shape.delay_us > 0:
                    self._delay(node, ["root"])
                continue
            node.run(
                [
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    node.ifname,
                    "root",
                    "handle",
                    "1:",
                    "tbf",
                    "rate",
                    f"{shape.rate_bps}bit",
                    "burst",
                    str(shape.burst_bytes),
                    "latency",
                    f"{TBF_LATENCY_MS}ms",
                ]
            )
            if shape.delay_us > 0:
                self._delay(node, ["parent", "1:1", "handle", "10:"])

    def _delay(self, node: Node, where: list[str]) -> None:
        netem = [
            "tc",
            "qdisc",
            "add",
            "dev",
            node.ifname,
            *where,
            "netem",
            "delay",
            f"{self.shape.delay_us:g}us",
            "limit",
            "100000",
        ]
        try:
            node.run(netem)
        except LinkError as exc:
            if "unknown" not in str(exc).lower():
                raise
            if not self.delay_note:
                self.delay_note = (
                    f"no delay emulated: this kernel has no netem qdisc ({exc}); "
                    "the link has its rate only"
                )
                logger.warning("%s", self.delay_note)
            return
        self.delay_applied = True
        self.delay_note = ""

    def leftovers(self) -> list[str]:
        """What is still there of this link (processes, namespaces, a veth in this namespace);
        empty after :meth:`close`. The tests' leak check."""
        out = [f"process {pid} of node {n.name}" for n in self.nodes for pid in n.pids()]
        for node in self.nodes:
            for kind, inode in node.ns_inodes.items():
                users = namespace_in_use(kind, inode)
                if users:
                    out.append(f"{kind} namespace of node {node.name} used by {users}")
        links = subprocess.run(
            ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
        out += [
            f"interface {line.split(':')[1].strip()}"
            for line in links.splitlines()
            if f"okv{self.tag}" in line
        ]
        return out

    def close(self) -> None:
        """Stop every node process by PID, then the holders; idempotent, never raises for a
        process that is already gone."""
        for node in (self.b, self.a):
            node._close()

    def __enter__(self) -> EmulatedLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``SystemExit`` (like Ctrl-C's
    ``KeyboardInterrupt``), so ``finally`` blocks tear the link down. Main thread only; the
    previous handlers come back on exit. Used by ``omnikv bench link``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _call_main(argv: Sequence[str]) -> int:
    """``call MODULE:FUNCTION JSON``: the body of :meth:`Node.call` inside the node."""
    if len(argv) != 3 or argv[0] != "call":
        print("usage: python -m omnikv.bench.netns call MODULE:FUNCTION JSON", file=sys.stderr)
        return 2
    module_name, _, attr = argv[1].partition(":")
    func = getattr(importlib.import_module(module_name), attr)
    started = time.monotonic()
    result = func(**json.loads(argv[2]))
    logger.debug("%s returned after %.3f s", argv[1], time.monotonic() - started)
    print(CALL_RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - the body of Node.call
    sys.exit(_call_main(sys.argv[1:]))
