"""Rewards and costs for RL: rule functions over decoded text, and reward/cost models.

- Rule-based (:class:`RuleRewardConfig`, :class:`RuleScorer`): batched Python
  functions, named by ``"module:function"`` in configs and summed by weight. The
  usual form is TRL's ``fn(prompts=[...], completions=[...], **columns) ->
  list[float]`` (``columns``: the rows' own columns, :func:`row_columns`); the
  first form ``fn(prompts, responses, answers)`` still works (:func:`call_style`
  tells them apart; contract in ``workers.rewards._rule``). Sync or async; a call
  past ``timeout_s`` (ten minutes by default) fails with :class:`RewardTimeoutError`.
- Built-in verifiers: :func:`exact_match`, :func:`numeric_match`,
  :data:`format_check` (:class:`FormatCheck` for other patterns);
  :func:`arithmetic_reward` is the verifier of the arithmetic prompt source
  (``[data] source = "arithmetic"``): exact match up to ``<eos>``.
- Model-based (:class:`ModelRewardConfig`, :class:`ModelScorer`): a
  :class:`~workers.models.ValueModel` read at the last response token.

Both are :class:`Scorer` strategies over :class:`ScoreInputs`; the reward and cost
roles in ``workers.roles`` host them on a pool. :func:`masked_token_lists` reads a
padded batch's real tokens per row (the rollout's prompts too).
"""

from __future__ import annotations

from workers.rewards._arithmetic import arithmetic_reward
from workers.rewards._calling import (
    CallStyle,
    RewardBatch,
    RewardFn,
    RewardFunction,
    RewardFunctionError,
    RewardTimeoutError,
)
from workers.rewards._columns import row_columns, text_column
from workers.rewards._decode import (
    Decoder,
)
from workers.rewards._inputs import ScoreInputs, Scorer, masked_token_lists
from workers.rewards._model import ModelRewardConfig, ModelScorer
from workers.rewards._rule import (
    DEFAULT_REWARD_FN,
    DEFAULT_TIMEOUT_S,
    RuleRewardConfig,
    RuleScorer,
    load_reward_fn,
    split_function_spec,
)
from workers.rewards._verifiers import (
    FormatCheck,
    exact_match,
    format_check,
    numeric_match,
)

__all__ = [
    "DEFAULT_REWARD_FN",
    "DEFAULT_TIMEOUT_S",
    "CallStyle",
    "Decoder",
    "FormatCheck",
    "ModelRewardConfig",
    "ModelScorer",
    "RewardBatch",
    "RewardFn",
    "RewardFunction",
    "RewardFunctionError",
    "RewardTimeoutError",
    "RuleRewardConfig",
    "RuleScorer",
    "ScoreInputs",
    "Scorer",
    "arithmetic_reward",
    "exact_match",
    "format_check",
    "load_reward_fn",
    "masked_token_lists",
    "numeric_match",
    "row_columns",
    "split_function_spec",
    "text_column",
]
