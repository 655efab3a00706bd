"""The worker process: one Ray actor per (pool, rank), hosting role objects.

Three Ray concurrency groups keep the process responsive:

- ``compute`` (one thread): role methods run one at a time, in the order the
  driver submits them; so do ``poison`` and ``heal``, which touch the pool's
  process groups only while no role method runs.
- ``io``: sending slices of stored rows to the workers that pull them
  (``workers.host._pulls``), storing rows, freeing shards, statistics, so a
  consumer can pull rows this worker produced while it computes.
- ``watch`` (one thread): a call that never returns while the process lives; the
  driver learns of the process's death from Ray when it fails.

When a role method raises, the worker first *poisons* its pool's process groups
(drops their backends, which closes their connections): peers blocked in a
collective with this rank then fail at once instead of waiting for a timeout.
Before the pool's next call the driver has every rank ``heal`` (reconnect) them.

Where rows live on a worker (its device, its *store device*) is the data plane's
device contract, written down in ``workers.host._rows``.
"""

from __future__ import annotations

import gc
import importlib
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import msgspec
import ray
import torch
import torch.distributed as dist

from channels import (
    CHANNEL_CONCURRENCY_GROUPS,
    USER_CODE_ERRORS,
    Batch,
    ChannelHost,
    Layout,
    Packed,
    RankResult,
    ShardStore,
    StreamItem,
    unpack,
)
from workers.host import _groups, _meshes
from workers.host._allocator import keep_freed_memory
from workers.host._binding import bind_gloo_to_node
from workers.host._call import CallArgs, CallSpec, RankError, ungroup
from workers.host._control import ControlHost
from workers.host._cpu_policy import run_as_batch
from workers.host._engine_logs import route_from_environment
from workers.host._environment import LIVE_ENV, set_env
from workers.host._pulls import Pull, Sender, receive
from workers.host._register import Endpoint, endpoints
from workers.host._rendezvous import RayStore
from workers.host._role import WorkerContext
from workers.host._rows import (
    BoundTransform,
    Traced,
    apply_transforms,
    as_rows,
    check_returned_rows,
    check_writes,
    for_store,
    gather,
    reports_rows,
    row_lengths,
)
from workers.host._serving import RowServer, StreamEnds
from workers.host._streaming import StreamControl, StreamSink, drain, run_streamed

logger = logging.getLogger(__name__)

CONCURRENCY_GROUPS = {"io": 4, "compute": 1, "watch": 1, **CHANNEL_CONCURRENCY_GROUPS}
"""Ray concurrency groups of :class:`WorkerProcess`."""

MESH_DIMS = ("pp", "dp", "tp")

_INITIAL_SEED = torch.initial_seed()
"""The seed torch's default generator started with in this process."""


