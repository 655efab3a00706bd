"""RL algorithms as ``async def`` steps over worker-group calls.

Each step takes the placed roles (by name: ``actor``, ``ref``, ``critic``,
``reward``, ``cost``, ``cost_critic``), a future of prompt rows and a config, and
returns the step's metrics. No tensor passes through the driver: advantages are
computed by transforms on the ranks that consume the rows.
"""

from asyncflow.algos._common import PolicyConfig, RolloutConfig
from asyncflow.algos._grpo import GRPOConfig, grpo_step
from asyncflow.algos._ppo import PPOConfig, ppo_step
from asyncflow.algos._remax import ReMaxConfig, remax_step
from asyncflow.algos._safe_rlhf import SafeRLHFConfig, SafeRLHFState, safe_rlhf_step
from asyncflow.algos._transforms import (
    gae,
    greedy_baseline_advantages,
    group_advantages,
    kl_penalised_rewards,
    safe_advantages,
    token_rewards,
)

__all__ = [
    "GRPOConfig", "PPOConfig", "PolicyConfig", "ReMaxConfig", "RolloutConfig", "SafeRLHFConfig",
    "SafeRLHFState", "gae", "greedy_baseline_advantages", "group_advantages", "grpo_step",
    "kl_penalised_rewards", "ppo_step", "remax_step", "safe_advantages", "safe_rlhf_step",
    "token_rewards",
]
