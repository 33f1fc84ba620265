"""Never an orphan: the kill matrix over every cross-process transport, with real processes.

For each transport (shared memory, Mooncake Transfer Engine, NIXL, Mooncake Store) one isolated
scenario kills stage processes (SIGKILL, by PID) at each moment that matters and records what
the surviving side saw:

* the receiver dies before taking the payload, after taking it but before its verdict, after
  adopting it: the sender's ``wait_delivered`` ends ``expired``, ``expired``, ``delivered``;
* the sender dies before its put, during it (the writer never returns), after it: the receiver's
  receive ends (timeout, peer gone, unavailable, or ok for a payload that outlived its sender)
  within its ``recv_timeout``, never hangs.

Then nothing is left behind: the surviving sender's pool holds no byte and no entry, the
surviving receiver holds nothing, and (Store) no object of the scenario stays in the store.
Each scenario runs in its own network namespace where ``unshare`` allows (see
``support.mooncake_peers.run_scenario``).
"""

from __future__ import annotations

from typing import Any

import pytest

from support.edges import TRANSPORTS, Edge, open_edge, transport_scenario
from support.kill_stage import Stage

#: What each side waits for: a payload's time to live, the sender's verdict watch and the
#: receiver's deadline (seconds). A receiver started just before a send must take the payload
#: within its TTL, on a host the lanes load: 2 s let the Store's TTL take one first.
TTL_S, ACK_S, RECV_S = 5.0, 2.0, 5.0
#: Slack on top of a deadline for process scheduling on a loaded 2-core host (seconds).
SLACK_S = 6.0

#: Every connector's expiry settings in the scenario.
_EXPIRY = {"buffer_ttl_seconds": TTL_S, "ack_timeout_s": ACK_S}


def _verdict(sender: Stage, rid: str) -> dict[str, Any]:
    _, status, reason, seconds = sender.ask("verdict", rid, TTL_S + ACK_S + SLACK_S, timeout=60)
    return {"status": status, "reason": reason, "seconds": seconds}


def _received(receiver: Stage, rid: str) -> dict[str, Any]:
    _, status, reason, seconds = receiver.ask("receive", rid, timeout=RECV_S + 60)
    return {"status": status, "reason": reason, "seconds": seconds}


def _connected(receiver: Stage) -> Stage:
    """``receiver`` once its connector exists (``health`` creates it): a receive's deadline then
    counts from the wait, not from the connector's start, which took over 5 s (a NIXL agent)
    under a whole ``make test``."""
    receiver.ask("health", timeout=120)
    return receiver


