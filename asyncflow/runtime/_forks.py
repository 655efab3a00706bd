"""Ray worker processes forked from one that has imported their libraries already.

A worker process spends seconds of one core importing torch and transformers
before it serves its first call (about 4 s on a laptop core, 6 on a slow one):
on an embedded instance that is most of the wait for the first step, after Ray's
own start, and a session of several ranks pays it once per rank, the ranks
importing side by side. A fork server pays it once, while Ray starts:

- :func:`~asyncflow.runtime._fork_server.start_fork_server` (one per process,
  for the embedded Ray instance it starts) runs this file as a script, the
  **server** (``python -P _forks.py --serve SOCKET``): it listens on a Unix socket
  at once, imports :data:`PRELOAD`, fills :data:`WARM`'s caches, then forks a
  child for each worker the raylet starts.
- The raylet starts each worker through Ray's public ``py_executable`` (the
  instance's ``runtime_env``, ``ForkServer.runtime_env``), which runs this file
  as the **stub** (``python -P _forks.py --stub SOCKET default_worker.py ARGS``):
  it imports nothing heavy, hands its arguments, environment, working directory,
  signal settings and standard streams to the server, and stays as the raylet's
  child until the worker ends, with the worker's exit status; the signals it can
  catch it passes on to the worker.
- The child takes on the stub's environment and streams, leads a process group of
  its own (as the raylet's workers do) and runs Ray's ``default_worker.py`` as
  ``__main__``, as a new process would. It registers with the raylet under its own
  pid, which is what Ray signals and kills; a worker whose stub dies without
  ending it (``SIGKILL``) ends too.

Where the server is not there, or ends before it forks, the stub runs Ray's script
itself: a worker is never lost to the server, only slower to start. The server
ends when its owner ends it (``stop_fork_server``, after Ray's shutdown) or dies
(its standard input closes). The owner's side (starting, ending, and whether
workers are forked here: Linux, and no GPU) is :mod:`asyncflow.runtime._fork_server`.
The server forks a process that has imported torch, which is sound where the
fork carries no thread or device state, so not where a GPU may be used. This
file imports the standard library only.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import socket
import struct
import sys
import time
from typing import Any, NoReturn

RAY_LIBRARIES = ("google.protobuf.json_format", "requests", "jsonschema", "pydantic.fields", "pydantic.v1.fields",
                 "starlette.datastructures", "uvloop", "msgpack", "msgspec")
"""The libraries a Ray process imports beside Ray itself by the time it runs its
first task or creates its first actor: protobuf, requests and jsonschema (Ray's
imports), pydantic's field modules and starlette's data structures (Ray
registers serializers for the libraries it finds installed as it builds its
serialization context, at its first call or actor), uvloop, msgpack, and
msgspec (``channels``): about 0.3 s of a core, which a new process would spend
on its critical path. Not pyarrow, whose serializers Ray registers too: it
starts a thread as it loads, which a fork would leave behind (the driver, which
forks nothing, imports it with these: ``asyncflow.runtime._ray_start``). None
reads the process's environment as it loads."""

PRELOAD = ("torch", "torch.distributed", "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           *RAY_LIBRARIES)
"""What the server imports before it forks: torch, which every worker imports;
what those that host a Hugging Face model import next (Llama's, the family of the
examples' and most small models); and :data:`RAY_LIBRARIES`. Not Ray: its native
library reads its settings and the worker's identity (job, token) from the
environment when it loads, so each worker loads it itself, as a new process does.
Never vLLM: a worker that loaded it is not adopted by a later session."""

WARM = (("transformers.conversion_mapping", "get_checkpoint_conversion_mapping", "llama"),)
"""``(module, function, argument)``: calls the server makes after its imports, to
fill caches a worker's first model load would fill: transformers' table of
checkpoint key conversions (0.2 s of a core: it compiles some 650 regular
expressions, for every model type at once)."""

STUB_ENV = "ASYNCFLOW_FORK_STUB"
"""A forked worker's stub's pid, in the worker's environment."""

_BOUND_S = 30.0
"""How long a stub waits for the server's socket to appear (it binds at once)."""

_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

# -- messages ----------------------------------------------------------------------


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


def run_stub(path: str, argv: list[str]) -> NoReturn:
    """Have the server at ``path`` fork the worker ``argv`` (Ray's script and its
    arguments) and wait for it; run it here where the server cannot."""
    sock = _connect(path)
    if sock is None:
        run_rays_script(argv)
    _send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), **_signal_masks(),
                 "stub": os.getpid()}, [0, 1, 2])
    got = _answer(sock)
    if got is None:  # the server ended before it forked: nothing runs the worker yet
        sock.close()
        run_rays_script(argv)
    pid = int(got[0])
    for sig in _FORWARDED:
        signal.signal(sig, lambda signum, _frame: _forward(pid, signum))
    ended = _answer(sock)
    status = int(ended[0]) if ended is not None else 1 << 8  # the server gone: exit code 1
    if os.WIFSIGNALED(status):  # end as the worker did, for the raylet to see
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _answer(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The server's next message, None once it is gone."""
    try:
        return _recv(sock)
    except OSError:
        return None


def _forward(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _connect(path: str) -> socket.socket | None:
    """A connection to the server, or None where there is none: no socket after
    :data:`_BOUND_S`, or a socket nobody listens on any more."""
    deadline = time.monotonic() + _BOUND_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except FileNotFoundError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        except OSError:
            sock.close()
            return None


def run_rays_script(argv: list[str]) -> NoReturn:
    """Run Ray's worker script ``argv[0]`` with ``argv[1:]`` in this process, as
    ``python default_worker.py ARGS`` would; it ends the process (``SystemExit``)."""
    import runpy

    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


# -- the server --------------------------------------------------------------------


def _serve(path: str) -> None:
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle; its end closes stdin
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # stubs connect now and wait while the server imports
    # The imports build some 600,000 objects that live as long as the process:
    # collecting among them as they arrive costs about a tenth of the imports' CPU,
    # and a worker's every full collection would walk them all (0.15-0.3 s of a
    # core, writing to pages it shares with the server). So the collector is off
    # while they import and they are frozen before the first fork (Python's advice
    # for fork servers); the few objects the imports leave as garbage stay too.
    gc.disable()
    for name in PRELOAD:
        with contextlib.suppress(Exception):  # the worker's own import raises it again, with context
            importlib.import_module(name)
    for module, function, argument in WARM:
        with contextlib.suppress(Exception):  # a cache left empty: the worker fills it
            getattr(importlib.import_module(module), function)(argument)
    gc.freeze()
    gc.enable()
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
                with contextlib.suppress(OSError):
                    _send(conn, status)
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
    with contextlib.suppress(OSError):  # the stub died: its worker sees it (_end_with)
        _send(conn, pid)
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
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    if "numpy" in sys.modules:  # a new process's numpy seeds its global generator from the OS
        sys.modules["numpy"].random.seed()
    _end_with(request["stub"])
    # the server's objects go back to the collector as the worker ends, for its
    # last collection to see them as a new process's would (extensions' leak
    # checks, such as nanobind's, report objects it leaves alive)
    atexit.register(gc.unfreeze)
    run_rays_script(request["argv"])


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

    threading.Thread(target=watch, name="asyncflow-fork-stub-watch", daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2])
    elif sys.argv[1:2] == ["--stub"]:
        run_stub(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: _forks.py --serve SOCKET | --stub SOCKET WORKER_SCRIPT [ARGS...]")
