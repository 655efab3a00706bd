"""``Session``: the driver's handle on a Ray instance, its pools and roles.

    async with Session() as session:
        roles = await session.spawn({"actor": RoleSpec(Actor, pool=gpus), ...})
        out = roles.actor.generate(prompts)        # DataFuture, returned at once

The embedded default starts a local Ray instance sized to this machine, on the
loopback interface, and shuts it down on exit; ``Session(address=...)`` (or
``RAY_ADDRESS``) joins an existing cluster instead. This module only wires things
together: pools (``_pool``), the worker processes and their placement groups
(``_workers``), the data-plane transport (``_transport``), the shard ledger
(``_ledger``), the call loops (``_scheduler``) and the role proxies (``_proxy``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Literal

import ray

from asyncflow.runtime import _idle
from asyncflow.runtime._control import Control, connect
from asyncflow.runtime._errors import RemoteStageError, SessionClosedError
from asyncflow.runtime._fork_server import stop_fork_server
from asyncflow.runtime._pool import (
    Node,
    ResourcePool,
    RoleSpec,
    check_fits,
    check_placement,
    live_nodes,
    slot_resource,
    world_size,
)
from asyncflow.runtime._proxy import Roles
from asyncflow.runtime._ray_start import claim_started_instance, head_answers, init_ray
from asyncflow.runtime._runtime import Runtime
from asyncflow.runtime._transport import RayTransport
from asyncflow.runtime._workers import Workers
from channels import AsyncflowError, ConfigError, Layout

logger = logging.getLogger(__name__)

Transport = Literal["auto", "gloo", "nccl", "object_store"]


class Session(Runtime):
    """An asyncflow session: Ray, pools, worker processes and the call loops.

    The rendezvous of the workers' process groups goes through a store served over
    Ray's authenticated channels (no listener of ours accepts strangers), and gloo
    listens on each node's cluster address only. An embedded instance binds every
    Ray listener to the loopback interface, and a watchdog ends its processes if
    the driver dies without closing the session (``kill -9`` included).

    Args:
        address: a Ray cluster address to join (``"auto"``: the cluster started on
            this machine with ``ray start``); None: ``RAY_ADDRESS`` when it is set
            (as ``ray job submit`` sets it), else a new local instance sized to
            this machine, or the one ``asyncflow.start_ray`` started.
        cpu_slots: CPU device slots the embedded instance offers (worker
            processes, not cores).
        transport: how rows move between workers: ``"auto"`` (over the
            session's gloo process group on CPU, by Ray Direct Transport over
            NCCL on GPU, the object store when that is unavailable), or one of
            them explicitly.
        collective_timeout_s: timeout of the pools' collectives. Only a rank that
            hangs meets it: a rank that fails releases its peers at once.
        rendezvous_timeout_s: how long workers wait for each other when groups form.
        worker_nice: the niceness of the worker processes of a Ray instance this
            session starts (Ray's own default, 15, lets any other busy process on
            the machine take their cores; 0 shares them fairly). Ignored with
            ``address`` (the cluster's setting holds).
        placement_timeout_s: how long :meth:`spawn` waits for a pool's devices
            when the cluster has them but others hold them now.
        worker_env: environment variables of the worker processes, set when
            each starts, on whichever node (Ray's ``runtime_env``; asyncflow's own,
            ``workers.STARTUP_ENV``, by the worker's constructor, half a second
            sooner); a value may name the node's own variables as ``${NAME}``.
        keep_workers: on a Ray instance that outlives the session, hand its
            clean CPU workers and its rendezvous store server to the next
            session of this driver instead of ending them, and adopt those an
            earlier session left (seconds of start-up saved per worker; see
            ``asyncflow.runtime._idle``).
    """

    def __init__(self, *, address: str | None = None, cpu_slots: int = 64, transport: Transport = "auto",
                 collective_timeout_s: float = 120.0, rendezvous_timeout_s: float = 300.0,
                 worker_nice: int = 0, placement_timeout_s: float = 120.0,
                 worker_env: Mapping[str, str] | None = None, keep_workers: bool = True) -> None:
        if transport not in ("auto", "gloo", "nccl", "object_store"):
            raise ConfigError(f"transport must be auto, gloo, nccl or object_store, got {transport!r}")
        for name, value in (("collective_timeout_s", collective_timeout_s),
                            ("rendezvous_timeout_s", rendezvous_timeout_s),
                            ("placement_timeout_s", placement_timeout_s)):
            if not value > 0:
                raise ConfigError(f"Session.{name} must be > 0, got {value!r}")
        if not isinstance(worker_nice, int) or isinstance(worker_nice, bool) or not 0 <= worker_nice <= 19:
            raise ConfigError(f"Session.worker_nice must be an int in 0..19 (lower runs first), got {worker_nice!r}")
        super().__init__()
        self._worker_nice = worker_nice
        self._address, self._cpu_slots = address, cpu_slots
        self._transport_choice = transport
        self._collective_timeout, self._rendezvous_timeout = collective_timeout_s, rendezvous_timeout_s
        self._placement_timeout = placement_timeout_s
        self._worker_env = dict(worker_env or {})
        self._keep_workers = keep_workers
        self._workers: Workers | None = None
        self._rdt_group: Any = None  # Ray Direct Transport's NCCL group (GPU workers)
        self._started_ray = False
        self._actors: list[Any] = []
        self._actor_ids: list[str] = []
        self._nodes: dict[str, Node] = {}  # by node id: where the workers run
        self._actor_nodes: list[str] = []  # node id of each worker
        self._store: Any = None
        self._rows_by: str | None = None
        self._controls: list[Control] = []

    # ----- lifecycle -----

    async def __aenter__(self) -> Session:
        if self._address is None and claim_started_instance():
            self._started_ray = True  # asyncflow.start_ray's instance: ours to shut down
        elif not ray.is_initialized():
            init_ray(self._address, self._cpu_slots, self._worker_nice)
            self._started_ray = True
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Settle every call (:class:`SessionClosedError` for those not finished),
        free every worker and placement group, and shut Ray down if this session
        started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        broken, running = await self._stop()
        for control in self._controls:
            control.close()
        clean = not (broken or running or self._started_ray)
        if not head_answers():  # Ray's own processes are gone: nothing to free there, and asking would hang
            logger.info("the Ray cluster's head does not answer: its workers end with it")
            if self._started_ray:
                shutdown_ray()
            return
        if self._rdt_group is not None and not broken:
            try:
                from ray.experimental.collective import destroy_collective_group
                await asyncio.to_thread(destroy_collective_group, self._rdt_group)
            except Exception:  # workers may be dead already
                logger.debug("destroying the collective group failed", exc_info=True)
                clean = False  # a worker still in it could not join another session's
        if self._workers is not None:
            await self._workers.release(clean=clean)
        if self._store is not None and clean and self._keep_workers:
            _idle.keep_store(self._store)  # emptied when the next session takes it (_kept_store)
        elif self._store is not None:
            ray.kill(self._store, no_restart=True)
        if self._started_ray:
            shutdown_ray()

    @property
    def transport(self) -> str:
        """How rows move between workers: ``"gloo"``, ``"nccl"`` or ``"object_store"``."""
        return self._rows_by or "object_store"

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
        pools, layouts = check_placement(roles)
        device = _device_of(pools)
        slot = slot_resource(device, ray.cluster_resources())
        nodes = live_nodes(ray.nodes())
        check_fits(pools, device, slot, nodes)
        self._nodes = {n.id: n for n in nodes}
        self._workers = Workers(worker_env=self._worker_env, adopt=self._keep_workers,
                                keep=self._keep_workers and not self._started_ray,
                                placement_timeout_s=self._placement_timeout)
        # The rendezvous store's process starts beside the workers' (the first call
        # that needs it comes once they are up); a world of one process needs none.
        store = (asyncio.ensure_future(_rendezvous_store(self._keep_workers))
                 if world_size(pools) > 1 else None)
        try:
            ranks = await self._workers.create(pools, device, slot, _role_modules(roles))
        finally:
            self._store = await store if store is not None else None
        self._actors = self._workers.actors
        await self._init_groups(pools, ranks, roles, layouts)
        rank_local = await self._add_roles(ranks, roles, layouts)
        await self._init_transport(device)
        return self._start(RayTransport(self._actors, self._actor_ids, self._rows_by, self._controls), ranks,
                           roles, layouts, rank_local)

    def where(self, pool: str, rank: int) -> Node:
        """The node ``rank`` of ``pool`` runs on (its ``describe()``: ``node 1f3a2b4c
        (10.0.0.5)``).

        Raises:
            KeyError: no such pool or rank in this session.
        """
        assert self._scheduler is not None
        workers = self._scheduler.pools[pool].workers
        if not 0 <= rank < len(workers):
            raise KeyError(f"pool {pool!r} has no rank {rank}")
        return self._nodes[self._actor_nodes[workers[rank]]]

    def placement(self) -> dict[str, list[Node]]:
        """Each pool's ranks' nodes (:meth:`where`), in rank order."""
        assert self._scheduler is not None
        return {name: [self.where(name, r) for r in range(len(p.workers))]
                for name, p in self._scheduler.pools.items()}

    @staticmethod
    def has_left(node: Node) -> bool:
        """Whether ``node`` is known to be no longer a live node of the cluster
        (False when the cluster does not answer)."""
        if not head_answers():  # Ray's own processes are gone (a signal to the whole process group)
            return False
        try:
            nodes = ray.nodes()
        except ray.exceptions.RayError:
            return False
        return all(n.id != node.id for n in live_nodes(nodes))

    def _pool_actors(self, ranks: Mapping[str, list[int]], pool: ResourcePool) -> list[Any]:
        return [self._actors[i] for i in ranks[pool.name]]

    async def _init_groups(self, pools: list[ResourcePool], ranks: Mapping[str, list[int]],
                           roles: Mapping[str, RoleSpec], layouts: Mapping[str, Layout]) -> None:
        identities = await asyncio.gather(*(a.identity.remote() for a in self._actors))
        self._actor_ids = [aid for _, aid, _, _ in identities]
        self._actor_nodes = [node for *_, node in identities]
        await asyncio.gather(*(
            a.init_world.remote(self._store, node_ip=ip, timeout_s=self._rendezvous_timeout,
                                collective_timeout_s=self._collective_timeout)
            for a, (_, _, ip, _) in zip(self._actors, identities, strict=True)))
        await asyncio.gather(*(
            a.build_groups.remote(ranks[p.name], list(dict.fromkeys(
                layouts[n] for n, s in roles.items() if s.pool.name == p.name)))
            for p in pools for a in self._pool_actors(ranks, p)))

    async def _add_roles(self, ranks: Mapping[str, list[int]], roles: Mapping[str, RoleSpec],
                         layouts: Mapping[str, Layout]) -> dict[str, frozenset[str]]:
        """Host the roles; returns each role's rank-local methods (on every rank)."""
        jobs = [(name, spec.pool.name, rank, actor.add_role.remote(name, spec.cls, spec.config, layouts[name]))
                for name, spec in roles.items() for rank, actor in enumerate(self._pool_actors(ranks, spec.pool))]
        local: dict[str, frozenset[str]] = {}
        for name, pool, rank, ref in jobs:
            try:
                methods = frozenset(await ref or ())
            except ray.exceptions.RayTaskError as e:
                raise _role_start_error(name, pool, rank, e) from None
            local[name] = local[name] & methods if name in local else methods
        return local

    async def _init_transport(self, device: str) -> None:
        choice = self._transport_choice
        if choice == "object_store":
            return
        backend = {"cpu": "gloo", "cuda": "nccl"}[device]
        if choice not in ("auto", backend):
            raise ConfigError(f"transport {choice!r} does not work on {device}; use auto or {backend}")
        if backend == "gloo":  # the session's own process group (workers.host._pulls)
            self._rows_by = backend
            self._controls = await connect(self._actors)  # calls without a Ray task each
        else:
            from ray.experimental.collective import create_collective_group

            try:
                self._rdt_group = await asyncio.to_thread(create_collective_group, self._actors, backend="nccl")
                self._rows_by = backend
            except Exception as e:
                if choice != "auto":
                    raise
                logger.warning("Ray Direct Transport (nccl) unavailable, rows go through the object store: %s", e)
        # The stores keep rows where the transport takes them from (CUDA for NCCL).
        await asyncio.gather(*(a.use_transport.remote(self._rows_by) for a in self._actors))

    def worker(self, pool: str, rank: int) -> Any:
        """The Ray actor handle of ``rank`` of ``pool`` (for tests and tools)."""
        assert self._scheduler is not None
        return self._actors[self._scheduler.pools[pool].workers[rank]]


STORE_ANSWER_S = 10.0
"""How long a kept rendezvous store server has to answer before it is replaced."""


async def _rendezvous_store(kept_ok: bool) -> Any:
    """The session's rendezvous store server: the one its driver's last session (or
    ``asyncflow.start_ray``) kept, when ``kept_ok`` and it answers, else a new one."""
    kept = await _kept_store() if kept_ok else None
    return kept or _idle.start_store()


async def _kept_store() -> Any | None:
    """The rendezvous store server the driver's last session left (``_idle``),
    emptied, if it answers and no rank still waits in it; None otherwise."""
    store = _idle.take_store()
    if store is None:
        return None
    try:
        if await asyncio.wait_for(store.reset.remote(), STORE_ANSWER_S):
            return store
    except (ray.exceptions.RayError, TimeoutError):
        logger.debug("the kept rendezvous store did not answer", exc_info=True)
    ray.kill(store, no_restart=True)
    return None


def _role_start_error(role: str, pool: str, rank: int, e: ray.exceptions.RayTaskError) -> AsyncflowError:
    """A role that failed to start, as one error naming it: a configuration error
    stays a :class:`ConfigError`."""
    cause = e.cause
    if isinstance(cause, ConfigError):
        return ConfigError(f"role {role!r} failed to start on rank {rank} of pool {pool!r}: {cause}")
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(e)
    return RemoteStageError(role=role, method="__init__", rank=rank, pool=pool, cause=text,
                            remote_traceback=getattr(e, "traceback_str", "") or "")


def _role_modules(roles: Mapping[str, RoleSpec]) -> dict[str, tuple[str, ...]]:
    """Per pool, the modules of its role classes (a worker imports them while it
    starts; ``__main__`` is the driver's script, not importable there)."""
    modules: dict[str, dict[str, None]] = {}
    for spec in roles.values():
        if spec.cls.__module__ != "__main__":
            modules.setdefault(spec.pool.name, {})[spec.cls.__module__] = None
    return {pool: tuple(names) for pool, names in modules.items()}


def shutdown_ray() -> None:
    """``ray.shutdown()``, leaving the process ready for another session.

    Ray 2.60 keeps its driver-side Ray Direct Transport manager (a process-wide
    singleton) across ``ray.shutdown()``: it shuts the manager down but keeps it, so
    the next session's transfers go to a manager whose monitor thread is gone and
    their refs are never released. Dropping the manager lets Ray create a new one on
    first use. No public API reaches it; ``ray.worker`` is Ray's own deprecation
    shim over its worker module, read here through the attribute that does not log
    a deprecation warning (a deliberate exception to our no-private-access rule).
    Workers kept for later sessions (``asyncflow.runtime._idle``) end first, and the
    embedded instance's fork server (``asyncflow.runtime._forks``) after Ray.
    """
    if ray.is_initialized():
        _idle.forget()
    ray.shutdown()
    stop_fork_server()
    worker = getattr(getattr(ray, "worker", None), "_real_worker", None)
    global_worker = getattr(worker, "global_worker", None)
    if getattr(global_worker, "_rdt_manager", None) is not None:
        global_worker._rdt_manager = None  # type: ignore[union-attr]


def _device_of(pools: list[ResourcePool]) -> str:
    kinds = {p.device for p in pools} - {"auto"}
    if len(kinds) > 1:
        raise ConfigError("all pools of a session must use one device kind (cpu or cuda)")
    if kinds:
        return kinds.pop()
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
