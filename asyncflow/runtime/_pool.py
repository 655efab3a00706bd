"""Resource pools and role placement.

A :class:`ResourcePool` is a Ray placement group of ``devices`` bundles: one GPU
each on GPU machines, one *CPU device slot* each on CPU machines. A CPU slot is a
seat for a worker process, not a core: the embedded session gives Ray
``cpu_slots`` of them and sizes each worker's torch threads to the cores
(:func:`worker_threads`; a pool may set its own). On a cluster whose nodes offer
no CPU slots a CPU rank takes one of Ray's ``CPU`` (:func:`slot_resource`).

The bundles of a pool are packed onto as few nodes as they fit (Ray's ``PACK``),
on nodes whose labels match the pool's ``labels`` when it has any;
:func:`check_fits` refuses at once a pool the cluster cannot hold.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncflow.runtime._ray_start import CPU_SLOT
from channels import ConfigError, Layout
from workers import check_role_class


@dataclass(frozen=True, kw_only=True)
class ResourcePool:
    """A set of devices whose processes host roles.

    Roles on the same pool share its processes and run one call at a time, in call
    order; roles on different pools run concurrently.
    """

    name: str
    """Unique name of the pool (appears in errors and metrics)."""
    devices: int
    """Number of devices, i.e. worker processes (ranks)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device kind; ``"auto"`` picks CUDA when the cluster has GPUs."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Extra Ray resources every bundle asks for (e.g. a custom resource that only
    some nodes offer)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Node labels the pool's nodes must have (``ray start --labels key=value``):
    the pool's ranks go only to such nodes."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy."""
    threads: int | None = None
    """torch intra-op threads in each of the pool's worker processes. None: the
    driver's ``OMP_NUM_THREADS`` when set, else on CPU the machine's cores divided
    among every pool's workers (at least 1), on GPU half the cores. The default
    process count times threads never exceeds the cores: torch threads that
    outnumber free cores wait on each other (a shared machine turns that into
    stalls); give a pool more only when its processes have the cores to
    themselves."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"ResourcePool.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.devices, int) or self.devices < 1:
            raise ConfigError(f"ResourcePool({self.name!r}).devices must be an integer >= 1, got {self.devices!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"ResourcePool({self.name!r}).device must be auto, cpu or cuda, got {self.device!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise ConfigError(f"ResourcePool({self.name!r}).threads must be an int >= 1 or None (the default), "
                              f"got {self.threads!r}")

    def bundle(self, device: str, slot: str = CPU_SLOT) -> dict[str, float]:
        """The Ray resources of one bundle on ``device`` (``slot``: the resource a
        CPU rank takes, see :func:`slot_resource`)."""
        base = {"GPU": 1.0} if device == "cuda" else {slot: 1.0}
        return {**base, **self.resources}

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` may host this pool's ranks."""
        return all(labels.get(k) == v for k, v in self.labels.items())


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """Where and how to host one role."""

    cls: type
    """The role class (a ``workers.Role`` subclass with ``@register`` methods)."""
    pool: ResourcePool
    """The pool whose processes host it."""
    layout: Layout | None = None
    """Parallel layout over the pool; None: pure data parallel over every device."""
    config: Any = None
    """Passed to the role's constructor as its second argument when not None."""

    def resolved_layout(self) -> Layout:
        """The layout, checked against the pool size.

        Raises:
            ConfigError: the layout does not span the pool exactly.
        """
        layout = self.layout or Layout(d=self.pool.devices)
        if layout.world != self.pool.devices:
            raise ConfigError(
                f"layout {layout} spans {layout.world} ranks but pool {self.pool.name!r} has "
                f"{self.pool.devices} devices; use Layout.fill({self.pool.devices}, p=..., t=...)"
            )
        return layout


def check_placement(roles: Mapping[str, RoleSpec]) -> tuple[list[ResourcePool], dict[str, Layout]]:
    """The distinct pools of ``roles`` and each role's layout.

    Raises:
        ConfigError: a bad role name, role class, pool or layout (the message names it).
    """
    if not roles:
        raise ConfigError("spawn needs at least one role")
    pools: dict[str, ResourcePool] = {}
    layouts: dict[str, Layout] = {}
    for name, spec in roles.items():
        if not name.isidentifier():
            raise ConfigError(f"role name {name!r} must be a Python identifier")
        if not isinstance(spec, RoleSpec):
            raise ConfigError(f"role {name!r}: expected a RoleSpec, got {type(spec).__name__}")
        check_role_class(spec.cls)
        if inspect.isabstract(spec.cls):
            raise ConfigError(f"role {name!r}: {spec.cls.__qualname__} is abstract")
        known = pools.setdefault(spec.pool.name, spec.pool)
        if known != spec.pool:
            raise ConfigError(f"two different pools are named {spec.pool.name!r}")
        try:
            layouts[name] = spec.resolved_layout()
        except ConfigError as e:
            raise ConfigError(f"role {name!r}: {e}") from None
    return list(pools.values()), layouts


