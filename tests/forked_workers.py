"""Ray worker processes forked from one that has imported their libraries already.

A Ray worker process spends seconds of CPU importing torch (and transformers, for
one that hosts a Hugging Face model) before it serves anything, and the suite
starts over a hundred of them on its shared Ray instances (conftest.py's
``shared_ray``). For those instances a fork server imports these libraries once,
and each worker is a fork of it:

- The raylet starts a worker as always, but with this file in place of Ray's
  ``default_worker.py`` (:func:`raylet_starts_stubs` while ``ray.init`` runs). This
  file, run as a script, is the **stub**: it imports nothing heavy, hands its
  arguments, environment, working directory, signal settings and standard streams
  to the server over a Unix socket, and stays as the raylet's child until the
  worker ends, with the worker's exit status; the signals it can catch it passes
  on to the worker.
- The **server** (:func:`start`, ``python forked_workers.py --serve SOCKET``) forks a
  child per stub, which takes on the stub's environment and streams, leads a
  process group of its own in the driver's session (as the raylet's workers do:
  with the kernel's autogroups a session of its own would be scheduled apart from
  the other processes) and runs Ray's ``default_worker.py`` as ``__main__``, as
  a new process would. The worker registers with the raylet under its own pid,
  which is what Ray (and the tests) signal and kill. A worker whose stub dies
  without ending it (``SIGKILL``) ends too.

Where the server is not there or not answering, the stub runs the worker itself,
as Ray's own script would. The server ends when its owner closes its stdin.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

ENV = "ASYNCFLOW_TEST_FORKSERVER"
"""The server's socket path, in the environment the raylet gives its workers."""
STUB_ENV = "ASYNCFLOW_TEST_FORKSERVER_STUB"
"""A forked worker's stub's pid, in the worker's environment."""

PRELOAD = ("torch", "torch.distributed", "transformers.modeling_utils")
"""What the server imports before it forks: torch, which every worker imports, and
what those hosting a Hugging Face model import next. Not Ray: its native library
reads its settings and the worker's identity (job, token) from the environment
when it loads, so each worker loads it itself, as a new process does.
Never vLLM: a worker that loaded it is not adopted by a later session."""

_CONNECT_S = 60.0
"""How long a stub waits for the server to listen (it imports first)."""

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@functools.cache
def _default_worker() -> str:
    import importlib.util  # Ray's script's path, without importing Ray

    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None, "Ray is not installed"
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "default_worker.py")


def _send(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    header = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(sock, [header + data], fds)
    else:
        sock.sendall(header + data)


def _recv(sock: socket.socket, with_fds: int = 0) -> tuple[Any, list[int]] | None:
    """One message (and up to ``with_fds`` descriptors), None at the end of the stream."""
    fds: list[int] = []
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + struct.unpack("!I", buf[:4])[0]:
        if with_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(sock, 1 << 20, with_fds)
            fds = list(got)
        else:
            chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        buf += chunk
    return json.loads(buf[4:]), fds


def _signal_masks() -> dict[str, list[int]]:
    """This process's ignored and blocked signals (/proc/self/status's ``SigIgn``
    and ``SigBlk``), as ``{"ignored": [...], "blocked": [...]}``."""
    fields = {"SigIgn": "ignored", "SigBlk": "blocked"}
    masks: dict[str, list[int]] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in fields:
                bits = int(value, 16)
                masks[fields[name]] = [n for n in range(1, 65) if bits >> (n - 1) & 1]
    return masks


# -- the stub: what the raylet starts ----------------------------------------------


def _stub() -> None:
    path = os.environ.get(ENV)
    sock = _connect(path) if path else None
    if sock is None:
        _run_rays_script(sys.argv[1:])
        return
    _send(sock, {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), **_signal_masks(),
                 "stub": os.getpid()}, [0, 1, 2])
    got = _recv(sock)
    if got is None:
        sys.exit("forked_workers: the server ended before starting the worker")
    pid = int(got[0])
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    ended = _recv(sock)
    status = int(ended[0]) if ended is not None else 1
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _connect(path: str) -> socket.socket | None:
    deadline = time.monotonic() + _CONNECT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)


