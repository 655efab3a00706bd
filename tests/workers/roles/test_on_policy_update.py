"""``actor.update`` without ``old_logprobs`` (on-policy: no ``log_prob`` call) makes
the same update as with them: same loss and metrics, same parameters after."""

from __future__ import annotations

import pytest
import torch
from roles_testlib import TINY, advantages_for, local_ctx, prompt_columns

from channels import Batch
from workers.engines import TrainingConfig
from workers.models import save_tiny_model
from workers.objectives import PolicyLoss
from workers.roles import ActorConfig, ActorWorker, UpdateConfig
from workers.rollout import SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))


def _actor(model_dir: str, micro_batch_size: int) -> ActorWorker:
    training = TrainingConfig(lr=1e-2, micro_batch_size=micro_batch_size)
    config = ActorConfig(model_dir=model_dir, training=training,
                         sampling=SamplingParams(max_new_tokens=6, temperature=1.0))
    return ActorWorker(local_ctx("actor"), config)


@pytest.mark.parametrize(("micro_batch_size", "schedule"), [
    (64, UpdateConfig()),                                    # one step, one micro-batch
    # One step accumulated over micro-batches; unshuffled, so that log_prob's pass
    # pads its micro-batches alike (else old_logprobs move by float rounding).
    (3, UpdateConfig(shuffle=False)),
    (4, UpdateConfig(epochs=2, mini_batches=2)),             # several steps: a no-grad pass first
])
def test_update_without_old_logprobs_equals_the_update_with_log_prob(model_dir: str, micro_batch_size: int,
                                                                     schedule: UpdateConfig) -> None:
    with_pass, without = _actor(model_dir, micro_batch_size), _actor(model_dir, micro_batch_size)
    rollout = with_pass.generate(Batch(prompt_columns()), n=3)
    old = with_pass.log_prob(Batch(rollout))["old_logprobs"]
    # A reference a little off the policy, so the KL term and its metric are not 0.
    ref = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * rollout["response_mask"]
    rows = {**rollout, "advantages": advantages_for(rollout), "ref_logprobs": ref}
    loss = PolicyLoss(kl_coef=0.1, entropy_coef=0.01, clip_ratio_low=0.1)
    for update in range(2):  # the second starts from weights the first changed
        got_with = with_pass.update(Batch({**rows, "old_logprobs": with_pass.log_prob(Batch(rows))["old_logprobs"]}),
                                    loss=loss, schedule=schedule)
        got_without = without.update(Batch(rows), loss=loss, schedule=schedule)
        assert got_with.keys() == got_without.keys()
        for key, value in got_with.items():
            # The mismatch is float noise (1e-7) on the current policy's samples.
            noise = 1e-6 if key.startswith("actor/logprob_mismatch") else 1e-7
            assert got_without[key] == pytest.approx(value, rel=1e-5, abs=noise), key
        assert got_without["actor/kl_to_ref"] > 0
        if update == 0:  # the rows are the current policy's samples
            assert got_without["actor/logprob_mismatch"] < 1e-5
        for (name, a), (_, b) in zip(with_pass.engine.model.named_parameters(),
                                     without.engine.model.named_parameters(), strict=True):
            assert torch.equal(a, b), name
    # The rollout engine got the new weights too: the same greedy samples.
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert torch.equal(with_pass.generate(Batch(prompt_columns()), params=greedy)["response_ids"],
                       without.generate(Batch(prompt_columns()), params=greedy)["response_ids"])
