"""Companions are the caller's own: a CFG companion list (client input, a request's
``cfg_kv_request_ids``) cannot name another request's id and so capture that request's KV.

A real sender process publishes over shared memory; the receiving stage offers or receives as a
scheduler would, with an attacker's request listing the victim's id as its companion.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnikv.transfer.requests import MAX_COMPANIONS, checked_companions, companion_refusal
from support.stage_sender import SenderProc, stage_receiver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _fill(result: Any) -> float:
    assert result is not None and result.ok and result.kv is not None
    return float(result.kv.key_cache[0].flatten()[0])


def test_an_offer_cannot_claim_another_requests_id_as_its_companion(
    senders: list[SenderProc], namespace: str
) -> None:
    """The attacker offers its request ``a1`` first, listing the victim's ``v1`` as a CFG
    companion; the victim then offers ``v1``: the victim gets its own KV, the attacker none of
    it (its own companion ``a1__neg`` is taken as usual)."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=3.0)
    try:
        senders[0].send_kv("v1", 7)
        senders[0].send_kv("a1", 1)
        senders[0].send_kv("a1__neg", 2)
        adm = mgr.admission
        started = adm.offer("a1", companions={"a1": ["v1", "a1__neg"]})
        assert started == ["a1", "a1__neg"]
        assert adm.offer("v1") == ["v1"]
        end = time.monotonic() + 10
        while not {"a1", "v1"} <= set(adm.ready()):
            assert time.monotonic() < end, adm.poll()
            time.sleep(0.005)
        assert _fill(adm.take("v1")) == 7  # the victim's own KV
        assert _fill(adm.take("a1")) == 1 and _fill(adm.take("a1__neg")) == 2
        assert len(adm) == 0
    finally:
        mgr.close()


def test_a_companion_list_cannot_make_a_receive_take_another_requests_kv(
    senders: list[SenderProc], namespace: str
) -> None:
    """The synchronous path (``receive_multi_kv_cache`` and the model's collector): a request
    whose ``cfg_kv_request_ids`` name the victim's id receives only its own KV; the victim's
    payload stays at the source for the victim."""
    senders.append(SenderProc(namespace))
    mgr = stage_receiver(namespace, timeout=1.0)
    try:
        senders[0].send_kv("v1", 7)
        senders[0].send_kv("a1", 1)
        seen: list[dict[str, str]] = []

        def collect(rid: str, cfg_ids: dict[str, str], manager: Any, device: Any) -> dict:
            seen.append(dict(cfg_ids))
            for cid in cfg_ids.values():
                manager.receive_kv_cache_for_request(cid, device)
            return {}

        sp = SimpleNamespace(cfg_kv_request_ids={"cfg_text": "v1", "cfg_img": "a1__img"})
        req = SimpleNamespace(request_id="a1", sampling_params=sp)
        assert mgr.receive_multi_kv_cache(req, collect, None) is True
        assert seen == [{"cfg_img": "a1__img"}]
        assert torch.all(req.past_key_values.key_cache[0] == 1)
        victim = mgr.receive_kv_cache_result("v1")
        assert _fill(victim) == 7
    finally:
        mgr.close()


@pytest.mark.parametrize(
    "companion",
    ["v1", "a1", "a1__", "a1_x", "xa1__neg", 7, None, "a1__" + "x" * 600, "a1__\n"],
)
def test_companion_ids_are_checked_like_transfer_ids(companion: Any) -> None:
    assert companion_refusal("a1", companion) is not None
    assert checked_companions("a1", {"r": companion}) == {}


def test_companions_are_bounded_in_number() -> None:
    many = {f"r{i}": f"a1__{i}" for i in range(100)}
    kept = checked_companions("a1", many)
    assert len(kept) == MAX_COMPANIONS and companion_refusal("a1", "a1__cfg_text") is None
