"""Making reconnectable groups and meshes of them, and poisoning or healing every
group of this process (see :mod:`workers.host._groups` for what a reconnectable group is).

Making a group (:func:`new_reconnectable_group`, :func:`mesh_from_groups`) and
healing (:func:`heal_all`) are collective over the groups' members; poisoning
(:func:`poison_all`) is local.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from channels import ConfigError
from workers.host._groups import BACKEND, ReconnectableGroup, find, local_groups, remember

_LOCK = threading.Lock()
_MADE: dict[object, dict[tuple[int, ...], int]] = {}  # {world group: {ranks: groups made}}


def _create(options: Any, _backend_options: Any) -> ReconnectableGroup:
    """The c10d creator; the extended API tells it the members' default-group ranks."""
    ranks = tuple(int(r) for r in options.global_ranks_in_group) or tuple(range(options.group_size))
    world = dist.group.WORLD
    with _LOCK:  # members agree on how often this world has made these ranks into a group
        if world not in _MADE:  # a new world (and store): forget the old one's counts
            _MADE.clear()
        made = _MADE.setdefault(world, {})
        generation = made[ranks] = made.get(ranks, -1) + 1
    base = world.get_group_store() if world is not None else options.store
    store = dist.PrefixStore(f"asyncflow/{'_'.join(map(str, ranks))}/{generation}", base)
    group = ReconnectableGroup(store, options.group_rank, options.group_size, options.timeout,
                               ranks=ranks)
    remember(group)
    return group


def register_backend() -> None:
    """Register the ``"asyncflow"`` c10d backend in this process (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def new_reconnectable_group(ranks: Sequence[int], timeout: timedelta) -> ReconnectableGroup:
    """This process's reconnectable group of ``ranks``, made on first use.

    The first call is collective over ``ranks``: every member calls it (non-members
    must not) and it waits up to ``timeout`` for them. Later calls return the cached
    group, whose first ``timeout`` stays.

    Args:
        ranks: the members' default-group ranks, increasing.
        timeout: the collectives' timeout.

    Raises:
        ConfigError: if the ranks are not increasing or do not include this rank.
    """
    key, me = tuple(int(r) for r in ranks), dist.get_rank()
    if list(key) != sorted(set(key)) or me not in key:
        raise ConfigError(f"group ranks {key} must be distinct, increasing, and include this "
                          f"rank {me}; only members create a group")
    cached = find(key)
    if cached is not None:
        return cached
    register_backend()
    group = dist.new_group(list(key), timeout=timeout, backend=BACKEND,
                           use_local_synchronization=True)
    assert isinstance(group, ReconnectableGroup), group
    return group


def mesh_from_groups(grid: torch.Tensor, dim_names: tuple[str, ...], device_type: str,
                     timeout: timedelta) -> DeviceMesh:
    """A DeviceMesh over ``grid`` whose dimension groups are reconnectable groups.

    Behaves like ``DeviceMesh(device_type, grid, mesh_dim_names=dim_names)``
    (slicing, ``get_group``, ``get_local_rank``). Collective over the grid's ranks:
    each makes (or reuses) the group of every dimension it is in, in dimension order.

    Args:
        grid: default-group ranks, one dimension per name, increasing along each.
        dim_names: the dimensions' names.
        device_type: ``"cpu"`` or ``"cuda"``.
        timeout: the groups' collective timeout.

    Returns:
        This process's view of the mesh.

    Raises:
        ConfigError: if this rank is not in ``grid`` or the names do not fit its shape.
    """
    me = dist.get_rank()
    if grid.ndim != len(dim_names) or me not in grid.flatten().tolist():
        raise ConfigError(f"mesh grid of shape {tuple(grid.shape)} must have one dimension per "
                          f"name in {dim_names} and contain this rank {me}")
    groups: list[dist.ProcessGroup] = []
    for dim in range(grid.ndim):
        rows = grid.movedim(dim, -1).reshape(-1, grid.size(dim)).tolist()
        groups.append(new_reconnectable_group(next(r for r in rows if me in r), timeout))
    return DeviceMesh.from_group(groups, device_type, mesh=grid.contiguous(),
                                 mesh_dim_names=dim_names)


def poison_all() -> None:
    """Poison every group of this process (local; see :meth:`ReconnectableGroup.poison`)."""
    for group in local_groups():
        group.poison()


def heal_all(epoch: int) -> None:
    """Heal every group of this process, in order of ranks.

    Collective over every rank with reconnectable groups: each calls it with the same
    ``epoch``, and waits for the members of each of its groups in turn. The common
    order never makes a cycle of waits: the smallest group not yet healed has all its
    members at it.

    Args:
        epoch: larger than every earlier epoch; the same on every rank.
    """
    for group in local_groups():
        group.heal(epoch)
