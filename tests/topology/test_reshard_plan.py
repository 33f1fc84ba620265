"""The reshard planner against a brute-force oracle over random placements.

The oracle says, element by element and without the planner's code, which elements
(layer, KV head, token) each rank of a placement holds. Every target rank must get each element it
holds from exactly one piece, whose source rank holds that element, and nothing else; the
planned volume is then the minimum. A second check moves real tensors along the plan.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnikv.errors import ConfigError
from omnikv.topology.reshard import Placement, plan_reshard


def _heads_of(num_heads: int, slot: int, slots: int) -> list[int]:
    if num_heads % slots == 0:
        return [h for h in range(num_heads) if h // (num_heads // slots) == slot]
    assert slots % num_heads == 0
    return [h for h in range(num_heads) if slot // (slots // num_heads) == h]


def _held(p: Placement, rank: int, tokens: int) -> set[tuple[int, int, int]]:
    """Brute force: the (layer, head, token) elements ``rank`` of ``p`` holds."""
    tp = rank % p.tp
    sp = (rank // p.tp) % p.sp
    pp = (rank // (p.tp * p.sp)) % p.pp
    split = p.layer_split or ()
    first = sum(split[:pp])
    layers = range(first, first + split[pp])
    heads = _heads_of(p.num_kv_heads, tp, p.tp)
    toks = list(range(tokens))
    if p.sp > 1 and p.sp_mode == "ulysses":
        heads = [heads[i] for i in _heads_of(len(heads), sp, p.sp)]
    elif p.sp > 1:
        sizes = [tokens // p.sp + (1 if i < tokens % p.sp else 0) for i in range(p.sp)]
        start = sum(sizes[:sp])
        toks = toks[start : start + sizes[sp]]
    return set(itertools.product(layers, heads, toks))


def _elements(box: object) -> set[tuple[int, int, int]]:
    layers, heads, tokens = box.layers, box.heads, box.tokens  # type: ignore[attr-defined]
    return set(itertools.product(range(*layers), range(*heads), range(*tokens)))


@st.composite
def _placements(draw: st.DrawFn) -> tuple[Placement, Placement, int]:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    layers = draw(st.integers(1, 6))
    tokens = draw(st.integers(0, 9))

    def one(max_world: int) -> Placement:
        tp = draw(
            st.sampled_from([t for t in (1, 2, 3, 4, 6, 8, 12) if heads % t == 0 or t % heads == 0])
        )
        pp = draw(st.integers(1, min(layers, 3)))
        split = None
        if pp > 1 and draw(st.booleans()):
            cuts = sorted(
                draw(
                    st.lists(
                        st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1, unique=True
                    )
                )
            )
            split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True))
        mode = draw(st.sampled_from(["ulysses", "ring"]))
        local = len(_heads_of(heads, 0, tp))
        sps = [s for s in (1, 2, 3, 4) if mode == "ring" or local % s == 0 or s % local == 0]
        sp = draw(st.sampled_from(sps))
        cfg = draw(st.integers(1, 2))
        if tp * pp * sp * cfg > max_world:
            return Placement(layers, heads, tp=tp)
        return Placement(
            layers, heads, tp=tp, pp=pp, sp=sp, sp_mode=mode, cfg=cfg, layer_split=split
        )

    return one(24), one(24), tokens


@settings(max_examples=300, deadline=None)
@given(_placements())
def test_every_target_element_comes_from_exactly_one_holder(
    case: tuple[Placement, Placement, int],
) -> None:
    source, target, tokens = case
    plan = plan_reshard(source, target, tokens)
    holds = {r: _held(source, r, tokens) for r in range(source.world_size)}
    minimum = 0
    for rank in range(target.world_size):
        need = _held(target, rank, tokens)
        minimum += len(need)
        got: dict[tuple[int, int, int], int] = {}
        pieces = plan.for_target(rank)
        assert len({p.source for p in pieces}) == len(pieces)  # one payload per source-target pair
        for piece in pieces:
            elems = _elements(piece.box)
            assert elems, "an empty piece was planned"
            assert elems <= holds[piece.source], "a piece asks a source for what it lacks"
            assert elems <= need, "a piece carries what the target does not hold"
            for e in elems:
                got[e] = got.get(e, 0) + 1
        assert set(got) == need and set(got.values()) <= {1}
    assert plan.elements == minimum  # nothing more than the targets hold
    assert plan.elements <= plan.broadcast_elements() or tokens == 0


@settings(max_examples=60, deadline=None)
@given(_placements())
def test_tensors_moved_along_the_plan_equal_the_targets_slices(
    case: tuple[Placement, Placement, int],
) -> None:
    source, target, tokens = case
    layers, heads = source.num_layers, source.num_kv_heads
    glob = torch.arange(layers * heads * tokens * 2, dtype=torch.float32).reshape(
        layers, heads, tokens, 2
    )

    def region(box: object) -> torch.Tensor:
        (l0, l1), (h0, h1), (t0, t1) = box.layers, box.heads, box.tokens  # type: ignore[attr-defined]
        return glob[l0:l1, h0:h1, t0:t1]

    local = {r: region(source.box(r, tokens)).clone() for r in range(source.world_size)}
    plan = plan_reshard(source, target, tokens)
    for rank in range(target.world_size):
        box = target.box(rank, tokens)
        out = torch.full_like(region(box), -1.0)
        for piece in plan.for_target(rank):
            src_box = source.box(piece.source, tokens)
            b = piece.box
            src = local[piece.source][
                b.layers[0] - src_box.layers[0] : b.layers[1] - src_box.layers[0],
                b.heads[0] - src_box.heads[0] : b.heads[1] - src_box.heads[0],
                b.tokens[0] - src_box.tokens[0] : b.tokens[1] - src_box.tokens[0],
            ]
            out[
                b.layers[0] - box.layers[0] : b.layers[1] - box.layers[0],
                b.heads[0] - box.heads[0] : b.heads[1] - box.heads[0],
                b.tokens[0] - box.tokens[0] : b.tokens[1] - box.tokens[0],
            ] = src
        assert torch.equal(out, region(box))


def test_the_issue_pairs_plan_the_minimum() -> None:
    """TP 3 -> 2, 6 -> 4, TP x PP 2x2 -> 1 and -> 4, TP 2 -> SP 4 (both modes), CFG replicas."""
    cases = [
        (Placement(4, 6, tp=3), Placement(4, 6, tp=2)),
        (Placement(4, 12, tp=6), Placement(4, 12, tp=4)),
        (Placement(4, 4, tp=2, pp=2), Placement(4, 4)),
        (Placement(4, 4, tp=2, pp=2), Placement(4, 4, tp=4)),
        (Placement(4, 4, tp=2), Placement(4, 4, sp=4, sp_mode="ulysses")),
        (Placement(4, 4, tp=2), Placement(4, 4, sp=4, sp_mode="ring")),
        (Placement(4, 4, tp=2), Placement(4, 4, sp=2, cfg=2)),
    ]
    for source, target in cases:
        plan = plan_reshard(source, target, 10)
        need = sum(target.box(r, 10).volume for r in range(target.world_size))
        assert plan.elements == need
    # 2x2 -> 1: the one target takes each layer run x head group from one source rank
    plan = plan_reshard(*cases[2], 10)
    assert [p.source for p in plan.for_target(0)] == [0, 1, 2, 3]


def test_replicated_heads_spread_over_their_holders() -> None:
    # 2 KV heads over TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1
    plan = plan_reshard(Placement(1, 2, tp=4), Placement(1, 2, cfg=2), 8)
    assert [p.source for p in plan.for_target(0)] == [0, 2]
    assert [p.source for p in plan.for_target(1)] == [1, 3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp": 4}, "cannot be split"),  # 6 heads over TP 4
        ({"pp": 7}, "exceeds num_layers"),
        ({"pp": 2, "layer_split": (1, 2)}, "summing to"),
        ({"sp": 2, "sp_mode": "tree"}, "sp_mode"),
        ({"tp": 0}, "positive int"),
        ({"cfg": True}, "positive int"),
        ({"tp": 2, "sp": 2, "sp_mode": "ulysses"}, "cannot be split"),
    ],
)
def test_placements_that_cannot_hold_the_kv_are_refused(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Placement(6, 6, **kwargs)  # type: ignore[arg-type]


def test_from_mapping_names_unknown_keys_and_checks_the_model() -> None:
    p = Placement.from_mapping(
        {"tp": 2, "pp": 2, "layer_split": [1, 3]}, num_layers=4, num_kv_heads=4
    )
    assert p.box(3, 5).layers == (1, 4) and p.box(3, 5).heads == (2, 4)
    with pytest.raises(ConfigError, match="unknown key"):
        Placement.from_mapping({"tp": 2, "pp_size": 2}, num_layers=4, num_kv_heads=4)
    with pytest.raises(ConfigError, match="disagree on the model"):
        plan_reshard(Placement(4, 4), Placement(5, 4), 3)


def test_rank_mapping_grows_and_stays_compatible() -> None:
    from omnikv.config import check_omni_kv_config
    from omnikv.topology.reshard import placement_from_rank_mapping

    seed = {"from_tp": 2, "to_tp": 4}
    check_omni_kv_config({"rank_mapping": seed})  # the seed's form, as before
    assert placement_from_rank_mapping(seed, "to", num_layers=2, num_kv_heads=4).tp == 4
    grown = {"from_tp": 2, "from_pp": 2, "to_sp": 4, "to_sp_mode": "ring", "to_cfg": 2}
    check_omni_kv_config({"rank_mapping": grown})
    src = placement_from_rank_mapping(grown, "from", num_layers=4, num_kv_heads=4)
    dst = placement_from_rank_mapping(grown, "to", num_layers=4, num_kv_heads=4)
    assert (src.tp, src.pp, dst.sp, dst.sp_mode, dst.cfg) == (2, 2, 4, "ring", 2)
    with pytest.raises(ConfigError, match="did you mean 'to_sp'"):
        check_omni_kv_config({"rank_mapping": {"from_tp": 2, "to_spp": 4}})
