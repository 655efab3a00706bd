"""A third-party algorithm package, as a user would write one: it registers
``group_mean`` (REINFORCE with the mean reward of the prompt's samples as the
baseline) through the ``asyncflow.algorithms`` entry point (see
``af_plugin_demo-0.1.dist-info/entry_points.txt``), with no change to asyncflow.
``tests/asyncflow/test_plugin_on_cpu.py`` trains with it through ``asyncflow train``.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from asyncflow import Batch, DataFuture, RoleGroup, gather, transform
from asyncflow.algos import PolicyConfig, RoleSet, SamplingConfig, algorithm, merge_rows
from workers.roles import ActorWorker, RewardWorker, score_summary


class GroupMeanConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The plug-in's settings."""

    sampling: SamplingConfig = SamplingConfig(n=2)
    """Sampling: ``n`` samples per prompt."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""
    scale: float = 1.0
    """Multiplies the advantages."""


class GroupMeanRoles(RoleSet):
    """The actor and the reward."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]


@transform(reads=("scores", "uid", "response_mask"), writes=("advantages",))
def group_mean_advantages(batch: Batch, *, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Each sample's score minus its prompt group's mean, on every response token."""
    scores, mask = batch["scores"].float(), batch["response_mask"]
    _, inverse = torch.unique(batch["uid"], return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    zeros = torch.zeros(groups)
    mean = zeros.index_add(0, inverse, scores) / zeros.index_add(0, inverse, torch.ones_like(scores))
    return {"advantages": scale * (scores - mean[inverse])[:, None] * mask}


@algorithm("group_mean", config=GroupMeanConfig, roles=GroupMeanRoles)
async def group_mean_step(roles: GroupMeanRoles, prompts: DataFuture[Any], config: GroupMeanConfig, *,
                          seed: int | None = None) -> dict[str, float]:
    """Sample, score, subtract the group mean, update."""
    rollout = roles.actor.generate(prompts, n=config.sampling.n, params=config.sampling.params(seed=seed))
    scores = roles.reward.score(rollout)
    batch = merge_rows(rollout, scores).map(group_mean_advantages, scale=config.scale)
    actor, stats = await gather(roles.actor.update(batch, **config.policy.update_kwargs()),
                                roles.reward.stats(scores))
    return actor | score_summary(stats) | {"group_mean/scale": config.scale}