def scenario_kills(transport: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with open_edge(transport, _EXPIRY, RECV_S) as edge:
        # -- receivers die; one sender lives ---------------------------------------------------
        sender = Stage(edge.sender(0))
        try:
            receiver = Stage(edge.receiver(0), edge.info(0))
            assert sender.ask("send", "d")[1] == "sent"
            receiver.kill()
            res["receiver_dies_before_taking"] = _verdict(sender, "d")

            receiver = _connected(Stage(edge.receiver(1), edge.info(0)))
            assert sender.ask("send", "f")[1] == "sent"
            assert receiver.ask("take_and_hang", "f", timeout=RECV_S + 30) == ("taken",)
            receiver.kill()
            res["receiver_dies_before_its_verdict"] = _verdict(sender, "f")

            receiver = _connected(Stage(edge.receiver(2), edge.info(0)))
            assert sender.ask("send", "e")[1] == "sent"
            res["adopted"] = _received(receiver, "e")
            receiver.kill()
            res["receiver_dies_after_adopting"] = _verdict(sender, "e")
            res["sender_health"] = sender.ask("health")[1]
        finally:
            sender.close()
        # -- senders die; one receiver lives ---------------------------------------------------
        receiver = _connected(Stage(edge.receiver(3)))
        try:
            sender = Stage(edge.sender(1))
            receiver.ask("sender", edge.info(1))
            sender.kill()
            res["sender_dies_before_put"] = _received(receiver, "a")

            sender = Stage(edge.sender(2))
            receiver.ask("sender", edge.info(2))
            sender.in_q.put(("stall_put", "omni_0_to_1_kv_cache_b"))
            assert sender.answer() == ("stalling",)
            sender.kill()
            res["sender_dies_during_put"] = _received(receiver, "b")

            sender = Stage(edge.sender(3))
            receiver.ask("sender", edge.info(3))
            assert sender.ask("send", "c")[1] == "sent"
            sender.kill()
            res["sender_dies_after_put"] = _received(receiver, "c")
            res["receiver_health"] = receiver.ask("health")[1]
        finally:
            receiver.close()
        if transport == "store":
            res["left_in_store"] = _left_in_store(edge)
    return res


def _left_in_store(edge: Edge) -> list[str]:
    """Keys of this scenario a fresh Store client still finds (payloads and verdict records)."""
    from omnikv.connectors.mooncake_store.connector import MooncakeStoreConnector

    probe = MooncakeStoreConnector(edge.connector(2000))
    try:
        found = []
        for rid in "abcdef":
            key = f"omni_0_to_1_kv_cache_{rid}"
            if probe.get("0", "1", key) is not None:
                found.append(key)
        return found
    finally:
        probe.close()


# -- the tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(TRANSPORTS))
def kills(request: pytest.FixtureRequest) -> dict[str, Any]:
    return transport_scenario(__file__, "scenario_kills", request.param, timeout=300)


# each test's bound covers its module's scenario, which has a budget of its own (300 s)
pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.timeout(330)]


def test_a_receiver_that_dies_before_taking_leaves_the_sender_expired(
    kills: dict[str, Any],
) -> None:
    got = kills["receiver_dies_before_taking"]
    assert got["status"] == "expired", got
    assert got["seconds"] <= TTL_S + SLACK_S


def test_a_receiver_that_dies_before_its_verdict_leaves_the_sender_expired(
    kills: dict[str, Any],
) -> None:
    got = kills["receiver_dies_before_its_verdict"]
    assert got["status"] == "expired", got
    assert got["seconds"] <= ACK_S + SLACK_S


def test_a_receiver_that_dies_after_adopting_leaves_the_sender_delivered(
    kills: dict[str, Any],
) -> None:
    assert kills["adopted"]["status"] == "ok", kills["adopted"]
    assert kills["receiver_dies_after_adopting"]["status"] == "delivered"


def test_a_sender_that_dies_leaves_the_receiver_a_terminal_state_in_time(
    kills: dict[str, Any],
) -> None:
    ended = ("timeout", "peer_gone", "unavailable", "corrupt")
    for case in ("sender_dies_before_put", "sender_dies_during_put", "sender_dies_after_put"):
        got = kills[case]
        allowed = (*ended, "ok") if case == "sender_dies_after_put" else ended
        assert got["status"] in allowed, (case, got)
        assert got["seconds"] <= RECV_S + SLACK_S, (case, got)


#: Health fields that count something still held (each transport reports some of them).
_HELD = (
    "pool_used",
    "entries",
    "pending",
    "published",
    "held_by_readers",
    "awaiting_verdicts",
    "quarantined",
    "late_arrivals_held",
)


def test_nothing_is_left_behind(kills: dict[str, Any]) -> None:
    sender, receiver = kills["sender_health"], kills["receiver_health"]
    for side, health in (("sender", sender), ("receiver", receiver)):
        held = {name: health[name] for name in _HELD if health.get(name)}
        assert not held, (kills["transport"], side, held)
        if "pool_free_bytes" in health:  # shared memory: every byte of the pool is free
            assert health["pool_free_bytes"] == health["pool_size_bytes"], health
    assert any(name in sender for name in _HELD), sender  # the check looked at something
    assert not kills.get("left_in_store"), kills.get("left_in_store")
