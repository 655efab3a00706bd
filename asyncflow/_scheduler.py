"""Running group calls: one loop per pool.

Every call to a role on a pool goes into that pool's channel, and the pool's loop
runs the calls one at a time in call order: wait for the inputs' metadata, plan
which rows each rank pulls from which producer, submit the call to every rank,
collect. Pools have separate loops, so calls on different pools overlap while
calls on one pool time-share it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import ray

from asyncflow._errors import PoolBrokenError, RemoteStageError, WorkerDiedError
from asyncflow._future import DataFuture, Lease, Resolved
from channels import (
    Collected,
    Layout,
    MissingFieldError,
    RankResult,
    ReceiveChannel,
    SendChannel,
    plan_pull,
)
from workers import CallSpec, DataArg, Endpoint

if TYPE_CHECKING:
    from asyncflow._session import Session

logger = logging.getLogger(__name__)

BROKEN_GRACE_S = 2.0
"""After one rank fails, how long the other ranks get to finish before the pool is
declared broken (they may be stuck in a collective with the failed rank)."""


@dataclass(eq=False, kw_only=True)
class Call:
    """A submitted call waiting for its pool."""

    call_id: int
    role: str
    endpoint: Endpoint[Any, Any]
    layout: Layout
    data_args: dict[str, DataFuture[Any]]
    kwargs: dict[str, Any]
    result: asyncio.Future[Any]

    @property
    def label(self) -> str:
        return f"{self.role}.{self.endpoint.spec.name}#{self.call_id}"


@dataclass(eq=False, kw_only=True)
class PoolState:
    """A pool's workers, its call channel and whether it can still take calls."""

    name: str
    actors: list[Any]
    indices: list[int]
    """Session-wide worker index of each rank."""
    send: SendChannel[Call]
    receive: ReceiveChannel[Call]
    broken: BaseException | None = None
    running: list[int] = field(default_factory=list)


_call_ids = itertools.count(1)


def next_call_id() -> int:
    """A session-unique call id."""
    return next(_call_ids)


async def pool_loop(session: Session, pool: PoolState) -> None:
    """Run ``pool``'s calls in order until its channel closes."""
    async with pool.receive:
        async for call in pool.receive:
            if call.result.done():  # cancelled by the caller
                continue
            if pool.broken is not None:
                call.result.set_exception(PoolBrokenError(
                    f"{call.label} was not run: pool {pool.name!r} is broken since an earlier call "
                    f"failed ({pool.broken})"
                ))
                continue
            try:
                call.result.set_result(await _run(session, pool, call))
            except Exception as e:
                if not call.result.done():
                    call.result.set_exception(e)
            finally:
                del call  # drop the inputs' leases as soon as the call is over


async def _run(session: Session, pool: PoolState, call: Call) -> Any:
    spec = call.endpoint.spec
    inputs: dict[str, Resolved] = {}
    for name, fut in call.data_args.items():
        resolved = await fut._resolve()
        if not isinstance(resolved, Resolved):
            raise MissingFieldError(f"{call.label}: argument {name!r} ({fut.label}) is a value, not rows")
        inputs[name] = resolved
    pulls = {name: _pull_fields(call, name, r) for name, r in inputs.items()}
    assignments = {
        name: spec.protocol.distribute(r.meta, call.layout, r.row_lengths) for name, r in inputs.items()
    }
    refs = []
    for rank, actor in enumerate(pool.actors):
        data_args: list[DataArg] = []
        pieces: list[Any] = []
        for name, r in inputs.items():
            runs = assignments[name][rank]
            if runs is None:
                data_args.append(DataArg(name=name, plan=None))
                continue
            plan = plan_pull(r.meta, runs, pulls[name])
            data_args.append(DataArg(name=name, plan=plan))
            pieces.extend(None if p.worker == pool.indices[rank] else session.slice_ref(p) for p in plan.pieces)
        cs = CallSpec(call_id=call.call_id, role=call.role, method=spec.name,
                      out_key=f"c{call.call_id}", data_args=tuple(data_args))
        transforms = {n: [(t.fn, t.kwargs) for t in r.transforms] for n, r in inputs.items() if r.transforms}
        refs.append(actor.execute.remote(msgspec.msgpack.encode(cs), call.kwargs, transforms, *pieces))
    results = await _await_ranks(session, pool, call, refs)
    first = next(iter(assignments.values()), None)
    out = spec.protocol.collect(results, call.layout, first)
    return _finish(session, call, results, out)


