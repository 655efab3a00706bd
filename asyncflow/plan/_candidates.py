"""Placements: which roles share a pool and how many devices each pool gets.

:func:`candidates` enumerates them as HybridFlow's auto-mapping does (its
Algorithm 1): every partition of the roles into colocated sets (pools), times
every way of giving those pools the machine's devices. Ranking them by predicted
step time is :func:`asyncflow.plan.rank`'s job.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Pools and the pool of each role, as ``[pools]`` and ``[placement]`` of a run's
    config write them.

    Args:
        pools: devices (worker processes) per pool name.
        roles: pool name per role.

    Raises:
        ValueError: a pool has fewer than one device, or a role names no pool of ``pools``.
    """

    pools: Mapping[str, int] = field(default_factory=dict)
    roles: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only copies: the placement is a value (hashable, safe to share).
        object.__setattr__(self, "pools", MappingProxyType(dict(self.pools)))
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))
        for name, devices in self.pools.items():
            if not isinstance(devices, int) or devices < 1:
                raise ValueError(f"pools[{name!r}] = {devices!r}: a pool needs an int >= 1 devices")
        for role, pool in self.roles.items():
            if pool not in self.pools:
                raise ValueError(f"roles[{role!r}] names pool {pool!r}, which is not in pools "
                                 f"({sorted(self.pools)}); add it or use one of those")

    def __hash__(self) -> int:
        return hash((frozenset(self.pools.items()), frozenset(self.roles.items())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return dict(self.pools) == dict(other.pools) and dict(self.roles) == dict(other.roles)

    def __repr__(self) -> str:
        return f"Placement(pools={dict(self.pools)!r}, roles={dict(self.roles)!r})"

    @property
    def world(self) -> int:
        """Worker processes over all pools."""
        return sum(self.pools.values())

    def members(self, pool: str) -> list[str]:
        """The roles on ``pool``, in ``roles`` order."""
        return [r for r, p in self.roles.items() if p == pool]

    def describe(self) -> str:
        """One line, e.g. ``actor+ref | critic+reward (1+1 devices)``."""
        sets = " | ".join("+".join(self.members(p)) or f"({p})" for p in self.pools)
        return f"{sets} ({'+'.join(str(d) for d in self.pools.values())} devices)"

    def config_block(self) -> str:
        """The ``[pools]`` and ``[placement]`` tables of a run config (TOML)."""
        lines = ["[pools]"]
        lines += [f"{_key(p)} = {{ devices = {d} }}" for p, d in self.pools.items()]
        lines += ["", "[placement]"]
        lines += [f"{_key(r)} = {{ pool = {_string(p)} }}" for r, p in self.roles.items()]
        return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _string(name)


def _string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def candidates(roles: Sequence[str], devices: int, *, cores: int | None = None,
               max_pools: int | None = None) -> list[Placement]:
    """Every placement of ``roles`` on ``devices`` devices.

    Every partition of the roles into pools, and for each every assignment of
    device counts (each >= 1) summing to exactly ``devices``. On a CPU machine
    (``cores`` given) a partition with more pools than ``devices`` is kept too,
    with one device (worker slot) per pool: the processes share the cores, which
    the simulator's contention model accounts for. On GPUs it is dropped.

    The order is deterministic: partitions in restricted-growth order (all roles
    on one pool first), then device counts in lexicographic order. Pools are named
    after their roles (``actor_ref``), or ``pool<i>`` where that would clash.

    Args:
        roles: the roles to place (distinct).
        devices: devices (GPUs, or worker slots on a CPU machine) to share out.
        cores: CPU cores, or ``None`` for a GPU machine.
        max_pools: keep partitions into at most this many pools.

    Raises:
        ValueError: no roles, repeated roles, ``devices`` < 1 or ``max_pools`` < 1.
    """
    if not roles or len(set(roles)) != len(roles):
        raise ValueError(f"candidates needs distinct role names, got {list(roles)}")
    if devices < 1:
        raise ValueError(f"candidates needs devices >= 1, got {devices}")
    if max_pools is not None and max_pools < 1:
        raise ValueError(f"max_pools must be >= 1 (or None for no limit), got {max_pools}")
    out: list[Placement] = []
    for groups in set_partitions(roles):
        k = len(groups)
        if max_pools is not None and k > max_pools:
            continue
        if k <= devices:
            splits: list[tuple[int, ...]] = list(compositions(devices, k))
        elif cores is not None:
            splits = [(1,) * k]
        else:
            continue
        names = _pool_names(groups)
        for split in splits:
            out.append(Placement(pools=dict(zip(names, split, strict=True)),
                                 roles={r: names[i] for i, g in enumerate(groups) for r in g}))
    return out


def set_partitions(items: Sequence[str]) -> Iterator[list[list[str]]]:
    """Every partition of ``items`` into non-empty groups (Bell-number many), in
    restricted-growth order; groups keep ``items``' order."""
    n = len(items)
    labels = [0] * n

    def walk(i: int, top: int) -> Iterator[list[list[str]]]:
        if i == n:
            groups: list[list[str]] = [[] for _ in range(top + 1)]
            for item, label in zip(items, labels, strict=True):
                groups[label].append(item)
            yield groups
            return
        for label in range(top + 2):
            labels[i] = label
            yield from walk(i + 1, max(top, label))

    if n:
        yield from walk(1, 0)


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way of writing ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def _pool_names(groups: list[list[str]]) -> list[str]:
    names = ["_".join(g) for g in groups]
    if len(set(names)) != len(names):
        return [f"pool{i}" for i in range(len(groups))]
    return names
