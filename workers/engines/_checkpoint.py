"""Checkpoints and weight export for the training engine.

``save``/``load`` use torch.distributed.checkpoint (each rank writes its own shards,
and a checkpoint loads into any layout); ``export_hf`` writes an ordinary Hugging Face
directory from the gathered full state dict; ``named_full_weights`` streams full
tensors by their Hugging Face names for weight sync into rollout engines.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from workers.engines._objectives import EngineConfigError


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    # Without a process group DCP warns that it assumes a single process, which is
    # exactly the intent of an engine built without a mesh.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_path(path: str | os.PathLike[str]) -> Path:
    return Path(path) / "rng" / f"rank{_rank()}.pt"


def _rng_state() -> dict[str, object]:
    state: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(state["torch"])  # type: ignore[arg-type]
    random.setstate(state["python"])  # type: ignore[arg-type]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]


def save_checkpoint(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Write model, optimizer, step and this rank's RNG state under ``path``.

    Collective: every rank of the model's mesh calls it with the same ``path``.

    Args:
        path: checkpoint directory (created; must be shared by the ranks).
        model: the (parallelised) model.
        optimizer: its optimizer.
        step: optimizer steps taken so far.
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {
        "model": model_state,
        "optim": optim_state,
        "engine": {"step": torch.tensor(step, dtype=torch.int64)},
    }
    with _single_process_ok():
        dcp.save(state, checkpoint_id=os.fspath(path), no_dist=not _distributed())
    rng_file = _rng_path(path)
    rng_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), rng_file)


def load_checkpoint(
    path: str | os.PathLike[str], *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load what :func:`save_checkpoint` wrote into ``model`` and ``optimizer`` in place.

    Collective, like :func:`save_checkpoint`. The RNG state of this rank is restored
    when the checkpoint has one for it (same world size).

    Args:
        path: checkpoint directory.
        model: the model, already parallelised.
        optimizer: its optimizer.

    Returns:
        The step stored in the checkpoint.

    Raises:
        EngineConfigError: if ``path`` is not a checkpoint directory.
    """
    if not (Path(path) / ".metadata").exists():
        raise EngineConfigError(
            f"no checkpoint at {os.fspath(path)!r} (no .metadata file); pass a directory "
            "written by TrainingEngine.save"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    step = torch.tensor(0, dtype=torch.int64)
    state = {"model": model_state, "optim": optim_state, "engine": {"step": step}}
    # dcp.load fills the tensors of ``state`` in place (``step`` included).
    with _single_process_ok():
        dcp.load(state, checkpoint_id=os.fspath(path), no_dist=not _distributed())
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    rng_file = _rng_path(path)
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(step)


def export_hf(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Write an ordinary Hugging Face model directory (config and safetensors weights).

    Collective: the full state dict is gathered to rank 0 (on the CPU), which writes it.

    Args:
        path: output directory.
        model: a (possibly parallelised) Hugging Face ``PreTrainedModel``.

    Raises:
        EngineConfigError: if the model has no ``save_pretrained``.
    """
    if not hasattr(model, "save_pretrained"):
        raise EngineConfigError(
            f"export_hf needs a Hugging Face PreTrainedModel, got {type(model).__name__}; "
            "use save() for other modules"
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state = get_model_state_dict(model, options=options)
    if _rank() == 0:
        save_pretrained = model.save_pretrained
        assert callable(save_pretrained)
        save_pretrained(os.fspath(path), state_dict=full_state)
    if _distributed():
        dist.barrier()


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
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach()
        if key in shared:
            gathered[key] = full
        yield name, full
