"""A checkpoint or an export that cannot be written raises the ``OSError`` behind it,
with its errno, however the library writing it reported the failure (torch.save's
``RuntimeError``, DCP's ``CheckpointException``, safetensors' message), so that the
run can say which errno ended it."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from workers.engines._checkpoint import export_hf, os_error_behind
from workers.engines._dcp import save_checkpoint

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _with_context(error: BaseException, context: BaseException) -> BaseException:
    """``error`` as raised while handling ``context``."""
    error.__context__ = context
    return error


@pytest.mark.parametrize("how", ["itself", "torch.save", "dcp", "safetensors"])
def test_the_os_error_behind_a_failed_write_is_found(how: str) -> None:
    error = {
        "itself": ENOSPC,
        "torch.save": _with_context(RuntimeError("unexpected pos 704 vs 598"), ENOSPC),
        "dcp": dcp.CheckpointException("save", {1: (_with_context(RuntimeError("unexpected pos"), ENOSPC),
                                                    None)}),  # type: ignore[dict-item]
        "safetensors": RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
    }[how]
    found = os_error_behind(error)
    assert found is not None and found.errno == errno.ENOSPC and "No space left on device" in str(found)


def test_other_errors_have_none_behind_them() -> None:
    assert os_error_behind(_with_context(ValueError("bad shape"), KeyError("x"))) is None


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (skipped where this process may not mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def test_a_checkpoint_and_an_export_on_a_full_disk_raise_enospc(full_disk: Path) -> None:
    model = nn.Linear(300, 300)  # 360 KB of weights, 1 MB with the optimizer's state
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(OSError) as saved:
        save_checkpoint(full_disk / "checkpoint", model=model, optimizer=optimizer, step=1, group=None)
    assert saved.value.errno == errno.ENOSPC

    def write(state: dict[str, torch.Tensor], out: Path) -> None:
        save_file(state, str(out / "model.safetensors"))

    with pytest.raises(OSError) as exported:
        export_hf(full_disk / "export", model, group=None, save=write)
    assert exported.value.errno == errno.ENOSPC
