"""What a run keeps under its configuration's ``output_dir``.

Each ``asyncflow train`` writes into a directory of its own, ``version_0``,
``version_1``, ... (the convention of Lightning's loggers), and ``latest`` links the
newest: its metrics, TensorBoard files, curves, traces, checkpoints and exported
policy. A new run never changes an earlier run's files; ``--resume`` continues the
newest run with a checkpoint in place (``latest``, unless newer runs ended before
their first checkpoint), and only ``--clean`` deletes earlier runs.

Beside the runs lie caches that runs with the same settings share: the SFT warm
start's model and a GGUF file's conversion, each in a directory named after a hash
of what made it, so that runs with other settings never overwrite it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from asyncflow.train._checkpoint import CheckpointDir
from channels import ConfigError

if TYPE_CHECKING:
    from asyncflow.train._config import RunConfig

VERSION_PREFIX = "version_"
"""A run's directory is ``version_<n>``, n = 0, 1, 2, ..."""

LATEST = "latest"
"""The symbolic link to the newest run's directory."""


class RunDirs:
    """The run directories under ``output_dir``.

    Args:
        output_dir: the configuration's ``output_dir``.
    """

    def __init__(self, output_dir: Path) -> None:
        self.root = output_dir

    def versions(self) -> list[Path]:
        """The runs' directories, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            number = path.name.removeprefix(VERSION_PREFIX)
            if path.name.startswith(VERSION_PREFIX) and number.isdigit() and path.is_dir():
                found.append((int(number), path))
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        """The newest run's directory (the one ``latest`` links; without the link,
        the highest version), or None when there is no run."""
        link = self.root / LATEST
        if link.is_symlink() and link.is_dir():
            return self.root / os.readlink(link)
        runs = self.versions()
        return runs[-1] if runs else None

    def to_resume(self, *, steps: int) -> tuple[Path, Path]:
        """The run ``--resume`` continues, and its newest complete checkpoint: the
        newest run that has one. Where newer runs ended before their first (a
        configuration error found once the workers were up, a run stopped at once),
        ``latest`` links the run resumed again.

        Args:
            steps: the configuration's ``train.steps``.

        Raises:
            ConfigError: there is no run, no complete checkpoint, or the checkpoint
                is past ``steps`` (nothing to train).
        """
        latest = self.latest()
        if latest is None:
            raise ConfigError(f"--resume: no run under {self.root} to continue; start one without --resume")
        run = next((r for r in reversed(self.versions()) if CheckpointDir(r / "checkpoints").complete()), latest)
        if run.name != latest.name:
            self._link_latest(run)
        checkpoint = CheckpointDir(run / "checkpoints").latest()
        if (done := int(CheckpointDir.state(checkpoint)["step"])) > steps:
            raise ConfigError(f"--resume: {checkpoint} is step {done}, past train.steps = {steps}; "
                              "raise train.steps to train on")
        return run, checkpoint

    def new(self) -> Path:
        """Make the next run's directory and point ``latest`` at it.

        Returns:
            ``<output_dir>/version_<n>``, empty, n one more than the highest so far.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        runs = self.versions()
        number = int(runs[-1].name.removeprefix(VERSION_PREFIX)) + 1 if runs else 0
        while True:
            path = self.root / f"{VERSION_PREFIX}{number}"
            try:
                path.mkdir()
                break
            except FileExistsError:  # a run started beside this one took it
                number += 1
        self._link_latest(path)
        return path

    def _link_latest(self, run: Path) -> None:
        # A new link under a temporary name replaces the old one atomically: a reader
        # sees the previous run or this one, never no link.
        tmp = self.root / f".{LATEST}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run.name, target_is_directory=True)
        os.replace(tmp, self.root / LATEST)

    def clean(self) -> list[Path]:
        """Delete every run's directory and ``latest`` (the caches stay).

        Returns:
            The deleted directories.
        """
        runs = self.versions()
        self.refuse_busy()
        (self.root / LATEST).unlink(missing_ok=True)
        for path in runs:
            shutil.rmtree(path)
        return runs

    def refuse_busy(self) -> None:
        """Raise :class:`ConfigError` when a run under ``output_dir`` is in use by
        another process (:class:`RunLock`): ``--clean`` would delete it under it."""
        for run in self.versions():
            if (holder := RunLock.holder(run)) is not None:
                raise ConfigError(f"--clean: {run} is in use by another asyncflow run (process {holder}); "
                                  "wait for it to end or stop it")


