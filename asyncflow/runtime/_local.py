"""In-process workers: the scheduler, futures and proxies without Ray or processes.

For unit tests of the control plane (and for debugging a role in one process).
Each worker is a plain ``workers.WorkerProcess`` whose compute methods run on a
thread of its own (so calls on one worker run in order and pools overlap, as
with Ray); rows move by reference. :meth:`LocalTransport.kill` simulates the
death of a worker process. Roles that use process groups (more than one rank and
collectives) need the real :class:`~asyncflow.Session`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from asyncflow.runtime._pool import RoleSpec, check_placement, world_size
from asyncflow.runtime._proxy import Roles
from asyncflow.runtime._runtime import Runtime
from asyncflow.runtime._transport import BoundTransforms, WorkerGone
from channels import Piece, RankResult, StoreStats, StreamItem, open_channel
from workers import CallArgs, WorkerProcess, pieces_by_worker

T = TypeVar("T")


class LocalTransport:
    """A :class:`~asyncflow.runtime._transport.Transport` over in-process workers.

    Args:
        workers: the workers by session-wide index.
    """

    def __init__(self, workers: Sequence[WorkerProcess]) -> None:
        self.workers: list[Any] = list(workers)  # plain calls: Ray's method typing does not apply
        self._compute = [ThreadPoolExecutor(1, thread_name_prefix=f"asyncflow-local-{i}")
                         for i in range(len(workers))]
        self._dead: list[asyncio.Event] = [asyncio.Event() for _ in workers]
        self.log: list[tuple[str, int]] = []
        """``(operation, worker)`` of every compute operation, in submission order."""

    def kill(self, worker: int) -> None:
        """Simulate the death of ``worker``'s process: its calls fail, its watch fires."""
        self._dead[worker].set()

    async def _compute_on(self, worker: int, op: str, fn: Callable[[], T]) -> T:
        self.log.append((op, worker))
        if self._dead[worker].is_set():
            raise WorkerGone(worker, "killed")
        job: asyncio.Future[T] = asyncio.ensure_future(
            asyncio.get_running_loop().run_in_executor(self._compute[worker], fn))
        death: asyncio.Future[Any] = asyncio.ensure_future(self._dead[worker].wait())
        await asyncio.wait({job, death}, return_when=asyncio.FIRST_COMPLETED)
        death.cancel()
        if not job.done():
            job.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise WorkerGone(worker, "killed")
        return job.result()

    def _slices(self, worker: int, pieces: Sequence[Piece]) -> Any:
        if self._dead[worker].is_set():
            raise WorkerGone(worker, "killed")
        return self.workers[worker].slices(pieces)

    def _piece(self, worker: int, p: Piece) -> dict[str, torch.Tensor] | None:
        if p.worker == worker:
            return None
        if self._dead[p.worker].is_set():
            raise WorkerGone(p.worker, "killed")
        return self.workers[p.worker].slice(p.key, p.lo, p.hi, p.fields)

    async def execute(self, worker: int, spec: bytes, kwargs: Mapping[str, Any], transforms: BoundTransforms,
                      pieces: Sequence[Piece], free: Sequence[str] = ()) -> RankResult:
        def run() -> RankResult:
            fetched = [self._slices(w, group) for w, group in pieces_by_worker(pieces, worker).items()]
            return self.workers[worker].execute(CallArgs(spec, kwargs, transforms, tuple(free)), *fetched)
        return await self._compute_on(worker, "execute", run)

    async def put(self, worker: int, key: str, columns: Mapping[str, torch.Tensor], group_size: int) -> RankResult:
        return self.workers[worker].put(key, columns, group_size)

    async def fetch(self, pieces: Sequence[Piece]) -> list[dict[str, torch.Tensor]]:
        out = []
        for p in pieces:
            if self._dead[p.worker].is_set():
                raise WorkerGone(p.worker, "killed")
            out.append(self.workers[p.worker].slice_to_host(p.key, p.lo, p.hi, p.fields))
        return out

    async def free(self, worker: int, keys: Sequence[str]) -> Any:
        return self.workers[worker].free(keys)

    async def poison(self, worker: int) -> None:
        await self._compute_on(worker, "poison", self.workers[worker].poison)

    async def heal(self, worker: int, epoch: int) -> None:
        await self._compute_on(worker, "heal", lambda: self.workers[worker].heal(epoch))

    async def watch(self, worker: int) -> None:
        await self._dead[worker].wait()
        raise WorkerGone(worker, "killed")

    def on_disconnect(self, fn: Callable[[int, bool], None]) -> None:
        """In-process workers have no connection of their own: ``fn`` is never called."""

    async def stats(self, worker: int) -> StoreStats:
        return self.workers[worker].stats()

    async def clock(self, worker: int) -> float:
        return float(self.workers[worker].clock())

    async def open_stream(self, worker: int, call_id: int, capacity: int) -> _Receiver:
        loop = asyncio.get_running_loop()
        send, receive = open_channel[StreamItem](math.inf)
        dead = self._dead[worker]

        class Sink:
            def send(self, item: StreamItem) -> None:
                loop.call_soon_threadsafe(send.send_nowait, item)

            def close(self) -> None:
                loop.call_soon_threadsafe(send.close)

        self.workers[worker].attach_stream(call_id, Sink())

        async def receiving() -> AsyncIterator[StreamItem]:
            async with receive:
                async for item in receive:
                    if dead.is_set():
                        raise WorkerGone(worker, "killed")
                    yield item
        return _Receiver(receiving())

    async def stream_control(self, worker: int, call_id: int, action: str, count: int) -> bool:
        return bool(self.workers[worker].stream_control(call_id, action, count))

    async def stream_adopt(self, worker: int, call_id: int, piece: Piece | None, group_size: int) -> None:
        columns = None if piece is None else self._piece(worker, piece)  # a target is never its own source
        self.workers[worker].stream_adopt(call_id, group_size, columns)

    def close(self) -> None:
        """Stop the worker threads."""
        for ex in self._compute:
            ex.shutdown(wait=False, cancel_futures=True)