class WorkerProcess(RowServer, StreamEnds, ChannelHost, ControlHost):
    """Hosts the roles of one rank of one pool. Created by the control plane with
    ``ray.remote(concurrency_groups=CONCURRENCY_GROUPS)``.

    Args:
        index: session-wide worker index (also its rank in the session's process group).
        pool: the pool's name.
        rank: rank within the pool.
        pool_size: ranks in the pool.
        world: workers in the session.
        device: ``"cpu"``, ``"cuda"`` (this process's first visible GPU) or another
            torch device type (in-process tests use a fake accelerator).
        num_threads: torch intra-op threads (keeps pools from starving each other);
            None: torch's default, for a worker started ahead of its session.
        preload: modules to import in the background from the start (the role
            classes' modules: their imports then overlap the process groups'
            rendezvous instead of following it).
        env: the session's ``worker_env`` variables this process sets itself, before
            anything else (:data:`~workers.host._environment.STARTUP_ENV`; Ray's
            ``runtime_env`` set any other before the process started).
    """

    def __init__(self, *, index: int, pool: str, rank: int, pool_size: int, world: int,
                 device: str, num_threads: int | None, preload: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        set_env(env or {})
        route_from_environment()  # before the engines log anything (the driver's worker_env says where)
        self._own_process = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
        """A Ray actor, alone in its process, whose settings it may change (not one
        that ``LocalSession`` runs in its caller's process)."""
        if self._own_process:
            keep_freed_memory()  # before the roles allocate (see workers.host._allocator)
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device(device)
        self._alive = threading.Event()
        self._streams_lock = threading.Lock()
        self._compute = threading.Lock()
        """Held by a method of the compute group while it runs: ``execute`` runs on
        the control connection's thread too (``workers.host._control``)."""
        self._preloads: list[threading.Thread] = []
        self.sender = Sender()
        self._join(index=index, pool=pool, rank=rank, pool_size=pool_size, world=world,
                   num_threads=num_threads, preload=preload)

    def _join(self, *, index: int, pool: str, rank: int, pool_size: int, world: int,
              num_threads: int | None, preload: Sequence[str]) -> None:
        """Become one session's worker (the constructor's arguments; ``index`` -1
        and no ``num_threads``: a worker started ahead of its session, which a
        session adopts, see ``asyncflow.start_ray``)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if num_threads is not None and self.device.type == "cpu" and self._own_process:
            run_as_batch(num_threads)  # before the roles start threads (see workers.host._cpu_policy)
        if preload := [name for name in preload if name not in sys.modules]:
            thread = threading.Thread(target=_import_quietly, args=(tuple(preload), tuple(self._preloads)),
                                      name="asyncflow-preload", daemon=True)
            thread.start()
            self._preloads.append(thread)
        self.index, self.pool, self.rank = index, pool, rank
        self.pool_size, self.world = pool_size, world
        self._forget()

    def _forget(self) -> None:
        """A session's state, empty."""
        self.store_device = torch.device("cpu")
        """Where the store keeps rows (see the module docstring); :meth:`use_transport`
        sets it."""
        self.store = ShardStore()
        self.sender.close()  # its waits end with the session's process group
        self.sender = Sender()
        self.roles: dict[str, Any] = {}
        self._endpoints: dict[str, dict[str, Endpoint[Any, Any]]] = {}
        self._pool_group: Any = None
        self._meshes: dict[Layout, Any] = {}
        self._timeout = timedelta(seconds=600)
        self._streams: dict[int, tuple[StreamSink, StreamControl]] = {}

    # ----- set-up (default concurrency group, before any call) -----

    def identity(self) -> tuple[int, str, str, str]:
        """``(pid, Ray actor id, node IP, Ray node id)``: the driver maps a dead actor
        to its worker index and names the node it ran on, and gloo binds to the
        node's cluster address."""
        context = ray.get_runtime_context()
        return os.getpid(), context.get_actor_id() or "", ray.util.get_node_ip_address(), context.get_node_id()

    def rejoin(self, *, index: int, pool: str, rank: int, pool_size: int, world: int, num_threads: int,
               preload: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        """Become a worker of another session, after :meth:`leave`: the driver adopts
        an idle process instead of starting one (see ``asyncflow.runtime._idle``).

        The arguments are the constructor's. The driver adopts a process only for
        the torch threads it has: a process whose thread count changed computes
        differently in the last bits from a new one. ``env`` holds the variables
        of the new session's ``worker_env`` this process reads after it started
        (where the engine logs go, :data:`~workers.host._environment.LIVE_ENV`).
        """
        set_env(env or {}, allowed=LIVE_ENV)
        route_from_environment(again=True)
        self._join(index=index, pool=pool, rank=rank, pool_size=pool_size, world=world,
                   num_threads=num_threads, preload=preload)

    @ray.method(concurrency_group="compute")
    def leave(self) -> bool:
        """Forget the session, so that another one can adopt this process
        (:meth:`rejoin`) without paying for a start and the imports again: end the
        watch call, close the streams and the roles (their ``close()``, where they
        have one), drop the rows and the process groups, unset the variables
        :meth:`rejoin` may set (:data:`~workers.host._environment.LIVE_ENV`), and
        reseed torch's default generator with the seed it started with.

        The driver calls it after a session closed with no call running and no
        pool broken. Returns False where the process is not fit to serve again: it
        loaded vLLM, whose engines do not give everything back when they close.
        """
        self.close_control()
        with self._compute:
            return self._leave()

    def _leave(self) -> bool:
        self._alive.set()  # the closed session's watch call returns
        self._alive = threading.Event()
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for sink, _ in streams:
            sink.close()
        for role in self.roles.values():
            close = getattr(role, "close", None)
            if callable(close):
                close()
        self._forget()
        if dist.is_initialized():
            dist.destroy_process_group()  # every group of the session, the reconnectable ones included
        for name in LIVE_ENV:  # the closed session's log file, whichever session set it
            os.environ.pop(name, None)
        route_from_environment(again=True)
        torch.set_default_dtype(torch.float32)
        torch.manual_seed(_INITIAL_SEED)
        gc.collect()
        return "vllm" not in sys.modules

    def init_world(self, store: Any, *, node_ip: str, timeout_s: float, collective_timeout_s: float) -> None:
        """Join the session-wide process group (every worker of every pool).

        Args:
            store: the session's rendezvous store actor (a ``workers.StoreServer``);
                the rendezvous goes through Ray's authenticated channels. None for
                a world of this one process, which meets nobody: its groups keep
                their keys in a ``HashStore`` of its own.
            node_ip: this node's cluster address; gloo listens on it only.
            timeout_s: timeout of the rendezvous.
            collective_timeout_s: timeout of the pool's collectives (a backstop:
                a failing rank releases its peers at once).
        """
        bind_gloo_to_node(node_ip)
        self._timeout = timedelta(seconds=collective_timeout_s)
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        rendezvous = RayStore(store, timedelta(seconds=timeout_s)) if store is not None else dist.HashStore()
        dist.init_process_group(backend, store=rendezvous, rank=self.index, world_size=self.world,
                                timeout=self._timeout)
        # Done before add_role's arguments (the role classes) are unpickled: two
        # threads importing one package at once can deadlock on its module locks.
        for thread in self._preloads:
            thread.join()
        self._preloads.clear()

    def build_groups(self, ranks: Sequence[int], layouts: Sequence[Layout]) -> None:
        """Create this pool's process group and a DeviceMesh per layout.

        Collective over the pool's workers only (``ranks``: their session-wide
        indices, in pool-rank order); other pools build theirs independently. The
        groups are reconnectable: see :meth:`poison` and :meth:`heal`.
        """
        if self.pool_size == 1:
            return
        self._pool_group = _meshes.new_reconnectable_group(tuple(ranks), self._timeout)
        for layout in layouts:
            grid = torch.tensor(list(ranks)).view(layout.p, layout.d, layout.t)
            self._meshes[layout] = _meshes.mesh_from_groups(grid, MESH_DIMS, self.device.type, self._timeout)

    def use_transport(self, transport: str | None) -> None:
        """How rows leave this worker: ``"nccl"`` (Ray Direct Transport of CUDA
        tensors: the store keeps rows on this worker's device), ``"gloo"`` or None
        (the object store): the store keeps them on the CPU. Called before any
        role method runs."""
        self.store_device = self.device if transport == "nccl" else torch.device("cpu")

    def add_role(self, name: str, cls: type, config: Any, layout: Layout) -> list[str]:
        """Construct role ``name`` in this process; returns its rank-local methods
        (``Role.rank_local``)."""
        ctx = WorkerContext(
            role=name, pool=self.pool, rank=self.rank, world_size=self.pool_size,
            global_rank=self.index, layout=layout, device=self.device,
            process_group=self._pool_group, mesh=self._meshes.get(layout), roles=self.roles,
        )
        role = self.roles[name] = cls(ctx) if config is None else cls(ctx, config)
        self._endpoints[name] = endpoints(cls)
        route_from_environment()  # again: a library the role imported may have re-configured its logger
        local = getattr(role, "rank_local", None)
        return sorted(local()) if callable(local) else []

    # ----- compute -----

    @ray.method(concurrency_group="compute")
    def execute(self, call: CallArgs, *fetched: tuple[Packed, Mapping[str, torch.Tensor]] | Pull) -> RankResult:
        """Run one role method on this rank's rows and store the rows it returns.

        Args:
            call: the call's spec, arguments, transforms and the shards to free
                first (:class:`~workers.host._call.CallArgs`).
            fetched: the pieces of every data argument's plan that this worker
                does not hold, as ``slices`` packed them, or a :class:`Pull` of
                what ``send_slices`` sends: one per producer worker in the order
                of ``pieces_by_worker`` (one transfer per producer). Pulls are
                received first, whatever fails after, so that no producer's send
                waits for a receive that never comes.

        Raises:
            RankError: the method (or a transform) raised; the pool's groups are
                poisoned first so that peers waiting on this rank fail at once.
        """
        with self._compute:
            # A thread's OpenMP thread count is the machine's until torch first sets
            # it there (torch does so lazily, on the thread's first parallel operation
            # or query): native code that reads it before then, as vLLM's CPU attention
            # does to plan its work, would plan for more threads than then run.
            torch.get_num_threads()
            return self._execute_call(call, fetched)

    def _execute_call(self, call: CallArgs, fetched: Sequence[Any]) -> RankResult:
        spec_bytes, kwargs, transforms, free = call
        try:
            received = receive(fetched)
            if free:
                self.store.free(free)
            spec = msgspec.msgpack.decode(spec_bytes, type=CallSpec)
            traced = Traced() if spec.trace else None
            plans = [a.plan for a in spec.data_args if a.plan is not None]
            pieces = ungroup([p for plan in plans for p in plan.pieces], self.index,
                             [unpack(layout, buffers) for layout, buffers in received])
            result = self._execute(spec, kwargs, transforms, pieces, traced)
        except USER_CODE_ERRORS as e:  # sys.exit() in a method is its error, not this thread's end
            peer = isinstance(e, Exception) and _groups.is_peer_failure(e)
            _meshes.poison_all()
            raise RankError.from_exception(e, peer_failure=peer) from None
        if traced is None:
            return result
        return msgspec.structs.replace(result, timing=traced.timing())

    def _execute(self, spec: CallSpec, kwargs: Mapping[str, Any], transforms: Mapping[str, Sequence[BoundTransform]],
                 pieces: Sequence[Any], traced: Traced | None) -> RankResult:
        args = dict(kwargs)
        i = 0
        for arg in spec.data_args:
            if arg.plan is None:
                args[arg.name] = None
                continue
            n = len(arg.plan.pieces)
            rows = gather(self.store, arg.plan, pieces[i:i + n], worker=self.index, device=self.device, traced=traced)
            args[arg.name] = apply_transforms(self.roles[spec.role], self._endpoints[spec.role][spec.method],
                                              spec.method, transforms.get(arg.name, ()), rows)
            i += n
        role = self.roles[spec.role]
        endpoint = self._endpoints[spec.role][spec.method]
        if not endpoint.spec.streams:
            return self._result(spec, endpoint, endpoint.fn(role, **args))
        if spec.stream is None:
            return self._result(spec, endpoint, drain(endpoint.fn(role, **args)))
        with self._streams_lock:
            sink, control = self._streams[spec.call_id]
        try:
            steps = run_streamed(endpoint.fn(role, **args), control, self._emitter(spec, endpoint, sink),
                                 micro_batch=spec.stream.micro_batch, progress_below=spec.stream.progress_below)
        finally:
            with self._streams_lock:
                self._streams.pop(spec.call_id, None)
            sink.close()
        return RankResult(rank=self.rank, worker=self.index, value={"steps": steps})

    def _emitter(self, spec: CallSpec, endpoint: Endpoint[Any, Any], sink: StreamSink
                 ) -> Callable[[str, Batch | None, tuple[int, ...], int], None]:
        seq = itertools.count()
        reports = reports_rows(endpoint.spec.protocol, getattr(self.roles[spec.role], "ctx", None))

        def emit(kind: str, rows: Batch | None, ids: tuple[int, ...], pending: int) -> None:
            if rows is None or (kind == "rows" and not reports):
                sink.send(StreamItem(kind="progress", rank=self.rank, worker=self.index, pending=pending))
                return
            key = f"{spec.out_key}/{self.rank}.{next(seq)}"
            rows = for_store(rows, self.store_device)
            self.store.put(key, rows)
            lengths = row_lengths(endpoint, rows) if kind == "rows" else None
            sink.send(StreamItem(kind=kind, rank=self.rank, worker=self.index, key=key,  # type: ignore[arg-type]
                                 num_rows=rows.num_rows, fields=rows.field_specs(), row_ids=ids,
                                 row_lengths=lengths, group_size=rows.group_size, pending=pending))
        return emit

    @ray.method(concurrency_group="compute")
    def poison(self) -> None:
        """Drop the pool's group connections (peers blocked on this rank fail now).

        The driver calls it on every rank that finished a failed call."""
        with self._compute:
            _meshes.poison_all()

    @ray.method(concurrency_group="compute")
    def heal(self, epoch: int) -> None:
        """Reconnect the pool's groups; collective over the pool (same ``epoch``)."""
        with self._compute:
            _meshes.heal_all(epoch)

    def _result(self, spec: CallSpec, endpoint: Endpoint[Any, Any], out: Any) -> RankResult:
        rows = as_rows(out)
        if rows is None:
            check_returned_rows(f"{spec.role}.{spec.method}", endpoint, out)
            return RankResult(rank=self.rank, worker=self.index, value=out)
        check_writes(f"{spec.role}.{spec.method}", endpoint, rows)
        rows = for_store(rows, self.store_device)
        self.store.put(spec.out_key, rows)
        return RankResult(rank=self.rank, worker=self.index, key=spec.out_key, num_rows=rows.num_rows,
                          fields=rows.field_specs(), row_lengths=row_lengths(endpoint, rows),
                          group_size=rows.group_size)

    # ----- liveness (watch group) -----

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Block while the process lives: the driver's pending call fails exactly
        when the process dies (Ray's actor-death signal), with no polling."""
        self._alive.wait()


def _import_quietly(modules: tuple[str, ...], after: tuple[threading.Thread, ...] = ()) -> None:
    """Import ``modules`` once the threads ``after`` (earlier preloads) are done; a
    failure is left for the real import to report."""
    for thread in after:
        thread.join()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # the role's own import raises it again, with context
            logger.debug("preloading %s failed", name, exc_info=True)