class RunDir:
    """The directory one run writes into, held while it does: a new run's
    (:meth:`new`) or the run ``--resume`` continues (:meth:`resume`), locked against
    a second run (:class:`RunLock`) until :meth:`close`.

    Args:
        path: the run's directory.
        keep: how many checkpoints it keeps (``train.keep_checkpoints``).
        resumed: the checkpoint a resumed run continues from; None for a new run.

    Raises:
        ConfigError: another process holds the directory.
    """

    def __init__(self, path: Path, *, keep: int, resumed: Path | None = None) -> None:
        self.path = path
        self.resumed = resumed
        self.checkpoints = CheckpointDir(path / "checkpoints", keep=keep)
        """The run's checkpoints."""
        self._lock = RunLock(path)
        self._lock.acquire()

    @classmethod
    def new(cls, runs: RunDirs, config: RunConfig, *, clean: bool, say: Callable[[str], None]) -> RunDir:
        """The next run's directory under ``runs``, with ``config`` kept in it (with
        ``clean``, the earlier runs deleted first)."""
        if clean and (gone := runs.clean()):
            say(f"--clean: deleted {len(gone)} earlier run(s) under {runs.root}")
        run = cls(runs.new(), keep=config.train.keep_checkpoints)
        save_settings(run.path, config)
        return run

    @classmethod
    def resume(cls, runs: RunDirs, config: RunConfig, *, say: Callable[[str], None]) -> RunDir:
        """The run ``--resume`` continues (:meth:`RunDirs.to_resume`); says which when
        newer runs ended before their first checkpoint, and warns of settings other
        than those the run started with.

        Raises:
            ConfigError: nothing to resume, or the run is in use by another process.
        """
        latest = runs.latest()
        path, checkpoint = runs.to_resume(steps=config.train.steps)
        run = cls(path, keep=config.train.keep_checkpoints, resumed=checkpoint)
        if latest is not None and latest.name != path.name:
            say(f"--resume: {latest.name} ended before its first checkpoint; continuing {path.name}")
        if changed := changed_settings(path, config):
            say(f"warning: --resume with other settings than {path.name} started with "
                f"({'; '.join(changed)}): the run will not repeat the uninterrupted one")
        return run

    def where_to_go_on(self) -> str:
        """Where a run stopped now continues from, for messages."""
        done = self.checkpoints.complete()
        return (f"last checkpoint: {done[-1]} (continue with --resume)" if done
                else "no checkpoint was written yet (rerun from the start)")

    def close(self) -> None:
        """Let the directory go (the run is over)."""
        self._lock.release()


class RunLock:
    """The lock a run holds on its directory while it writes there, so that a second
    ``--resume`` of it, or a ``--clean`` of its ``output_dir``, is refused instead of
    writing or deleting under it. An advisory ``flock`` on ``<run>/.lock`` (which
    holds the holder's process id): the system drops it when the process ends, however
    it ends."""

    FILE = ".lock"

    def __init__(self, run: Path) -> None:
        self.run = run
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            ConfigError: another process holds it.
        """
        fd = os.open(self.run / self.FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"{self.run} is in use by another asyncflow run (process {holder}); "
                              "wait for it to end or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        """Let the lock go (the run is over)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def holder(cls, run: Path) -> str | None:
        """The process id holding ``run``'s lock, or None when no process does."""
        if not (run / cls.FILE).exists():  # never held (a run from before locks): nothing to make
            return None
        lock = cls(run)
        try:
            lock.acquire()
        except ConfigError:
            return (run / cls.FILE).read_text().strip() or "?"
        lock.release()
        return None


SETTINGS = "run_config.json"
"""The file in a run's directory holding the settings it started with."""

FREE_ON_RESUME = ("output_dir", "train.steps", "train.max_seconds", "train.checkpoint_every",
                  "train.keep_checkpoints", "train.trace_steps", "train.export_hf", "train.eval_every")
"""Settings a resumed run may change without changing what it computes: its budget,
where and how often it writes, what it traces."""


def save_settings(run: Path, config: object) -> None:
    """Keep ``config`` (a run configuration) in ``run``'s directory, for ``--resume``
    to compare (:func:`changed_settings`)."""
    (run / SETTINGS).write_text(json.dumps(msgspec.to_builtins(config), indent=1, sort_keys=True) + "\n")


def changed_settings(run: Path, config: object) -> list[str]:
    """The settings of ``config`` other than those ``run`` started with, as ``"key:
    old -> new"``, but for :data:`FREE_ON_RESUME`; none where the run kept none."""
    path = run / SETTINGS
    if not path.is_file():
        return []
    old = _flat(json.loads(path.read_text()))
    new = _flat(json.loads(json.dumps(msgspec.to_builtins(config))))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key) and not key.startswith(FREE_ON_RESUME)]


def _flat(table: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in table.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value}
    return out


def make_output_dir(output_dir: Path) -> None:
    """Make ``output_dir`` (and its parents) where it is missing.

    Raises:
        ConfigError: it is a file, lies under one, or cannot be made or written to.
    """
    where = f"output_dir = '{output_dir}'"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{where} is a file, not a directory; name a directory") from None
    except NotADirectoryError:
        raise ConfigError(f"{where} lies under a file, not a directory; name a directory") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be made: {e.strerror or e}; name a directory this user may write") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user; name a directory it may write")


def cache_dir(output_dir: Path, name: str, key: bytes) -> Path:
    """The directory of a cache runs share: ``<output_dir>/<name>-<hash of key>``.

    Args:
        output_dir: the configuration's ``output_dir``.
        name: what the cache holds (``"sft_model"``).
        key: everything that made its content; another key, another directory.
    """
    return output_dir / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"
