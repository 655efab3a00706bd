"""``Layout(p, t, d)``: how the ranks of a worker group form pipeline, tensor and
data parallel groups; and its generation layout (the hybrid engine's pg-tg-dg-d).

Tensor-parallel groups are consecutive ranks (innermost), then data parallel, then
pipeline (outermost), as in Megatron-LM; a DeviceMesh of shape ``(p, d, t)`` with
dims ``("pp", "dp", "tp")`` follows the same order.

A role that generates (the actor) may lay the same ranks out differently while it
generates: :class:`GenerationLayout` ``(pg, tg)`` splits each training replica of
``p * t`` ranks into ``dg = (p * t) / (pg * tg)`` micro-data-parallel replicas of
``pg * tg`` ranks each. This module holds only the rank arithmetic (which the
transfer protocols need); ``hybrid_engine`` builds the process groups and moves
the weights.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import msgspec

from channels._errors import ConfigError


class Coords(NamedTuple):
    """A rank's position in a layout."""

    pp: int
    dp: int
    tp: int


Grouping = Literal["hybridflow", "vanilla"]
"""How generation groups take the training ranks (see :class:`GenerationLayout`)."""


class GenCoords(NamedTuple):
    """A rank's position in the generation layout."""

    pp: int
    """Generation pipeline stage, ``0..pg-1``."""
    tp: int
    """Rank in its generation tensor-parallel group, ``0..tg-1``."""
    replica: int
    """Its micro-data-parallel replica, ``0..d*dg-1`` (training replica ``dp`` holds
    ``dp*dg .. dp*dg+dg-1``)."""


class GenerationLayout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the ranks of a training layout ``p-t-d`` generate: ``pg-tg-dg-d``.

    ``pg`` must divide ``p`` and ``tg`` must divide ``t``; ``dg = (p/pg) * (t/tg)``.

    Groupings (HybridFlow section 5.4):

    - ``"hybridflow"``: a generation TP group takes the training TP ranks at stride
      ``t/tg`` (a generation PP group the stages at stride ``p/pg``), so the
      ``dg`` ranks that share a generation shard are consecutive, each rank's
      generation shard contains its training shard, and resharding gathers inside
      those micro-DP groups only.
    - ``"vanilla"``: generation TP groups are consecutive ranks (HybridFlow-V); a
      rank's generation shard generally does not contain its training shard.
    """

    pg: int = 1
    """Generation pipeline-parallel size."""
    tg: int = 1
    """Generation tensor-parallel size."""
    grouping: Grouping = "hybridflow"
    """``"hybridflow"`` (zero redundancy) or ``"vanilla"`` (baseline)."""

    def __post_init__(self) -> None:
        for name in ("pg", "tg"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GenerationLayout.{name} must be an int >= 1, got {value!r}")
        if self.grouping not in ("hybridflow", "vanilla"):
            raise ConfigError(f"GenerationLayout.grouping must be 'hybridflow' or 'vanilla', got {self.grouping!r}")


class Layout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Parallel layout of one role's ranks, and how they generate (``gen``)."""

    p: int = 1
    """Pipeline-parallel size."""
    t: int = 1
    """Tensor-parallel size."""
    d: int = 1
    """Data-parallel size."""
    gen: GenerationLayout | None = None
    """The generation layout; None: every rank generates with whole weights
    (``pg = tg = 1``, ``dg = p * t``)."""

    def __post_init__(self) -> None:
        for name in ("p", "t", "d"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.gen is not None:
            if self.p % self.gen.pg:
                raise ConfigError(f"generation pg={self.gen.pg} must divide the training pipeline size "
                                  f"p={self.p} (layout p{self.p}-t{self.t}-d{self.d})")
            if self.t % self.gen.tg:
                raise ConfigError(f"generation tg={self.gen.tg} must divide the training tensor size "
                                  f"t={self.t} (layout p{self.p}-t{self.t}-d{self.d})")

    @property
    def generation(self) -> GenerationLayout:
        """``gen``, or the whole-weights default (``pg = tg = 1``)."""
        return self.gen if self.gen is not None else GenerationLayout()

    @property
    def dg(self) -> int:
        """Micro-data-parallel replicas per training replica: ``(p*t) / (pg*tg)``."""
        g = self.generation
        return (self.p // g.pg) * (self.t // g.tg)

    def gen_coords(self, rank: int) -> GenCoords:
        """Position of ``rank`` in the generation layout (see :class:`GenerationLayout`)."""
        c, g = self.coords(rank), self.generation
        ap, at = self.p // g.pg, self.t // g.tg
        if g.grouping == "hybridflow":
            pp, tp, micro = c.pp // ap, c.tp // at, (c.pp % ap) * at + c.tp % at
        else:
            pp, tp, micro = c.pp % g.pg, c.tp % g.tg, (c.pp // g.pg) * at + c.tp // g.tg
        return GenCoords(pp=pp, tp=tp, replica=c.dp * self.dg + micro)

    def gen_groups(self, kind: Literal["tp", "pp", "micro_dp"]) -> list[tuple[int, ...]]:
        """Every generation group of one kind, as increasing tuples of ranks.

        ``"tp"``/``"pp"``: the ranks of one replica that differ only in generation
        TP rank (pipeline stage); ``"micro_dp"``: the ``dg`` ranks of one training
        replica that share one generation position (their training shards together
        make that position's generation shard under the ``hybridflow`` grouping).
        """
        keys: dict[tuple[int, ...], list[int]] = {}
        for r in range(self.world):
            g, dp = self.gen_coords(r), self.coords(r).dp
            key = {"tp": (g.replica, g.pp), "pp": (g.replica, g.tp), "micro_dp": (dp, g.pp, g.tp)}[kind]
            keys.setdefault(key, []).append(r)
        return sorted(tuple(v) for v in keys.values())

    @classmethod
    def fill(cls, world: int, *, p: int = 1, t: int = 1, gen: GenerationLayout | None = None) -> Layout:
        """The layout with pipeline ``p`` and tensor ``t`` (and generation layout
        ``gen``) whose data-parallel size fills ``world`` ranks.

        Raises:
            ConfigError: ``p * t`` does not divide ``world``, or ``gen`` does not fit.
        """
        if p < 1 or t < 1 or world % (p * t):
            raise ConfigError(f"p*t = {p}*{t} must divide the pool size {world}")
        return cls(p=p, t=t, d=world // (p * t), gen=gen)

    @property
    def world(self) -> int:
        """Ranks the layout spans."""
        return self.p * self.t * self.d

    def coords(self, rank: int) -> Coords:
        """Position of ``rank`` (tp innermost, pp outermost)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a layout of {self.world} ranks")
        return Coords(pp=rank // (self.t * self.d), dp=(rank // self.t) % self.d, tp=rank % self.t)

    def rank_of(self, coords: Coords) -> int:
        """Inverse of :meth:`coords`."""
        return (coords.pp * self.d + coords.dp) * self.t + coords.tp

    def __str__(self) -> str:
        base = f"p{self.p}-t{self.t}-d{self.d}"
        if self.gen is None:
            return base
        return f"{base} (gen pg{self.gen.pg}-tg{self.gen.tg}-dg{self.dg}, {self.gen.grouping})"
