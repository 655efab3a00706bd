"""Checkpoints of a role's training engine, collective over the role's own pool.

The session's default process group spans every worker of every pool, so the
engine's own ``save``/``load``/``export_hf`` (collective over the default group,
written by global rank 0) would wait for pools that are not taking part. These
functions do the same with torch.distributed.checkpoint over the *pool's* group (or
without any group on a 1-rank pool): model, optimizer, step and each rank's RNG
states, loadable into any layout of the same model.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from channels import ConfigError, OneToAll
from workers._register import register
from workers._role import Role, WorkerContext
from workers.engines import TrainingEngine

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt")
"""Files copied from the source model directory into an exported one when present."""


def _group_args(ctx: WorkerContext) -> dict[str, object]:
    if ctx.world_size == 1:
        return {"no_dist": True}
    return {"process_group": ctx.process_group}


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Without a group DCP warns that it assumes a single process: exactly the intent
    # on a 1-rank pool.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_file(path: str | os.PathLike[str], ctx: WorkerContext) -> Path:
    return Path(path) / "rng" / f"{ctx.role}_rank{ctx.rank}.pt"


def save_training_state(engine: TrainingEngine, path: str | os.PathLike[str], *,
                        ctx: WorkerContext, generators: Mapping[str, torch.Generator]) -> None:
    """Write the engine's model, optimizer and step, and this rank's RNG states.

    Collective over the role's pool: every rank calls it with the same ``path``.

    Args:
        engine: the role's engine.
        path: checkpoint directory (created; shared by the pool's ranks).
        ctx: the role's context (its pool group and rank).
        generators: the role's own generators, saved with the global RNG states.
    """
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    state = {"model": model_state, "optim": optim_state,
             "engine": {"step": torch.tensor(engine.step, dtype=torch.int64)}}
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=os.fspath(path), **_group_args(ctx))  # type: ignore[arg-type]
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "generators": {name: g.get_state() for name, g in generators.items()}}
    target = _rng_file(path, ctx)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rng, target)


def load_training_state(engine: TrainingEngine, path: str | os.PathLike[str], *,
                        ctx: WorkerContext, generators: Mapping[str, torch.Generator]) -> None:
    """Restore what :func:`save_training_state` wrote, in place.

    Collective over the role's pool. RNG states are restored when the checkpoint has
    this rank's (same pool size).

    Args:
        engine: the role's engine (any layout of the same model).
        path: checkpoint directory.
        ctx: the role's context.
        generators: the role's own generators, restored in place.

    Raises:
        ConfigError: ``path`` holds no checkpoint.
    """
    if not (Path(path) / ".metadata").exists():
        raise ConfigError(
            f"load_checkpoint: no checkpoint at {os.fspath(path)!r} (no .metadata); pass a "
            "directory written by save_checkpoint"
        )
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    step = torch.tensor(0, dtype=torch.int64)
    state = {"model": model_state, "optim": optim_state, "engine": {"step": step}}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=os.fspath(path), **_group_args(ctx))  # type: ignore[arg-type]
    set_state_dict(engine.model, engine.optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state)
    # TrainingEngine has no setter for its step (it drives the lr warm-up); see
    # TrainingEngine.load, which sets the same attribute.
    engine._step = int(step)
    rng_file = _rng_file(path, ctx)
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        for name, g in generators.items():
            if name in rng["generators"]:
                g.set_state(rng["generators"][name])


def full_weights(engine: TrainingEngine) -> dict[str, Tensor]:
    """Every weight of the engine's model, unsharded, on the CPU.

    Collective over the engine's mesh (sharded tensors are gathered).

    Returns:
        Name (the model's own, i.e. Hugging Face names) to full tensor.
    """
    return {name: t.detach().cpu() for name, t in engine.named_full_weights()}


def export_model(engine: TrainingEngine, path: str | os.PathLike[str], *, ctx: WorkerContext,
                 source_dir: str, save: Callable[[dict[str, Tensor], Path], None]) -> None:
    """Write the engine's model as a Hugging Face directory; pool rank 0 writes it.

    Collective over the engine's mesh. Tokenizer and generation files of
    ``source_dir`` are copied beside the weights, so the directory serves as a model
    directory for every role.

    Args:
        engine: the role's engine.
        path: output directory.
        ctx: the role's context.
        source_dir: the directory the model was loaded from.
        save: writes the full state dict into the directory (on rank 0 only).
    """
    state = full_weights(engine)
    if ctx.rank != 0:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save(state, out)
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file() and not (out / name).exists():
            shutil.copyfile(src, out / name)


class TrainedRole(Role):
    """A role that trains a model with a :class:`TrainingEngine`: checkpoints and
    export, shared by the actor and the critic.

    Subclasses set ``self.engine``, ``self._shuffle`` (the mini-batch generator) and
    ``self.config.model_dir``, and implement :meth:`_save_export`.
    """

    engine: TrainingEngine
    _shuffle: torch.Generator
    config: Any

    @register(protocol=OneToAll())
    def save_checkpoint(self, path: str) -> None:
        """Save model, optimizer, step and RNG states (DCP; every rank writes its shards).

        Args:
            path: a directory every rank can write.
        """
        save_training_state(self.engine, path, ctx=self.ctx, generators={"shuffle": self._shuffle})

    @register(protocol=OneToAll())
    def load_checkpoint(self, path: str) -> None:
        """Restore a :meth:`save_checkpoint` directory.

        Args:
            path: the checkpoint directory.

        Raises:
            ConfigError: ``path`` holds no checkpoint.
        """
        load_training_state(self.engine, path, ctx=self.ctx, generators={"shuffle": self._shuffle})
        self._after_load()

    @register(protocol=OneToAll())
    def export_hf(self, path: str) -> None:
        """Write the model as a Hugging Face directory (weights gathered, pool rank 0
        writes); tokenizer and generation files of ``config.model_dir`` are copied
        beside it, so the directory can be any role's ``model_dir``.

        Args:
            path: output directory.
        """
        export_model(self.engine, path, ctx=self.ctx, source_dir=self.config.model_dir, save=self._save_export)

    def _after_load(self) -> None:
        """Hook run after a checkpoint is loaded (the actor syncs its rollout engine)."""

    def _save_export(self, state: dict[str, Tensor], out: Path) -> None:
        raise NotImplementedError
