"""PPO with a critic and GAE (the InstructGPT recipe: KL folded into the reward)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow import DataFuture, RoleGroup, StreamOptions, gather
from asyncflow.algos._checks import at_least, check_gae
from asyncflow.algos._common import (
    _CFG,
    PolicyConfig,
    SamplingConfig,
    merge_rows,
    sampled,
    scores_and_ref,
    whole,
)
from asyncflow.algos._feed import Feed
from asyncflow.algos._registry import algorithm
from asyncflow.algos._role_set import RoleSet
from asyncflow.algos._transforms import gae, kl_penalised_rewards, token_rewards
from workers.roles import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, score_summary


class PPOConfig(msgspec.Struct, **_CFG):
    """PPO settings."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""
    reward_kl_coef: float = 0.05
    """KL-to-reference penalty folded into the per-token reward (0: no reference)."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""
    fuse_updates: bool = True
    """Run the actor's and the critic's updates as one fused pipeline schedule
    (RLHFuse's intra-stage fusion: each model fills the other's pipeline bubbles)
    where the placement allows it: both on one pool in the same pipeline layout
    (``p`` above 1, one chunk), the critic's pipeline reversed (``asyncflow train``
    builds it so); elsewhere the two run side by side."""

    def check(self) -> None:
        """Raises ConfigError naming a KL coefficient or GAE setting out of range."""
        at_least("algorithm.reward_kl_coef", self.reward_kl_coef, 0, "0 turns the KL penalty off")
        check_gae("algorithm", self.gamma, self.lam)


class PPORoles(RoleSet):
    """PPO's roles: actor, critic and reward; the reference when a KL term is on."""

    actor: RoleGroup[ActorWorker]
    critic: RoleGroup[CriticWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: PPOConfig) -> dict[str, str]:
        """The reference when the reward or the loss has a KL term."""
        if config.reward_kl_coef > 0:
            return {"ref": "algorithm.reward_kl_coef > 0"}
        return {"ref": "algorithm.policy.kl_coef > 0"} if config.policy.kl_coef > 0 else {}


# [docs:ppo-step] README.md shows this step, from here to its end mark (tests/docs checks it).
@algorithm("ppo", config=PPOConfig, roles=PPORoles)
async def ppo_step(roles: PPORoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any], config: PPOConfig, *,
                   seed: int | None = None, stream: StreamOptions | None = None,
                   rollout: DataFuture[Any] | None = None) -> dict[str, float]:
    """One PPO step: rollout, reference log-probs, values and scores (each on its
    role's pool, so stages on different pools overlap), GAE on the consumers'
    ranks, then the actor and critic updates (side by side, or fused where they
    share pipeline stages). With ``stream``, the inference calls on other pools
    than the actor's run per micro-batch as samples finish (:class:`Feed` says
    which); the updates get the same rows."""
    r = PPORoles.of(roles, config=config, algorithm="PPO")
    feed = Feed(sampled(r, prompts, config, seed=seed, stream=stream, rollout=rollout), producer=r.actor,
                stream=stream)
    old, values = feed(r.actor.log_prob), feed(r.critic.values)
    scores, parts = scores_and_ref(r, feed)
    stats = r.reward.stats(whole(scores))  # asked for first: it runs behind the scores, not after the updates
    batch = merge_rows(feed.rows, old, values, *parts)
    if r.ref is not None:
        batch = batch.map(kl_penalised_rewards, kl_coef=config.reward_kl_coef)
    else:
        batch = batch.map(token_rewards)
    batch = whole(batch).map(gae, gamma=config.gamma, lam=config.lam)
    updates, summary = await gather(actor_and_critic_updates(r, batch, config), stats)
    return updates | score_summary(summary)
# [/docs:ppo-step]


async def actor_and_critic_updates(r: PPORoles, batch: DataFuture[Any], config: PPOConfig) -> dict[str, float]:
    """The actor's and the critic's updates on ``batch``: one fused call where
    :func:`fusable` says so, else the two side by side."""
    if config.fuse_updates and fusable(r.actor, r.critic):
        metrics: dict[str, float] = await r.actor.update(batch, with_critic=True, **config.policy.update_kwargs())
        return metrics
    actor, critic = await gather(r.actor.update(batch, **config.policy.update_kwargs()), r.critic.update(batch))
    return actor | critic


def fusable(actor: RoleGroup[Any], critic: RoleGroup[Any]) -> bool:
    """Whether the two roles' updates can run as one fused pipeline schedule: one
    pool, the same pipeline and tensor sizes (so the same pipeline ranks), ``p``
    above 1, one chunk each, the pipelines in opposite directions."""
    mine, theirs = actor.layout, critic.layout
    if actor.pool.name != critic.pool.name or mine.p < 2 or (mine.p, mine.t) != (theirs.p, theirs.t):
        return False
    a, c = getattr(actor.config, "training", None), getattr(critic.config, "training", None)
    return (a is not None and c is not None and a.pipeline_chunks == c.pipeline_chunks == 1
            and a.pipeline_reversed != c.pipeline_reversed)
