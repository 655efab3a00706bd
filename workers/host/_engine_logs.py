"""Where the engines' own log records go, in a worker process and in the driver.

vLLM, Ray and transformers log through Python's ``logging`` under their
own logger names (:data:`ENGINE_LOGGERS`), each with handlers of its own that
print to the terminal. :class:`EngineLogs` replaces those handlers with two:

- the run's log file receives every record from INFO up (from DEBUG when the
  terminal shows DEBUG);
- the terminal (stderr; in a worker, Ray forwards it to the driver's terminal)
  receives the records at the terminal's level and above (WARNING unless asked
  for more), each distinct message once per process, and none of the
  :data:`HARMLESS` ones (those go to the file only).

A worker process learns the file and the level from its environment
(:func:`engine_log_env`, read by :func:`route_from_environment`), which the driver
gives it when it starts the workers. The same environment keeps vLLM from
configuring its loggers itself (``VLLM_CONFIGURE_LOGGING=0``) and turns off the
Hugging Face libraries' progress bars (``HF_HUB_DISABLE_PROGRESS_BARS=1``).

Libraries that configure their loggers when first imported (transformers does)
undo the routing for their own logger; routing again after the import restores
it, so a worker routes once when it starts and again after each role is added.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path

ENGINE_LOGGERS = ("vllm", "ray", "transformers", "accelerate", "huggingface_hub", "datasets")
"""The loggers routed: the engines' and their libraries' top-level logger names.
Not torch's: ``torch._logging`` owns those (``TORCH_LOGS``), WARNING by default,
and sets their handlers again whenever it re-reads its settings."""

HARMLESS = (
    # vLLM's in-place weight reload reports every layer without weights of its own;
    # rotary embeddings hold only buffers computed from the config.
    re.compile(r"\w*RotaryEmbedding: Failed to load weights"),
    # vLLM reporting settings asyncflow's rollout engine makes on purpose
    # (workers/rollout/_vllm.py): an in-process engine seeded per worker, eager
    # mode, no chunked prefill, the worker's own thread count, token-id prompts.
    re.compile(r"The global random seed is set to \d+\. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False.*"),
    re.compile(r"Enforce eager set, disabling torch\.compile.*"),
    re.compile(r"Inductor compilation was disabled by user settings.*"),
    re.compile(r"This model does not officially support disabling chunked prefill.*"),
    re.compile(r"CPU backend doesn't allow to use `torch\.set_num_threads` after the thread binding, skip it\."),
    re.compile(r"Passing raw prompts to InputProcessor is deprecated.*"),
)
"""Warnings that mean nothing for the user: the log file keeps them, the terminal does not."""

LOG_FILE_ENV = "ASYNCFLOW_ENGINE_LOG"
"""The environment variable naming a worker's log file (see :func:`engine_log_env`)."""

LEVEL_ENV = "ASYNCFLOW_LOG"
"""The environment variable holding the terminal's level name (``debug``, ``info``, ``warning``)."""

_FORMAT = "%(levelname)s %(name)s: %(message)s"
_FILE_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"


class _TerminalFilter(logging.Filter):
    """Drops :data:`HARMLESS` records and repeats of a message already shown."""

    def __init__(self) -> None:
        super().__init__()
        self._shown: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(p.fullmatch(message) for p in HARMLESS):
            return False
        key = (record.name, message)
        if key in self._shown:
            return False
        self._shown.add(key)
        return True


class EngineLogs:
    """The routing of :data:`ENGINE_LOGGERS` (see the module docstring).

    Args:
        terminal_level: the lowest level the terminal shows.
        log_file: the file that receives the records from INFO up (appended to);
            None, or a directory that does not exist on this node: no file, the
            records below ``terminal_level`` are dropped.
    """

    def __init__(self, *, terminal_level: int = logging.WARNING, log_file: str | Path | None = None) -> None:
        self.terminal_level = terminal_level
        self.file_level = min(logging.INFO, terminal_level)
        terminal = logging.StreamHandler(sys.stderr)
        terminal.setLevel(terminal_level)
        terminal.setFormatter(logging.Formatter(_FORMAT))
        terminal.addFilter(_TerminalFilter())
        self._handlers: list[logging.Handler] = [terminal]
        if log_file is not None and Path(log_file).parent.is_dir():
            file = logging.FileHandler(log_file, mode="a", encoding="utf-8")  # opened now: see asyncflow.train
            file.setLevel(self.file_level)
            file.setFormatter(logging.Formatter(_FILE_FORMAT))
            self._handlers.append(file)
        self._saved: dict[str, tuple[list[logging.Handler], int, bool]] = {}

    def install(self) -> None:
        """Route every engine logger to this object's handlers; again after a library
        re-configured its logger. The first call remembers each logger's own set-up
        for :meth:`remove`."""
        for name in ENGINE_LOGGERS:
            log = logging.getLogger(name)
            self._saved.setdefault(name, (list(log.handlers), log.level, log.propagate))
            for handler in list(log.handlers):
                log.removeHandler(handler)
            for handler in self._handlers:
                log.addHandler(handler)
            log.setLevel(self.file_level)
            log.propagate = False

    def remove(self) -> None:
        """Give each engine logger back its own handlers and level, and close the file."""
        for name, (handlers, level, propagate) in self._saved.items():
            log = logging.getLogger(name)
            for handler in list(log.handlers):
                log.removeHandler(handler)
            for handler in handlers:
                log.addHandler(handler)
            log.setLevel(level)
            log.propagate = propagate
        self._saved.clear()
        for handler in self._handlers:
            handler.close()

    def __enter__(self) -> EngineLogs:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def engine_log_env(*, terminal_level: int, log_file: str | Path | None) -> dict[str, str]:
    """The environment variables that make worker processes route their engine logs
    as :class:`EngineLogs` would (read by :func:`route_from_environment`)."""
    env = {LEVEL_ENV: logging.getLevelName(terminal_level).lower(), "VLLM_CONFIGURE_LOGGING": "0",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if log_file is not None:
        env[LOG_FILE_ENV] = str(Path(log_file).absolute())
    return env


_routed: EngineLogs | None = None


def route_from_environment(environ: Mapping[str, str] = os.environ, *, again: bool = False) -> None:
    """Route this process's engine logs as its environment says (:func:`engine_log_env`);
    nothing without :data:`LOG_FILE_ENV`. Idempotent: later calls re-install the
    first call's routing (after a library re-configured its logger); ``again``
    undoes it and reads the environment anew (a worker that joins another session)."""
    global _routed
    if again and _routed is not None:
        _routed.remove()
        _routed = None
    if _routed is None:
        path = environ.get(LOG_FILE_ENV)
        if path is None:
            return
        level = logging.getLevelName(environ.get(LEVEL_ENV, "warning").upper())
        _routed = EngineLogs(terminal_level=level if isinstance(level, int) else logging.WARNING, log_file=path)
    _routed.install()
