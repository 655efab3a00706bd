"""Shared setup of the rollout-role tests on real Ray workers: a tensor-parallel
actor (t = 2) on its own pool beside a rollout role on another, the model they
share, a transform that moves the weights, and one update followed by a planned
bucketed weight sync."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import ray
import torch
from roles_testlib import prompt_columns

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from asyncflow.algos import WeightSync
from channels import Layout
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig
from workers.roles import ActorConfig, ActorWorker, RolloutWorker, RolloutWorkerConfig
from workers.rollout import SamplingParams

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers run its transform

MODEL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=32, num_hidden_layers=1)
"""Two heads: tensor parallel over 2 ranks splits them."""
POLICY = ResourcePool(name="policy", devices=2)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@af.transform(reads=("response_mask",), writes=("advantages",))
def alternating_advantages(batch):
    """+1 / -1 by row: enough to move the weights."""
    mask = batch["response_mask"].float()
    return {"advantages": (1.0 - 2.0 * (torch.arange(mask.shape[0]) % 2).float())[:, None] * mask}


@contextlib.contextmanager
def actor_and_rollout(loop_thread: Any, model_dir: str, *, gen: ResourcePool,
                      rollout_layout: Layout | None = None) -> Iterator[tuple[af.Session, af.Roles]]:
    """A session with ``actor`` (t = 2 on :data:`POLICY`) and ``rollout`` (on
    ``gen``, laid out as ``rollout_layout``) on the Ray instance running (the
    caller's ``shared_ray``), closed on exit."""
    session = af.Session()

    async def start() -> af.Roles:
        await session.__aenter__()
        return await session.spawn({
            "actor": RoleSpec(cls=ActorWorker, pool=POLICY, layout=Layout(t=2), config=ActorConfig(
                model_dir=model_dir, training=TrainingConfig(lr=1e-2),
                sampling=SamplingParams(max_new_tokens=6, temperature=1.0))),
            "rollout": RoleSpec(cls=RolloutWorker, pool=gen, layout=rollout_layout,
                                config=RolloutWorkerConfig(model_dir=model_dir)),
        })

    try:
        yield session, loop_thread.run(start())
    finally:
        loop_thread.run(session.close())


async def updated_and_planned(session: af.Session, roles: af.Roles) -> tuple[af.DataFuture[Any], WeightSync]:
    """Put the test prompts on :data:`POLICY`, move the actor's weights with one
    update, and plan a :class:`WeightSync` of 16 KiB buckets; the prompts and the sync."""
    src = await session.put(prompt_columns(), pool=POLICY)
    await roles.actor.update(roles.actor.generate(src, n=2).map(alternating_advantages))
    sync = WeightSync(roles.actor, roles.rollout, bucket_bytes=16 << 10, timeout_s=60)
    await sync.prepare()
    return src, sync
