"""A run's ``engines.log``: the engines' log records below the terminal's level.

The file starts before the workers do, while the run's directory does not exist
yet (it is made once the workers are up: a run that never started leaves none),
as ``<output_dir>/.engines-<pid>.log``; :meth:`RunLog.move_into` renames it into
the run's directory, where the processes that opened it go on writing (a rename
keeps open files). A resumed run appends to its directory's file from the start.
A run that ends before its directory exists leaves the file where it is, unless it
is empty. See :mod:`workers.host._engine_logs` for what goes where.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from asyncflow.train._rundir import make_output_dir
from workers import EngineLogs, engine_log_env

LOG_NAME = "engines.log"
"""The file's name in the run's directory."""


class RunLog:
    """The engine-log routing of one run, in the driver and (through
    :meth:`worker_env`) in its workers.

    Args:
        output_dir: the configuration's ``output_dir``.
        terminal_level: the lowest level the terminal shows.
        run_dir: the run's directory when it exists already (a resumed run).
    """

    def __init__(self, output_dir: Path, *, terminal_level: int = logging.WARNING,
                 run_dir: Path | None = None) -> None:
        make_output_dir(output_dir)  # a ConfigError naming output_dir where it cannot be one
        self.path = run_dir / LOG_NAME if run_dir is not None else output_dir / f".engines-{os.getpid()}.log"
        """Where the file is now."""
        self.terminal_level = terminal_level
        self._pending = run_dir is None
        self._driver = EngineLogs(terminal_level=terminal_level, log_file=self.path)

    def worker_env(self) -> dict[str, str]:
        """The environment variables that route a worker's engine logs into this file."""
        return engine_log_env(terminal_level=self.terminal_level, log_file=self.path)

    def move_into(self, run_dir: Path) -> None:
        """Rename the file into ``run_dir`` (the processes writing to it go on)."""
        if self._pending:
            target = run_dir / LOG_NAME
            os.replace(self.path, target)
            self.path, self._pending = target, False

    def __enter__(self) -> RunLog:
        self._driver.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self._driver.remove()
        if self._pending and self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()
