"""A watchdog that ends what a driver started once the driver dies, however it dies.

An embedded Ray instance is a tree of processes under the driver: the GCS server
and the raylet, and under the raylet its agents and the worker processes. Ray
ends most of them when the driver exits or is signalled, but not on ``kill -9``:
its DashboardAgent and RuntimeEnvAgent outlive a killed driver. Only a process
outside the tree can clean up after a death the driver never sees, so
:func:`watch_this_process` starts one:

- in its own session (a Ctrl-C or a ``kill`` of the driver's process group does
  not reach it), reading a pipe whose only writer is the driver: end of file
  means the driver is gone, whether it exited or was killed;
- meanwhile, once a second, it records the driver's descendants (pid and start
  time, so that a reused pid is never taken for one of them);
- when the driver is gone it sends SIGTERM to every recorded process still alive
  and to their descendants (processes orphaned by the death are re-parented, not
  ended), then SIGKILL to any left after a grace period.

After a clean shutdown nothing is left to end and the watchdog just exits. This
file runs as a script (``python _watchdog.py PID``), not as a module of the
package, so that the watchdog imports psutil and nothing heavier.
"""

from __future__ import annotations

import os
import subprocess
import sys

POLL_S = 1.0
"""How often the watchdog records the driver's descendants."""
GRACE_S = 3.0
"""How long the processes get between SIGTERM and SIGKILL."""

_watchdog: subprocess.Popen[bytes] | None = None


def watch_this_process() -> None:
    """Start the watchdog of this process, once per process (later calls do nothing
    while it runs). It lives until this process dies, then ends every process this
    one started that is still running."""
    global _watchdog
    if _watchdog is not None and _watchdog.poll() is None:
        return
    _watchdog = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _watch(driver_pid: int) -> None:
    import select
    import signal

    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    me = os.getpid()
    tracked: dict[int, psutil.Process] = {}

    def record(procs: list[psutil.Process]) -> None:
        for p in procs:
            if p.pid != me and p.pid not in tracked:
                tracked[p.pid] = p  # a psutil.Process remembers its start time

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break  # end of file: the driver is gone
        try:
            record(driver.children(recursive=True))
        except psutil.NoSuchProcess:
            break
    victims: dict[int, psutil.Process] = {}
    for p in tracked.values():
        try:
            if p.is_running():  # same pid *and* start time
                victims[p.pid] = p
                victims.update((c.pid, c) for c in p.children(recursive=True) if c.pid != me)
        except psutil.Error:
            continue
    for p in victims.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(victims.values()), timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
