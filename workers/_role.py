"""Roles and the context a worker process gives them.

A role (actor, critic, reward, ...) is an ordinary object living in a worker
process. Several roles placed on one pool share that pool's processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from channels import Coords, Layout


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where a role instance runs."""

    role: str
    """The role's name in the session (e.g. ``"critic"``)."""
    pool: str
    """The resource pool's name."""
    rank: int
    """Rank within the pool (and the role's layout)."""
    world_size: int
    """Ranks in the pool."""
    global_rank: int
    """Rank in the session-wide process group."""
    layout: Layout
    """The role's parallel layout over the pool."""
    device: torch.device
    """The device this rank computes on."""
    process_group: dist.ProcessGroup | None
    """The pool's process group (gloo on CPU, NCCL on GPU); None for a 1-rank pool."""
    mesh: Any
    """``torch.distributed.DeviceMesh`` of shape (p, d, t), dims ("pp", "dp", "tp")."""

    @property
    def coords(self) -> Coords:
        """This rank's (pp, dp, tp) position."""
        return self.layout.coords(self.rank)


class Role:
    """Base class of role objects hosted by worker processes.

    Subclasses receive the :class:`WorkerContext` and, when the placement gives
    one, a config object: ``__init__(self, ctx)`` or ``__init__(self, ctx, config)``.
    Their ``@register`` methods are callable through group proxies.
    """

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def rank_local(self) -> frozenset[str]:
        """Registered methods that use no other rank of the pool (no collective):
        the driver may run them on some of the pool's ranks only, e.g. on ranks
        that long-tail migration freed while others still generate. Default none."""
        return frozenset()
