"""A CPU worker whose torch computes on one thread runs its threads under Linux's
``SCHED_BATCH`` policy: compute that does not preempt the thread running when it
wakes.

Under the normal policy a thread that wakes may preempt the one running on its
core: the driver's event loop when it writes a call to a worker (the worker's
control thread wakes and takes the driver's core, and the driver's write to the
pool's next rank waits until the scheduler moves it), and a rank's compute thread
whenever one of its helper threads wakes (Ray's signal check and gloo's loops, a
few hundred times a second). ``SCHED_BATCH`` is the kernel's policy for CPU-bound
work that is not interactive: the same share of the CPU and the same niceness,
but a thread that wakes runs on an idle core or when the running one sleeps or
its time slice ends, instead of at once. Its price: a thread that wakes while
every core is busy waits for one.

A worker of several torch threads keeps the normal policy: its compute wakes its
OpenMP team at every parallel operation, and those wake-ups must not wait for a
core the driver holds. What either choice gained and cost, measured, is in
``docs/benchmarks.md`` ("The call path's parts, and the workers' scheduling
policy").

:func:`run_as_batch` moves the process's threads that run under the normal
policy, so a worker started under another one (``chrt --idle``, say) keeps it;
threads started later take the policy of the thread that starts them. Where the
worker's environment sets :data:`OFF_VARIABLE` to ``0``, or the system has no
``SCHED_BATCH`` (not Linux), nothing changes. GPU workers are left as they are:
their threads wait for the device, and a kernel launch should not wait for a core.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF_VARIABLE = "ASYNCFLOW_BATCH_WORKERS"
"""Set to ``0`` in a worker's environment: its threads keep the normal policy."""

_PASSES = 3
"""Times the process's threads are listed: a thread started while they were being
moved (by one not yet moved) is moved on the next pass."""


def run_as_batch(threads: int, environ: Mapping[str, str] | None = None) -> int:
    """For a process whose torch computes on ``threads`` threads: move its threads
    that run under the normal policy to ``SCHED_BATCH`` where ``threads`` is 1 (see
    the module docstring; ``WorkerProcess`` calls it when it joins a session on the
    CPU in a process of its own, not in a ``LocalSession``'s caller); how many were
    moved: 0 with several threads, where ``environ`` (default: this process's)
    sets :data:`OFF_VARIABLE` to ``0``, or where the system has no such policy or
    no ``/proc/self/task``."""
    env = os.environ if environ is None else environ
    batch, normal = getattr(os, "SCHED_BATCH", None), getattr(os, "SCHED_OTHER", None)
    if (threads != 1 or env.get(OFF_VARIABLE) == "0" or batch is None or normal is None
            or not os.path.isdir("/proc/self/task")):
        return 0
    seen: set[int] = set()
    moved = 0
    for _ in range(_PASSES):
        listed = {int(tid) for tid in os.listdir("/proc/self/task")} - seen
        if not listed:
            break
        for tid in listed:
            seen.add(tid)
            try:
                if os.sched_getscheduler(tid) == normal:
                    os.sched_setscheduler(tid, batch, os.sched_param(0))
                    moved += 1
            except OSError:  # the thread ended meanwhile, or the system refused
                pass
    return moved
