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

The names load on first use (PEP 562), each with its own module: ``start_ray``
imports Ray and nothing heavier, so that Ray starts before torch imports.
"""

# The imports under TYPE_CHECKING are for type checkers only; the names reach users
# through __getattr__ (channels._lazy).
# ruff: noqa: F401

from __future__ import annotations

from typing import TYPE_CHECKING

from channels._lazy import lazy_exports

_EXPORTS = {
    "asyncflow.runtime._calls": ("CallArgumentError",),
    "asyncflow.runtime._datastream": ("DataStream", "StreamOptions", "collect"),
    "asyncflow.runtime._errors": ("CallTimeoutError", "PoolBrokenError", "RemoteStageError", "SessionClosedError",
                                  "WorkerDiedError"),
    "asyncflow.runtime._fork_server": ("start_fork_server", "stop_fork_server"),
    "asyncflow.runtime._future": ("DataFuture", "gather"),
    "asyncflow.runtime._migration": ("StepCost", "long_tail_lengths", "predicted_speedups"),
    "asyncflow.runtime._observed": ("auto_migration",),
    "asyncflow.runtime._ops": ("concat", "merge"),
    "asyncflow.runtime._pool": ("ResourcePool", "RoleSpec"),
    "asyncflow.runtime._proxy": ("RoleGroup", "Roles", "Stage", "Submit"),
    "asyncflow.runtime._ray_start": ("CPU_SLOT", "check_answers", "cluster_address", "head_answers", "start_ray",
                                     "starts_own_instance"),
    "asyncflow.runtime._session": ("Session", "shutdown_ray"),
    "asyncflow.runtime._transform": ("transform",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from asyncflow.runtime._calls import CallArgumentError
    from asyncflow.runtime._datastream import DataStream, StreamOptions, collect
    from asyncflow.runtime._errors import (
        CallTimeoutError,
        PoolBrokenError,
        RemoteStageError,
        SessionClosedError,
        WorkerDiedError,
    )
    from asyncflow.runtime._fork_server import start_fork_server, stop_fork_server
    from asyncflow.runtime._future import DataFuture, gather
    from asyncflow.runtime._migration import StepCost, long_tail_lengths, predicted_speedups
    from asyncflow.runtime._observed import auto_migration
    from asyncflow.runtime._ops import concat, merge
    from asyncflow.runtime._pool import ResourcePool, RoleSpec
    from asyncflow.runtime._proxy import RoleGroup, Roles, Stage, Submit
    from asyncflow.runtime._ray_start import (
        CPU_SLOT,
        check_answers,
        cluster_address,
        head_answers,
        start_ray,
        starts_own_instance,
    )
    from asyncflow.runtime._session import Session, shutdown_ray
    from asyncflow.runtime._transform import transform
