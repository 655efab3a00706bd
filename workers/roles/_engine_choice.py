"""Which training engine a model role (actor, critic, reference) builds: the
PyTorch-native :class:`~workers.engines.TrainingEngine` (FSDP2/DTensor over the
role's mesh) or :class:`~workers.engines.MegatronTrainingEngine` (Megatron-core
layers over the same mesh's groups, GPU only).

Both take the pool's own DeviceMesh and process group, never the session's default
group, which spans every pool (see :mod:`workers.engines._megatron` for why the
Megatron engine does not initialise Megatron's global parallel state). The layouts
the Megatron engine cannot serve are refused here, on every rank alike, before any
collective: pipeline stages (``p > 1``) and a generation layout (the hybrid engine
reshards the native engine's DTensor shards).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from channels import ConfigError
from workers.engines import (
    MegatronTrainingEngine,
    ModelHead,
    TrainingConfig,
    TrainingEngine,
    megatron_available,
)
from workers.host import WorkerContext
from workers.objectives import LossFn
from workers.roles._training import engine_group, engine_mesh

EngineName = Literal["native", "megatron"]
"""The training engines a role can build."""

ENGINES: tuple[EngineName, ...] = ("native", "megatron")


def check_engine(owner: str, engine: object) -> None:
    """Raise :class:`ConfigError` naming ``{owner}.engine`` unless it is one of :data:`ENGINES`."""
    if engine not in ENGINES:
        raise ConfigError(f"{owner}.engine must be one of {list(ENGINES)}, got {engine!r}")


def megatron_refusal(ctx: WorkerContext) -> str | None:
    """Why the Megatron engine cannot serve this role here, or None when it can."""
    layout = ctx.layout
    if layout.p != 1:
        return (f"layout {layout} has p = {layout.p} pipeline stages, which the Megatron engine does not "
                "drive yet; use p = 1 and split the model with t")
    if layout.gen is not None:
        return (f"a generation layout ({layout}) needs engine='native': the hybrid engine reshards the native "
                "engine's DTensor shards (resharding Megatron's is planned)")
    return megatron_available()


def build_engine(ctx: WorkerContext, model: nn.Module, *, engine: EngineName, config: TrainingConfig,
                 head: ModelHead, loss: LossFn | None = None, replicate: bool = False,
                 trainable: bool = True) -> TrainingEngine:
    """The role's training engine over its pool's mesh and group.

    Args:
        ctx: where the role runs (its layout, mesh and pool group).
        model: the role's model, on ``ctx.device``; the native engine shards it in
            place, the Megatron engine copies its weights.
        engine: ``"native"`` or ``"megatron"``.
        config: optimizer, schedule and micro-batching.
        head: what the engine computes from the model's outputs.
        loss: the default objective of ``train_step``.
        replicate: every rank keeps a whole model and runs alone (no mesh, no group).
        trainable: False for a role that only infers (the reference): the native
            engine then builds no optimizer and, in bf16, stores the weights in
            bf16; the Megatron engine keeps its optimizer (built lazily: no state
            until a step).

    Returns:
        The engine (a :class:`MegatronTrainingEngine` is a :class:`TrainingEngine`).

    Raises:
        ConfigError: an unknown ``engine``, or a Megatron engine this layout, this
            environment (megatron-core >= 0.16, CUDA) or this model cannot have; the
            message names the role and says the fix.
    """
    check_engine(ctx.role, engine)
    mesh, group = engine_mesh(ctx, replicate=replicate), engine_group(ctx, replicate=replicate)
    if engine == "native":
        return TrainingEngine(model, config=config, mesh=mesh, head=head, loss=loss, process_group=group,
                              trainable=trainable)
    problem = megatron_refusal(ctx)
    if problem is not None:
        raise ConfigError(f"{ctx.role} (engine='megatron'): {problem}; or set engine='native'")
    return MegatronTrainingEngine(model, config=config, mesh=mesh, head=head, loss=loss, process_group=group)
