"""The actor's weights in two layouts: trained in ``p-t-d``, generating in the
placement's generation layout (``Layout.gen``), moved by the hybrid engine. With
pipeline stages (``p > 1``) each rank trains its stage's parameters and a
generation replica gathers every stage's.

Before a generation, :meth:`HybridWeights.to_generation` gathers this rank's
generation shards (inside micro-DP groups with the ``hybridflow`` grouping, each
training shard reused in place) and binds them as the rollout model's weights,
tensor parallel over the generation TP group when ``tg > 1``. Before the training
engine runs again, :meth:`HybridWeights.to_training` releases them and gives the
training shards their own memory back. Nothing is copied into a second full
model: between generations the rollout model holds no weights at all.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from channels import ConfigError
from hybrid_engine import ParamSpec, Resharder, TransitionStats, make_plan
from workers._dtensor import is_dtensor
from workers.engines import apply_tensor_parallel
from workers.host import WorkerContext, mesh_from_groups, new_reconnectable_group
from workers.rollout import NativeRolloutEngine

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The groups' timeout on a pool without its own group (one rank: no communication)."""


def training_shards(model: nn.Module, *, stage: int = 0) -> tuple[list[ParamSpec], dict[str, Tensor]]:
    """The specs of ``model``'s parameters and this rank's training shards.

    A tensor-parallel parameter (a DTensor sharded on a 1-D mesh) is split along
    its ``Shard`` dimension; any other parameter is whole. With pipeline stages the
    model holds its ``stage``'s parameters only.

    Raises:
        ConfigError: a parameter is also sharded over data-parallel ranks (FSDP).
    """
    specs, shards = [], {}
    for name, param in model.named_parameters():
        dim = None
        if is_dtensor(param):
            from torch.distributed.tensor import (  # imported already: param is a DTensor
                Replicate,
                Shard,
            )

            if param.device_mesh.mesh_dim_names != ("tp",):
                raise ConfigError(
                    f"the hybrid engine reshards tensor-parallel shards, but {name!r} is also sharded over the "
                    "data-parallel ranks (FSDP); use TrainingConfig(data_parallel='replicate') with a generation "
                    "layout")
            (placement,) = param.placements
            if isinstance(placement, Shard):
                dim = placement.dim
            elif not isinstance(placement, Replicate):
                raise ConfigError(f"parameter {name!r} has placement {placement}, which the hybrid engine cannot split")
            local: Tensor = param._local_tensor  # the shard itself, not to_local()'s view
        else:
            local = param.detach()
        specs.append(ParamSpec(name=name, shape=tuple(param.shape), dtype=param.dtype, dim=dim, stage=stage))
        shards[name] = local
    return specs, shards


def every_stage(specs: list[ParamSpec], ctx: WorkerContext) -> list[ParamSpec]:
    """The specs of every pipeline stage's parameters, in stage order, from this
    rank's (collective over the pool's ranks: each stage's ranks know their own)."""
    gathered: list[list[ParamSpec] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, specs, group=ctx.process_group)
    out: list[ParamSpec] = []
    for stage in range(ctx.layout.p):
        first = next(r for r in range(ctx.world_size) if ctx.layout.coords(r).pp == stage)
        out.extend(gathered[first] or [])
    return out


class HybridWeights:
    """One actor rank's side of the hybrid engine.

    Collective at construction (it makes the resharding and generation TP groups
    with the pool's other ranks) and in both transitions.

    Args:
        ctx: the actor's context; ``ctx.layout.gen`` is the generation layout.
        model: the training engine's model (tensor parallel over the layout's ``t``).
        rollout: the native rollout engine, whose model is laid out for generation
            here and whose weights are released until the first generation.
        bucket_bytes: the most bytes one resharding gather moves.
    """

    def __init__(self, ctx: WorkerContext, model: nn.Module, rollout: NativeRolloutEngine, *,
                 bucket_bytes: int) -> None:
        layout = ctx.layout
        self.ctx, self.rollout = ctx, rollout
        specs, shards = training_shards(model, stage=layout.coords(ctx.rank).pp)
        if layout.p > 1:
            specs = every_stage(specs, ctx)
        self.plan = make_plan(layout, specs, method=layout.generation.grouping, bucket_bytes=bucket_bytes)
        ranks = ctx.mesh.mesh.flatten().tolist() if ctx.mesh is not None else [ctx.global_rank]
        timeout = getattr(ctx.process_group, "timeout", DEFAULT_TIMEOUT)

        def group(members: tuple[int, ...]):  # type: ignore[no-untyped-def]
            return new_reconnectable_group(tuple(ranks[r] for r in members), timeout)

        self._resharder = Resharder(self.plan, ctx.rank, shards, group)
        self._resharder.connect()
        tg = layout.generation.tg
        if tg > 1:
            mine = next(g for g in layout.gen_groups("tp") if ctx.rank in g)
            grid = torch.tensor([ranks[r] for r in mine])
            mesh = mesh_from_groups(grid, ("tp",), ctx.device.type, timeout)
            apply_tensor_parallel(rollout.model, mesh)
        rollout.release_weights()
        self.generating = False
        self.last: TransitionStats | None = None
        """The figures of the last transition to generation."""

    def to_generation(self) -> TransitionStats | None:
        """Reshard into the generation layout and bind the rollout model's weights
        (no-op when already there). Returns the transition's figures (None: none ran)."""
        if self.generating:
            return None
        weights = self._resharder.to_generation()
        self.rollout.bind_weights(weights.items())
        self.generating = True
        self.last = self._resharder.stats
        if self.last is not None:
            log.debug("reshard to generation: %.3f s, %d bytes sent, peak %d bytes", self.last.seconds,
                      self.last.sent_bytes, self.last.peak_bytes)
        return self.last

    def to_training(self) -> None:
        """Release the rollout model's weights and give the training shards their own
        memory back (local; no-op when not generating)."""
        if not self.generating:
            return
        self.rollout.release_weights()
        self._resharder.to_training()
        self.generating = False
