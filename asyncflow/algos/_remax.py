"""ReMax: REINFORCE with the greedy response's reward as the baseline, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow import DataFuture, RoleGroup, gather, merge
from asyncflow.algos._common import _CFG, PolicyConfig, SamplingConfig, ref_for_kl
from asyncflow.algos._registry import algorithm
from asyncflow.algos._role_set import RoleSet
from asyncflow.algos._transforms import greedy_baseline_advantages
from channels import ConfigError
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class ReMaxConfig(msgspec.Struct, **_CFG):
    """ReMax settings."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling of the trained responses (one per prompt)."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""

    def check(self) -> None:
        """Raises ConfigError unless one response is sampled per prompt."""
        if self.sampling.n != 1:
            raise ConfigError(f"algorithm.sampling.n = {self.sampling.n}: ReMax samples one response per prompt "
                              "(and the greedy one as its baseline); leave it out")


class ReMaxRoles(RoleSet):
    """ReMax's roles: the actor and the reward; the reference when placed."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: ReMaxConfig) -> dict[str, str]:
        """The reference when the loss has a KL term."""
        return ref_for_kl(config.policy)


@algorithm("remax", config=ReMaxConfig, roles=ReMaxRoles)
async def remax_step(roles: ReMaxRoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any],
                     config: ReMaxConfig, *, seed: int | None = None) -> dict[str, float]:
    """One ReMax step: a sampled and a greedy response per prompt; the greedy
    response's score is the sampled one's baseline. The update takes
    ``old_logprobs`` from its own forward (on-policy: no ``actor.log_prob`` call)."""
    r = ReMaxRoles.of(roles, config=config, algorithm="ReMax")
    rollout = r.actor.generate(prompts, n=1, params=config.sampling.params(seed=seed))
    greedy = r.actor.generate(prompts, n=1, params=config.sampling.params(seed=seed, greedy=True))
    scores = r.reward.score(rollout)
    stats = r.reward.stats(scores)  # asked for first: it runs behind the scores, not after the update
    baseline = r.reward.score(greedy).rename(scores="baseline_scores")
    parts = [rollout, scores, baseline] + ([r.ref.log_prob(rollout)] if r.ref else [])
    batch = merge(*parts).map(greedy_baseline_advantages)
    actor, summary = await gather(r.actor.update(batch, **config.policy.update_kwargs()), stats)
    return actor | score_summary(summary)
