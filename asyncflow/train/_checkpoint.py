"""Checkpoint directories of a run: ``checkpoints/step_000010/`` with one folder per
role and the driver's ``state.json``; ``latest`` names the newest complete one.

A checkpoint is written into a temporary directory and renamed into place only once
complete, and ``latest`` is replaced atomically, so a crash during a save never
leaves a run without its previous checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from channels import ConfigError


class CheckpointDir:
    """The checkpoints of one run.

    Args:
        root: ``<output_dir>/checkpoints``.
        keep: how many complete checkpoints to keep (oldest removed first).
    """

    def __init__(self, root: Path, *, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        root.mkdir(parents=True, exist_ok=True)

    def staging(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of ``step``."""
        tmp = self.root / f".tmp_step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int, state: dict[str, Any]) -> Path:
        """Finish the checkpoint staged in ``tmp``: write ``state.json``, move it into
        place, point ``latest`` at it and prune old ones."""
        (tmp / "state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")
        final = self.root / f"step_{step:06d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = self.root / ".latest.tmp"
        pointer.write_text(final.name, encoding="utf-8")
        os.replace(pointer, self.root / "latest")
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted(p for p in self.root.glob("step_*") if (p / "state.json").exists())

    def latest(self) -> Path:
        """The newest complete checkpoint.

        Raises:
            ConfigError: there is none (nothing to resume from).
        """
        pointer = self.root / "latest"
        if pointer.exists():
            path = self.root / pointer.read_text(encoding="utf-8").strip()
            if (path / "state.json").exists():
                return path
        done = self.complete()
        if not done:
            raise ConfigError(f"--resume: no complete checkpoint under {self.root}")
        return done[-1]

    @staticmethod
    def state(path: Path) -> dict[str, Any]:
        """The driver state saved with checkpoint ``path``."""
        return dict(json.loads((path / "state.json").read_text(encoding="utf-8")))