class _Receiver:
    """An async iterator with ``aclose`` (what the scheduler expects of a stream's receive end)."""

    def __init__(self, gen: AsyncIterator[StreamItem]) -> None:
        self._gen = gen

    def __aiter__(self) -> AsyncIterator[StreamItem]:
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()  # type: ignore[attr-defined]


class LocalSession(Runtime):
    """A session whose workers live in this process (see the module docstring).

        async with LocalSession() as session:
            roles = await session.spawn({"producer": RoleSpec(cls=Producer, pool=pool)})
    """

    def __init__(self, *, device: str = "cpu", store_on_device: bool = False) -> None:
        """Args:
            device: the workers' device (``"cpu"``, ``"cuda"``, or a test device such
                as the fake accelerator of the tests).
            store_on_device: keep stored rows on ``device``, as workers whose rows
                move over NCCL do; else on the CPU, as with gloo or the object store.
        """
        super().__init__()
        self._device, self._store_on_device = device, store_on_device
        self.local: LocalTransport | None = None
        """The in-process transport (tests call ``local.kill(worker)`` and read ``local.log``)."""

    async def __aenter__(self) -> LocalSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def spawn(self, roles: Mapping[str, RoleSpec]) -> Roles:
        """Create the pools' in-process workers and host the roles on them."""
        pools, layouts = check_placement(roles)
        workers: list[WorkerProcess] = []
        ranks: dict[str, list[int]] = {}
        world = world_size(pools)
        for pool in pools:
            ranks[pool.name] = []
            for rank in range(pool.devices):
                ranks[pool.name].append(len(workers))
                worker = WorkerProcess(index=len(workers), pool=pool.name, rank=rank, pool_size=pool.devices,
                                       world=world, device=self._device, num_threads=torch.get_num_threads())
                worker.use_transport("nccl" if self._store_on_device else None)
                workers.append(worker)
        local: dict[str, frozenset[str]] = {}
        for name, spec in roles.items():
            for i in ranks[spec.pool.name]:
                methods = frozenset(workers[i].add_role(name, spec.cls, spec.config, layouts[name]))
                local[name] = local[name] & methods if name in local else methods
        self.local = LocalTransport(workers)
        return self._start(self.local, ranks, roles, layouts, local)

    async def close(self) -> None:
        """Settle every call and stop the worker threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._stop()
        if self.local is not None:
            self.local.close()