def _run_rays_script(argv: list[str]) -> None:
    """Run Ray's ``default_worker.py`` with ``argv`` in this process, as
    ``python default_worker.py ARGV`` would; it ends the process (``SystemExit``)."""
    import runpy

    worker = _default_worker()
    sys.argv = [worker, *argv]
    sys.path[0] = os.path.dirname(worker)
    runpy.run_path(worker, run_name="__main__")
    sys.exit(0)


# -- the server --------------------------------------------------------------------


def _serve(path: str) -> None:
    import importlib
    import selectors

    for name in PRELOAD:
        importlib.import_module(name)
    _default_worker()  # found once: the forks inherit it
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(sys.stdin, selectors.EVENT_READ, "owner")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the stub's connection)
    while True:
        for key, _ in sel.select():
            if key.data == "owner":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "accept":
                started = _fork_for(listener.accept()[0], listener, sel, children)
                if started is not None:
                    pidfd, child = started
                    children[pidfd] = child
                    sel.register(pidfd, selectors.EVENT_READ, "child")
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                try:
                    _send(conn, status)
                except OSError:
                    pass
                conn.close()


def _fork_for(conn: socket.socket, listener: socket.socket, sel: Any,
              children: dict[int, tuple[int, socket.socket]]) -> tuple[int, tuple[int, socket.socket]] | None:
    """Fork a worker for the stub on ``conn``: its pidfd and (pid, conn), or None when
    the stub died before asking. In the child this never returns (the worker's
    ``SystemExit`` ends the process)."""
    try:
        got = _recv(conn, with_fds=3)
    except OSError:
        got = None
    if got is None:
        conn.close()
        return None
    request, fds = got
    pid = os.fork()
    if pid == 0:
        for pidfd, (_, other) in children.items():
            os.close(pidfd)
            other.close()
        listener.close()
        sel.close()
        conn.close()
        _become_worker(request, fds)
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, pid)
    except OSError:
        pass  # the stub died: its worker sees it (_end_with)
    return os.pidfd_open(pid), (pid, conn)


def _become_worker(request: dict[str, Any], fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[STUB_ENV] = str(request["stub"])
    ignored = set(request["ignored"])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.SIG_IGN if sig in ignored else (
            signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    if "numpy" in sys.modules:  # a new process's numpy seeds its global generator from the OS
        sys.modules["numpy"].random.seed()
    _end_with(request["stub"])
    _run_rays_script(request["argv"])


def _end_with(stub: int) -> None:
    """End this worker when its stub dies without ending it first."""
    import select
    import threading

    try:
        pidfd = os.pidfd_open(stub)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="forked-worker-stub-watch", daemon=True).start()


# -- the owner's side --------------------------------------------------------------


class Server:
    """A running fork server (:func:`start`); :meth:`close` ends it."""

    def __init__(self, path: str, proc: subprocess.Popen[bytes]) -> None:
        self.path = path
        self._proc = proc

    def close(self) -> None:
        import shutil
        import subprocess

        proc = self._proc
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


def start(env: dict[str, str]) -> Server:
    """A fork server with ``env`` added to this process's environment (the
    workers' path); it imports :data:`PRELOAD` while the caller goes on (stubs wait
    for it)."""
    import subprocess
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="afforks"), "sock")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", path], stdin=subprocess.PIPE,
                            env={**os.environ, **env})
    return Server(path, proc)


@contextlib.contextmanager
def raylet_starts_stubs() -> Iterator[None]:
    """While in this context, a Ray instance that starts has its raylet start this
    file in place of Ray's ``default_worker.py`` (the ``worker_path`` Ray's node
    gives ``ray._private.services.start_raylet``)."""
    import inspect

    import ray._private.services as services

    original = services.start_raylet
    signature = inspect.signature(original)

    def start_raylet(*args, **kwargs):  # type: ignore[no-untyped-def]
        bound = signature.bind(*args, **kwargs)
        bound.arguments["worker_path"] = os.path.abspath(__file__)
        return original(*bound.args, **bound.kwargs)

    services.start_raylet = start_raylet
    try:
        yield
    finally:
        services.start_raylet = original


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2])
    else:
        _stub()
