"""PPO with a critic and GAE (the InstructGPT recipe: KL folded into the reward)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow._datastream import StreamOptions
from asyncflow._future import DataFuture, gather
from asyncflow._ops import merge
from asyncflow.algos._common import _CFG, PolicyConfig, RolloutConfig, require_roles, whole
from asyncflow.algos._transforms import gae, kl_penalised_rewards, token_rewards
from workers.roles import score_summary


class PPOConfig(msgspec.Struct, **_CFG):
    """PPO settings."""

    rollout: RolloutConfig = RolloutConfig()
    """Sampling."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""
    reward_kl_coef: float = 0.05
    """KL-to-reference penalty folded into the per-token reward (0: no reference)."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""


async def ppo_step(roles: Mapping[str, Any], prompts: DataFuture[Any], config: PPOConfig, *,
                   seed: int | None = None, stream: StreamOptions | None = None) -> dict[str, float]:
    """One PPO step: rollout, reference log-probs, values and scores (each on its
    role's pool, so stages on different pools overlap), GAE on the consumers'
    ranks, then the actor and critic updates side by side. With ``stream``, the
    inference calls run per micro-batch as samples finish; the updates get the
    same rows."""
    use_ref = config.reward_kl_coef > 0 or config.policy.kl_coef > 0
    require_roles(roles, "PPO", "actor", "critic", "reward", *(["ref"] if use_ref else []))
    rollout = roles["actor"].generate(prompts, n=config.rollout.n, params=config.rollout.params(seed=seed),
                                      stream=stream)
    old = roles["actor"].log_prob(rollout)
    values = roles["critic"].values(rollout)
    scores = roles["reward"].score(rollout)
    if use_ref:
        batch = merge(rollout, old, roles["ref"].log_prob(rollout), values, scores)
        batch = batch.map(kl_penalised_rewards, kl_coef=config.reward_kl_coef)
    else:
        batch = merge(rollout, old, values, scores).map(token_rewards)
    batch = whole(batch).map(gae, gamma=config.gamma, lam=config.lam)
    actor, critic, stats = await gather(roles["actor"].update(batch, **config.policy.update_kwargs()),
                                        roles["critic"].update(batch), roles["reward"].stats(whole(scores)))
    return actor | critic | score_summary(stats)
