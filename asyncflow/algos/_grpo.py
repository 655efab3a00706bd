"""GRPO: group-normalised outcome advantages, no critic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from asyncflow._datastream import StreamOptions
from asyncflow._future import DataFuture, gather
from asyncflow._ops import merge
from asyncflow.algos._common import _CFG, PolicyConfig, RolloutConfig, require_roles, whole
from asyncflow.algos._transforms import group_advantages
from workers.roles import score_summary


class GRPOConfig(msgspec.Struct, **_CFG):
    """GRPO settings."""

    rollout: RolloutConfig = RolloutConfig(n=8)
    """Sampling; ``n`` responses form each prompt's group."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update (``kl_coef > 0`` adds the KL loss and needs role ``ref``)."""
    scale_by_std: bool = True
    """Divide by the group's standard deviation (Dr. GRPO sets this False)."""


async def grpo_step(roles: Mapping[str, Any], prompts: DataFuture[Any], config: GRPOConfig, *,
                    seed: int | None = None, stream: StreamOptions | None = None) -> dict[str, float]:
    """One GRPO step: sample ``n`` responses per prompt, score them, normalise the
    scores within each prompt's group and update the actor. ``seed`` seeds the
    step's sampling (a resumed run then samples what an uninterrupted one would).
    With ``stream``, groups flow into the log-prob and reward calls as they finish
    (and the long tail may migrate); the update gets the same rows."""
    # A placed reference is used for the KL metric even without a KL loss term.
    use_ref = config.policy.kl_coef > 0 or "ref" in roles
    require_roles(roles, "GRPO", "actor", "reward", *(["ref"] if use_ref else []))
    rollout = roles["actor"].generate(prompts, n=config.rollout.n, params=config.rollout.params(seed=seed),
                                      stream=stream)
    old = roles["actor"].log_prob(rollout)
    scores = roles["reward"].score(rollout)
    parts = [rollout, old, scores] + ([roles["ref"].log_prob(rollout)] if use_ref else [])
    batch = whole(merge(*parts)).map(group_advantages, scale_by_std=config.scale_by_std)
    actor, stats = await gather(roles["actor"].update(batch, **config.policy.update_kwargs()),
                                roles["reward"].stats(whole(scores)))
    return actor | score_summary(stats)

