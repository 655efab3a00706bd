"""The PPO workload the overlap benchmark and the planner share.

PPO with four roles: the actor (native rollout engine; generation, old log-probs,
update), the reference (log-probs), the critic (values, update) and a reward
model (scores). Everything is synthetic and built here: random-initialised tiny
Llamas (nothing is downloaded) and random prompts. Every response runs to its own
fixed budget (EOS ignored; budgets drawn once from a seeded long-tailed
distribution and the same in every run), so every run of every placement and
mode does exactly the same work: the runs differ by scheduling only.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions
from asyncflow.algos import PolicyConfig, PPOConfig, SamplingConfig, ppo_step
from asyncflow.plan import Placement
from asyncflow.runtime import long_tail_lengths
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, save_tiny_model
from workers.rewards import ModelRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
    RewardWorker,
    ScoreConfig,
)
from workers.rollout import NativeRolloutConfig

ROLES = ("actor", "ref", "critic", "reward")

PLACEMENTS: dict[str, Placement] = {
    "colocate": Placement(pools={"all": 2}, roles=dict.fromkeys(ROLES, "all")),
    "split": Placement(pools={"actor_ref": 1, "critic_reward": 1},
                       roles={"actor": "actor_ref", "ref": "actor_ref", "critic": "critic_reward",
                              "reward": "critic_reward"}),
    "standalone": Placement(pools={r: 1 for r in ROLES}, roles={r: r for r in ROLES}),
}
"""The benchmarked placements on two devices (two cores here)."""


@dataclass(frozen=True, kw_only=True)
class PPOJob:
    """The workload's sizes (defaults: what ``bench.ppo`` measures on 2 cores)."""

    prompts: int = 32
    """Prompts per step (one response each)."""
    prompt_len: int = 8
    median_len: int = 64
    """Median response length; the budgets are long-tailed (p99 about 3x)."""
    max_len: int = 192
    micro_batch: int = 4
    """Rows per streamed micro-batch."""
    actor: TinyModelConfig = field(default_factory=lambda: _llama(128, 256, 4))
    """Actor and reference."""
    critic: TinyModelConfig = field(default_factory=lambda: _llama(128, 256, 4))
    """The actor's shape (a critic is commonly initialised from the policy)."""
    reward: TinyModelConfig = field(default_factory=lambda: _llama(512, 1024, 2))
    """Wider than the policy: scoring a batch costs about 4x the reference's
    log-probs here, so the critic+reward pool has work to overlap with generation
    (streaming), while one call (the score) dominates what that pool does after it."""
    seed: int = 0

    def lengths(self) -> list[int]:
        """Every response's budget, fixed by ``seed``."""
        return long_tail_lengths(self.prompts, median=self.median_len, p99_ratio=3.0, max_len=self.max_len,
                                 seed=self.seed)

    def config(self) -> PPOConfig:
        """PPO's settings: one response per prompt, each to its budget."""
        return PPOConfig(sampling=SamplingConfig(n=1, max_new_tokens=self.max_len, ignore_eos=True),
                         policy=PolicyConfig(kl_coef=0.0), reward_kl_coef=0.05)

    def prompt_columns(self) -> dict[str, torch.Tensor]:
        """Random prompts, each carrying its response budget."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(3, 16, (self.prompts, self.prompt_len), generator=g)
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids),
                "max_new_tokens": torch.tensor(self.lengths(), dtype=torch.int64)}

    def tokens_per_step(self) -> int:
        """Generated tokens per step."""
        return sum(self.lengths())


def _llama(hidden: int, mlp: int, layers: int) -> TinyModelConfig:
    return TinyModelConfig(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                           num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
                           max_position_embeddings=512)


class Models:
    """The workload's model directories (a temporary directory, removed on exit)."""

    def __init__(self, job: PPOJob) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="asyncflow-ppo-")
        root = Path(self._tmp.name)
        self.actor = str(save_tiny_model(root / "actor", job.actor, seed=job.seed))
        self.critic = str(save_tiny_model(root / "critic", job.critic, seed=job.seed + 1))
        self.reward = str(save_tiny_model(root / "reward", job.reward, seed=job.seed + 2))

    def __enter__(self) -> Models:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()


def role_specs(job: PPOJob, models: Models, placement: Placement) -> dict[str, RoleSpec]:
    """The four roles on ``placement``'s pools."""
    pools = {name: ResourcePool(name=name, devices=n) for name, n in placement.pools.items()}
    training = TrainingConfig(lr=1e-4, micro_batch_size=job.prompts)
    built: Mapping[str, tuple[type, Any]] = {
        "actor": (ActorWorker, ActorConfig(model_dir=models.actor, training=training, seed=job.seed,
                                           rollout=NativeRolloutConfig(max_batch_size=job.prompts))),
        "ref": (ReferenceWorker, ReferenceConfig(model_dir=models.actor, replicate=True, training=training)),
        "critic": (CriticWorker, CriticConfig(model_dir=models.critic, training=training, seed=job.seed)),
        "reward": (RewardWorker, ScoreConfig(scorer=ModelRewardConfig(model_dir=models.reward,
                                                                      micro_batch_size=job.prompts))),
    }
    return {role: RoleSpec(cls=cls, pool=pools[placement.roles[role]], config=config)
            for role, (cls, config) in built.items()}


class Runner:
    """Runs the workload's steps in one session (one placement)."""

    def __init__(self, job: PPOJob, session: af.Session, roles: Any, prompts: Any) -> None:
        self.job, self.session, self.roles, self.prompts = job, session, roles, prompts
        self._steps = 0

    @classmethod
    async def start(cls, job: PPOJob, models: Models, placement: Placement, session: af.Session) -> Runner:
        """Spawn the roles and put the prompts on the actor's pool."""
        roles = await session.spawn(role_specs(job, models, placement))
        prompts = await session.put(job.prompt_columns(), pool=placement.roles["actor"])
        return cls(job, session, roles, prompts)

    async def step(self, *, stream: bool = False) -> dict[str, float]:
        """One PPO step (``asyncflow.algos.ppo_step``): overlapped, or with
        ``session.serial`` on, sequential."""
        self._steps += 1
        self.session.mark_step()
        options = StreamOptions(micro_batch=self.job.micro_batch, migrate=None) if stream else None
        return await ppo_step(self.roles, self.prompts, self.job.config(), seed=self.job.seed + self._steps,
                              stream=options)

    async def steps(self, n: int, *, stream: bool = False) -> float:
        """Run ``n`` steps; their wall-clock seconds."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(n):
            await self.step(stream=stream)
        return loop.time() - start
