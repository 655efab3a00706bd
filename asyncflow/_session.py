"""``Session``: the driver's handle on a Ray instance, its pools and roles.

    async with Session() as session:
        roles = await session.spawn({"actor": RoleSpec(Actor, pool=gpus), ...})
        out = roles.actor.generate(prompts)        # DataFuture, returned at once

The embedded default starts a local Ray instance sized to this machine and shuts it
down on exit; ``Session(address=...)`` joins an existing cluster instead.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from asyncflow._errors import SessionClosedError
from asyncflow._future import DataFuture, Lease, Resolved
from asyncflow._pool import CPU_SLOT, ResourcePool, RoleSpec
from asyncflow._scheduler import Call, PoolState, check_call_fields, next_call_id, pool_loop
from channels import (
    AllToAll,
    Batch,
    BatchMeta,
    ConfigError,
    Layout,
    Piece,
    StoreStats,
    assemble,
    open_channel,
    plan_pull,
    split_rows,
)
from workers import CONCURRENCY_GROUPS, Endpoint, WorkerProcess, check_role_class, endpoints

logger = logging.getLogger(__name__)

Transport = Literal["auto", "gloo", "nccl", "object_store"]


class RoleGroup:
    """The driver-side proxy of one role: ``group.method(...)`` submits the call to
    every rank of the role's pool and returns a :class:`DataFuture` at once."""

    def __init__(self, session: Session, name: str, spec: RoleSpec, layout: Layout) -> None:
        self._session, self._name, self._spec, self._layout = session, name, spec, layout
        self._endpoints = endpoints(spec.cls)

    @property
    def name(self) -> str:
        """The role's name."""
        return self._name

    @property
    def layout(self) -> Layout:
        """The role's parallel layout."""
        return self._layout

    @property
    def pool(self) -> ResourcePool:
        """The pool hosting the role."""
        return self._spec.pool

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        endpoint = self._endpoints.get(method)
        if endpoint is None:
            raise AttributeError(
                f"role {self._name!r} ({self._spec.cls.__qualname__}) has no registered method {method!r}; "
                f"it has {sorted(self._endpoints)}"
            )

        def submit(*args: Any, **kwargs: Any) -> DataFuture[Any]:
            return self._session._submit(self, endpoint, args, kwargs)

        submit.__doc__ = endpoint.__doc__
        submit.__name__ = method
        return submit

    def __repr__(self) -> str:
        return f"<RoleGroup {self._name} on {self._spec.pool.name} {self._layout}>"


class Roles(Mapping[str, RoleGroup]):
    """The spawned roles, by name and as attributes (``roles.actor``)."""

    def __init__(self, groups: Mapping[str, RoleGroup]) -> None:
        self._groups = dict(groups)

    def __getattr__(self, name: str) -> RoleGroup:
        try:
            return self._groups[name]
        except KeyError:
            raise AttributeError(f"no role {name!r}; roles are {sorted(self._groups)}") from None

    def __getitem__(self, name: str) -> RoleGroup:
        return self._groups[name]

    def __iter__(self):
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


