"""Rows, futures, streams and metrics on an accelerator, seen from a CPU machine.

The roles' calls of GRPO and PPO steps run on in-process workers whose device is
the fake accelerator of ``tests/fake_device.py``: its tensors refuse to mix with
CPU tensors as CUDA's do, so code that builds an index or a metric on the CPU and
combines it with rows on the device fails here as it failed on a GPU. Each step,
a checkpoint saved and loaded, and the exported policy must give what they give on the CPU (the fake device computes with
the CPU's kernels), with the stores keeping rows on the CPU (gloo, object store)
and on the device (NCCL).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import asyncflow as af
import fake_device
from asyncflow.algos import GRPOConfig, PolicyConfig, PPOConfig, SamplingConfig, grpo_step, ppo_step
from asyncflow.runtime._local import LocalSession
from support import ppo_role_specs
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model
from workers.rewards import RuleRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    RewardWorker,
    RolloutWorker,
    RolloutWorkerConfig,
    ScoreConfig,
)

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
POLICY = PolicyConfig(kl_coef=0.01)
FAKE = fake_device.NAME


@pytest.fixture(autouse=True)
def _fake_device() -> None:
    fake_device.require()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


def test_the_fake_device_refuses_cpu_tensors_where_cuda_does() -> None:
    dev = fake_device.device()
    rows = torch.arange(6.0).view(3, 2).to(dev)
    with pytest.raises(RuntimeError, match="same device"):
        rows.index_select(0, torch.tensor([2, 0]))  # workers/_streaming.py's drain did this
    with pytest.raises(RuntimeError, match="same device"):
        _ = rows - torch.ones(3, 2)  # the actor's rollout_consistency did this
    with pytest.raises(RuntimeError, match="generator"):
        torch.rand(3, device=dev, generator=torch.Generator().manual_seed(0))
    # What CUDA accepts: 0-dim CPU tensors, CPU indices in advanced indexing, moves.
    assert (rows * torch.tensor(2.0)).device == dev
    assert rows[torch.tensor([2, 0])].cpu().tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert rows.sum().item() == 15.0 and rows.cpu().device.type == "cpu"
    moved = torch.empty(3, 2)
    moved.copy_(rows)
    assert torch.equal(moved, torch.arange(6.0).view(3, 2))


Step = Callable[[Any, Any, int], Awaitable[dict[str, float]]]
STEPS: dict[str, Step] = {
    "grpo": lambda roles, prompts, s: grpo_step(roles, prompts, GRPOConfig(sampling=SAMPLING, policy=POLICY), seed=s),
    "ppo": lambda roles, prompts, s: ppo_step(roles, prompts, PPOConfig(sampling=SAMPLING, policy=POLICY), seed=s),
    "grpo_streamed": lambda roles, prompts, s: grpo_step(
        roles, prompts, GRPOConfig(sampling=SAMPLING, policy=POLICY), seed=s, stream=af.StreamOptions(micro_batch=2)),
}


def _run_steps(model_dir: str, out_dir: Path, *, device: str, store_on_device: bool) -> dict[str, Any]:
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=8, eval_size=2)).train)

    async def main() -> dict[str, Any]:
        async with LocalSession(device=device, store_on_device=store_on_device) as session:
            roles = await session.spawn(ppo_role_specs(model_dir, af.ResourcePool(name="main", devices=1)))
            out: dict[str, Any] = {}
            for s, (name, step) in enumerate(STEPS.items()):
                columns = prompt_batch(problems[s * 2:(s + 1) * 2], tok, first_uid=10 * s)
                # The second prompt's group finishes first: the rows come back out of order.
                columns["max_new_tokens"] = torch.tensor([SAMPLING.max_new_tokens, 1])
                prompts = await session.put(columns)
                out[name] = await step(roles, prompts, s)
            # Checkpoints and exports of device tensors; a loaded checkpoint trains on.
            await af.gather(roles.actor.save_checkpoint(str(out_dir / "actor")),
                            roles.critic.save_checkpoint(str(out_dir / "critic")))
            await roles.actor.export_hf(str(out_dir / "policy"))
            await af.gather(roles.actor.load_checkpoint(str(out_dir / "actor")),
                            roles.critic.load_checkpoint(str(out_dir / "critic")))
            out["after_load"] = await STEPS["ppo"](roles, prompts, 9)
            rollout = roles.actor.generate(prompts, n=2, params=SAMPLING.params(seed=7))
            out["fetched"] = await rollout.fetch()
            assert session.local is not None
            worker = session.local.workers[0]
            out["param_devices"] = {p.device.type for role in ("actor", "ref", "critic")
                                    for p in worker.roles[role].engine.model.parameters()}
            out["stored_devices"] = {t.device.type for key in list(worker.store._shards)
                                     for t in worker.store.get(key).values()}
            return out
    return asyncio.run(main())


@pytest.fixture(scope="module")
def on_cpu(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out_dir = tmp_path_factory.mktemp("on_cpu")
    return _run_steps(model_dir, out_dir, device="cpu", store_on_device=False) | {"dir": out_dir}


@pytest.mark.parametrize("store_on_device", [False, True], ids=["store_on_cpu", "store_on_device"])
def test_grpo_and_ppo_steps_run_on_an_accelerator_as_on_the_cpu(model_dir: str, on_cpu: dict[str, Any],
                                                                 store_on_device: bool, tmp_path: Path) -> None:
    got = _run_steps(model_dir, tmp_path, device=FAKE, store_on_device=store_on_device)
    assert got["param_devices"] == {FAKE}
    assert got["stored_devices"] == {FAKE if store_on_device else "cpu"}
    for name in (*STEPS, "after_load"):
        assert got[name].keys() == on_cpu[name].keys(), name
        for key, value in on_cpu[name].items():
            assert math.isclose(got[name][key], value, rel_tol=1e-5, abs_tol=1e-6), (name, key)
    # The driver's fetch receives CPU tensors whatever the workers' stores hold.
    fetched = got["fetched"]
    assert {t.device.type for t in fetched.values()} == {"cpu"}
    for key, value in on_cpu["fetched"].items():  # the same samples (log-probs to rounding)
        torch.testing.assert_close(fetched[key], value, rtol=1e-5, atol=1e-5, msg=key)
    exported, expected = (load_file(d / "policy" / "model.safetensors") for d in (tmp_path, on_cpu["dir"]))
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _rollout_after_update(model_dir: str, *, device: str, store_on_device: bool) -> dict[str, torch.Tensor]:
    """An actor without a rollout engine trains one GRPO step (generated by a rollout
    role on another pool), then the rollout role loads its weights and samples."""
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=4, eval_size=2)).train)
    train, gen = af.ResourcePool(name="train", devices=1), af.ResourcePool(name="gen", devices=1)
    specs = {
        "actor": af.RoleSpec(cls=ActorWorker, pool=train, config=ActorConfig(model_dir=model_dir, rollout=None)),
        "rollout": af.RoleSpec(cls=RolloutWorker, pool=gen, config=RolloutWorkerConfig(model_dir=model_dir)),
        "reward": af.RoleSpec(cls=RewardWorker, pool=gen,
                              config=ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir))),
    }

    async def main() -> dict[str, torch.Tensor]:
        async with LocalSession(device=device, store_on_device=store_on_device) as session:
            roles = await session.spawn(specs)
            prompts = await session.put(prompt_batch(problems[:2], tok))
            rollout = roles.rollout.generate(prompts, n=2, params=SAMPLING.params(seed=3))
            await grpo_step(roles, prompts, GRPOConfig(sampling=SAMPLING, policy=PolicyConfig()), rollout=rollout)
            await roles.rollout.load_weights(roles.actor.weights())
            return await roles.rollout.generate(prompts, n=2, params=SAMPLING.params(seed=4)).fetch()
    return asyncio.run(main())


@pytest.mark.parametrize("store_on_device", [False, True], ids=["store_on_cpu", "store_on_device"])
def test_a_rollout_role_loads_an_accelerator_actors_weights(model_dir: str, store_on_device: bool) -> None:
    expected = _rollout_after_update(model_dir, device="cpu", store_on_device=False)
    got = _rollout_after_update(model_dir, device=FAKE, store_on_device=store_on_device)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
