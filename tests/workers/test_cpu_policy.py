"""A CPU worker's threads run under the batch scheduling policy
(``workers.host._cpu_policy``): the threads it has, the ones it starts later,
not one that runs under another policy, and none where the environment turns it
off (each case in a fresh process: the policy is the threads' for good); and an
in-process session leaves its caller's process as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import asyncflow as af
from support import POLICY_NAMES, Sleeper, run_local, thread_policies
from workers.host import _cpu_policy
from workers.host._cpu_policy import OFF_VARIABLE, run_as_batch

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH") or not os.path.isdir("/proc/self/task"),
                                reason="Linux's scheduling policies")

# The module loaded by its file: it imports only the standard library.
_PROBE = f"POLICY_NAMES = {POLICY_NAMES!r}\n" + """
import importlib.util, json, os, threading
spec = importlib.util.spec_from_file_location("cpu_policy", PATH)
cpu_policy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_policy)
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # whatever the test runner runs under

def _own() -> str:
    names = {getattr(os, k): v for k, v in POLICY_NAMES.items() if hasattr(os, k)}
    return names[os.sched_getscheduler(threading.get_native_id())]

release, seen = threading.Event(), {}
def waiting(name: str, idle: bool = False) -> None:
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    started.set()
    release.wait()
    seen[name] = _own()

threads = []
for name, idle in (("before", False), ("idle", True)):
    started = threading.Event()
    threads.append(threading.Thread(target=waiting, args=(name, idle)))
    threads[-1].start()
    started.wait()
nice = os.nice(3)
moved = cpu_policy.run_as_batch(1)
started = threading.Event()
threads.append(threading.Thread(target=waiting, args=("after",)))
threads[-1].start()
started.wait()
release.set()
for t in threads:
    t.join()
print(json.dumps({"moved": moved, "main": _own(), "nice": os.nice(0), **seen}))
""".replace("PATH", repr(_cpu_policy.__file__))


def _probe(**env: str) -> dict[str, str | int]:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    result: dict[str, str | int] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_threads_a_worker_has_and_starts_run_as_batch_at_their_niceness() -> None:
    got = _probe()
    # main and "before" moved; the idle thread kept its policy; "after" took main's.
    assert got == {"moved": 2, "main": "batch", "nice": 3, "before": "batch", "idle": "idle", "after": "batch"}, got


def test_the_environment_can_turn_it_off() -> None:
    got = _probe(**{OFF_VARIABLE: "0"})
    assert got == {"moved": 0, "main": "normal", "nice": 3, "before": "normal", "idle": "idle", "after": "normal"}, got
    assert run_as_batch(1, {OFF_VARIABLE: "0"}) == 0  # returns before touching this process's threads


def test_a_local_session_leaves_its_callers_threads_as_they_were() -> None:
    before, threads = thread_policies(), torch.get_num_threads()
    torch.set_num_threads(1)  # the in-process worker then has one thread, as a batch worker would
    try:
        async def main(session: object, roles: object, src: object) -> None:
            await roles.one.work(0.0)  # type: ignore[attr-defined]
        run_local({"one": af.RoleSpec(cls=Sleeper, pool=af.ResourcePool(name="one", devices=1))},
                  {"x": torch.zeros(2, 1)}, "one", main)
    finally:
        torch.set_num_threads(threads)
    assert thread_policies() == before
