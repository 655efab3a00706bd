"""The precision and memory settings of a run reach the roles: ``[actor]`` and
``[critic]`` ``precision`` and ``activation_checkpointing``, the actor's offload,
the rollout engine's dtype and the reference's and reward model's inference
precision; pools name their device kind, one kind per run."""

from __future__ import annotations

import pytest

from asyncflow.train import load_config
from asyncflow.train._roles import role_specs
from channels import ConfigError
from workers.models import TinyModelConfig, save_tiny_model

MAIN_JOB = "examples/arith_grpo.toml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TinyModelConfig(), seed=0))


def _specs(model_dir: str, **overrides: object) -> dict:
    config = load_config(MAIN_JOB, {"sft": None, "model.path": model_dir, **overrides})
    return {name: spec.config for name, spec in role_specs(config, model_dir).items()}


def test_defaults_follow_the_device(model_dir: str) -> None:
    specs = _specs(model_dir, **{"algorithm.name": "ppo"})
    actor = specs["actor"]
    assert actor.training.precision == "auto" and actor.rollout.dtype == "auto"
    assert not actor.training.activation_checkpointing and not actor.offload_optimizer
    assert specs["ref"].training.precision == "auto"
    assert specs["critic"].training.precision == "auto"


def test_bf16_and_memory_settings_reach_every_role(model_dir: str) -> None:
    specs = _specs(model_dir, **{
        "algorithm.name": "ppo", "actor.precision": "bf16", "actor.activation_checkpointing": True,
        "actor.offload_optimizer": True, "actor.offload_params": True, "critic.precision": "fp32",
        "critic.activation_checkpointing": True, "actor.micro_batch_size": 32})
    actor, ref, critic = specs["actor"], specs["ref"], specs["critic"]
    assert actor.training.precision == "bf16" and actor.training.activation_checkpointing
    assert actor.offload_optimizer and actor.offload_params
    assert actor.rollout.dtype == "bfloat16"  # the rollout samples in the policy's precision
    # The reference infers like the actor, in its micro-batches.
    assert ref.training.precision == "bf16" and ref.training.micro_batch_size == 32
    assert critic.training.precision == "fp32" and critic.training.activation_checkpointing
    fp32 = _specs(model_dir, **{"actor.precision": "fp32", "actor.rollout_engine": "vllm"})
    assert fp32["actor"].rollout.dtype == "float32"


def test_a_reward_model_infers_in_the_policys_precision(model_dir: str) -> None:
    specs = _specs(model_dir, **{"actor.precision": "bf16", "reward.model_dir": model_dir})
    assert specs["reward"].scorer.precision == "bf16"


def test_pools_name_one_device_kind_and_bad_values_name_the_key(model_dir: str) -> None:
    config = load_config(MAIN_JOB, {"sft": None, "model.path": model_dir, "pools.main.device": "cpu"})
    specs = role_specs(config, model_dir)
    assert {spec.pool.device for spec in specs.values()} == {"cpu"}
    with pytest.raises(ConfigError, match="pools mix device kinds"):
        load_config(MAIN_JOB, {"sft": None, "model.path": model_dir, "pools.main.device": "cpu",
                               "pools.side": {"devices": 1, "device": "cuda"}})
    with pytest.raises(ConfigError, match=r"actor\.precision"):
        load_config(MAIN_JOB, {"actor.precision": "fp16"})
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        load_config(MAIN_JOB, {"critic.activation_checkpointing": "yes"})
