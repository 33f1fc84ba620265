"""Readiness without taking: ``OmniConnectorBase.probe`` and ``manager.probe_kv_cache``.

A scheduler asks where a request's KV stands before it receives it: ``missing`` (nobody offers
it), ``offered`` (a sender holds it; taking it moves the bytes), ``ready`` (in memory of this
node) or ``unknown`` (the transport cannot tell, or a peer did not answer in time). A probe
takes nothing, claims nothing and never raises.

The rules and the in-process connector are checked here directly; every cross-process transport
(shared memory, Transfer Engine, NIXL, Store) runs one isolated scenario with a sender and a
receiver stage in their own processes (``support.kill_stage``): the receiver probes an id never
sent, a payload sent (twice: the first probe consumed nothing, and the sender still sees
``sent``), the same id after its receive (which hears its bytes on their way where the
transport reports it), and an id after the sender was SIGKILLed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv import OmniKVTransferManager
from omnikv.connectors.base import KeyProbe, KeyState, OmniConnectorBase
from omnikv.connectors.local import LocalConnector
from omnikv.transfer.receive import combine_probes
from support.edges import TRANSPORTS, open_edge, transport_scenario
from support.kill_stage import Stage

#: How long a probe may ask its peers in the scenarios, and the scheduling slack on top.
PROBE_S, SLACK_S = 2.0, 6.0


# -- the rules ----------------------------------------------------------------------------------
def test_combined_probe_is_missing_when_any_key_is_then_unknown_then_offered() -> None:
    ready, offered = KeyProbe(KeyState.READY, 10), KeyProbe(KeyState.OFFERED, 5)
    unknown = KeyProbe(KeyState.UNKNOWN, detail="silent")
    assert combine_probes([ready, ready]) == KeyProbe(KeyState.READY, 20)
    assert combine_probes([ready, offered]) == KeyProbe(KeyState.OFFERED, 15)
    assert combine_probes([offered, unknown]).state is KeyState.UNKNOWN
    assert combine_probes([offered, unknown]).detail == "silent"
    assert combine_probes([unknown, KeyProbe(KeyState.MISSING), ready]).state is KeyState.MISSING
    assert combine_probes([]).state is KeyState.UNKNOWN


class _ReferenceStyle(OmniConnectorBase):
    """A connector written against the reference: only ``put`` / ``get`` / ``close``."""

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> Any:
        return True, 0, None

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> Any:
        raise AssertionError("a probe must never take")

    def close(self) -> None:
        self._closed = True


def test_a_connector_that_cannot_probe_says_unknown_without_taking() -> None:
    got = _ReferenceStyle().probe("0", "1", "k", deadline=time.monotonic() + 1)
    assert got.state is KeyState.UNKNOWN
    assert got.detail is not None and "_ReferenceStyle" in got.detail


def test_local_probe_sees_a_payload_without_consuming_it() -> None:
    ns = f"probe-{time.monotonic_ns()}"
    sender = LocalConnector({"namespace": ns})
    receiver = LocalConnector({"namespace": ns})
    end = time.monotonic() + 1
    try:
        assert receiver.probe("0", "1", "k", deadline=end).state is KeyState.MISSING
        assert sender.put("0", "1", "k", b"x" * 100)[0]
        assert receiver.probe("0", "1", "k", deadline=end) == KeyProbe(KeyState.READY, 100)
        assert receiver.probe("0", "1", "k", deadline=end) == KeyProbe(KeyState.READY, 100)
        buf = receiver.wait("0", "1", "k", deadline=end)
        assert buf is not None and buf.size == 100
        buf.release()
        assert receiver.probe("0", "1", "k", deadline=end).state is KeyState.MISSING
    finally:
        sender.close()
        receiver.close()
    assert receiver.probe("0", "1", "k", deadline=end).state is KeyState.UNKNOWN


def _managers(ns: str) -> tuple[OmniKVTransferManager, OmniKVTransferManager]:
    conn = {"type": "LocalConnector", "namespace": ns}
    send = {"connector_config": conn, "omni_from_stage": "0", "omni_to_stage": "1"}
    recv = {
        "connector_config": conn,
        "stage_id": 1,
        "engine_input_source": [0],
        "need_recv_cache": True,
        "recv_timeout": 2.0,
    }
    mk = OmniKVTransferManager.from_od_config
    send["need_send_cache"] = True
    return (
        mk(SimpleNamespace(omni_kv_config=send)),
        mk(SimpleNamespace(omni_kv_config=recv)),
    )


def test_manager_probe_follows_a_request_from_missing_to_ready_to_taken() -> None:
    sender, receiver = _managers(f"probe-m-{time.monotonic_ns()}")
    caches = [torch.full((2, 4, 8, 2, 4), float(i)) for i in range(2)]
    try:
        assert receiver.probe_kv_cache("r1").state is KeyState.MISSING
        spec = {"r1": {"block_ids": [0, 1], "seq_len": 10}}
        sender.handle_finished_requests_kv_transfer(spec, caches, 8, "torch.float32")
        first = receiver.probe_kv_cache("r1")
        assert first.state is KeyState.READY and first.nbytes > 0
        assert receiver.probe_kv_cache("r1") == first  # nothing was taken
        got = receiver.receive_kv_cache_result("r1")
        assert got.ok and got.nbytes > 0
        assert receiver.probe_kv_cache("r1").state is KeyState.MISSING
    finally:
        sender.close()
        receiver.close()


def test_manager_probe_of_client_input_never_raises() -> None:
    sender, receiver = _managers(f"probe-x-{time.monotonic_ns()}")
    try:
        bad = receiver.probe_kv_cache("r", sender_info={"0": {"host": 7, "zmq_port": "x"}})
        assert bad.state is KeyState.UNKNOWN
        assert receiver.probe_kv_cache("r" * 10_000).state in (KeyState.MISSING, KeyState.UNKNOWN)
        # a stage that does not receive has nothing to say
        assert sender.probe_kv_cache("r").state is KeyState.UNKNOWN
    finally:
        sender.close()
        receiver.close()


# -- every cross-process transport, with real processes -----------------------------------------
def _probe(receiver: Stage, rid: str, probe_s: float = PROBE_S) -> dict[str, Any]:
    _, state, nbytes, detail, seconds = receiver.ask("probe", rid, probe_s, timeout=60)
    return {"state": state, "nbytes": nbytes, "detail": detail, "seconds": seconds}


def scenario_probe(transport: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with open_edge(transport, recv_s=10.0) as edge:
        sender = Stage(edge.sender(0))
        receiver = Stage(edge.receiver(0), edge.info(0))
        try:
            # the first probe opens the control channel to the sender (seconds on a loaded
            # host); a probe returns as soon as the sender answered, so the budget only waits
            # out a starved host
            res["never_sent"] = _probe(receiver, "never", probe_s=30.0)
            assert sender.ask("send", "p")[1] == "sent"
            res["sent"] = _probe(receiver, "p")
            res["sent_again"] = _probe(receiver, "p")
            res["sender_sees"] = sender.ask("result", "p")[1]
            _, res["received"], res["nbytes"], res["arrivals"] = receiver.ask(
                "receive_watched", "p", timeout=60
            )
            res["after_receive"] = _probe(receiver, "p")
            sender.kill()
            res["sender_killed"] = _probe(receiver, "q")
        finally:
            receiver.close()
            sender.close()
    return res


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def probed(request: pytest.FixtureRequest) -> dict[str, Any]:
    return transport_scenario(__file__, "scenario_probe", request.param, timeout=240)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(290)  # above the scenario's own bound (240 s) and its report
def test_probe_over_each_transport_takes_nothing_and_names_the_state(
    probed: dict[str, Any],
) -> None:
    where = "ready" if probed["transport"] == "shm" else "offered"  # shm: already on this node
    assert probed["never_sent"]["state"] == "missing", probed
    for case in ("sent", "sent_again"):
        assert probed[case]["state"] == where, (case, probed)
        assert probed[case]["nbytes"] > 0, (case, probed)
    assert probed["sent"]["nbytes"] == probed["sent_again"]["nbytes"]
    assert probed["sender_sees"] == "sent"  # probing is not taking
    assert probed["received"] == "ok"
    assert probed["after_receive"]["state"] == "missing", probed


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(290)  # above the scenario's own bound (240 s) and its report
def test_a_receive_hears_its_bytes_on_their_way_where_the_transport_reports_it(
    probed: dict[str, Any],
) -> None:
    """Cross-node transports say when a payload's bytes start to move (admission's
    ``pending``); shared memory maps it at once, so its receive hears only the take."""
    n = probed["sent"]["nbytes"]
    expected = [n] if probed["transport"] == "shm" else [n, n]
    assert probed["arrivals"] == expected, probed


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(290)  # above the scenario's own bound (240 s) and its report
def test_probe_after_the_sender_died_answers_within_its_bound(probed: dict[str, Any]) -> None:
    got = probed["sender_killed"]
    # pull transports ask the dead sender itself; shm and the Store know nobody offers it
    expected = "unknown" if probed["transport"] in ("te", "nixl") else "missing"
    assert got["state"] == expected, probed
    assert got["seconds"] <= PROBE_S + SLACK_S, got
