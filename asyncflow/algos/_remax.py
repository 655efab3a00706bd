"""ReMax: REINFORCE with the greedy response's reward as the baseline, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow._future import DataFuture, gather
from asyncflow._ops import merge
from asyncflow.algos._common import _CFG, PolicyConfig, RolloutConfig, require_roles
from asyncflow.algos._transforms import greedy_baseline_advantages
from workers.roles import score_summary


class ReMaxConfig(msgspec.Struct, **_CFG):
    """ReMax settings."""

    rollout: RolloutConfig = RolloutConfig()
    """Sampling of the trained responses (one per prompt)."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""


async def remax_step(roles: Mapping[str, Any], prompts: DataFuture[Any], config: ReMaxConfig, *,
                     seed: int | None = None) -> dict[str, float]:
    """One ReMax step: a sampled and a greedy response per prompt; the greedy
    response's score is the sampled one's baseline."""
    use_ref = config.policy.kl_coef > 0 or "ref" in roles
    require_roles(roles, "ReMax", "actor", "reward", *(["ref"] if use_ref else []))
    rollout = roles["actor"].generate(prompts, n=1, params=config.rollout.params(seed=seed))
    greedy = roles["actor"].generate(prompts, n=1, params=config.rollout.params(seed=seed, greedy=True))
    old = roles["actor"].log_prob(rollout)
    scores = roles["reward"].score(rollout)
    baseline = roles["reward"].score(greedy).rename(scores="baseline_scores")
    parts = [rollout, old, scores, baseline] + ([roles["ref"].log_prob(rollout)] if use_ref else [])
    batch = merge(*parts).map(greedy_baseline_advantages)
    actor, stats = await gather(roles["actor"].update(batch, **config.policy.update_kwargs()),
                                roles["reward"].stats(scores))
    return actor | score_summary(stats)
