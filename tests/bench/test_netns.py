"""Emulated nodes (``omnikv.bench.netns``): rates parse, the link really shapes, nothing stays.

The link tests need root and ``unshare`` (skipped otherwise) and work both on the host and inside
``.ci/loopback-only``: the two nodes are fresh namespaces of their own, whatever namespace this
process runs in. Speeds are asserted as ratios with wide margins (the machine is shared).
"""

from __future__ import annotations

import os
import socket
import statistics

import pytest

from omnikv.bench.link import LinkRun
from omnikv.bench.netns import (
    MIN_BURST,
    EmulatedLink,
    Shape,
    format_rate,
    namespace_in_use,
    parse_rate,
    unavailable_reason,
)

MiB = 1 << 20
needs_netns = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def test_rates_parse_in_tc_units() -> None:
    assert parse_rate("10gbit") == 10**10
    assert parse_rate("1.5gbit") == 1_500_000_000
    assert parse_rate("500mbit") == 500 * 10**6
    assert parse_rate("25G") == 25 * 10**9
    assert parse_rate("none") is None and parse_rate("0") is None
    with pytest.raises(ValueError, match="bytes per second"):
        parse_rate("10gbps")
    assert format_rate(10**10) == "10gbit" and format_rate(None) == "unshaped"


def test_the_burst_is_a_millisecond_of_traffic_but_never_below_the_floor() -> None:
    assert Shape(10**10).burst_bytes == 1_250_000
    assert Shape(10**9).burst_bytes == MIN_BURST
    assert Shape(None).burst_bytes == 0


@needs_netns
@pytest.mark.slow
def test_a_node_runs_commands_and_functions_in_its_own_namespace() -> None:
    with EmulatedLink(Shape(10**9, delay_us=50)) as link:
        # a function runs inside node b: it sees lo and its end of the link, nothing else
        names = {name for _, name in link.b.call("socket:if_nameindex", {})}
        assert names == {"lo", link.b.ifname}
        # the node's /sys lists its own devices (UCX picks its interface there)
        assert link.a.ifname in link.a.run(["ls", "/sys/class/net"]).stdout.split()
        qdisc = link.a.run(["tc", "qdisc", "show", "dev", link.a.ifname]).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        # the delay is there, or the link says why not (kernels without netem) and still works
        assert link.delay_applied or "netem" in link.delay_note
        inodes = [(kind, ino) for node in link.nodes for kind, ino in node.ns_inodes.items()]
        assert len(set(inodes)) == 4  # two fresh namespaces of each kind
        assert link.a.address.startswith("10.213.") and link.a.address.endswith(".1")
        assert socket.if_nametoindex("lo")  # this process's namespace is untouched
    assert link.leftovers() == []
    for kind, ino in inodes:
        assert namespace_in_use(kind, ino) == []


@needs_netns
def test_split_cpus_gives_each_node_its_own_half() -> None:
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split")
    with EmulatedLink(split_cpus=True) as link:
        allowed: dict[str, frozenset[int]] = {}
        for node in link.nodes:
            status = node.run(["cat", "/proc/self/status"]).stdout
            line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
            allowed[node.name] = _cpu_set(line.split(":")[1].strip())
        assert link.a.cpus is not None and link.b.cpus is not None
        assert link.a.cpus.isdisjoint(link.b.cpus) and link.a.cpus | link.b.cpus == mine
    assert allowed == {n.name: n.cpus for n in link.nodes}


def _cpu_set(text: str) -> frozenset[int]:
    """The kernel's CPU list (``0-3,6``) as a set."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


@needs_netns
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_1gbit_link_slows_a_raw_stream_to_about_its_rate() -> None:
    n = 16 * MiB
    with EmulatedLink() as link:
        run = LinkRun(link, n).start()
        try:
            unshaped = [run.raw_sample(f"unshaped {i}")[0] for i in range(3)]
            link.reshape(Shape(10**9))
            shaped = [run.raw_sample(f"shaped {i}")[0] for i in range(3)]
        finally:
            run.close()
        assert run.failures == []  # every sample verified and seen on the link
    assert link.leftovers() == []
    at_rate = n * 8 / 1e9  # the payload's time at 1 Gbit/s, headers not counted
    # never faster than the link allows (the tbf bucket lends at most MIN_BURST at once)
    assert min(shaped) >= 0.9 * at_rate, (shaped, at_rate)
    # but close to it: tbf is precise, a loaded machine still gets well within 2x
    assert statistics.median(shaped) <= 2.0 * at_rate, (shaped, at_rate)
    # an unshaped veth is several times faster than 1 Gbit/s even on a busy 2-core VM
    assert statistics.median(unshaped) * 1.5 <= statistics.median(shaped), (unshaped, shaped)
