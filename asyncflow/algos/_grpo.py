"""GRPO: group-normalised outcome advantages, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow import DataFuture, RoleGroup, StreamOptions, gather
from asyncflow.algos._checks import check_group_size
from asyncflow.algos._common import _CFG, PolicyConfig, SamplingConfig, ref_for_kl, sample_and_score
from asyncflow.algos._registry import algorithm
from asyncflow.algos._role_set import RoleSet
from asyncflow.algos._transforms import group_advantages
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class GRPOConfig(msgspec.Struct, **_CFG):
    """GRPO settings."""

    sampling: SamplingConfig = SamplingConfig(n=8)
    """Sampling; ``n`` responses form each prompt's group."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update (``kl_coef > 0`` adds the KL loss and needs role ``ref``)."""
    scale_by_std: bool = True
    """Divide by the group's standard deviation (Dr. GRPO sets this False)."""

    def check(self) -> None:
        """Raises ConfigError unless each prompt has a group of samples."""
        check_group_size(self.sampling.n, "GRPO compares the samples of one prompt; 8 is usual")


class GRPORoles(RoleSet):
    """GRPO's roles: the actor and the reward; the reference when placed (its KL
    is reported, and enters the loss with ``policy.kl_coef``)."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: GRPOConfig) -> dict[str, str]:
        """The reference when the loss has a KL term."""
        return ref_for_kl(config.policy)


@algorithm("grpo", config=GRPOConfig, roles=GRPORoles)
async def grpo_step(roles: GRPORoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any], config: GRPOConfig,
                    *, seed: int | None = None, stream: StreamOptions | None = None,
                    rollout: DataFuture[Any] | None = None) -> dict[str, float]:
    """One GRPO step: sample ``n`` responses per prompt, score them, normalise the
    scores within each prompt's group and update the actor. ``seed`` seeds the
    step's sampling (a resumed run then samples what an uninterrupted one would).
    With ``stream``, groups flow into the log-prob and reward calls as they finish
    on other pools than the actor's (:class:`Feed` says which; the
    long tail may migrate); the update gets the same rows. ``rollout``: the
    samples, generated ahead by a rollout role (asynchronous training)."""
    r = GRPORoles.of(roles, config=config, algorithm="GRPO")
    batch, scores = sample_and_score(r, prompts, config, seed=seed, stream=stream, rollout=rollout)
    stats = r.reward.stats(scores)  # asked for first: it runs behind the scores, not after the update
    batch = batch.map(group_advantages, scale_by_std=config.scale_by_std)
    actor, summary = await gather(r.actor.update(batch, **config.policy.update_kwargs()), stats)
    return actor | score_summary(summary)
