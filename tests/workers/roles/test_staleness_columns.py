"""``staleness_columns``: the columns ``ActorWorker.update`` adds so that
``PolicyLoss`` corrects tokens an older policy sampled (``policy_version`` below the
actor's optimizer step), and adds nothing to rows without versions."""

from __future__ import annotations

import pytest
import torch

from channels import Batch
from workers.objectives import BEHAVIOUR_LOGPROBS, STALE_TOKENS
from workers.roles import fields
from workers.roles._staleness import staleness_columns, version_metrics


def _rows(**extra: torch.Tensor) -> Batch:
    return Batch({
        fields.RESPONSE_MASK: torch.tensor([[1, 1, 1], [1, 1, 0]]),
        fields.ROLLOUT_LOGPROBS: torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, 0.0]]),
        **extra,
    })


@pytest.mark.parametrize("drop", [fields.POLICY_VERSION, fields.ROLLOUT_LOGPROBS])
def test_rows_without_versions_or_rollout_logprobs_get_no_columns(drop: str) -> None:
    full = _rows(**{fields.POLICY_VERSION: torch.zeros(2, 3, dtype=torch.int64)})
    batch = Batch({k: v for k, v in full.items() if k != drop})
    rows, names = staleness_columns(batch, step=5)
    assert names == ()
    assert rows is batch


def test_tokens_older_than_the_step_are_stale_and_keep_their_rollout_logprobs() -> None:
    versions = torch.tensor([[2, 3, 4], [3, 3, 2]])
    batch = _rows(**{fields.POLICY_VERSION: versions})
    rows, names = staleness_columns(batch, step=3)
    assert names == (STALE_TOKENS, BEHAVIOUR_LOGPROBS)
    assert rows[STALE_TOKENS].dtype == torch.float32
    assert rows[STALE_TOKENS].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    assert torch.equal(rows[BEHAVIOUR_LOGPROBS], batch[fields.ROLLOUT_LOGPROBS])
    assert all(rows[k] is v for k, v in batch.items())  # the batch's own columns, untouched
    fresh, _ = staleness_columns(batch, step=2)
    assert fresh[STALE_TOKENS].sum() == 0  # version == step is the current policy


def test_version_metrics_measure_the_lag_of_response_tokens_and_mixed_samples() -> None:
    batch = {
        fields.RESPONSE_MASK: torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]]),
        fields.POLICY_VERSION: torch.tensor([[2, 2, 4], [3, 3, 0], [0, 0, 0]]),  # padding is not a token
    }
    got = version_metrics(batch, step=4)
    assert got["actor/version_lag_mean"] == pytest.approx((2 + 2 + 0 + 1 + 1) / 5)
    assert got["actor/version_lag_max"] == 2
    assert got["actor/mixed_version_samples"] == pytest.approx(1 / 2)  # of the samples with tokens
    assert version_metrics({fields.RESPONSE_MASK: batch[fields.RESPONSE_MASK]}, step=4) == {}
