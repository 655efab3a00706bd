"""RNG states, write errors and weight export of a training engine, collective over a
named process group.

One implementation serves every caller, each naming the group the call is collective
over: :class:`TrainingEngine` (the default group when it has a mesh), the roles (their
pool's group: the session's default group spans every pool, whose other workers are
not taking part) and :class:`MegatronTrainingEngine` (its RNG states). ``None`` means
no distribution: one process holding the whole model.

- :mod:`workers.engines._dcp` saves and loads checkpoints with
  torch.distributed.checkpoint, with each rank's RNG states (:func:`save_rng`,
  :func:`load_rng`) beside them; it is imported on first use, so that a process
  that never checkpoints does not import DCP.
- :func:`export_hf` gathers full tensors with :func:`named_full_weights`; one writer
  rank writes an ordinary Hugging Face directory.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers._dtensor import is_dtensor
from workers.engines._errors import EngineConfigError

ExportWriter = Callable[[dict[str, Tensor], Path], None]
"""Writes a gathered full state dict (names to CPU tensors) into an export directory."""

Generators = Mapping[str, torch.Generator]
"""A caller's own random generators by name, checkpointed with the global RNG states."""


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (0 without a group).

    Args:
        group: a process group this process belongs to, or None.

    Returns:
        The rank.
    """
    return 0 if group is None else dist.get_rank(group)


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How a Rust library (safetensors) names the errno of a failed write."""


def os_error_behind(error: BaseException) -> OSError | None:
    """The ``OSError`` (a full disk, a permission) that made ``error``, if one did.

    Libraries report a failed write each in its own way: torch.save as a
    ``RuntimeError`` ("unexpected pos ...") whose context is the ``OSError``, DCP as
    a ``CheckpointException`` holding each rank's error, safetensors with only the
    errno in its message ("os error 28").

    Args:
        error: what a save or an export raised.

    Returns:
        ``error`` itself when it is one, the first ``OSError`` among its causes,
        contexts and DCP failures, one made from an errno in a message, or None.
    """
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += _dcp_failures(e)
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        if (found := _RUST_OS_ERROR.search(str(e))) is not None:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
    return None


def _dcp_failures(error: BaseException) -> list[BaseException]:
    """The ranks' errors when ``error`` is DCP's ``CheckpointException`` (none can
    be while DCP is not imported), else none."""
    dcp = sys.modules.get("torch.distributed.checkpoint")
    if dcp is None or not isinstance(error, dcp.CheckpointException):
        return []
    return [failure for failure, _ in error.failures.values()]


@contextlib.contextmanager
def os_errors() -> Iterator[None]:
    """A failed write raises the ``OSError`` behind it (see :func:`os_error_behind`),
    with errno, wherever the library hid it."""
    try:
        yield
    except Exception as e:
        cause = os_error_behind(e)
        if cause is None or cause is e:
            raise
        raise cause from e


def _rng_file(path: str | os.PathLike[str], group: dist.ProcessGroup | None) -> Path:
    return Path(path) / "rng" / f"rank{group_rank(group)}.pt"


def save_rng(
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None,
    generators: Generators | None = None,
) -> None:
    """Write this rank's RNG states under ``path/rng/`` (one file per rank of ``group``).

    Args:
        path: checkpoint directory (created).
        group: the group the checkpoint is collective over; names the file.
        generators: the caller's own generators, saved by name beside the global states.
    """
    state: dict[str, object] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "generators": {name: g.get_state() for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    target = _rng_file(path, group)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a Python file: a failed write raises its OSError (torch.save writing to
    # a path raises a RuntimeError without the errno).
    with target.open("wb") as file:
        torch.save(state, file)


def load_rng(
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None,
    generators: Generators | None = None,
) -> None:
    """Restore what :func:`save_rng` wrote for this rank, if the checkpoint has it.

    A checkpoint written by a group of another size may lack this rank's file; the
    RNG states are then left as they are (weights and optimizer still load).

    Args:
        path: checkpoint directory.
        group: the group the load is collective over.
        generators: the caller's generators, restored in place when saved.
    """
    file = _rng_file(path, group)
    if not file.is_file():
        return
    state = torch.load(file, weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("generators", {})
    for name, generator in (generators or {}).items():
        if name in saved:
            generator.set_state(saved[name])


def _save_pretrained(model: nn.Module) -> ExportWriter:
    save_pretrained = getattr(model, "save_pretrained", None)
    if not callable(save_pretrained):
        raise EngineConfigError(
            f"export_hf needs a Hugging Face PreTrainedModel, got {type(model).__name__}; "
            "pass save= to write another model, or use save() for a checkpoint"
        )

    def write(state: dict[str, Tensor], out: Path) -> None:
        # Imported here: importing the engines does not load transformers.
        from workers.models import save_pretrained_here

        # Not model.save_pretrained: transformers writes only on the default group's
        # rank 0, and the writer is rank 0 of the model's own group.
        save_pretrained_here(model, out, state_dict=state)  # type: ignore[arg-type]

    return write


def export_hf(
    path: str | os.PathLike[str],
    model: nn.Module,
    *,
    group: dist.ProcessGroup | None,
    writer: int = 0,
    save: ExportWriter | None = None,
    weights: Iterable[tuple[str, Tensor]] | None = None,
) -> None:
    """Write the model's full weights as a model directory; rank ``writer`` writes it.

    Collective over ``group``: every rank gathers the full tensors (on the CPU only on
    the writer), and every rank returns once the directory is complete.

    Args:
        path: output directory (created).
        model: a (possibly parallelised) model.
        group: the group spanning the model's ranks; None for one process.
        writer: the rank in ``group`` that writes.
        save: writes the full state dict into the directory; default the model's
            ``save_pretrained(path, state_dict=...)``.
        weights: the full weights to write (default :func:`named_full_weights` of
            ``model``; pipeline stages pass the whole model's).

    Raises:
        EngineConfigError: without ``save``, if the model has no ``save_pretrained``.
    """
    write = save if save is not None else _save_pretrained(model)
    is_writer = group_rank(group) == writer
    state: dict[str, Tensor] = {}
    for name, tensor in named_full_weights(model) if weights is None else weights:
        if is_writer:
            state[name] = tensor.cpu()
    if is_writer:
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        with os_errors():
            write(state, out)
    if group is not None:
        dist.barrier(group=group)


def named_full_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, full tensor)`` for every entry of the model's state dict.

    Names are the model's own (Hugging Face names for HF models); sharded DTensors are
    gathered, so this is collective: every rank must exhaust the iterator in step.
    Tied weights are gathered once and yielded under each of their names.

    Args:
        model: the (possibly parallelised) model.

    Yields:
        ``(name, tensor)`` with a full, detached tensor on the model's device.
    """
    state = model.state_dict()
    shared = {key for key, count in Counter(id(t) for t in state.values()).items() if count > 1}
    gathered: dict[int, Tensor] = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key in gathered:
            yield name, gathered[key]
            continue
        full = tensor.full_tensor() if is_dtensor(tensor) else tensor
        full = full.detach()
        if key in shared:
            gathered[key] = full
        yield name, full
