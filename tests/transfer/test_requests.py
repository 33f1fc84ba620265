"""Applying and collecting KV on duck-typed request objects."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from omnikv.transfer.requests import (
    apply_kv_cache_to_request,
    apply_request_kv_payload,
    cfg_companion_ids,
    collect_cfg_companions,
    collect_request_kv_payload,
    move_to_device,
    request_id_of,
)


def _data() -> dict:
    return {
        "request_id": "r",
        "layer_blocks": {"key_cache": [torch.ones(2, 1, 1)], "value_cache": [torch.zeros(2, 1, 1)]},
        "metadata": {"seq_len": 2},
    }


def test_apply_sets_request_and_sampling_params() -> None:
    req = SimpleNamespace(request_id="r", sampling_params=SimpleNamespace())
    apply_kv_cache_to_request(req, _data())
    assert req.past_key_values is req.sampling_params.past_key_values
    assert req.past_key_values.key_cache[0].eq(1).all()
    assert req.kv_metadata == req.sampling_params.kv_metadata == {"seq_len": 2}
    bare = SimpleNamespace()
    apply_kv_cache_to_request(bare, {"no": "kv"})
    assert not vars(bare)


def test_collect_and_apply_round_trip() -> None:
    kv = SimpleNamespace(key_cache=[torch.ones(1)], value_cache=[torch.ones(1)])
    sp = SimpleNamespace(
        past_key_values=kv,
        kv_metadata={"a": 1},
        cfg_text_past_key_values=kv,
        cfg_text_kv_metadata={"b": 2},
        cfg_kv_request_ids={"cfg_text": "x"},
        cfg_unrelated=1,
        temperature=0.5,
        cfg_img_past_key_values=None,
    )
    req = SimpleNamespace(
        request_id="r", past_key_values=kv, kv_metadata={"a": 1}, sampling_params=sp
    )
    payload = collect_request_kv_payload(req)
    assert set(payload) == {
        "past_key_values",
        "kv_metadata",
        "sp.past_key_values",
        "sp.kv_metadata",
        "sp.cfg_text_past_key_values",
        "sp.cfg_text_kv_metadata",
        "sp.cfg_kv_request_ids",
    }
    other = SimpleNamespace(request_id="r", sampling_params=SimpleNamespace())
    apply_request_kv_payload(other, payload, torch.device("cpu"))
    assert other.sampling_params.cfg_text_kv_metadata == {"b": 2}
    assert other.past_key_values.key_cache[0].eq(1).all()


def test_move_to_device_rebuilds_without_mutating() -> None:
    kv = SimpleNamespace(key_cache=[torch.ones(1)], value_cache=[None])
    moved = move_to_device({"kv": kv, "t": (torch.zeros(1),), "n": 3}, torch.device("meta"))
    assert moved["kv"] is not kv and moved["kv"].key_cache[0].device.type == "meta"
    assert kv.key_cache[0].device.type == "cpu"
    assert moved["t"][0].device.type == "meta" and moved["n"] == 3
    assert move_to_device(kv, None) is kv


def test_request_id_of_takes_request_ids_first_entry() -> None:
    assert request_id_of(SimpleNamespace(request_id="a", request_ids=["b"])) == "a"
    assert request_id_of(SimpleNamespace(request_ids=["b", "c"])) == "b"
    assert request_id_of(SimpleNamespace(request_ids=[])) is None
    assert request_id_of(SimpleNamespace(request_id=7)) == "7"
    assert request_id_of("plain-id") == "plain-id"
    assert request_id_of(SimpleNamespace()) is None


def test_cfg_companions_are_collected_and_applied() -> None:
    sp = SimpleNamespace(cfg_kv_request_ids={"cfg_text": "r__t", "cfg_img": None})
    req = SimpleNamespace(request_id="r", sampling_params=sp)
    assert cfg_companion_ids(req) == {"cfg_text": "r__t"}
    seen: list[tuple] = []

    def collect(rid: str, ids: dict, *rest: object) -> dict:
        seen.append((rid, ids, rest))
        return {"cfg_text_past_key_values": "kv"}

    collect_cfg_companions(req, collect, "mgr", None)
    assert sp.cfg_text_past_key_values == "kv" and seen[0][0] == "r" and seen[0][2] == ("mgr", None)

    def broken(*_: object) -> dict:
        raise RuntimeError("model bug")

    collect_cfg_companions(req, broken)  # logged, not raised
