"""RL algorithms as plug-ins: ``async def`` steps over role-group calls.

Each algorithm is registered (:func:`algorithm`) with its config type, its roles
(a :class:`RoleSet`: ``roles.actor``, ``roles.ref``, ... typed by the worker
class they run) and its step, which takes the placed roles, a future of prompt
rows and the config, and returns the step's metrics. Steps call every stage
through the typed roles (:class:`Feed` feeds one stage's rows to another), so
mypy with ``asyncflow.mypy_plugin`` checks each call; the built-ins use only
what this package and ``asyncflow`` export, as a plug-in does. No tensor passes through the
driver: advantages are computed by transforms on the ranks that consume the rows.
Installed packages add algorithms through the ``asyncflow.algorithms`` entry-point
group; :func:`algorithms` lists them all.
"""

from asyncflow.algos._common import (
    OutcomeRoles,
    PolicyConfig,
    SamplingConfig,
    carries,
    merge_rows,
    ref_for_kl,
    sample_and_score,
    scores_and_ref,
    whole,
)
from asyncflow.algos._dapo import (
    DAPOConfig,
    DAPORoles,
    dapo_advantages,
    dapo_step,
)
from asyncflow.algos._feed import Feed
from asyncflow.algos._grpo import GRPOConfig, GRPORoles, grpo_step
from asyncflow.algos._ppo import PPOConfig, PPORoles, ppo_step
from asyncflow.algos._registry import (
    ENTRY_POINT_GROUP,
    Algorithm,
    PromptSource,
    StepState,
    algorithm,
    algorithm_of,
    algorithms,
    config_section,
    get_algorithm,
)
from asyncflow.algos._remax import ReMaxConfig, ReMaxRoles, remax_step
from asyncflow.algos._rloo import RLOOConfig, RLOORoles, rloo_advantages, rloo_step
from asyncflow.algos._role_set import RoleSet
from asyncflow.algos._safe_rlhf import SafeRLHFConfig, SafeRLHFRoles, SafeRLHFState, safe_rlhf_step
from asyncflow.algos._transforms import (
    gae,
    greedy_baseline_advantages,
    group_advantages,
    kl_penalised_rewards,
    safe_advantages,
    token_rewards,
)
from asyncflow.algos._weight_sync import WeightSync

__all__ = [
    "ENTRY_POINT_GROUP",
    "Algorithm",
    "DAPOConfig",
    "DAPORoles",
    "Feed",
    "GRPOConfig",
    "GRPORoles",
    "OutcomeRoles",
    "PPOConfig",
    "PPORoles",
    "PolicyConfig",
    "PromptSource",
    "RLOOConfig",
    "RLOORoles",
    "ReMaxConfig",
    "ReMaxRoles",
    "RoleSet",
    "SafeRLHFConfig",
    "SafeRLHFRoles",
    "SafeRLHFState",
    "SamplingConfig",
    "StepState",
    "WeightSync",
    "algorithm",
    "algorithm_of",
    "algorithms",
    "carries",
    "config_section",
    "dapo_advantages",
    "dapo_step",
    "gae",
    "get_algorithm",
    "greedy_baseline_advantages",
    "group_advantages",
    "grpo_step",
    "kl_penalised_rewards",
    "merge_rows",
    "ppo_step",
    "ref_for_kl",
    "remax_step",
    "rloo_advantages",
    "rloo_step",
    "safe_advantages",
    "safe_rlhf_step",
    "sample_and_score",
    "scores_and_ref",
    "token_rewards",
    "whole",
]
