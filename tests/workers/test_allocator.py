"""A worker process keeps the memory it frees (``workers.host._allocator``): glibc's
allocator then stops handing freed memory back to the system for the next round
to fault in again; glibc's own variables, where set, decide instead. Each case
runs in a fresh process (the setting is the process's for good)."""

from __future__ import annotations

import inspect
import json
import os
import platform
import subprocess
import sys

import pytest

from support import malloc_refaults
from workers.host import _allocator
from workers.host._allocator import keep_freed_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

# The module loaded by its file: it imports only the standard library (its package, torch).
_PROBE = inspect.getsource(malloc_refaults) + """
import ctypes, importlib.util, json, sys, threading
spec = importlib.util.spec_from_file_location("allocator", PATH)
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
keep_freed_memory = allocator.keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
on_thread = []
t = threading.Thread(target=lambda: on_thread.append(malloc_refaults()))
t.start(); t.join()
print(json.dumps({"kept": kept, "main": malloc_refaults(), "thread": on_thread[0]}))
""".replace("PATH", repr(_allocator.__file__))


def _probe(mode: str, **env: str) -> dict[str, float | bool | None]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    result: dict[str, float | bool | None] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_freed_memory_is_kept_for_the_next_round() -> None:
    default, kept = _probe("default"), _probe("keep")
    pages = 40 * (512 << 10) // 4096
    # Without it, a round's memory went back to the system and was faulted in again.
    assert default["main"] >= pages / 2 and default["thread"] >= pages / 2, default  # type: ignore[operator]
    assert kept == {"kept": True, "main": pytest.approx(0, abs=pages / 20),
                    "thread": pytest.approx(0, abs=pages / 20)}, kept


def test_glibcs_own_variables_decide_where_set() -> None:
    own = _probe("keep", MALLOC_TRIM_THRESHOLD_="131072", MALLOC_MMAP_THRESHOLD_="131072")
    assert own["kept"] is False
    assert own["main"] >= 40 * (512 << 10) // 4096 / 2, own  # type: ignore[operator]
    # Read from the environment it is given (these return before touching this process's allocator).
    assert keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=65536"}) is False
