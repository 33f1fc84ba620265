"""The layout registry: names, aliases and the tuples the config and the vLLM options check."""

from __future__ import annotations

import pytest
import torch

from omnikv.errors import ExtractionError
from omnikv.layouts.specs import (
    LAYOUTS,
    VLLM_BLOCK_LAYOUTS,
    VLLM_LAYOUTS,
    BlocksFirstLayout,
    KVFirstLayout,
    KVPairLayout,
    layout_spec,
    split_layer_kv,
    stage_layout_spec,
)


def test_the_declarable_and_vllm_names_come_from_the_registry() -> None:
    assert LAYOUTS == (
        "kv_first",
        "blocks_first",
        "vllm_cpu",
        "vllm_bhnc",
        "vllm_cpu_amx",
        "auto",
    )
    assert VLLM_LAYOUTS == ("vllm_cpu", "vllm_bhnc", "kv_first", "blocks_first")
    assert (*VLLM_LAYOUTS, "vllm_cpu_amx") == VLLM_BLOCK_LAYOUTS


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("kv_first", KVFirstLayout),
        ("flash_attn", KVFirstLayout),
        ("nhd", KVFirstLayout),
        ("blocks_first", BlocksFirstLayout),
        ("flashinfer", BlocksFirstLayout),
        ("pair", KVPairLayout),
    ],
)
def test_names_and_aliases_resolve_to_one_spec(name: str, spec: type) -> None:
    assert type(layout_spec(name)) is spec


def test_unknown_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ExtractionError, match=r"unknown cache layout 'hnd'.*'kv_first'"):
        layout_spec("hnd")
    assert stage_layout_spec(None) is None and stage_layout_spec("auto") is None
    with pytest.raises(ExtractionError, match="unknown kv_cache_layout"):
        stage_layout_spec("pair")  # a form, not a stage's declaration


def test_an_alias_names_itself_when_the_shape_does_not_fit() -> None:
    with pytest.raises(ExtractionError, match="does not match layout 'flashinfer'"):
        split_layer_kv(torch.zeros(3, 5, 4, 2, 2), layout="flashinfer")