def _pull_fields(call: Call, name: str, r: Resolved) -> tuple[str, ...] | None:
    """Columns to pull for data argument ``name`` (None: all), checked to exist."""
    reads = call.endpoint.spec.reads_for(name)
    have = set(r.meta.field_names)
    t_writes: set[str] = set()
    t_reads: set[str] = set()
    for t in r.transforms:
        if t.writes is None or t.reads is None:
            return None if reads is None else _checked(call, name, reads, have | set(reads))
        t_writes |= set(t.writes)
        t_reads |= set(t.reads) - t_writes
    if reads is None:
        return None
    _checked(call, name, reads, have | t_writes)
    needed = [f for f in reads if f not in t_writes] + sorted(t_reads - set(reads))
    return _checked(call, name, needed, have)


def _checked(call: Call, name: str, fields: Sequence[str], have: set[str]) -> tuple[str, ...]:
    for f in fields:
        if f not in have:
            raise MissingFieldError(
                f"{call.label} reads field {f!r} but its argument {name!r} "
                f"({call.data_args[name].label}) has only {sorted(have)}"
            )
    return tuple(dict.fromkeys(fields))


async def _await_ranks(session: Session, pool: PoolState, call: Call, refs: Sequence[Any]) -> list[RankResult]:
    tasks = [asyncio.ensure_future(ref) for ref in refs]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [i for i, t in enumerate(tasks) if t.done() and t.exception() is not None]
    if not failed:
        return [t.result() for t in tasks]
    rank = failed[0]
    err = remote_error(tasks[rank].exception(), call=call, pool=pool.name, rank=rank)
    if pending:
        _, still = await asyncio.wait(pending, timeout=BROKEN_GRACE_S)
        if still:
            pool.broken = err
    if isinstance(err, WorkerDiedError):
        pool.broken = err
    def discard(task: asyncio.Future[RankResult]) -> None:
        # The call failed: rows other ranks produced for it are never named by a
        # future. (Reading the exception also keeps asyncio from logging it.)
        if not task.cancelled() and task.exception() is None and task.result().key is not None:
            session.release_now({(task.result().worker, task.result().key)})

    for t in tasks:
        if t.done():
            discard(t)
        else:
            t.add_done_callback(discard)
    raise err


def remote_error(exc: BaseException, *, call: Call, pool: str, rank: int) -> BaseException:
    """A Ray failure as one error naming role, method and rank."""
    where: dict[str, Any] = {"role": call.role, "method": call.endpoint.spec.name, "rank": rank, "pool": pool}
    if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError):
        return WorkerDiedError(cause=f"the worker process died ({type(exc).__name__})",
                               remote_traceback=str(exc), **where)
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = exc.cause
        if isinstance(cause, RemoteStageError):
            return cause
        if isinstance(cause, ray.exceptions.ActorDiedError):
            return WorkerDiedError(cause=f"a worker it pulled rows from died: {cause}",
                                   remote_traceback=str(exc), **where)
        text = f"{type(cause).__name__}: {cause}" if cause is not None else exc.__class__.__name__
        return RemoteStageError(cause=text, remote_traceback=getattr(exc, "traceback_str", None) or str(exc), **where)
    if isinstance(exc, ray.exceptions.RayError):
        return RemoteStageError(cause=f"{type(exc).__name__}: {exc}", remote_traceback="", **where)
    return exc


def _finish(session: Session, call: Call, results: Sequence[RankResult], out: Any) -> Any:
    produced = {(r.worker, r.key) for r in results if r.key is not None}
    if not isinstance(out, Collected):
        session.release_now(produced)
        return out
    kept = out.meta.shard_keys()
    session.release_now(produced - kept)
    leases = tuple(Lease(w, k, session.release) for w, k in sorted(kept))
    return Resolved(meta=out.meta, row_lengths=out.row_lengths, leases=leases)


def check_call_fields(call_label: str, endpoint: Endpoint[Any, Any], data_args: Mapping[str, DataFuture[Any]]) -> None:
    """Fail at call time when a data argument's known fields lack a field the
    method reads."""
    for name, fut in data_args.items():
        reads = endpoint.spec.reads_for(name)
        if reads is None or fut.fields is None:
            continue
        missing = [f for f in reads if f not in fut.fields]
        if missing:
            raise MissingFieldError(
                f"{call_label} reads field {missing[0]!r} but its argument {name!r} ({fut.label}) "
                f"carries only {sorted(fut.fields)}"
            )
