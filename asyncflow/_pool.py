"""Resource pools and role placement.

A :class:`ResourcePool` is a Ray placement group of ``devices`` bundles: one GPU
each on GPU machines, one *CPU device slot* each on CPU machines. A CPU slot is a
seat for a worker process, not a core: the embedded session gives Ray
``cpu_slots`` of them and sizes each worker's torch threads to the cores
(:func:`worker_threads`; a pool may set its own).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncflow._ray_start import CPU_SLOT
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
    """Extra Ray resources every bundle asks for (e.g. a node label resource)."""
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

    def bundle(self, device: str) -> dict[str, float]:
        """The Ray resources of one bundle on ``device``."""
        base = {"GPU": 1.0} if device == "cuda" else {CPU_SLOT: 1.0}
        return {**base, **self.resources}


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


def check_resources(pools: list[ResourcePool], device: str, have: Mapping[str, float]) -> None:
    """Raise :class:`ConfigError` unless the cluster's resources ``have`` fit ``pools``."""
    need: dict[str, float] = {}
    for p in pools:
        for k, v in p.bundle(device).items():
            need[k] = need.get(k, 0.0) + v * p.devices
    for k, v in need.items():
        if have.get(k, 0.0) < v:
            hint = (f" (start Ray nodes with --resources='{{\"{CPU_SLOT}\": N}}')" if k == CPU_SLOT else "")
            raise ConfigError(
                f"the pools need {v:g} {k} in all but the Ray cluster has {have.get(k, 0.0):g}{hint}"
            )


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
