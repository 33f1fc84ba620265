"""Placements of a request's KV over a stage's ranks, and the reshard plan between two of them.

A request's KV is a box of ``layers x KV heads x tokens`` (each element a ``head_dim`` vector,
K and V alike). A stage spreads it over its ranks along four axes (:class:`Placement`):

* **TP** splits the KV heads into ``tp`` equal groups; with more ranks than KV heads each head is
  replicated over ``tp // heads`` consecutive ranks, as tensor-parallel attention replicates it
  (:func:`~omnikv.topology.tp.head_range`; sizes where neither divides the other are refused);
* **PP** splits the layers into ``pp`` consecutive runs, evenly or as ``layer_split`` says
  (uneven splits allowed);
* **SP** splits, within a rank's TP heads, either the heads again (``"ulysses"``) or the tokens
  into ``sp`` consecutive runs (``"ring"``, balanced: the first ``tokens % sp`` runs hold one
  more);
* **CFG** branches are replicas: every branch holds the same KV.

Rank ``r`` of a stage sits at ``(cfg, pp, sp, tp)`` with TP varying fastest:
``r = ((cfg * pp_size + pp) * sp_size + sp) * tp_size + tp``.

:func:`plan_reshard` gives, for every target rank, the :class:`Piece` s it needs: for each
source box (the distinct regions source ranks hold) that meets the target's box, one piece of
the intersection from one of the source ranks holding it (replicas take turns by target rank,
so the load spreads). Every element a target holds comes from exactly one source element, and
nothing is planned that the target does not hold. Plain values and pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnikv.errors import ConfigError
from omnikv.topology.tp import head_range

__all__ = [
    "RANK_MAPPING_KEYS",
    "SP_MODES",
    "Box",
    "Piece",
    "Placement",
    "ReshardPlan",
    "placement_from_rank_mapping",
    "plan_reshard",
]

#: Sequence-parallel modes: Ulysses splits heads, Ring splits the sequence.
SP_MODES = ("ulysses", "ring")
#: Largest size of any one axis (bounds what a config can make a planner enumerate).
MAX_AXIS = 4096
_AXES = ("tp", "pp", "sp", "sp_mode", "cfg", "layer_split")
#: The keys of ``omni_kv_config["rank_mapping"]``: the seed's ``from_tp`` / ``to_tp`` and, per
#: side, the other axes of a placement (``from_pp``, ``to_sp``, ``to_sp_mode``, ``to_cfg``, ...).
RANK_MAPPING_KEYS = frozenset(f"{side}_{axis}" for side in ("from", "to") for axis in _AXES)

Range = tuple[int, int]


def _split(total: int, parts: int, index: int) -> Range:
    """``[start, stop)`` of run ``index`` when ``total`` is cut into ``parts`` consecutive runs
    that differ by at most one (the first ``total % parts`` runs hold one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _meet(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True, order=True)
class Box:
    """A region of one request's KV: ``[start, stop)`` of layers, KV heads and tokens."""

    layers: Range
    heads: Range
    tokens: Range

    @property
    def volume(self) -> int:
        """Elements (``head_dim`` vectors of K, and as many of V) in the box."""
        return (
            (self.layers[1] - self.layers[0])
            * (self.heads[1] - self.heads[0])
            * (self.tokens[1] - self.tokens[0])
        )

    def meet(self, other: Box) -> Box | None:
        """The intersection, or ``None`` when the boxes do not overlap."""
        layers = _meet(self.layers, other.layers)
        heads = _meet(self.heads, other.heads)
        tokens = _meet(self.tokens, other.tokens)
        if layers is None or heads is None or tokens is None:
            return None
        return Box(layers, heads, tokens)


@dataclass(frozen=True)
class Placement:
    """How one stage lays a request's KV over its ranks (module docstring).

    ``num_layers`` and ``num_kv_heads`` are the model's; the sizes are the stage's parallel
    sizes. Construction checks every value (:class:`~omnikv.errors.ConfigError`): sizes in
    ``1..4096``, ``sp_mode`` one of :data:`SP_MODES`, ``layer_split`` (optional) ``pp`` positive
    counts summing to ``num_layers``, and KV heads that TP (and Ulysses SP within it) can split.
    """

    num_layers: int
    num_kv_heads: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    sp_mode: str = "ulysses"
    cfg: int = 1
    layer_split: tuple[int, ...] | None = None
    _layer_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "tp", "pp", "sp", "cfg"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= (1 << 20 if "num" in name else MAX_AXIS):
                raise ConfigError(f"placement: {name} must be a positive int, got {value!r}")
        if self.sp_mode not in SP_MODES:
            raise ConfigError(f"placement: sp_mode must be one of {SP_MODES}, got {self.sp_mode!r}")
        if self.pp > self.num_layers:
            raise ConfigError(f"placement: pp={self.pp} exceeds num_layers={self.num_layers}")
        split = self.layer_split
        if split is None:
            split = tuple(
                b - a for a, b in (_split(self.num_layers, self.pp, i) for i in range(self.pp))
            )
        else:
            split = tuple(split)
            if (
                len(split) != self.pp
                or any(type(n) is not int or n < 1 for n in split)
                or sum(split) != self.num_layers
            ):
                raise ConfigError(
                    f"placement: layer_split must be {self.pp} positive counts summing to"
                    f" {self.num_layers}, got {self.layer_split!r}"
                )
        starts = [0]
        for n in split:
            starts.append(starts[-1] + n)
        object.__setattr__(self, "layer_split", split)
        object.__setattr__(self, "_layer_starts", tuple(starts))
        try:
            for t in range(self.tp):
                lo, hi = head_range(self.num_kv_heads, t, self.tp)
                if self.sp_mode == "ulysses" and self.sp > 1:
                    head_range(hi - lo, 0, self.sp)
        except ValueError as exc:
            raise ConfigError(f"placement: {exc}") from None

    @property
    def world_size(self) -> int:
        return self.cfg * self.pp * self.sp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(cfg, pp, sp, tp)`` of ``rank``; ``ValueError`` outside ``[0, world_size)``."""
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} outside [0, {self.world_size})")
        rank, tp = divmod(rank, self.tp)
        rank, sp = divmod(rank, self.sp)
        cfg, pp = divmod(rank, self.pp)
        return cfg, pp, sp, tp

    def box(self, rank: int, num_tokens: int) -> Box:
        """The region of a ``num_tokens``-token request that ``rank`` holds."""
        if type(num_tokens) is not int or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        _cfg, pp, sp, tp = self.coords(rank)
        layers = (self._layer_starts[pp], self._layer_starts[pp + 1])
        heads = head_range(self.num_kv_heads, tp, self.tp)
        tokens: Range = (0, num_tokens)
        if self.sp > 1 and self.sp_mode == "ulysses":
            lo, hi = head_range(heads[1] - heads[0], sp, self.sp)
            heads = (heads[0] + lo, heads[0] + hi)
        elif self.sp > 1:
            tokens = _split(num_tokens, self.sp, sp)
        return Box(layers, heads, tokens)

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], *, num_layers: int, num_kv_heads: int
    ) -> Placement:
        """A placement from a config mapping with keys ``tp``, ``pp``, ``sp``, ``sp_mode``,
        ``cfg`` and ``layer_split`` (each optional); an unknown key is a ``ConfigError`` naming
        it."""
        known = set(_AXES)
        extra = sorted(str(k) for k in mapping if k not in known)
        if extra:
            raise ConfigError(f"placement: unknown key(s) {extra}; known: {sorted(known)}")
        split = mapping.get("layer_split")
        if split is not None and (
            isinstance(split, str | bytes)
            or not isinstance(split, Sequence)
            or len(split) > MAX_AXIS
        ):
            raise ConfigError(f"placement: layer_split must be a list of ints, got {split!r:.60}")
        return cls(
            num_layers,
            num_kv_heads,
            tp=mapping.get("tp", 1),
            pp=mapping.get("pp", 1),
            sp=mapping.get("sp", 1),
            sp_mode=mapping.get("sp_mode", "ulysses"),
            cfg=mapping.get("cfg", 1),
            layer_split=None if split is None else tuple(split),
        )


def placement_from_rank_mapping(
    rank_mapping: Mapping[str, Any], side: str, *, num_layers: int, num_kv_heads: int
) -> Placement:
    """The placement of the sending (``side="from"``) or receiving (``"to"``) stage that a
    stage's ``rank_mapping`` describes: ``{from_tp, to_tp}`` as before, plus per side ``pp``,
    ``sp``, ``sp_mode``, ``cfg`` and ``layer_split`` (``to_sp: 4``, ``to_sp_mode: "ring"``,
    ...). A key of neither form is a ``ConfigError`` naming it."""
    if side not in ("from", "to"):
        raise ValueError(f"side must be 'from' or 'to', got {side!r}")
    extra = sorted(str(k) for k in rank_mapping if k not in RANK_MAPPING_KEYS)
    if extra:
        raise ConfigError(
            f"rank_mapping: unknown key(s) {extra}; known: {sorted(RANK_MAPPING_KEYS)}"
        )
    prefix = side + "_"
    mine = {k[len(prefix) :]: v for k, v in rank_mapping.items() if k.startswith(prefix)}
    return Placement.from_mapping(mine, num_layers=num_layers, num_kv_heads=num_kv_heads)


@dataclass(frozen=True, order=True)
class Piece:
    """What one target rank takes from one source rank: ``box`` (global coordinates)."""

    source: int
    target: int
    box: Box


@dataclass(frozen=True)
class ReshardPlan:
    """:func:`plan_reshard`'s answer: the pieces of every target rank, by target then source."""

    source: Placement
    target: Placement
    num_tokens: int
    pieces: tuple[Piece, ...]

    def for_target(self, rank: int) -> list[Piece]:
        """The pieces target ``rank`` assembles its KV from, by source rank."""
        return [p for p in self.pieces if p.target == rank]

    def for_source(self, rank: int) -> list[Piece]:
        """The pieces source ``rank`` sends (one per target it serves), by target rank."""
        return [p for p in self.pieces if p.source == rank]

    @property
    def elements(self) -> int:
        """Elements planned in all (per K, and as many for V): the minimum any transfer moves,
        since every target rank needs every element of its box once."""
        return sum(p.box.volume for p in self.pieces)

    def broadcast_elements(self) -> int:
        """Elements moved if every source rank sent all it holds to every target rank."""
        held = sum(
            self.source.box(r, self.num_tokens).volume for r in range(self.source.world_size)
        )
        return held * self.target.world_size


def plan_reshard(source: Placement, target: Placement, num_tokens: int) -> ReshardPlan:
    """Plan a ``num_tokens``-token request's KV from ``source``'s ranks onto ``target``'s.

    Both placements must describe the same model (layers, KV heads): else ``ConfigError``.
    Each target rank gets one piece per distinct source box it meets, from one of the source
    ranks holding that box (``target_rank % holders``), so replicated heads and CFG replicas
    share the sending.
    """
    if (source.num_layers, source.num_kv_heads) != (target.num_layers, target.num_kv_heads):
        raise ConfigError(
            "reshard: the stages disagree on the model: source has"
            f" {source.num_layers} layers x {source.num_kv_heads} KV heads, target"
            f" {target.num_layers} x {target.num_kv_heads}"
        )
    holders: dict[Box, list[int]] = {}
    for rank in range(source.world_size):
        holders.setdefault(source.box(rank, num_tokens), []).append(rank)
    pieces: list[Piece] = []
    for rank in range(target.world_size):
        want = target.box(rank, num_tokens)
        for box, ranks in holders.items():
            part = box.meet(want)
            if part is not None:
                pieces.append(Piece(ranks[rank % len(ranks)], rank, part))
    pieces.sort(key=lambda p: (p.target, p.source))
    return ReshardPlan(source, target, num_tokens, tuple(pieces))
