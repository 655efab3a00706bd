"""Reward functions that make the disk look full to the worker process they run in,
for the tests of a run whose checkpoint or export cannot be written.

On a pool of one process the reward runs in the actor's process, so a reward
function can change what that process does: each of these scores like
:func:`support.digit_share_reward` and, on its first call, makes the next write of
one kind fail with ``OSError(ENOSPC)`` after writing part of its file, as a full
disk does. The write after it goes through (the disk was freed): a later session
may reuse the process (``asyncflow.runtime._idle``).
Only the writes into :data:`FAILING_CHECKPOINT` (or the final export's staging
directory) fail, so the checkpoints before it are written as usual.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from support import digit_share_reward

FAILING_CHECKPOINT = ".tmp_step_000002"
"""The staging directory of the checkpoint whose writes fail (step 2's)."""

FAILING_EXPORT = ".tmp_policy"
"""The staging directory of the run's final export."""

_installed: set[str] = set()


def enospc(path: Path) -> OSError:
    """The error a write to ``path`` on a full disk raises."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def full_disk_for_shards(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """The actor's shards of step 2's checkpoint (torch.distributed.checkpoint's
    writer) fail."""
    if "shards" not in _installed:
        _installed.add("shards")
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def failing(self: Any, plan: Any, planner: Any) -> Any:
            if FAILING_CHECKPOINT in str(self.path):
                (Path(self.path) / "__0_0.distcp").write_bytes(b"cut short")
                FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
                _installed.discard("shards")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() raises it: no file name
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = failing  # type: ignore[method-assign]
    return digit_share_reward(prompts, responses, answers)


def full_disk_for_export(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """The actor's write of the final export (``policy``) fails."""
    if "export" not in _installed:
        _installed.add("export")
        from workers.roles import _actor

        save = _actor.save_pretrained_here

        def failing(model: Any, directory: Any, *, state_dict: Any = None) -> Path:
            if Path(directory).name == FAILING_EXPORT:
                weights = Path(directory) / "model.safetensors"
                weights.write_bytes(b"cut short")
                _actor.save_pretrained_here = save
                _installed.discard("export")
                raise enospc(weights)
            return save(model, directory, state_dict=state_dict)

        _actor.save_pretrained_here = failing
    return digit_share_reward(prompts, responses, answers)


def state_json_on_a_full_disk(write_text: Any) -> Any:
    """``Path.write_text`` whose write of step 2's ``state.json`` (the driver's, last
    of a checkpoint) fails half-way; ``write_text`` is the real one."""

    def write(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if self.name == "state.json" and self.parent.name == FAILING_CHECKPOINT:
            write_text(self, data[: len(data) // 2], *args, **kwargs)
            raise enospc(self)
        return int(write_text(self, data, *args, **kwargs))

    return write
