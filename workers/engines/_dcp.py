"""Checkpoints of a training engine with torch.distributed.checkpoint (DCP),
collective over a named process group (``None``: one process holding the whole
model). Each rank writes its own shards and a checkpoint loads into any layout of
the same model; the optimizer step and each rank's RNG states (torch, Python, CUDA
and any named generators) travel with it, so a resumed run continues exactly.

The engines import this module when they first save or load, so that a process
that never checkpoints does not import DCP.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from workers.engines._checkpoint import Generators, load_rng, os_error_behind, os_errors, save_rng
from workers.engines._errors import EngineConfigError


class _FileSystemWriter(dcp.FileSystemWriter):
    """DCP's file writer, whose failed write raises the ``OSError`` behind it: DCP
    sends each rank's error to every rank pickled, which would drop the ``OSError``
    that torch.save keeps only as the context of its ``RuntimeError``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with os_errors():
            return super().write_data(plan, planner)


@contextlib.contextmanager
def _dcp_call() -> Iterator[None]:
    """Around a ``dcp.save`` or ``dcp.load``: the error of the first rank that failed
    (the ``OSError`` behind it, when there is one) instead of DCP's
    ``CheckpointException``, a ``BaseException`` that callers catching
    ``Exception`` (a worker's call) would let through."""
    # Without a group DCP warns that it assumes a single process, which is exactly
    # the intent of a call with group=None.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except dcp.CheckpointException as e:
            error = os_error_behind(e) or e.failures[min(e.failures)][0]
            if not isinstance(error, Exception):
                raise
            raise error from e


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    # DCP's state-dict helpers take any number of optimizers; none for inference only.
    return [] if optimizer is None else [optimizer]


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer's state saved by parameter name (``optim.param_groups.<name>.lr``,
...): ranks that hold different parameters (pipeline stages) each write their own
groups' settings, where one nested ``param_groups`` list would be kept from one
rank only."""


def _flat(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint at ``path`` holds the optimizer state by parameter name
    (those written before it did hold one nested list)."""
    keys = dcp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    return not any(re.fullmatch(r"optim\.param_groups\.\d+\.lr", key) for key in keys)


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    group: dist.ProcessGroup | None,
    generators: Generators | None = None,
) -> None:
    """Write model, optimizer, step and this rank's RNG states under ``path``.

    Collective over ``group``: every rank calls it with the same ``path``.

    Args:
        path: checkpoint directory (created; shared by the group's ranks).
        model: the (parallelised) model.
        optimizer: its optimizer; None for an inference-only model (no optimizer state).
        step: optimizer steps taken so far.
        group: the group spanning the model's ranks; None for one process.
        generators: the caller's own generators, saved with the RNG states.
    """
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer), options=_FLAT)
    state = {
        "model": model_state,
        "optim": optim_state,
        "engine": {"step": torch.tensor(step, dtype=torch.int64)},
    }
    with _dcp_call():
        dcp.save(
            state,
            storage_writer=_FileSystemWriter(path),
            process_group=group,
            no_dist=group is None,
        )
    save_rng(path, group=group, generators=generators)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
    generators: Generators | None = None,
) -> int:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizer`` in place.

    Collective over ``group``, like :func:`save_checkpoint`; the layout may differ from
    the one that saved. RNG states are restored when the checkpoint has this rank's.

    Args:
        path: checkpoint directory.
        model: the model, already parallelised.
        optimizer: its optimizer, or None (the checkpoint's optimizer state is then
            not read).
        group: the group spanning the model's ranks; None for one process.
        generators: the caller's generators, restored in place.

    Returns:
        The step stored in the checkpoint.

    Raises:
        EngineConfigError: if ``path`` is not a checkpoint directory.
    """
    if not (Path(path) / ".metadata").exists():
        raise EngineConfigError(
            f"no checkpoint at {os.fspath(path)!r} (no .metadata file); pass a directory "
            "written by save / save_checkpoint"
        )
    optimizers = _optimizers(optimizer)
    options = _FLAT if _flat(path) else None
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    step = torch.tensor(0, dtype=torch.int64)
    state = {"model": model_state, "optim": optim_state, "engine": {"step": step}}
    # dcp.load fills the tensors of ``state`` in place (``step`` included).
    with _dcp_call():
        dcp.load(
            state, checkpoint_id=os.fspath(path), process_group=group, no_dist=group is None
        )
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state, options=options)
    load_rng(path, group=group, generators=generators)
    return int(step)
