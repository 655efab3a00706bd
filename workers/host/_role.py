"""Roles and the context a worker process gives them.

A role (actor, critic, reward, ...) is an ordinary object living in a worker
process. Several roles placed on one pool share that pool's processes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from channels import Coords, Layout, TransferProtocol


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
    roles: Mapping[str, Any] = field(default_factory=dict)
    """The role objects this process hosts, by name (a live view: roles added later
    appear). For roles that work together in one process: the actor's update runs
    the co-located critic's in one fused pipeline schedule."""

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


@dataclass(frozen=True, kw_only=True)
class CallScope:
    """The group call whose rows a rank's transforms are transforming (see
    :func:`current_call`): enough to reduce a statistic over all of the call's rows."""

    ctx: WorkerContext
    """The called role's context on this rank (its pool's group and layout)."""
    protocol: TransferProtocol
    """The method's transfer protocol: how the call's rows spread over the ranks."""
    rank_local: bool
    """The method is rank-local (it may run on some ranks only): no collective allowed."""


class _CurrentCall:
    """The scope of the call whose transforms run now. A worker runs one call at a
    time (its one-thread ``compute`` group), so one slot per process suffices."""

    scope: CallScope | None = None


def current_call() -> CallScope | None:
    """The call whose input rows this process's transforms are applied to, or None
    outside one (on the driver, which holds every row, e.g. ``fut.fetch()``)."""
    return _CurrentCall.scope


@contextmanager
def calling(scope: CallScope | None) -> Iterator[None]:
    """Make ``scope`` the :func:`current_call` while the block runs (the worker wraps
    the transforms of each call's data arguments in it; calls run one at a time)."""
    previous, _CurrentCall.scope = _CurrentCall.scope, scope
    try:
        yield
    finally:
        _CurrentCall.scope = previous
