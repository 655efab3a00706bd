"""ReMax: REINFORCE with the greedy response's reward as the baseline, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow.algos._common import (
    _CFG,
    PolicyConfig,
    RolloutConfig,
    ref_for_kl,
    require_ref_for_kl,
)
from asyncflow.algos._registry import RoleSet, algorithm
from asyncflow.algos._transforms import greedy_baseline_advantages
from asyncflow.runtime import DataFuture, RoleGroup, gather, merge
from channels import ConfigError
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class ReMaxConfig(msgspec.Struct, **_CFG):
    """ReMax settings."""

    rollout: RolloutConfig = RolloutConfig()
    """Sampling of the trained responses (one per prompt)."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""


class ReMaxRoles(RoleSet):
    """ReMax's roles: the actor and the reward; the reference when placed."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None


def _check(config: ReMaxConfig) -> None:
    if config.rollout.n != 1:
        raise ConfigError(f"algorithm.rollout.n = {config.rollout.n}: ReMax samples one response per prompt "
                          "(and the greedy one as its baseline); leave it out")



@algorithm("remax", config=ReMaxConfig, roles=ReMaxRoles, check=_check, wants=ref_for_kl)
async def remax_step(roles: ReMaxRoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any],
                     config: ReMaxConfig, *, seed: int | None = None) -> dict[str, float]:
    """One ReMax step: a sampled and a greedy response per prompt; the greedy
    response's score is the sampled one's baseline. The update takes
    ``old_logprobs`` from its own forward (on-policy: no ``actor.log_prob`` call)."""
    r = ReMaxRoles.of(roles, algorithm="ReMax")
    require_ref_for_kl("ReMax", config, r.ref)
    rollout = r.actor.generate(prompts, n=1, params=config.rollout.params(seed=seed))
    greedy = r.actor.generate(prompts, n=1, params=config.rollout.params(seed=seed, greedy=True))
    scores = r.reward.score(rollout)
    baseline = r.reward.score(greedy).rename(scores="baseline_scores")
    parts = [rollout, scores, baseline] + ([r.ref.log_prob(rollout)] if r.ref else [])
    batch = merge(*parts).map(greedy_baseline_advantages)
    actor, stats = await gather(r.actor.update(batch, **config.policy.update_kwargs()), r.reward.stats(scores))
    return actor | score_summary(stats)
