"""Safe-RLHF: maximise reward subject to an expected-cost limit, with a Lagrange
multiplier updated each step (Dai et al., 2023)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncflow._future import DataFuture, gather, merge
from asyncflow.algos._common import _CFG, PolicyConfig, RolloutConfig, require_roles
from asyncflow.algos._grpo import _sampling
from asyncflow.algos._transforms import gae, safe_advantages, token_rewards


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
                         state: SafeRLHFState, ptx: DataFuture[Any] | None = None) -> dict[str, float]:
    """One Safe-RLHF step; updates ``state.lagrange`` from the step's mean cost."""
    require_roles(roles, "Safe-RLHF", "actor", "critic", "cost_critic", "reward", "cost")
    rollout = roles["actor"].generate(prompts, n=config.rollout.n, **_sampling(config.rollout))
    old = roles["actor"].log_prob(rollout)
    values = roles["critic"].values(rollout)
    cost_values = roles["cost_critic"].values(rollout).rename(values="cost_values")
    scores = roles["reward"].score(rollout)
    costs = roles["cost"].score(rollout)
    actor_batch = merge(rollout, old, values, cost_values, scores, costs).map(
        safe_advantages, lagrange=state.lagrange, gamma=config.gamma, lam=config.lam)
    cost_batch = merge(rollout, costs.rename(costs="scores"), cost_values.rename(cost_values="values"))
    cost_batch = cost_batch.map(token_rewards).map(gae, gamma=config.gamma, lam=config.lam)
    update = config.policy.update_kwargs()
    if ptx is not None and config.ptx_coef > 0:
        update |= {"ptx": ptx, "ptx_coef": config.ptx_coef}
    actor, critic, cost_critic = await gather(
        roles["actor"].update(actor_batch, **update),
        roles["critic"].update(actor_batch),
        roles["cost_critic"].update(cost_batch),
    )
    mean_cost = actor.get("cost_mean", 0.0)
    state.lagrange = min(config.lagrange_max,
                         max(0.0, state.lagrange + config.lagrange_lr * (mean_cost - config.cost_limit)))
    return (actor | {f"critic/{k}": v for k, v in critic.items()}
            | {f"cost_critic/{k}": v for k, v in cost_critic.items()} | {"lagrange": state.lagrange})
