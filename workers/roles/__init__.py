"""The RLHF roles hosted by worker processes: actor, reference, critic, reward, cost.

Each is a :class:`~workers.Role` with a nested keyword-only ``Config`` and
``@register`` methods that follow the batch field contract (the constants below;
``from workers.roles import fields as F`` gives them as ``F.PROMPT_IDS``, ...):

- :class:`ActorWorker`: ``generate`` (MicroDP, n samples per prompt, consecutive),
  ``log_prob``, ``update`` (then syncs the rollout engine), checkpoints, ``export_hf``;
  with a generation layout (``Layout.gen``) the hybrid engine reshards its weights
  for each ``generate`` instead;
- :class:`RolloutWorker`: ``generate`` on its own pool (the actor's rows; with
  :class:`PartialRollout`, long samples carried over to the next call) and
  ``load_weights`` of ``actor.weights()``, a data future of the actor's shards;
- :class:`ReferenceWorker`: ``log_prob`` -> ``ref_logprobs``;
- :class:`CriticWorker`: ``values``, ``update``, checkpoints, ``export_hf``;
- :class:`RewardWorker` / :class:`CostWorker`: ``score`` -> ``scores`` / ``costs``, by a
  rule function or a reward/cost model (``workers.rewards``).

:func:`sum_over_call_rows` lets a transform applied to a call's rows (``fut.map``)
reduce statistics over every rank's share of them.
"""

from __future__ import annotations

from workers.roles import _fields as fields
from workers.roles._actor import ActorWorker
from workers.roles._actor_config import ActorConfig
from workers.roles._call_sums import sum_over_call_rows
from workers.roles._critic import CriticConfig, CriticWorker
from workers.roles._fields import (
    ADVANTAGES,
    ANSWER_IDS,
    COSTS,
    ENTROPY,
    OLD_LOGPROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    REF_LOGPROBS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    RETURNS,
    ROLLOUT_LOGPROBS,
    SCORES,
    UID,
    VALUES,
)
from workers.roles._reference import ReferenceConfig, ReferenceWorker
from workers.roles._reward import CostWorker, RewardWorker, ScoreConfig, ScorerConfig, score_summary
from workers.roles._rollout import ROLLOUT_DTYPES, RolloutConfig
from workers.roles._rollout_worker import PartialRollout, RolloutWorker, RolloutWorkerConfig
from workers.roles._training import UpdateConfig
from workers.roles._weights import WEIGHTS_VERSION, weight_buckets

__all__ = [
    "ADVANTAGES",
    "ANSWER_IDS",
    "COSTS",
    "ENTROPY",
    "OLD_LOGPROBS",
    "PROMPT_IDS",
    "PROMPT_MASK",
    "REF_LOGPROBS",
    "RESPONSE_IDS",
    "RESPONSE_MASK",
    "RETURNS",
    "ROLLOUT_DTYPES",
    "ROLLOUT_LOGPROBS",
    "SCORES",
    "UID",
    "VALUES",
    "WEIGHTS_VERSION",
    "ActorConfig",
    "ActorWorker",
    "CostWorker",
    "CriticConfig",
    "CriticWorker",
    "PartialRollout",
    "ReferenceConfig",
    "ReferenceWorker",
    "RewardWorker",
    "RolloutConfig",
    "RolloutWorker",
    "RolloutWorkerConfig",
    "ScoreConfig",
    "ScorerConfig",
    "UpdateConfig",
    "fields",
    "score_summary",
    "sum_over_call_rows",
    "weight_buckets",
]
