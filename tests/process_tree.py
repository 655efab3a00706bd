"""Watching a command's process tree from outside: the sockets its processes
listen on while it runs, and which of them outlive its death.

The command runs in a subprocess with the environment a new shell would give it
(:func:`clean_env`), so what it shows does not depend on how pytest was started.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def clean_env(**extra: str) -> dict[str, str]:
    """PATH (this venv's ``bin`` first), HOME (Ray's token lives there) and ``extra``:
    nothing of the test process's own settings."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", **extra}


def gone(pid: int, timeout_s: float = 30) -> bool:
    """Whether process ``pid`` has ended (a zombie counts) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.1)
    return False


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address held by an IPv6 socket."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass(frozen=True)
class Listener:
    process: str
    ip: str
    port: int

    def __str__(self) -> str:
        return f"{self.process} on {self.ip}:{self.port}"


def _label(p: psutil.Process, name: str) -> str:
    """The process as a failure should name it: its name when first seen, and its
    command line now (a Ray worker, "python" when it starts, retitles itself
    ``ray::<Class>.<method>`` once it serves)."""
    try:
        return f"{name} (pid {p.pid}: {' '.join(p.cmdline())[:120]})"
    except psutil.Error:
        return f"{name} (pid {p.pid})"


_TABLES = {"tcp": socket.AF_INET, "tcp6": socket.AF_INET6, "udp": socket.AF_INET, "udp6": socket.AF_INET6}
_TCP_LISTEN = "0A"
_UDP_CONNECTED = "01"  # the kernel writes a connected UDP socket's state as TCP_ESTABLISHED


def _bound_sockets() -> dict[int, tuple[str, int]]:
    """Every listening TCP socket and bound, unconnected UDP socket of this network
    namespace, by inode: ``(ip, port)``. A connected UDP socket takes datagrams from
    its one peer only: a DNS lookup makes one for a moment, bound to the interface
    that reaches the name server. The kernel's tables are read once a sweep (psutil's
    ``Process.net_connections`` reads all of them again for each process: in a
    sweep of a run's fifteen processes, most of the watching thread's CPU)."""
    found: dict[int, tuple[str, int]] = {}
    for table, family in _TABLES.items():
        try:
            rows = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            ip, port_hex = fields[1].split(":")
            port, state, inode = int(port_hex, 16), fields[3], int(fields[9])
            tcp = table.startswith("tcp")
            if (tcp and state != _TCP_LISTEN) or (not tcp and state == _UDP_CONNECTED) or port == 0:
                continue
            found[inode] = (_address(ip, family), port)
    return found


def _address(hex_ip: str, family: int) -> str:
    """An address as /proc/net's tables write it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_ip)
    return socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def _socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


class WatchedRun:
    """``cmd`` started now; a thread samples its process tree every ``poll_s``
    (every process seen, every listening TCP socket and bound UDP socket) and
    another collects its output (stdout and stderr together)."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str], cwd: Path = REPO, poll_s: float = 0.3) -> None:
        self.proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.listeners: set[Listener] = set()
        self.seen: dict[int, psutil.Process] = {}
        self._names: dict[int, str] = {}
        self._poll_s = poll_s
        self._root = psutil.Process(self.proc.pid)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._reader.start()
        self._sampler.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _sample(self) -> None:
        while self.proc.poll() is None:
            try:
                tree = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                break
            bound = _bound_sockets()
            for p in tree:
                try:
                    name = self._names.setdefault(p.pid, p.name())
                    self.seen.setdefault(p.pid, p)
                    for inode in _socket_inodes(p.pid) & bound.keys():
                        self.listeners.add(Listener(_label(p, name), *bound[inode]))
                except psutil.Error:
                    continue
            time.sleep(self._poll_s)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def names(self) -> set[str]:
        """The names of every process seen in the tree."""
        return set(self._names.values())

    def wait_for_line(self, text: str, *, timeout_s: float) -> str:
        """The first output line containing ``text``; fails (killing the run) on
        exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None:
                self._reader.join(5)
                if any(text in line for line in self.lines):
                    continue
                break
            time.sleep(0.2)
        self.kill9()
        raise AssertionError(f"no line with {text!r} (exit {self.proc.returncode}); output:\n{self.output[-4000:]}")

    def wait(self, *, timeout_s: float) -> int:
        """The exit code; kills the run and fails after ``timeout_s``."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"still running after {timeout_s:.0f} s; output:\n{self.output[-4000:]}") from None
        self._reader.join(5)
        self._sampler.join(5)
        return rc

    def kill9(self) -> None:
        """SIGKILL the command's own process (not its tree)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def survivors(self, *, within_s: float) -> list[str]:
        """The processes of the tree still running ``within_s`` after now (none
        once every one has ended; zombies count as ended)."""
        deadline = time.monotonic() + within_s
        while True:
            alive = []
            for p in self.seen.values():
                try:
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{p.name()} (pid {p.pid})")
                except psutil.Error:
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)
