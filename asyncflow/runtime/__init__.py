"""asyncflow's runtime: the driver's side of a session.

Sessions start Ray and the workers (:class:`Session`), pools place roles
(:class:`ResourcePool`, :class:`RoleSpec`), group proxies turn method calls into
queued calls (:class:`RoleGroup`, :class:`Roles`), and the results are data
futures and streams that carry metadata only (:class:`DataFuture`,
:class:`DataStream`, :func:`merge`, :func:`concat`, :func:`collect`,
:func:`gather`). A scheduler per pool runs the calls and turns failures into the
errors below. ``StreamOptions(migrate="auto")`` picks the long-tail migration
threshold with a simulator of one step's generation and inference.

Users reach these names through ``asyncflow``; the trainer and the benchmarks
import them from here. The modules of this package are private.
"""

from __future__ import annotations

from asyncflow.runtime._calls import CallArgumentError
from asyncflow.runtime._datastream import DataStream, StreamOptions, collect
from asyncflow.runtime._errors import (
    CallTimeoutError,
    PoolBrokenError,
    RemoteStageError,
    SessionClosedError,
    WorkerDiedError,
)
from asyncflow.runtime._future import DataFuture, gather
from asyncflow.runtime._migration import StepCost, long_tail_lengths, predicted_speedups
from asyncflow.runtime._observed import auto_migration
from asyncflow.runtime._ops import concat, merge
from asyncflow.runtime._pool import CPU_SLOT, ResourcePool, RoleSpec
from asyncflow.runtime._proxy import RoleGroup, Roles, Stage, Submit
from asyncflow.runtime._ray_start import check_answers, start_ray
from asyncflow.runtime._session import Session, shutdown_ray
from asyncflow.runtime._transform import transform

__all__ = [
    "CPU_SLOT",
    "CallArgumentError",
    "CallTimeoutError",
    "DataFuture",
    "DataStream",
    "PoolBrokenError",
    "RemoteStageError",
    "ResourcePool",
    "RoleGroup",
    "RoleSpec",
    "Roles",
    "Session",
    "SessionClosedError",
    "Stage",
    "StepCost",
    "StreamOptions",
    "Submit",
    "WorkerDiedError",
    "auto_migration",
    "check_answers",
    "collect",
    "concat",
    "gather",
    "long_tail_lengths",
    "merge",
    "predicted_speedups",
    "shutdown_ray",
    "start_ray",
    "transform",
]
