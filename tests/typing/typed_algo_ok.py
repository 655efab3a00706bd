"""A typed algorithm that must type-check clean with asyncflow's mypy plugin.

Not a test module: ``tests/asyncflow/test_typed_roles.py`` runs mypy on it (and
``make test``'s type check includes it). Each ``assert_type`` pins what the plugin
infers for a call through a typed role group.
"""

from __future__ import annotations

from typing import Any, assert_type

from asyncflow import (
    BatchMeta,
    DataFuture,
    DataStream,
    Layout,
    ResourcePool,
    RoleGroup,
    Roles,
    StreamOptions,
    collect,
)
from workers.roles import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker
from workers.rollout import SamplingParams


class PPORoles:
    """An algorithm's roles, declared with the role class each group runs."""

    actor: RoleGroup[ActorWorker]
    critic: RoleGroup[CriticWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None


async def ppo_like_step(roles: PPORoles, prompts: DataFuture[Any], stream: StreamOptions | None) -> dict[str, float]:
    """Every kind of call the plugin types."""
    rollout = roles.actor.generate(prompts, n=2, params=SamplingParams(max_new_tokens=8))
    assert_type(rollout, DataFuture[BatchMeta])
    assert_type(await rollout, BatchMeta)

    # Streaming: stream=True (or StreamOptions) gives a stream, and a call on a
    # stream gives a stream; a value that may be either gives either.
    streamed = roles.actor.generate(prompts, stream=True)
    assert_type(streamed, DataStream[BatchMeta])
    assert_type(roles.actor.generate(prompts, stream=StreamOptions()), DataStream[BatchMeta])
    assert_type(roles.actor.generate(prompts, stream=False), DataFuture[BatchMeta])
    assert_type(roles.actor.generate(prompts, stream=stream), DataFuture[BatchMeta] | DataStream[BatchMeta])
    scores = roles.reward.score(streamed)
    assert_type(scores, DataStream[BatchMeta])
    assert_type(collect(scores), DataFuture[BatchMeta])

    values = roles.critic.values(rollout)
    assert_type(values, DataFuture[BatchMeta])
    if roles.ref is not None:
        assert_type(roles.ref.log_prob(rollout), DataFuture[BatchMeta])

    # Methods that do not return rows return their own type.
    metrics = await roles.actor.update(rollout, ptx=None, ptx_coef=0.0)
    assert_type(metrics, dict[str, float])
    # Every call takes the driver's timeout_s.
    assert_type(roles.actor.update(rollout, timeout_s=30.0), DataFuture[dict[str, float]])
    assert_type(roles.reward.stats(values), DataFuture[dict[str, float]])
    assert_type(roles.critic.save_checkpoint("/tmp/ckpt"), DataFuture[None])  # inherited

    # The group's own attributes keep their types.
    assert_type(roles.actor.name, str)
    assert_type(roles.actor.layout, Layout)
    assert_type(roles.actor.pool, ResourcePool)
    assert_type(roles.actor.config, Any)
    assert_type(roles.actor.rank_local, frozenset[str])
    return metrics


def untyped(roles: Roles, group: RoleGroup[Any], prompts: DataFuture[Any]) -> None:
    """Groups of ``Roles`` (and ``RoleGroup[Any]``) are not checked."""
    assert_type(roles.actor, RoleGroup[Any])
    assert_type(roles["actor"].generat(prompts, nn=2), Any)
    assert_type(group.anything(prompts), Any)
