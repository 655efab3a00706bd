"""The roles in bf16 with activation checkpointing, and the actor's offload during
generation, on in-process workers: the rollout engine samples in the policy's
precision, the reference stores bf16 weights without an optimizer, bf16 training
stays close to fp32's, and offloading changes nothing but where the state waits."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

import asyncflow as af
from asyncflow.algos import GRPOConfig, PolicyConfig, PPOConfig, SamplingConfig, grpo_step, ppo_step
from asyncflow.runtime._local import LocalSession
from support import ppo_role_specs
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.engines import TrainingConfig, TrainingEngine
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=32, num_hidden_layers=2)
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
POLICY = PolicyConfig(kl_coef=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def _steps(model_dir: str, *, precision: str = "fp32", checkpointing: bool = False,
           offload: bool = False) -> dict[str, Any]:
    training = TrainingConfig(lr=1e-3, precision=precision, activation_checkpointing=checkpointing,  # type: ignore[arg-type]
                              micro_batch_size=4)
    specs = ppo_role_specs(model_dir, af.ResourcePool(name="main", devices=1), training=training,
                           offload_optimizer=offload)
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=16, eval_size=2)).train)

    async def main() -> dict[str, Any]:
        async with LocalSession() as session:
            roles = await session.spawn(specs)
            out: dict[str, Any] = {}
            for s in range(2):
                prompts = await session.put(prompt_batch(problems[s * 4:(s + 1) * 4], tok, first_uid=10 * s))
                out[f"grpo{s}"] = await grpo_step(roles, prompts, GRPOConfig(sampling=SAMPLING, policy=POLICY), seed=s)
                out[f"ppo{s}"] = await ppo_step(roles, prompts, PPOConfig(sampling=SAMPLING, policy=POLICY), seed=s)
            assert session.local is not None
            hosted = session.local.workers[0].roles
            out["dtypes"] = {
                "actor": {p.dtype for p in hosted["actor"].engine.model.parameters()},
                "actor optimizer": {t.dtype for st in hosted["actor"].engine.optimizer.state.values()
                                    for t in st.values() if t.dim() > 0},
                "rollout": {p.dtype for p in hosted["actor"].rollout.model.parameters()},
                "ref": {p.dtype for p in hosted["ref"].engine.model.parameters()},
            }
            out["ref optimizer"] = hosted["ref"].engine.optimizer
            out["actor precision"] = hosted["actor"].engine.precision
            return out
    return asyncio.run(main())


@pytest.fixture(scope="module")
def fp32(model_dir: str) -> dict[str, Any]:
    return _steps(model_dir)


def test_bf16_roles_train_close_to_fp32_and_sample_in_bf16(model_dir: str, fp32: dict[str, Any]) -> None:
    bf16 = _steps(model_dir, precision="bf16", checkpointing=True)
    assert bf16["actor precision"] == "bf16" and fp32["actor precision"] == "fp32"
    assert bf16["dtypes"] == {"actor": {torch.float32}, "actor optimizer": {torch.float32},
                              "rollout": {torch.bfloat16}, "ref": {torch.bfloat16}}
    assert fp32["dtypes"]["rollout"] == fp32["dtypes"]["ref"] == {torch.float32}
    assert bf16["ref optimizer"] is None and fp32["ref optimizer"] is None  # the reference never trains
    for step in ("grpo0", "ppo0", "grpo1", "ppo1"):
        got, expected = bf16[step], fp32[step]
        assert all(math.isfinite(v) for v in got.values()), step
        # The rollout samples in bf16 and training computes in bf16: their log-probs
        # differ by bf16 rounding, where fp32's agree to float32 rounding.
        assert expected["actor/logprob_mismatch"] < 1e-4 < got["actor/logprob_mismatch"] < 0.1, step
    # The first step's samples are the same tokens or nearly; its losses agree to bf16 rounding.
    for key in ("actor/loss", "critic/loss"):
        step = "grpo0" if key == "actor/loss" else "ppo0"
        assert bf16[step][key] == pytest.approx(fp32[step][key], rel=0.05, abs=0.02), key


def test_offloading_during_generation_changes_no_result(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU engine's offload is a no-op (its state is in host memory already); here
    it frees the optimizer state's storages as on a GPU, so that any use of them
    while the actor generates fails, and the steps must still be those of a run that
    keeps its state. (Parameters loaded from safetensors on the CPU are memory-mapped
    and cannot be freed; the engine's own tests move parameters.)"""
    moves: list[tuple[str, bool]] = []

    def offload(self: TrainingEngine, *, params: bool = False) -> None:
        moves.append(("offload", params))
        self._offloader.offload(params=params)

    def reload(self: TrainingEngine) -> None:
        moves.append(("reload", self._offloader.params_offloaded))
        self._offloader.reload()

    kept = _steps(model_dir)
    monkeypatch.setattr(TrainingEngine, "offload", offload)
    monkeypatch.setattr(TrainingEngine, "reload", reload)
    offloaded = _steps(model_dir, offload=True)
    assert moves == [("offload", False), ("reload", False)] * 4  # around each step's generation
    for step in ("grpo0", "ppo0", "grpo1", "ppo1"):
        assert offloaded[step] == kept[step], step