class Session:
    """An asyncflow session: Ray, pools, worker processes and the call loops.

    Args:
        address: a Ray cluster address to join; None starts (or reuses) a local
            instance sized to this machine.
        cpu_slots: CPU device slots the embedded instance offers (worker
            processes, not cores).
        transport: how rows move between workers: ``"auto"`` (Ray Direct
            Transport over gloo on CPU, NCCL on GPU, the object store when that is
            unavailable), or one of them explicitly.
        collective_timeout_s: timeout of the session's process-group operations.
    """

    def __init__(self, *, address: str | None = None, cpu_slots: int = 64,
                 transport: Transport = "auto", collective_timeout_s: float = 600.0) -> None:
        if transport not in ("auto", "gloo", "nccl", "object_store"):
            raise ConfigError(f"transport must be auto, gloo, nccl or object_store, got {transport!r}")
        self._address, self._cpu_slots = address, cpu_slots
        self._transport_choice = transport
        self._timeout = collective_timeout_s
        self._started_ray = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pools: dict[str, PoolState] = {}
        self._actors: list[Any] = []
        self._placement_groups: list[Any] = []
        self._roles: Roles | None = None
        self._rdt: str | None = None
        self._closed = False
        self._free_lock = threading.Lock()
        self._pending_free: dict[int, list[str]] = {}
        self._free_refs: list[Any] = []
        self._puts = itertools.count()

    # ----- lifecycle -----

    async def __aenter__(self) -> Session:
        self._loop = asyncio.get_running_loop()
        if not ray.is_initialized():
            if self._address is None:
                ray.init(num_cpus=os.cpu_count() or 1, resources={CPU_SLOT: self._cpu_slots},
                         include_dashboard=False, logging_level=logging.WARNING)
            else:
                ray.init(address=self._address, logging_level=logging.WARNING)
            self._started_ray = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the call loops, free every worker and placement group, and shut
        Ray down if this session started it. Idempotent."""
        if self._closed:
            return
        for pool in self._pools.values():
            pool.send.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:  # let released shards' frees finish while the workers are still there
            await asyncio.wait_for(self.drain(), timeout=10)
        except (TimeoutError, ray.exceptions.RayError):
            logger.debug("draining frees at close failed", exc_info=True)
        self._closed = True
        self._free_refs.clear()
        broken = any(p.broken is not None for p in self._pools.values())
        if self._actors and self._rdt is not None and not broken:
            try:
                from ray.experimental.collective import destroy_all_collective_groups
                destroy_all_collective_groups()
            except Exception:  # workers may be dead already
                logger.debug("destroying collective groups failed", exc_info=True)
        for a in self._actors:
            ray.kill(a, no_restart=True)
        for pg in self._placement_groups:
            remove_placement_group(pg)
        if self._started_ray:
            shutdown_ray()

    @property
    def roles(self) -> Roles:
        """The spawned roles."""
        if self._roles is None:
            raise ConfigError("no roles yet: call `await session.spawn({...})` first")
        return self._roles

    @property
    def transport(self) -> str:
        """How rows move between workers: ``"gloo"``, ``"nccl"`` or ``"object_store"``."""
        return self._rdt or "object_store"

    # ----- spawning -----

    async def spawn(self, roles: Mapping[str, RoleSpec]) -> Roles:
        """Create every pool's worker processes and host the roles on them.

        All roles of a session are spawned at once: the session's process group
        spans every worker of every pool.

        Raises:
            ConfigError: a bad role, pool or layout (the message names it), the
                cluster lacks the resources, or roles were spawned already.
        """
        if self._closed:
            raise SessionClosedError("the session is closed")
        if self._roles is not None:
            raise ConfigError("spawn was already called in this session; spawn every role at once")
        pools, layouts = _check_placement(roles)
        device = _device_of(pools)
        await self._create_workers(pools, device)
        meshes = list(dict.fromkeys((spec.pool.name, layouts[name]) for name, spec in roles.items()))
        ranks = [(p.name, self._pools[p.name].indices) for p in pools]
        await asyncio.gather(*(a.build_groups.remote(ranks, meshes) for a in self._actors))
        adds = []
        for name, spec in roles.items():
            for actor in self._pools[spec.pool.name].actors:
                adds.append(actor.add_role.remote(name, spec.cls, spec.config, layouts[name]))
        await asyncio.gather(*adds)
        for pool in self._pools.values():
            self._tasks.append(asyncio.create_task(pool_loop(self, pool), name=f"asyncflow-pool-{pool.name}"))
        self._roles = Roles({n: RoleGroup(self, n, s, layouts[n]) for n, s in roles.items()})
        return self._roles

    async def _create_workers(self, pools: list[ResourcePool], device: str) -> None:
        _check_resources(pools, device)
        world = sum(p.devices for p in pools)
        threads = max(1, (os.cpu_count() or 1) // world) if device == "cpu" else max(1, (os.cpu_count() or 1) // 2)
        cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS, enable_tensor_transport=True)(  # type: ignore[call-overload]
            WorkerProcess)
        index = 0
        for pool in pools:
            pg = placement_group([pool.bundle(device)] * pool.devices, strategy=pool.strategy)
            self._placement_groups.append(pg)
            await pg.ready()
            actors, indices = [], []
            for rank in range(pool.devices):
                opts: dict[str, Any] = {
                    "num_cpus": 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=rank),
                    "name": None,
                }
                if device == "cuda":
                    opts["num_gpus"] = 1
                    opts["resources"] = dict(pool.resources)
                else:
                    opts["resources"] = {CPU_SLOT: 1.0, **pool.resources}
                actors.append(cls.options(**opts).remote(
                    index=index, pool=pool.name, rank=rank, pool_size=pool.devices, world=world,
                    device=device, num_threads=threads))
                indices.append(index)
                index += 1
            send, receive = open_channel[Call](float("inf"))
            self._pools[pool.name] = PoolState(name=pool.name, actors=actors, indices=indices,
                                               send=send, receive=receive)
            self._actors.extend(actors)
        url = await self._actors[0].rendezvous_address.remote()
        await asyncio.gather(*(a.init_world.remote(url, self._timeout) for a in self._actors))
        await self._init_transport(device)

    async def _init_transport(self, device: str) -> None:
        choice = self._transport_choice
        if choice == "object_store":
            return
        backend = {"cpu": ("gloo", "torch_gloo"), "cuda": ("nccl", "nccl")}[device]
        if choice not in ("auto", backend[0]):
            raise ConfigError(f"transport {choice!r} does not work on {device}; use auto or {backend[0]}")
        from ray.experimental.collective import create_collective_group

        try:
            await asyncio.to_thread(create_collective_group, self._actors, backend=backend[1])
            self._rdt = backend[0]
        except Exception as e:
            if choice != "auto":
                raise
            logger.warning("Ray Direct Transport (%s) unavailable, rows go through the object store: %s",
                           backend[0], e)

    # ----- calls -----

    def _submit(self, group: RoleGroup, endpoint: Endpoint[Any, Any], args: tuple[Any, ...],
                kwargs: Mapping[str, Any]) -> DataFuture[Any]:
        if self._closed:
            raise SessionClosedError("the session is closed")
        spec = endpoint.spec
        call_id = next_call_id()
        label = f"{group.name}.{spec.name}#{call_id}"
        try:
            bound = spec.signature.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{group.name}.{spec.name}{spec.signature}: {e}") from None
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(spec.signature.parameters)))  # self
        data = {k: v for k, v in arguments.items() if isinstance(v, DataFuture)}
        plain = {k: v for k, v in arguments.items() if k not in data}
        check_call_fields(label, endpoint, data)
        assert self._loop is not None
        result = self._loop.create_future()
        call = Call(call_id=call_id, role=group.name, endpoint=endpoint, layout=group.layout,
                    data_args=data, kwargs=plain, result=result)
        self._pools[group.pool.name].send.send_nowait(call)
        fields = frozenset(spec.writes) if spec.writes is not None else None
        return DataFuture(label=label, fields=fields, session=self, source=result)

    def slice_ref(self, piece: Piece) -> Any:
        """Submit a producer-side slice for ``piece``; the consumer receives the rows
        straight from the producer (RDT) or through the object store."""
        method = self._actors[piece.worker].slice
        if self._rdt is not None:
            method = method.options(tensor_transport=self._rdt)
        return method.remote(piece.key, piece.lo, piece.hi, piece.fields)

    # ----- rows in and out of the driver -----

    async def put(self, columns: Mapping[str, Any], *, pool: ResourcePool | str | None = None) -> DataFuture[BatchMeta]:
        """Hand rows from the driver to a pool (split evenly over its ranks) and
        return their future; e.g. a data set's prompts.

        Raises:
            ConfigError: unknown pool, or no roles spawned yet.
        """
        batch = columns if isinstance(columns, Batch) else Batch(columns)
        if not self._pools:
            raise ConfigError("spawn roles before putting rows")
        name = next(iter(self._pools)) if pool is None else getattr(pool, "name", pool)
        if name not in self._pools:
            raise ConfigError(f"no pool {name!r}; pools are {sorted(self._pools)}")
        state = self._pools[name]
        n = next(self._puts)
        assignments = split_rows(batch.num_rows, len(state.actors))
        refs = []
        for rank, actor in enumerate(state.actors):
            rows = assignments[rank]
            part = batch.slice(rows[0][0], rows[0][1]) if rows else batch.slice(0, 0)
            refs.append(actor.put.remote(f"put{n}", part.to_dict()))
        results = await asyncio.gather(*refs)
        out = AllToAll().collect(results, Layout(d=len(state.actors)), assignments)
        leases = tuple(Lease(w, k, self.release) for w, k in sorted(out.meta.shard_keys()))
        for r in results:
            if r.num_rows == 0:
                self.release_now({(r.worker, r.key)})
        fut = self._loop.create_future() if self._loop else asyncio.get_running_loop().create_future()
        fut.set_result(Resolved(meta=out.meta, row_lengths=None, leases=leases))
        return DataFuture(label=f"put#{n}", fields=frozenset(batch), session=self, source=fut)

    async def fetch_rows(self, meta: BatchMeta) -> Batch:
        """The rows of ``meta``, pulled to the driver through the object store."""
        plan = plan_pull(meta, ((0, meta.num_rows),) if meta.num_rows else ())
        refs = [self._actors[p.worker].slice.remote(p.key, p.lo, p.hi, p.fields) for p in plan.pieces]
        return assemble(plan, await asyncio.gather(*refs))

    # ----- shard lifetime -----

    def release(self, worker: int, key: str) -> None:
        """Called when the last lease of a shard goes (from any thread)."""
        if self._closed or self._loop is None:
            return
        with self._free_lock:
            first = not self._pending_free
            self._pending_free.setdefault(worker, []).append(key)
        if first:
            try:
                self._loop.call_soon_threadsafe(self._flush_frees)
            except RuntimeError:  # loop closed
                pass

    def release_now(self, shards: Iterable[tuple[int, str | None]]) -> None:
        """Free shards no future will ever name."""
        for w, k in shards:
            if k is not None:
                self.release(w, k)

    def _flush_frees(self) -> None:
        with self._free_lock:
            pending, self._pending_free = self._pending_free, {}
        if self._closed:
            return
        for worker, keys in pending.items():
            self._free_refs.append(self._actors[worker].free.remote(keys))
        if self._free_refs:  # forget frees that are done (one wait for all of them)
            _, self._free_refs = ray.wait(self._free_refs, num_returns=len(self._free_refs), timeout=0)

    async def drain(self) -> None:
        """Wait until every shard released so far is freed on its worker."""
        self._flush_frees()
        refs, self._free_refs = self._free_refs, []
        await asyncio.gather(*refs, return_exceptions=True)

    async def store_stats(self) -> list[tuple[str, int, StoreStats]]:
        """``(pool, rank, stats)`` of every worker's shard store, after pending
        frees went through."""
        await self.drain()
        out: list[tuple[str, int, StoreStats]] = []
        for pool in self._pools.values():
            stats = await asyncio.gather(*(a.stats.remote() for a in pool.actors))
            out.extend((pool.name, rank, s) for rank, s in enumerate(stats))
        return out

    def worker(self, pool: str, rank: int) -> Any:
        """The Ray actor handle of ``rank`` of ``pool`` (for tests and tools)."""
        return self._pools[pool].actors[rank]


def shutdown_ray() -> None:
    """``ray.shutdown()``, leaving the process ready for another session.

    Ray 2.60 keeps its driver-side Ray Direct Transport manager (a process-wide
    singleton) across ``ray.shutdown()``, queued transfers of the finished session
    included. The next session's transfer monitor then trips over those, dies, and
    the new session's transfer refs are never released. Dropping the manager with
    the session it served avoids that (Ray creates a new one on first use).
    """
    ray.shutdown()
    worker = ray.worker.global_worker
    if getattr(worker, "_rdt_manager", None) is not None:
        worker._rdt_manager = None


def _check_placement(roles: Mapping[str, RoleSpec]) -> tuple[list[ResourcePool], dict[str, Layout]]:
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


def _device_of(pools: list[ResourcePool]) -> str:
    kinds = {p.device for p in pools} - {"auto"}
    if len(kinds) > 1:
        raise ConfigError("all pools of a session must use one device kind (cpu or cuda)")
    if kinds:
        return kinds.pop()
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def _check_resources(pools: list[ResourcePool], device: str) -> None:
    have = ray.cluster_resources()
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
