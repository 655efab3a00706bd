"""Safe-RLHF: maximise reward subject to an expected-cost limit, with a Lagrange
multiplier updated each step (Dai et al., 2023)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncflow._future import DataFuture, gather
from asyncflow._ops import merge
from asyncflow.algos._common import _CFG, PolicyConfig, RolloutConfig, require_roles
from asyncflow.algos._transforms import gae, safe_advantages, token_rewards
from workers.roles import score_summary


class SafeRLHFConfig(msgspec.Struct, **_CFG):
    """Safe-RLHF settings."""

    rollout: RolloutConfig = RolloutConfig()
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


@dataclass
class SafeRLHFState:
    """The driver-side state carried between steps (saved in checkpoints)."""

    lagrange: float


async def safe_rlhf_step(roles: Mapping[str, Any], prompts: DataFuture[Any], config: SafeRLHFConfig,
                         state: SafeRLHFState, ptx: DataFuture[Any] | None = None,
                         seed: int | None = None) -> dict[str, float]:
    """One Safe-RLHF step; updates ``state.lagrange`` from the step's mean cost."""
    use_ref = config.policy.kl_coef > 0
    require_roles(roles, "Safe-RLHF", "actor", "critic", "cost_critic", "reward", "cost",
                  *(["ref"] if use_ref else []))
    rollout = roles["actor"].generate(prompts, n=config.rollout.n, params=config.rollout.params(seed=seed))
    old = roles["actor"].log_prob(rollout)
    values = roles["critic"].values(rollout)
    cost_values = roles["cost_critic"].values(rollout).rename(values="cost_values")
    scores = roles["reward"].score(rollout)
    costs = roles["cost"].score(rollout)
    parts = [rollout, old, values, cost_values, scores, costs] + ([roles["ref"].log_prob(rollout)] if use_ref else [])
    actor_batch = merge(*parts).map(
        safe_advantages, lagrange=state.lagrange, gamma=config.gamma, lam=config.lam)
    cost_batch = merge(rollout, costs.rename(costs="scores"), cost_values.rename(cost_values="values"))
    cost_batch = cost_batch.map(token_rewards).map(gae, gamma=config.gamma, lam=config.lam)
    update = config.policy.update_kwargs()
    if ptx is not None and config.ptx_coef > 0:
        update |= {"ptx": ptx, "ptx_coef": config.ptx_coef}
    actor, critic, cost_critic, r_stats, c_stats = await gather(
        roles["actor"].update(actor_batch, **update),
        roles["critic"].update(actor_batch),
        roles["cost_critic"].update(cost_batch),
        roles["reward"].stats(scores),
        roles["cost"].stats(costs),
    )
    summary = score_summary(r_stats | c_stats)
    mean_cost = summary.get("cost/mean", 0.0)
    state.lagrange = min(config.lagrange_max,
                         max(0.0, state.lagrange + config.lagrange_lr * (mean_cost - config.cost_limit)))
    cost_critic = {k.replace("critic/", "cost_critic/", 1): v for k, v in cost_critic.items()}
    return actor | critic | cost_critic | summary | {"lagrange": state.lagrange}
