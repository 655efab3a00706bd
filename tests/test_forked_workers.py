"""The shared Ray instance's workers forked from asyncflow's fork server through the
suite's stub (forked_workers.py): what a worker started that way is, and how it
ends with its stub, the process the raylet started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

import forked_workers
from asyncflow.runtime import _forks
from process_tree import gone

pytestmark = pytest.mark.usefixtures("shared_ray")


@ray.remote(num_cpus=0)
class Probe:
    def facts(self) -> dict:
        return {"pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0), "session": os.getsid(0),
                "stub": int(os.environ[_forks.STUB_ENV]), "job": os.environ["RAY_JOB_ID"],
                "torch_loaded": "torch" in sys.modules, "argv0": sys.argv[0]}


def _started_probe() -> tuple[Any, dict[str, Any]]:
    probe = Probe.remote()
    return probe, ray.get(probe.facts.remote(), timeout=120)


def test_a_worker_is_a_fork_of_the_server_leading_its_own_group_running_rays_script() -> None:
    probe, facts = _started_probe()
    server = psutil.Process(facts["parent"])
    assert "--serve" in server.cmdline() and server.cmdline()[2].endswith("_forks.py")
    # a process group of its own in the driver's session, as the raylet's workers
    assert facts["group"] == facts["pid"] and facts["session"] == os.getsid(0)
    assert facts["torch_loaded"] and facts["argv0"].endswith("default_worker.py")
    stub = psutil.Process(facts["stub"])
    assert stub.cmdline()[1].endswith("forked_workers.py") and "--serve" not in stub.cmdline()
    ray.kill(probe)
    assert gone(facts["pid"]) and gone(facts["stub"]), "the worker or its stub outlived ray.kill"


def test_a_signal_to_the_stub_reaches_the_worker_and_both_end() -> None:
    _, facts = _started_probe()
    os.kill(facts["stub"], signal.SIGTERM)
    assert gone(facts["pid"]) and gone(facts["stub"])


def test_a_worker_whose_stub_is_killed_ends_too() -> None:
    _, facts = _started_probe()
    os.kill(facts["stub"], signal.SIGKILL)
    assert gone(facts["pid"]), "the worker outlived its stub"


def test_without_a_server_the_stub_runs_rays_worker_script_itself() -> None:
    env = {k: v for k, v in os.environ.items() if k != forked_workers.ENV}
    out = subprocess.run([sys.executable, str(Path(forked_workers.__file__)), "--help"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--worker-launch-time-ms" in out.stdout  # default_worker.py's own options
