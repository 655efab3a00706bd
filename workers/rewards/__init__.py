"""Rewards and costs for RL: rule functions over decoded text, and reward/cost models.

- Rule-based (:class:`RuleRewardConfig`, :class:`RuleScorer`): a batched Python
  function ``fn(prompts, responses, answers) -> scores`` (contract: :data:`RewardFn`),
  named by ``"module:function"`` in configs; :func:`arithmetic_reward` is the
  arithmetic task's exact-match rule.
- Model-based (:class:`ModelRewardConfig`, :class:`ModelScorer`): a
  :class:`~workers.models.ValueModel` read at the last response token.

Both are :class:`Scorer` strategies over :class:`ScoreInputs`; the reward and cost
roles in ``workers.roles`` host them on a pool.
"""

from __future__ import annotations

from workers.rewards._decode import Decoder, decode_rows, load_decoder
from workers.rewards._inputs import ScoreInputs, Scorer, masked_token_lists
from workers.rewards._model import ModelRewardConfig, ModelScorer
from workers.rewards._rule import (
    DEFAULT_REWARD_FN,
    RewardFn,
    RewardFunctionError,
    RuleRewardConfig,
    RuleScorer,
    arithmetic_reward,
    load_reward_fn,
    reward_fn_name,
    split_function_spec,
)

__all__ = [
    "DEFAULT_REWARD_FN",
    "Decoder",
    "ModelRewardConfig",
    "ModelScorer",
    "RewardFn",
    "RewardFunctionError",
    "RuleRewardConfig",
    "RuleScorer",
    "ScoreInputs",
    "Scorer",
    "arithmetic_reward",
    "decode_rows",
    "load_decoder",
    "load_reward_fn",
    "masked_token_lists",
    "reward_fn_name",
    "split_function_spec",
]
