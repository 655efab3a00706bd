"""Safe-RLHF: maximise reward subject to an expected-cost limit, with a Lagrange
multiplier updated each step (Dai et al., 2023)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncflow import DataFuture, RoleGroup, gather, merge
from asyncflow.algos._checks import at_least, check_gae, finite, within
from asyncflow.algos._common import _CFG, PolicyConfig, SamplingConfig, ref_for_kl
from asyncflow.algos._registry import algorithm
from asyncflow.algos._role_set import RoleSet
from asyncflow.algos._transforms import gae, safe_advantages, token_rewards
from channels import ConfigError
from workers.roles import (
    ActorWorker,
    CostWorker,
    CriticWorker,
    ReferenceWorker,
    RewardWorker,
    score_summary,
)


class SafeRLHFConfig(msgspec.Struct, **_CFG):
    """Safe-RLHF settings."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling."""
    policy: PolicyConfig = PolicyConfig()
    """The actor's update."""
    cost_limit: float = 0.0
    """Expected cost the policy may spend (the constraint's threshold)."""
    lagrange_init: float = 1.0
    """Initial multiplier."""
    lagrange_lr: float = 0.1
    """Step size of the multiplier's update."""
    lagrange_max: float = 100.0
    """Upper bound of the multiplier."""
    ptx_coef: float = 0.0
    """Weight of the optional pretraining (SFT) loss; needs ``ptx`` batches."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 0.95
    """GAE lambda."""

    def check(self) -> None:
        """Raises ConfigError naming a constraint, multiplier or GAE setting out of
        range, or a pretraining loss (no batches for it)."""
        key = "algorithm"
        finite(f"{key}.cost_limit", self.cost_limit, "the expected cost the policy may spend, e.g. 0.0")
        at_least(f"{key}.lagrange_max", self.lagrange_max, 0, "100.0 is usual")
        within(f"{key}.lagrange_init", self.lagrange_init, 0, self.lagrange_max,
               fix=f"the multiplier starts in [0, {key}.lagrange_max]; 1.0 is usual")
        at_least(f"{key}.lagrange_lr", self.lagrange_lr, 0, "0.1 is usual; 0 keeps the multiplier fixed")
        if self.ptx_coef != 0:
            raise ConfigError(f"{key}.ptx_coef = {self.ptx_coef!r}: asyncflow train has no pretraining batches to "
                              "mix into the actor's loss; set it to 0 or leave it out")
        check_gae(key, self.gamma, self.lam)


@dataclass
class SafeRLHFState:
    """The driver-side state carried between steps (saved in checkpoints)."""

    lagrange: float

    @classmethod
    def from_config(cls, config: SafeRLHFConfig) -> SafeRLHFState:
        """The multiplier at its initial value."""
        return cls(lagrange=config.lagrange_init)


class SafeRLHFRoles(RoleSet):
    """Safe-RLHF's roles: the actor, a reward critic and a cost critic, the reward
    and the cost; the reference when a KL term is on."""

    actor: RoleGroup[ActorWorker]
    critic: RoleGroup[CriticWorker]
    cost_critic: RoleGroup[CriticWorker]
    reward: RoleGroup[RewardWorker]
    cost: RoleGroup[CostWorker]
    ref: RoleGroup[ReferenceWorker] | None

    @classmethod
    def needed(cls, config: SafeRLHFConfig) -> dict[str, str]:
        """The reference when the loss has a KL term."""
        return ref_for_kl(config.policy)


@algorithm("safe_rlhf", config=SafeRLHFConfig, roles=SafeRLHFRoles)
async def safe_rlhf_step(roles: SafeRLHFRoles | Mapping[str, RoleGroup[Any]], prompts: DataFuture[Any],
                         config: SafeRLHFConfig, *, seed: int | None = None, state: SafeRLHFState | None = None,
                         ptx: DataFuture[Any] | None = None) -> dict[str, float]:
    """One Safe-RLHF step; updates ``state.lagrange`` from the step's mean cost
    (``state`` None: starts from ``lagrange_init`` and keeps nothing)."""
    r = SafeRLHFRoles.of(roles, config=config, algorithm="Safe-RLHF")
    state = state if state is not None else SafeRLHFState.from_config(config)
    rollout = r.actor.generate(prompts, n=config.sampling.n, params=config.sampling.params(seed=seed))
    old = r.actor.log_prob(rollout)
    values = r.critic.values(rollout)
    cost_values = r.cost_critic.values(rollout).rename(values="cost_values")
    scores = r.reward.score(rollout)
    costs = r.cost.score(rollout)
    # asked for first: they run behind the scores, not after the updates
    r_stats, c_stats = r.reward.stats(scores), r.cost.stats(costs)
    parts = [rollout, old, values, cost_values, scores, costs] + ([r.ref.log_prob(rollout)] if r.ref else [])
    actor_batch = merge(*parts).map(
        safe_advantages, lagrange=state.lagrange, gamma=config.gamma, lam=config.lam)
    cost_batch = merge(rollout, costs.rename(costs="scores"), cost_values.rename(cost_values="values"))
    cost_batch = cost_batch.map(token_rewards).map(gae, gamma=config.gamma, lam=config.lam)
    update = config.policy.update_kwargs()
    if ptx is not None and config.ptx_coef > 0:
        update |= {"ptx": ptx, "ptx_coef": config.ptx_coef}
    actor, critic, cost_critic, r_summary, c_summary = await gather(
        r.actor.update(actor_batch, **update),
        r.critic.update(actor_batch),
        r.cost_critic.update(cost_batch),
        r_stats,
        c_stats,
    )
    summary = score_summary(r_summary | c_summary)
    mean_cost = summary.get("cost/mean", 0.0)
    state.lagrange = min(config.lagrange_max,
                         max(0.0, state.lagrange + config.lagrange_lr * (mean_cost - config.cost_limit)))
    cost_critic = {k.replace("critic/", "cost_critic/", 1): v for k, v in cost_critic.items()}
    return actor | critic | cost_critic | summary | {"lagrange": state.lagrange}
