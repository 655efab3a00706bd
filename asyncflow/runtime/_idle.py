"""Worker processes (and a rendezvous store server) kept between the sessions of
one Ray instance.

A worker process costs seconds before it serves its first call: Ray starts it,
then it imports torch, transformers and the role modules (four to five seconds of
CPU on a laptop core). A session on a Ray instance that outlives it
(``asyncflow.start_ray(keep=True)``, a script's own ``ray.init``, a cluster) hands
its clean CPU workers back here when it closes, and the next session of the
driver adopts them instead of starting new ones: each worker forgets the old
session first (``WorkerProcess.leave``) and joins the new one as if new
(``WorkerProcess.rejoin``), with torch's default generator reseeded as it started.

Which workers come back: those of a session that closed with no call running and
no pool broken, whose ``leave`` answered in time and found them fit (a process
that loaded vLLM is not). Any other worker ends with its session. A worker is
adopted only on the node its pool's placement group reserved for it, with the
torch threads it has, by a session whose ``worker_env`` differs from the one it
started with at most in the variables the worker reads again when it joins
(:data:`workers.LIVE_ENV`). GPU workers are not kept: Ray gives an actor its GPU
when it starts it.

Kept workers hold no Ray resources (the next session's placement group reserves
them) but hold their memory: at most :data:`KEPT_WORKERS` per Ray connection.
They end with the driver's connection (``ray.shutdown``), as every actor it
created does.

The session's rendezvous store server (``workers.StoreServer``, half a second of
CPU to start) comes back on the same terms: one per Ray connection, which the next
session takes wherever its workers run, once it emptied (``StoreServer.reset``,
which a server some rank still waits in refuses: that one is replaced). Workers
started ahead come with one (:func:`start_ahead`), and a session that finds none
starts its own beside its workers: its ranks need it only once they are up. A
session of one worker process has none: its world meets nobody.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from workers import CONCURRENCY_GROUPS, LIVE_ENV, StoreServer, WorkerProcess, split_env

KEPT_WORKERS = 8
"""The most idle workers one driver's Ray connection keeps."""


@dataclass(frozen=True)
class Fit:
    """What an idle (CPU) worker must match to be adopted: where it runs, its torch
    threads (a process whose thread count changed computes differently in the last
    bits from a new one) and the environment it started with (less
    :data:`workers.LIVE_ENV`)."""

    node: str
    threads: int | None
    """None: a worker started ahead of its session, which takes any count."""
    env: frozenset[tuple[str, str]]

    @staticmethod
    def of(node: str, threads: int | None, worker_env: Mapping[str, str]) -> Fit:
        return Fit(node, threads, frozenset((k, v) for k, v in worker_env.items() if k not in LIVE_ENV))


_kept: dict[str, list[tuple[Fit, Any]]] = {}  # by Ray job id: the driver's connection
_kept_stores: dict[str, Any] = {}  # by Ray job id: a rendezvous store server (workers.StoreServer)


def _connection() -> str:
    return ray.get_runtime_context().get_job_id()


@functools.cache
def worker_class() -> Any:
    """``WorkerProcess`` as a Ray actor class."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS, enable_tensor_transport=True)(  # type: ignore[call-overload]
        WorkerProcess)


def start_keepable(node: str, worker_env: Mapping[str, str], args: Mapping[str, Any]) -> Any:
    """A new CPU worker (``WorkerProcess(**args)``) that may outlive its session:
    on ``node``, asking Ray for nothing (a placement group reserves its resources;
    removing the group would end a worker inside it)."""
    opts: dict[str, Any] = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    return start_worker(opts, worker_env, args, device="cpu")


def start_worker(opts: Mapping[str, Any], worker_env: Mapping[str, str], args: Mapping[str, Any], *,
                 device: str) -> Any:
    """A new ``WorkerProcess(**args)`` with Ray's actor options ``opts``: the
    variables of ``worker_env`` it can set itself (:data:`workers.STARTUP_ENV`) are
    its constructor's, only the others Ray's ``runtime_env`` (which costs a worker
    about half a second more to start)."""
    own, before_start = split_env(worker_env)
    if before_start:
        opts = {**opts, "runtime_env": {"env_vars": before_start}}
    return worker_class().options(**opts).remote(**args, device=device, env=own)


def take(fit: Fit) -> Any | None:
    """An idle worker that fits, no longer idle (one that served a session before
    one started ahead); None when there is none."""
    kept = _kept.get(_connection(), [])
    for ahead in (False, True):
        for i, (f, actor) in enumerate(kept):
            if f == fit or (ahead and f.threads is None and replace(f, threads=fit.threads) == fit):
                del kept[i]
                return actor
    return None


def start_ahead(count: int, *, preload: Sequence[str], worker_env: Mapping[str, str] | None = None) -> None:
    """Start ``count`` CPU workers on this node now, before any session, importing
    ``preload`` meanwhile, and for more than one a rendezvous store server: the
    next session on this Ray connection adopts them (the workers with
    ``worker_env``'s environment) instead of starting its own."""
    node = ray.get_runtime_context().get_node_id()
    env = dict(worker_env or {})
    blank = {"index": -1, "pool": "", "rank": -1, "pool_size": 0, "world": 0, "num_threads": None,
             "preload": tuple(preload)}
    for _ in range(count):
        keep(Fit.of(node, None, env), start_keepable(node, env, blank))
    if count > 1:  # and the rendezvous store server a session of several needs
        keep_store(start_store())


def start_store() -> Any:
    """A new rendezvous store server (``workers.StoreServer``), starting now; it asks
    Ray for nothing (a process of the standard library, mostly waiting)."""
    return ray.remote(StoreServer).options(num_cpus=0).remote()  # type: ignore[attr-defined]


def keep(fit: Fit, actor: Any) -> None:
    """Keep ``actor`` (it left its session) for a later session; when
    :data:`KEPT_WORKERS` are kept already, ends the one kept longest instead: the
    next session is likelier to fit the newest (a script's or a test suite's
    sessions in a row share their settings; old kept workers that fit none of them
    would otherwise hold every place and have each later session start its own)."""
    kept = _kept.setdefault(_connection(), [])
    kept.append((fit, actor))
    while len(kept) > KEPT_WORKERS:
        _, oldest = kept.pop(0)
        ray.kill(oldest, no_restart=True)


def keep_store(store: Any) -> None:
    """Keep a session's rendezvous store server for this Ray connection's next
    session, in place of one kept before."""
    old = _kept_stores.pop(_connection(), None)
    if old is not None:
        ray.kill(old, no_restart=True)
    _kept_stores[_connection()] = store


def take_store() -> Any | None:
    """The kept rendezvous store server, no longer kept; None when there is none."""
    return _kept_stores.pop(_connection(), None) if ray.is_initialized() else None


def kept_count() -> int:
    """How many idle workers this driver's Ray connection keeps now."""
    return len(_kept.get(_connection(), [])) if ray.is_initialized() else 0


def forget() -> None:
    """End every kept worker and forget them (before ``ray.shutdown``)."""
    for actor in [a for kept in _kept.values() for _, a in kept] + list(_kept_stores.values()):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    _kept.clear()
    _kept_stores.clear()
