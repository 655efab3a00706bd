"""The workers of ``asyncflow.start_ray``'s Ray instance forked from asyncflow's fork
server (asyncflow.runtime._forks; real Ray, through its public ``py_executable``):
what such a worker is, that the instance's end ends the server, that
``ASYNCFLOW_FORK_WORKERS=0`` and a session that starts Ray itself start workers as
Ray does, that a stub with no server to answer runs Ray's worker script itself,
and that ``asyncflow train`` leaves nothing behind when its configuration is
refused."""

from __future__ import annotations

import gc
import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

import asyncflow as af
from asyncflow.runtime import _fork_server, _forks, start_fork_server
from asyncflow.runtime._ray_start import init_ray
from forked_workers import rays_worker_script
from process_tree import REPO, clean_env, gone

_RAYS_LIBRARIES = {"pydantic": "pydantic_core/_pydantic_core", "google.protobuf": "google/_upb/_message",
                   "requests": "charset_normalizer/md", "jsonschema": "rpds/rpds", "msgpack": "msgpack/_cmsgpack",
                   "msgspec": "msgspec/_core", "uvloop": "uvloop/loop"}
"""Libraries of ``_forks.PRELOAD`` and a compiled module each loads (``rpds`` is
jsonschema's, ``charset_normalizer`` requests')."""

pytestmark = pytest.mark.usefixtures("no_shared_ray")  # each test starts its own instance, or none


@ray.remote(num_cpus=0)
class Probe:
    def __init__(self) -> None:
        self._torch_at_start = "torch" in sys.modules  # Ray's worker script imports no torch
        self._llama_at_start = "transformers.models.llama.modeling_llama" in sys.modules
        conversions = sys.modules.get("transformers.conversion_mapping")
        self._conversions_at_start = getattr(conversions, "_checkpoint_conversion_mapping_cache", None) is not None
        self._frozen_at_start = gc.get_freeze_count()  # objects the collector skips

    def facts(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "parent": os.getppid(), "torch_at_start": self._torch_at_start,
                "llama_at_start": self._llama_at_start, "conversions_at_start": self._conversions_at_start,
                "frozen_at_start": self._frozen_at_start,
                "stub": os.environ.get(_forks.STUB_ENV), "argv0": sys.argv[0]}


def test_start_rays_workers_are_forks_of_its_server_which_ends_with_it() -> None:
    af.start_ray(preload=(), worker_env={"ASYNCFLOW_TEST_FORK_ENV": "${HOME}/x"})
    try:
        server = start_fork_server()  # the running one
        assert server is not None
        facts = ray.get(Probe.remote().facts.remote(), timeout=120)
        assert facts["parent"] == server.pid and facts["torch_at_start"]
        # what a worker's first Llama load would import and fill, done once in the server (_forks.WARM)
        assert facts["llama_at_start"] and facts["conversions_at_start"]
        # the server's imported objects reach the worker frozen: its collections skip them
        assert facts["frozen_at_start"] > 100_000
        assert facts["argv0"].endswith("default_worker.py")
        serving = psutil.Process(server.pid)
        assert "--serve" in serving.cmdline()
        # the libraries every Ray worker imports as it starts came from the server too
        # (seen by their compiled modules in its memory), but not pyarrow (it starts a thread)
        mapped = {m.path for m in serving.memory_maps()}
        for library, compiled in _RAYS_LIBRARIES.items():
            if importlib.util.find_spec(library) is not None:
                assert any(f"/{compiled}." in path for path in mapped), f"the fork server did not import {library}"
        assert not any("/pyarrow/lib." in path for path in mapped)
        # the server's environment is the driver's with the session's worker_env over it
        assert serving.environ()["ASYNCFLOW_TEST_FORK_ENV"] == f"{os.environ['HOME']}/x"
        stub = psutil.Process(int(facts["stub"]))  # what the raylet started, through py_executable
        assert stub.cmdline()[2:5] == [_forks.__file__, "--stub", server.path]
    finally:
        af.shutdown_ray()
    assert gone(server.pid), "the fork server outlived its Ray instance"
    assert gone(facts["pid"]) and gone(stub.pid), "a forked worker or its stub outlived ray.shutdown"
    assert not Path(server.path).exists()


def test_fork_workers_0_starts_workers_as_ray_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_fork_server.OFF_ENV, "0")
    assert not _fork_server.available()
    af.start_ray(preload=())
    try:
        assert start_fork_server() is None
        facts = ray.get(Probe.remote().facts.remote(), timeout=120)
        assert not facts["torch_at_start"] and facts["stub"] is None and facts["frozen_at_start"] == 0
        assert "raylet" in psutil.Process(facts["parent"]).name()
    finally:
        af.shutdown_ray()


def test_a_session_that_starts_ray_itself_starts_its_workers_as_ray_does() -> None:
    init_ray(None, 64, 0)  # as a Session without an instance started for it does
    try:
        assert _fork_server.running_fork_server() is None
        facts = ray.get(Probe.remote().facts.remote(), timeout=120)
        assert not facts["torch_at_start"] and facts["stub"] is None
    finally:
        af.shutdown_ray()


def test_a_stub_whose_server_is_gone_runs_rays_worker_script_itself(tmp_path: Path) -> None:
    gone = tmp_path / "sock"  # a server's socket that nobody listens on any more
    socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).bind(str(gone))
    out = subprocess.run([sys.executable, "-P", _forks.__file__, "--stub", str(gone), rays_worker_script(), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--worker-launch-time-ms" in out.stdout  # default_worker.py's own options


def test_a_stub_whose_server_ends_before_it_forks_runs_the_worker_itself(tmp_path: Path) -> None:
    path = tmp_path / "sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    proc = subprocess.Popen([sys.executable, "-P", _forks.__file__, "--stub", str(path), rays_worker_script(),
                             "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    conn, _ = listener.accept()
    conn.recv(1 << 20)  # the stub's request
    conn.close()  # ... and the server ends without forking
    listener.close()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "--worker-launch-time-ms" in out


def test_a_refused_configuration_leaves_no_fork_server() -> None:
    mark = uuid.uuid4().hex
    env = clean_env(ASYNCFLOW_TEST_MARK=mark)
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow.cli", "train", str(REPO / "examples" / "arith_grpo.toml"),
                             "--set", "train.no_such_key=1", "--no-progress"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    servers: set[int] = set()
    while proc.poll() is None:
        try:
            servers |= {p.pid for p in psutil.Process(proc.pid).children() if "--serve" in p.cmdline()}
        except psutil.Error:
            pass
        time.sleep(0.05)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 2, out
    assert "no_such_key" in out
    assert servers, "asyncflow train started no fork server beside its configuration's check"
    assert all(gone(pid) for pid in servers), "the fork server outlived the refused run"
    marked = [p for p in psutil.process_iter() if _marked(p, mark)]
    assert not marked, f"processes of the refused run still run: {marked}"


def _marked(p: psutil.Process, mark: str) -> bool:
    try:
        return p.environ().get("ASYNCFLOW_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
