"""The batch field contract between the driver, the roles and the algorithms.

Shapes are per row (one row per sample); ``P`` is the prompt width, ``R`` the
response width (``max_new_tokens``), ``A`` the answer width.
"""

from __future__ import annotations

from workers.engines import OBSERVATION_MASK, SEQUENCE_FIELDS

# ----- put by the driver (one row per prompt)
PROMPT_IDS = "prompt_ids"
"""int64 ``[P]``, left-padded with the pad id."""
PROMPT_MASK = "prompt_mask"
"""int64 ``[P]``, 1 on real prompt tokens."""
UID = "uid"
"""int64 ``[]``: the prompt's id (GRPO groups samples by it; errors quote it)."""
ANSWER_IDS = "answer_ids"
"""int64 ``[A]``: the reference answer, right-padded with the pad id (rule rewards)."""

# ----- written by ActorWorker.generate (n rows per prompt, consecutive)
RESPONSE_IDS = "response_ids"
"""int64 ``[R]``, right-padded with the pad id (EOS kept)."""
RESPONSE_MASK = "response_mask"
"""int64 ``[R]``, 1 on generated tokens."""
ROLLOUT_LOGPROBS = "rollout_logprobs"
"""float32 ``[R]``: raw (temperature 1) log-probs of the sampled tokens, by the rollout engine."""
OBSERVATION_MASK = OBSERVATION_MASK
"""int64 ``[R]``, only in episodes' rows: 1 on the environment's tokens inside the
response (read by the model, not sampled: ``response_mask`` is 0 there)."""
POLICY_VERSION = "policy_version"
"""int64 ``[R]``: the version of the weights that sampled each token (the actor's
optimizer step count when they were published); ``ActorWorker.update`` corrects
tokens older than its own step (``PolicyLoss.off_policy``)."""

# ----- written by the other stages
OLD_LOGPROBS = "old_logprobs"
"""float32 ``[R]``: the actor's log-probs before the update (ActorWorker.log_prob)."""
ENTROPY = "entropy"
"""float32 ``[R]``: the actor's next-token entropy (ActorWorker.log_prob)."""
REF_LOGPROBS = "ref_logprobs"
"""float32 ``[R]``: the reference policy's log-probs (ReferenceWorker.log_prob)."""
VALUES = "values"
"""float32 ``[R]``: the critic's values (CriticWorker.values)."""
SCORES = "scores"
"""float32 ``[]``: one reward per sample (RewardWorker.score)."""
COSTS = "costs"
"""float32 ``[]``: one cost per sample (CostWorker.score)."""

# ----- written by the algorithm (advantage estimators), read by the updates
ADVANTAGES = "advantages"
"""float32 ``[R]`` (or ``[]``): read by ActorWorker.update."""
RETURNS = "returns"
"""float32 ``[R]``: read by CriticWorker.update."""

SEQUENCE = (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)
"""The four fields forming a training sequence (``prompt ++ response``)."""

SEQUENCE_OPTIONAL = (OBSERVATION_MASK,)
"""Sequence fields that only some rows carry (methods that read the sequence pull
them when present)."""

assert SEQUENCE == SEQUENCE_FIELDS, "the training engine's sequence fields changed"
