"""GRPO: group-normalised outcome advantages, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow._datastream import StreamOptions
from asyncflow._future import DataFuture, gather
from asyncflow._proxy import RoleGroup
from asyncflow.algos._common import (
    _CFG,
    PolicyConfig,
    RolloutConfig,
    call_on_rollout,
    merge_rows,
    whole,
)
from asyncflow.algos._registry import RoleSet, algorithm
from asyncflow.algos._transforms import group_advantages
from channels import ConfigError
from workers.roles import ActorWorker, ReferenceWorker, RewardWorker, score_summary


class GRPOConfig(msgspec.Struct, **_CFG):
    """GRPO settings."""

    rollout: RolloutConfig = RolloutConfig(n=8)
    """Sampling; ``n`` responses form each prompt's group."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update (``kl_coef > 0`` adds the KL loss and needs role ``ref``)."""
    scale_by_std: bool = True
    """Divide by the group's standard deviation (Dr. GRPO sets this False)."""


class GRPORoles(RoleSet):
    """GRPO's roles: the actor and the reward; the reference when placed (its KL
    is reported, and enters the loss with ``policy.kl_coef``)."""

    actor: RoleGroup[ActorWorker]
    reward: RoleGroup[RewardWorker]
    ref: RoleGroup[ReferenceWorker] | None


def _check(config: GRPOConfig) -> None:
    if config.rollout.n < 2:
        raise ConfigError(f"algorithm.rollout.n must be >= 2, got {config.rollout.n}: GRPO compares the "
                          "samples of one prompt; 8 is usual")


def _wants(config: GRPOConfig) -> tuple[str, ...]:
    return ("ref",) if config.policy.kl_coef > 0 else ()


@algorithm("grpo", config=GRPOConfig, roles=GRPORoles, streams=True, check=_check, wants=_wants)
async def grpo_step(roles: GRPORoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any], config: GRPOConfig,
                    *, seed: int | None = None, stream: StreamOptions | None = None) -> dict[str, float]:
    """One GRPO step: sample ``n`` responses per prompt, score them, normalise the
    scores within each prompt's group and update the actor. ``seed`` seeds the
    step's sampling (a resumed run then samples what an uninterrupted one would).
    With ``stream``, groups flow into the log-prob and reward calls as they finish
    on other pools than the actor's (``call_on_rollout`` says which; the
    long tail may migrate); the update gets the same rows."""
    r = GRPORoles.of(roles, algorithm="GRPO")
    if config.policy.kl_coef > 0 and r.ref is None:
        raise ConfigError("GRPO with policy.kl_coef > 0 needs a placed ref role")
    rollout = r.actor.generate(prompts, n=config.rollout.n, params=config.rollout.params(seed=seed), stream=stream)

    def call(group: RoleGroup[Any], method: str) -> Any:
        return call_on_rollout(group, method, rollout, producer=r.actor, stream=stream)

    scores = call(r.reward, "score")
    parts = [rollout, call(r.actor, "log_prob"), scores] + ([call(r.ref, "log_prob")] if r.ref else [])
    batch = whole(merge_rows(*parts)).map(group_advantages, scale_by_std=config.scale_by_std)
    actor, stats = await gather(r.actor.update(batch, **config.policy.update_kwargs()),
                                r.reward.stats(whole(scores)))
    return actor | score_summary(stats)
