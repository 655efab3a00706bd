"""Feeding one stage's rows to the next: :class:`Feed`.

A step's samples come from one role (``actor.generate``, or a rollout role ahead)
and go to the others (``critic.values``, ``ref.log_prob``, ``reward.score``).
Whether a consumer takes them micro-batch by micro-batch or as one batch depends
on where it runs; :class:`Feed` decides, and takes the stage itself
(``feed(roles.critic.values)``), so the mypy plugin checks the method name and
its keywords as it checks ``roles.critic.values(rows)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from asyncflow import DataFuture, DataStream, RoleGroup, Stage, StreamOptions, collect

P = ParamSpec("P")
T = TypeVar("T")


class Feed:
    """``rows`` (``producer``'s output, a future or a stream) fed to stages:
    ``feed(roles.critic.values)`` is ``roles.critic.values(what it takes of rows)``.

    A stage on another pool than the producer takes the stream: it runs
    micro-batch by micro-batch while generation goes on. A stage on the
    producer's own pool takes the whole batch once generation ends (its pool is
    busy generating until then, so micro-batch calls would only add their
    overheads), unless the long tail may migrate off some of the pool's ranks
    (``stream.migrate`` set, a pool of several ranks) and the method is
    rank-local: the freed ranks then run it on finished micro-batches. Without
    ``stream`` (or when ``rows`` is a future) every stage takes ``rows`` as is.

    Args:
        rows: the samples.
        producer: the group that produced them.
        stream: the step's streaming options (None: the step does not stream).
    """

    def __init__(self, rows: DataFuture[Any] | DataStream[Any], *, producer: RoleGroup[Any],
                 stream: StreamOptions | None) -> None:
        self.rows, self.producer, self.stream = rows, producer, stream

    def __call__(self, stage: Callable[Concatenate[Any, P], DataFuture[T]], /, *args: P.args,
                 **kwargs: P.kwargs) -> DataFuture[T] | DataStream[T]:
        """Call ``stage`` (a role group's method, e.g. ``roles.ref.log_prob``) on the
        rows it takes, with ``args`` and ``kwargs`` after them; returns its future,
        or its stream when it takes the stream.

        Raises:
            TypeError: ``stage`` is not a role group's method.
        """
        if not isinstance(stage, Stage):
            raise TypeError(f"Feed takes a role group's method (e.g. roles.critic.values), not {stage!r}")
        result: DataFuture[T] | DataStream[T] = stage(self.rows_for(stage.group, stage.method), *args, **kwargs)
        return result

    def rows_for(self, consumer: RoleGroup[Any], method: str) -> DataFuture[Any] | DataStream[Any]:
        """What ``consumer.method`` takes of the rows (see the class docstring)."""
        rows = self.rows
        same_pool = consumer.pool.name == self.producer.pool.name
        if self.stream is not None and isinstance(rows, DataStream) and same_pool:
            freed_ranks = bool(self.stream.migrate) and consumer.pool.devices > 1 and method in consumer.rank_local
            return rows if freed_ranks else collect(rows)
        return rows