def slot_resource(device: str, have: Mapping[str, float]) -> str:
    """The Ray resource a rank takes on ``device``: a GPU; on CPU a CPU device slot
    where the cluster offers them (the embedded session does), else a ``CPU``."""
    if device == "cuda":
        return "GPU"
    return CPU_SLOT if have.get(CPU_SLOT, 0.0) > 0 else "CPU"


@dataclass(frozen=True)
class Node:
    """A live node of the Ray cluster, as placement sees it."""

    id: str
    ip: str
    resources: Mapping[str, float]
    labels: Mapping[str, str]

    def describe(self) -> str:
        """``node 1f3a2b4c (10.0.0.5)``."""
        return f"node {self.id[:8]} ({self.ip})"


def live_nodes(nodes: list[dict[str, Any]]) -> list[Node]:
    """The live nodes in ``ray.nodes()``'s answer."""
    return [Node(id=n["NodeID"], ip=n.get("NodeManagerAddress", "?"), resources=n.get("Resources", {}),
                 labels={k: v for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io/")})
            for n in nodes if n.get("Alive")]


def check_fits(pools: list[ResourcePool], device: str, slot: str, nodes: list[Node]) -> None:
    """Raise :class:`ConfigError` unless the cluster's live ``nodes`` can hold
    ``pools``, naming what the pools ask for and what the cluster has.

    Each pool must fit the nodes its labels allow, and all pools together must fit
    the cluster. Whether they fit at the same time, bundle by bundle, is Ray's to
    decide: what is busy now may free up (the session waits for it, see
    ``Session(placement_timeout_s=...)``).
    """
    def has(resource: str, among: list[Node]) -> float:
        return sum(n.resources.get(resource, 0.0) for n in among)

    def inventory(resource: str, among: list[Node]) -> str:
        return ", ".join(f"{n.describe()}: {n.resources.get(resource, 0.0):g}" for n in among) or "no nodes"

    for p in pools:
        where = [n for n in nodes if p.matches(n.labels)]
        if p.labels and not where:
            seen = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items()})
            raise ConfigError(f"pool {p.name!r} asks for nodes labelled "
                              f"{', '.join(f'{k}={v}' for k, v in p.labels.items())} but no live node has "
                              f"them (labels in the cluster: {', '.join(seen) or 'none'}; set them with "
                              "ray start --labels key=value)")
        for k, v in p.bundle(device, slot).items():
            if has(k, where) < v * p.devices:
                on = " with its labels" if p.labels else ""
                raise ConfigError(f"pool {p.name!r} asks for {v * p.devices:g} {k} ({p.devices} devices) but the "
                                  f"nodes{on} have {has(k, where):g} ({inventory(k, where)})")
    need: dict[str, float] = {}
    for p in pools:
        for k, v in p.bundle(device, slot).items():
            need[k] = need.get(k, 0.0) + v * p.devices
    for k, v in need.items():
        if has(k, nodes) < v:
            asks = ", ".join(f"{p.name}: {p.bundle(device, slot).get(k, 0.0) * p.devices:g}" for p in pools)
            raise ConfigError(f"the pools ask for {v:g} {k} in all ({asks}) but the Ray cluster has "
                              f"{has(k, nodes):g} ({inventory(k, nodes)})")


def world_size(pools: Sequence[ResourcePool]) -> int:
    """Worker processes over every pool of a session: one per device."""
    return sum(p.devices for p in pools)


def worker_threads(pool: ResourcePool, *, world: int, device: str, cores: int | None = None,
                   env: Mapping[str, str] | None = None) -> int:
    """torch intra-op threads of each of ``pool``'s workers (see
    :attr:`ResourcePool.threads`); ``world``: workers over every pool."""
    if pool.threads is not None:
        return pool.threads
    omp = (os.environ if env is None else env).get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    cores = cores or os.cpu_count() or 1
    return max(1, cores // world) if device == "cpu" else max(1, cores // 2)
