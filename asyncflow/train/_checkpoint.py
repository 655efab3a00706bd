"""Checkpoint directories of a run: ``checkpoints/step_000010/`` with one folder per
trained role (:func:`save_roles`, :func:`load_roles`) and the driver's
``state.json``; ``latest`` names the newest complete one.

A checkpoint is written into a staging directory (``.tmp_step_000010``), finished
by its ``state.json`` and only then renamed into place; ``latest`` is replaced
atomically. A crash or a full disk during a save thus never costs a run its
previous checkpoint, and never leaves a partial one that ``--resume`` would take: a
failed write removes its staging directory and ends the run with a
:class:`CheckpointError` naming the directory and the errno.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncflow.runtime import RemoteStageError, Roles
from channels import AsyncflowError, ConfigError

TRAINED_ROLES = ("actor", "critic", "cost_critic")
"""The roles a checkpoint keeps: those that train (weights and optimizer state)."""

STATE_FILE = "state.json"
"""The driver's state of a checkpoint, written last: a directory with it is complete."""


class CheckpointError(AsyncflowError):
    """Writing a checkpoint or exporting the policy failed with an ``OSError`` (a
    full disk, a permission), on the driver or in a role's worker. The message names
    what was written, the directory and the errno; the checkpoint before it stays
    complete, and the failed one's staging directory is removed."""


async def save_roles(roles: Roles, into: Path, *, policy: bool = False) -> None:
    """Each trained role's checkpoint into ``into/<role>`` (its ranks write their
    parts), and with ``policy`` the actor's Hugging Face export into ``into/policy``."""
    for role in TRAINED_ROLES:
        if role in roles:
            await roles[role].save_checkpoint(for_workers(into / role))
    if policy:
        await roles.actor.export_hf(for_workers(into / "policy"))


async def load_roles(roles: Roles, checkpoint: Path) -> None:
    """Each trained role's state from ``checkpoint`` (:func:`save_roles`'s).

    Raises:
        ConfigError: the checkpoint lacks one of the run's trained roles (the
            placement changed).
    """
    for role in TRAINED_ROLES:
        if role in roles:
            if not (checkpoint / role).exists():
                raise ConfigError(f"--resume: checkpoint {checkpoint} has no {role} (placement changed?)")
            await roles[role].load_checkpoint(for_workers(checkpoint / role))


def for_workers(path: str | os.PathLike[str]) -> str:
    """``path`` as the workers are told it: absolute, since a worker's working
    directory is where its Ray node started (a cluster's, or a Ray instance started
    before this run), not necessarily the driver's."""
    return os.path.abspath(path)


@contextlib.contextmanager
def staged(what: str, tmp: Path, *, then: Callable[[], str] | None = None) -> Iterator[Path]:
    """Write ``what`` into the staging directory ``tmp``, created empty (one a crash
    left is replaced); on any failure of the body ``tmp`` is removed.

    Args:
        what: what the body writes, for the error (``"writing checkpoint step 10"``).
        tmp: the staging directory.
        then: what the error's message ends with, asked once the write failed
            (where the run can continue from).

    Yields:
        ``tmp``.

    Raises:
        CheckpointError: making ``tmp`` or the body raised an ``OSError``, here or
            in a role's worker (a :class:`~asyncflow.RemoteStageError` carrying it).
    """
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error(e)
        if cause is None:
            raise
        hint = f"; {then()}" if then is not None else ""
        raise CheckpointError(f"{what} to {tmp} failed: {cause}{hint}") from e


def _os_error(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error``: itself, or what a role's method raised."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, RemoteStageError) and isinstance(error.error, OSError):
        return error.error
    return None


class CheckpointDir:
    """The checkpoints of one run.

    Args:
        root: ``<run directory>/checkpoints`` (created by the first save).
        keep: how many complete checkpoints to keep (oldest removed first).
    """

    def __init__(self, root: Path, *, keep: int = 2) -> None:
        self.root = root
        self.keep = keep

    def staging(self, step: int) -> Path:
        """The staging directory of the checkpoint of ``step`` (see :func:`staged`)."""
        return self.root / f".tmp_step_{step:06d}"

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Finish the checkpoint staged in ``tmp``: write ``state.json`` (last), move it
        into place, point ``latest`` at it and prune old ones.

        Raises:
            OSError: a write failed (``tmp`` then is not a complete checkpoint).
        """
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2), encoding="utf-8")
        final = self.root / f"step_{step:06d}"
        if final.exists():  # the same step saved again: set aside until the new one is in place
            aside = self.root / f".old_{final.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
        pointer = self.root / ".latest.tmp"
        try:
            pointer.write_text(final.name, encoding="utf-8")
            os.replace(pointer, self.root / "latest")
        finally:
            pointer.unlink(missing_ok=True)
        for old in self.complete()[: -self.keep]:
            (old / STATE_FILE).unlink()  # incomplete from now on, should the removal stop half-way
            shutil.rmtree(old, ignore_errors=True)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.glob("step_*") if (p / STATE_FILE).exists())

    def latest(self) -> Path:
        """The newest complete checkpoint.

        Raises:
            ConfigError: there is none (nothing to resume from).
        """
        done = self.complete()
        if not done:
            raise ConfigError(f"--resume: no complete checkpoint under {self.root}; "
                              "start a new run without --resume")
        return done[-1]

    @staticmethod
    def state(path: Path) -> dict[str, Any]:
        """The driver state saved with checkpoint ``path``."""
        return dict(json.loads((path / STATE_FILE).read_text(encoding="utf-8")))
