"""``Layout(p, t, d)``: how the ranks of a worker group form pipeline, tensor and
data parallel groups.

Tensor-parallel groups are consecutive ranks (innermost), then data parallel, then
pipeline (outermost), as in Megatron-LM; a DeviceMesh of shape ``(p, d, t)`` with
dims ``("pp", "dp", "tp")`` follows the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from channels._errors import ConfigError


class Coords(NamedTuple):
    """A rank's position in a layout."""

    pp: int
    dp: int
    tp: int


class Layout(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Parallel layout of one role's ranks."""

    p: int = 1
    """Pipeline-parallel size."""
    t: int = 1
    """Tensor-parallel size."""
    d: int = 1
    """Data-parallel size."""

    def __post_init__(self) -> None:
        for name in ("p", "t", "d"):
            if getattr(self, name) < 1:
                raise ConfigError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def fill(cls, world: int, *, p: int = 1, t: int = 1) -> Layout:
        """The layout with pipeline ``p`` and tensor ``t`` whose data-parallel size
        fills ``world`` ranks.

        Raises:
            ConfigError: ``p * t`` does not divide ``world``.
        """
        if p < 1 or t < 1 or world % (p * t):
            raise ConfigError(f"p*t = {p}*{t} must divide the pool size {world}")
        return cls(p=p, t=t, d=world // (p * t))

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
        return f"p{self.p}-t{self.t}-d{self.d}"
