"""Turning a :class:`RunConfig` into placed roles."""

from __future__ import annotations

import dataclasses
from typing import Literal

import msgspec

from asyncflow.runtime import ResourcePool, RoleSpec
from asyncflow.train._config import (
    OptimSection,
    RunConfig,
    ScoreSection,
    episode_config,
    hybrid_actor,
    needed_roles,
    reward_of,
)
from channels import GenerationLayout, Layout
from workers.engines import TrainingConfig
from workers.rewards import ModelRewardConfig, RuleRewardConfig
from workers.roles import (
    ROLLOUT_DTYPES,
    ActorConfig,
    ActorWorker,
    CostWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
    RewardWorker,
    RolloutWorker,
    RolloutWorkerConfig,
    ScoreConfig,
    UpdateConfig,
)
from workers.rollout import NativeRolloutConfig, VLLMRolloutConfig


def _training(o: OptimSection, *, reversed_pipeline: bool = False) -> TrainingConfig:
    return TrainingConfig(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                          warmup_steps=o.warmup_steps, micro_batch_size=o.micro_batch_size,
                          precision=o.precision, activation_checkpointing=o.activation_checkpointing,
                          pipeline_chunks=o.pipeline_chunks, pipeline_reversed=reversed_pipeline)


def _critic_reversed(config: RunConfig) -> bool:
    """Whether the critic's pipeline runs the other way than the actor's: when they
    share a pool's pipeline stages (``p`` above 1, the same ``t``, one chunk each),
    so that their updates can run as one fused schedule (PPO's ``fuse_updates``)."""
    actor, critic = config.placement.get("actor"), config.placement.get("critic")
    if actor is None or critic is None or actor.pool != critic.pool or actor.p < 2:
        return False
    return ((actor.p, actor.t) == (critic.p, critic.t)
            and config.actor.pipeline_chunks == config.critic.pipeline_chunks == 1)


def _update(o: OptimSection) -> UpdateConfig:
    return UpdateConfig(epochs=o.epochs, mini_batches=o.mini_batches)


def _scorer(s: ScoreSection, model_dir: str, precision: Literal["auto", "fp32", "bf16"] = "auto") -> ScoreConfig:
    if s.model_dir:  # a reward or cost model infers in the policy's precision
        return ScoreConfig(scorer=ModelRewardConfig(model_dir=s.model_dir, precision=precision))
    weighted = s.weighted
    timeout_s = s.timeout_s or None
    if len(weighted) == 1 and weighted[0].weight == 1.0:
        return ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir, fn=weighted[0].function,
                                                   timeout_s=timeout_s))
    return ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir, fn=[w.function for w in weighted],
                                               weights=[w.weight for w in weighted], timeout_s=timeout_s))


def role_specs(config: RunConfig, model_dir: str, *, context: int = 0) -> dict[str, RoleSpec]:
    """Every role the run's algorithm needs, placed as ``[placement]`` says (a role it
    leaves out goes to the first pool); ``context``: the longest prompt plus its
    response, in tokens (vLLM's ``max_model_len``; 0: vLLM's default here)."""
    pools = {name: ResourcePool(name=name, devices=p.devices, threads=p.threads, device=p.device, labels=p.labels)
             for name, p in config.pools.items()}
    first = next(iter(config.pools))
    a = config.actor
    # A rollout role on another pool has no training precision to follow: it gets it spelled out.
    dtype = "auto" if a.precision == "auto" else ROLLOUT_DTYPES[a.precision]
    vllm = VLLMRolloutConfig(seed=config.seed, dtype=dtype)
    if context:
        vllm = msgspec.structs.replace(vllm, max_model_len=max(context, vllm.max_model_len))
    rollout = (vllm if a.rollout_engine == "vllm"
               else NativeRolloutConfig(max_batch_size=a.rollout_batch_size, seed=config.seed, dtype=dtype))
    hybrid = hybrid_actor(config)
    disaggregated = "rollout" in config.placement  # the actor trains, the rollout role generates
    episodes = episode_config(config)
    # The hybrid engine reshards tensor-parallel shards: data-parallel ranks keep theirs whole.
    actor_training = dataclasses.replace(_training(a), data_parallel="replicate") if hybrid else _training(a)
    build = {
        "actor": lambda: (ActorWorker, ActorConfig(model_dir=model_dir, training=actor_training, update=_update(a),
                                                   rollout=None if disaggregated else rollout, seed=config.seed,
                                                   engine=a.engine, offload_optimizer=a.offload_optimizer,
                                                   offload_params=a.offload_params,
                                                   episodes=None if disaggregated else episodes)),
        "rollout": lambda: (RolloutWorker, RolloutWorkerConfig(model_dir=model_dir, rollout=rollout,
                                                               seed=config.seed, episodes=episodes)),
        # The reference infers in the actor's precision and micro-batches.
        "ref": lambda: (ReferenceWorker, ReferenceConfig(
            model_dir=model_dir, seed=config.seed, engine=a.engine,
            training=TrainingConfig(micro_batch_size=a.micro_batch_size, precision=a.precision))),
        "critic": lambda: (CriticWorker, CriticConfig(model_dir=model_dir,
                                                      training=_training(config.critic,
                                                                         reversed_pipeline=_critic_reversed(config)),
                                                      update=_update(config.critic), seed=config.seed,
                                                      engine=config.critic.engine)),
        "cost_critic": lambda: (CriticWorker, CriticConfig(model_dir=model_dir, training=_training(config.critic),
                                                           update=_update(config.critic), seed=config.seed + 1,
                                                           engine=config.critic.engine)),
        "reward": lambda: (RewardWorker, _scorer(reward_of(config), model_dir, a.precision)),
        "cost": lambda: (CostWorker, _scorer(config.cost, model_dir, a.precision)),
    }
    specs = {}
    for role in needed_roles(config):
        place = config.placement.get(role)
        pool = pools[place.pool if place else first]
        gen = (GenerationLayout(pg=place.gen.p, tg=place.gen.t, grouping=place.gen.grouping)
               if place and place.gen else None)
        layout = Layout.fill(pool.devices, p=place.p, t=place.t, gen=gen) if place else None
        cls, role_config = build[role]()
        specs[role] = RoleSpec(cls=cls, pool=pool, layout=layout, config=role_config)
    return specs
