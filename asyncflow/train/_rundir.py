"""What a run keeps under its configuration's ``output_dir``.

Each ``asyncflow train`` writes into a directory of its own, ``version_0``,
``version_1``, ... (the convention of Lightning's loggers), and ``latest`` links the
newest: its metrics, TensorBoard files, curves, traces, checkpoints and exported
policy. A new run never changes an earlier run's files; ``--resume`` continues the
``latest`` run in place, and only ``--clean`` deletes earlier runs.

Beside the runs lie caches that runs with the same settings share: the SFT warm
start's model and a GGUF file's conversion, each in a directory named after a hash
of what made it, so that runs with other settings never overwrite it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from channels import ConfigError

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

    def to_resume(self) -> Path:
        """The newest run's directory, which ``--resume`` continues.

        Raises:
            ConfigError: there is no run.
        """
        run = self.latest()
        if run is None:
            raise ConfigError(f"--resume: no run under {self.root} to continue; start one without --resume")
        return run

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
        # A new link under a temporary name replaces the old one atomically: a reader
        # sees the previous run or this one, never no link.
        tmp = self.root / f".{LATEST}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.name, target_is_directory=True)
        os.replace(tmp, self.root / LATEST)
        return path

    def clean(self) -> list[Path]:
        """Delete every run's directory and ``latest`` (the caches stay).

        Returns:
            The deleted directories.
        """
        runs = self.versions()
        (self.root / LATEST).unlink(missing_ok=True)
        for path in runs:
            shutil.rmtree(path)
        return runs


def cache_dir(output_dir: Path, name: str, key: bytes) -> Path:
    """The directory of a cache runs share: ``<output_dir>/<name>-<hash of key>``.

    Args:
        output_dir: the configuration's ``output_dir``.
        name: what the cache holds (``"sft_model"``).
        key: everything that made its content; another key, another directory.
    """
    return output_dir / f"{name}-{hashlib.sha256(key).hexdigest()[:12]}"
