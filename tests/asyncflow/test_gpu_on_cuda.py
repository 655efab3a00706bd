"""GRPO and PPO through Ray on CUDA workers, in bf16, batch and streamed; rows between
two GPU pools over NCCL. GPU-marked: skipped without CUDA (``make gpu-check`` runs
them); the same calls run on every CPU CI run on a fake accelerator
(``test_device_discipline.py``)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

import asyncflow as af
from asyncflow.algos import GRPOConfig, PolicyConfig, PPOConfig, SamplingConfig, grpo_step, ppo_step
from support import ppo_role_specs
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.engines import TrainingConfig
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TINY = TinyModelConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, num_hidden_layers=2)
SAMPLING = SamplingConfig(n=4, temperature=1.0, max_new_tokens=4)
BF16 = TrainingConfig(lr=1e-4, precision="bf16", micro_batch_size=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _train(model_dir: str, pools: tuple[af.ResourcePool, af.ResourcePool]) -> tuple[str, dict[str, Any]]:
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=32, eval_size=4)).train)

    async def main() -> tuple[str, dict[str, Any]]:
        async with af.Session() as session:
            roles = await session.spawn(ppo_role_specs(model_dir, *pools, training=BF16))
            out: dict[str, Any] = {}
            policy = PolicyConfig(kl_coef=0.01)
            for s, stream in enumerate((None, af.StreamOptions(micro_batch=8))):
                mode = "stream" if stream else "batch"
                prompts = await session.put(prompt_batch(problems[s * 8:(s + 1) * 8], tok, first_uid=100 * s))
                out[f"grpo_{mode}"] = await grpo_step(roles, prompts, GRPOConfig(sampling=SAMPLING, policy=policy),
                                                      seed=s, stream=stream)
                out[f"ppo_{mode}"] = await ppo_step(roles, prompts, PPOConfig(sampling=SAMPLING, policy=policy),
                                                    seed=s, stream=stream)
            out["fetched"] = await roles.actor.generate(prompts, n=2, params=SAMPLING.params(seed=1)).fetch()
            return session.transport, out
    return asyncio.run(main())


def _check(out: dict[str, Any]) -> None:
    for name in ("grpo_batch", "grpo_stream", "ppo_batch", "ppo_stream"):
        metrics = out[name]
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
        # bf16 compute: the rollout and the training engine agree to bf16 rounding.
        assert metrics["actor/logprob_mismatch"] < 0.05, (name, metrics["actor/logprob_mismatch"])
    assert "critic/loss" in out["ppo_batch"]
    assert {t.device.type for t in out["fetched"].values()} == {"cpu"}


def test_grpo_and_ppo_train_on_one_gpu_in_bf16(model_dir: str) -> None:
    pool = af.ResourcePool(name="gpu", devices=1, device="cuda")
    _, out = _train(model_dir, (pool, pool))
    _check(out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_rows_move_between_two_gpu_pools_over_nccl(model_dir: str) -> None:
    policy = af.ResourcePool(name="policy", devices=1, device="cuda")
    scoring = af.ResourcePool(name="scoring", devices=1, device="cuda")
    transport, out = _train(model_dir, (policy, scoring))
    assert transport == "nccl"
    _check(out)
