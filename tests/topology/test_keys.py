"""omnikv.topology.keys: rank-aware and legacy keys, key hooks, stage ids, hook signatures."""

from __future__ import annotations

from typing import Any

import pytest

from omnikv import KVTPTopology
from omnikv.topology.keys import (
    TransferHooks,
    build_recv_keys,
    build_send_keys,
    recv_stages_of,
    send_stages_of,
    stage_key,
)


def test_rank_aware_and_legacy_keys() -> None:
    up, down = KVTPTopology(2, 4, 1), KVTPTopology(4, 2, 1)
    assert build_send_keys(up, "r", "0", "1") == ["r_0_0_1_2", "r_0_0_1_3"]
    assert build_recv_keys(down, "r", "0", "1") == [("r_0_0_2_1", 2), ("r_0_0_3_1", 3)]
    assert build_send_keys(KVTPTopology(1, 1), "r", "a", "b") == ["omni_a_to_b_kv_cache_r"]
    assert build_recv_keys(KVTPTopology(1, 1), "r", "a", "b") == [("omni_a_to_b_kv_cache_r", None)]


def test_hooks_win_and_strings_pair_with_source_ranks() -> None:
    down = KVTPTopology(4, 2, 0)
    assert build_send_keys(down, "r", "0", "1", hook=lambda *a: ["x"]) == ["x"]
    assert build_send_keys(down, "r", "0", "1", hook=lambda *a: []) == ["r_0_0_0_0"]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: ["a", "b"]) == [("a", 0), ("b", 1)]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: ["a"]) == [("a", None)]
    assert build_recv_keys(down, "r", "0", "1", hook=lambda *a: [("k", 7)]) == [("k", 7)]


# -- stage ids: "1" and 1 are the same stage (issue 12.7) ----------------------------------------
@pytest.mark.parametrize(
    ("value", "key"),
    [(1, "1"), ("1", "1"), (" 1 ", "1"), (0, "0"), ("stage2", "stage2"), ("", None), (None, None)],
)
def test_stage_key_spells_each_stage_once(value: Any, key: str | None) -> None:
    assert stage_key(value) == key


def test_recv_stages_from_a_string_stage_id_without_input_source() -> None:
    assert recv_stages_of(None, "1", []) == recv_stages_of(None, 1, None) == ("0", "1")
    assert recv_stages_of("0", "stage2", None) == ("0", "stage2")
    assert recv_stages_of("0", 3, ["1"]) == ("1", "3")
    assert send_stages_of(0, "1") == ("0", "1") and send_stages_of("0", None) == (None, None)


# -- hooks: the reference's calling conventions (issue 12.3) -------------------------------------
def test_hooks_accept_the_reference_signatures() -> None:
    seen: list[Any] = []

    def slicer(payload: dict) -> dict:  # the reference calls kv_payload_slicer(payload)
        seen.append(payload)
        return payload

    hooks = TransferHooks.of(slicer=slicer, merger=lambda payloads: payloads[0])
    assert hooks.slicer is not None and hooks.merger is not None
    assert hooks.slicer({"p": 1}, KVTPTopology(1, 2)) == {"p": 1} and seen == [{"p": 1}]
    rich = TransferHooks.of(slicer=lambda payload, topo: topo)
    assert rich.slicer is not None and rich.slicer({}, KVTPTopology(1, 1)) == KVTPTopology(1, 1)
