"""The RLHF roles on real Ray workers and gloo groups (CPU).

One session serves the module: a 2-rank pool ``train`` (actor with FSDP over two
data-parallel ranks, reference replicated and sharded) and a 1-rank pool ``aux`` (critic, rule reward,
reward model, cost model, and a reward whose function raises), so checkpoints also
run on pools smaller than the session's process group.
"""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from roles_testlib import TINY, prompt_columns

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from workers.engines import TrainingConfig
from workers.models import save_tiny_model
from workers.rewards import ModelRewardConfig, RuleRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CostWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
    RewardWorker,
    ScoreConfig,
)
from workers.rollout import SamplingParams

# The raising reward function below lives in this file, which workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TRAIN = ResourcePool(name="train", devices=2)
AUX = ResourcePool(name="aux", devices=1)
R = 6
GREEDY = SamplingParams(max_new_tokens=R, temperature=0.0)


def fails_on_42(prompts: list[str], responses: list[str], answers: list[str]) -> list[float]:
    """A rule reward with a bug: it cannot handle the answer 42."""
    return [float(int(a) // (int(a) - 42) > 0) for a in answers]


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))
    session = af.Session()
    roles = loop_thread.run(_start(session, model_dir))
    yield loop_thread, session, roles, tmp_path_factory.mktemp("ckpt")
    loop_thread.run(session.close())


async def _start(session: af.Session, model_dir: str) -> af.Roles:
    await session.__aenter__()
    training = TrainingConfig(lr=1e-2)
    rule = RuleRewardConfig(fn="workers.rewards:arithmetic_reward", tokenizer_dir=model_dir)
    return await session.spawn({
        "actor": RoleSpec(cls=ActorWorker, pool=TRAIN, config=ActorConfig(
            model_dir=model_dir, training=training,
            sampling=SamplingParams(max_new_tokens=R, temperature=1.0))),
        "ref": RoleSpec(cls=ReferenceWorker, pool=TRAIN, config=ReferenceConfig(model_dir=model_dir)),
        "ref_sharded": RoleSpec(cls=ReferenceWorker, pool=TRAIN, config=ReferenceConfig(
            model_dir=model_dir, training=TrainingConfig(data_parallel="shard"))),
        "critic": RoleSpec(cls=CriticWorker, pool=AUX, config=CriticConfig(
            model_dir=model_dir, training=training)),
        "reward": RoleSpec(cls=RewardWorker, pool=AUX, config=ScoreConfig(scorer=rule)),
        "rm": RoleSpec(cls=RewardWorker, pool=AUX, config=ScoreConfig(
            scorer=ModelRewardConfig(model_dir=model_dir, head_seed=1))),
        "cost": RoleSpec(cls=CostWorker, pool=AUX, config=ScoreConfig(
            scorer=ModelRewardConfig(model_dir=model_dir, head_seed=2))),
        "bad": RoleSpec(cls=RewardWorker, pool=AUX, config=ScoreConfig(
            scorer=RuleRewardConfig(fn=fails_on_42, tokenizer_dir=model_dir))),
    })


@af.transform(reads=("response_mask", "scores"), writes=("advantages", "returns"))
def outcome_advantages(batch):
    """The score on every response token (enough to move the weights)."""
    mask = batch["response_mask"].float()
    centred = batch["scores"] - batch["scores"].mean() + 0.5
    return {"advantages": centred[:, None] * mask, "returns": batch["scores"][:, None] * mask}


def test_a_ppo_step_through_every_role(env) -> None:
    lt, session, roles, _ = env
    n, prompts = 4, prompt_columns()

    async def main():
        src = await session.put(prompts, pool=TRAIN)
        before = roles.actor.generate(src, params=GREEDY)
        rollout = roles.actor.generate(src, n=n)
        old = roles.actor.log_prob(rollout)
        ref = roles.ref.log_prob(rollout)
        values = roles.critic.values(rollout)
        scores = roles.reward.score(rollout)
        rm, cost = roles.rm.score(rollout), roles.cost.score(rollout)
        batch = af.merge(rollout, old, ref, values, scores).map(outcome_advantages)
        a, c = await af.gather(roles.actor.update(batch), roles.critic.update(batch))
        after = roles.actor.generate(src, params=GREEDY)
        rows = await af.merge(rollout, old, ref, values, scores, rm.rename(scores="rm_scores"), cost).fetch()
        return (rows, await before.fetch(), await after.fetch(),
                await roles.actor.log_prob(before).fetch(), await roles.actor.log_prob(after).fetch(), a, c)

    rows, before, after, moved, after_lp, a, c = lt.run(main())
    count = n * len(prompts["uid"])
    # generate: n consecutive samples per prompt, prompt columns carried along.
    assert torch.equal(rows["uid"], prompts["uid"].repeat_interleave(n))
    assert torch.equal(rows["answer_ids"], prompts["answer_ids"].repeat_interleave(n, dim=0))
    for name, dtype in [("response_ids", torch.int64), ("response_mask", torch.int64),
                        ("rollout_logprobs", torch.float32), ("old_logprobs", torch.float32),
                        ("ref_logprobs", torch.float32), ("values", torch.float32)]:
        assert rows[name].shape == (count, R) and rows[name].dtype == dtype, name
    for name in ("scores", "rm_scores", "costs"):
        assert rows[name].shape == (count,) and rows[name].dtype == torch.float32, name
    assert set(rows["scores"].tolist()) <= {0.0, 1.0}
    # FSDP training engine over 2 ranks and the full-copy rollout engines agree.
    torch.testing.assert_close(rows["old_logprobs"], rows["rollout_logprobs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows["ref_logprobs"], rows["old_logprobs"], atol=1e-6, rtol=0)
    assert a["actor/steps"] == 1.0 and "critic/loss" in c
    # The update moved the weights, and the rollout engines of both ranks got them.
    assert (moved["old_logprobs"] - before["rollout_logprobs"]).abs().max() > 1e-3
    torch.testing.assert_close(after_lp["old_logprobs"], after["rollout_logprobs"], atol=1e-5, rtol=0)


def test_the_reference_is_rank_local_where_each_rank_holds_the_whole_model(env) -> None:
    lt, session, roles, _ = env

    async def main():
        src = await session.put(prompt_columns(), pool=TRAIN)
        await session.start_trace()
        rollout = roles.actor.generate(src, n=2)
        whole, sharded = roles.ref.log_prob(rollout), roles.ref_sharded.log_prob(rollout)
        rows = await af.merge(whole, sharded.rename(ref_logprobs="sharded")).fetch()
        return rows, session.stop_trace()

    rows, trace = lt.run(main())
    # The tiny model is replicated over the two data-parallel ranks by default
    # (TrainingConfig.data_parallel="auto"): its log_prob needs no other rank. Sharded
    # by FSDP2, every rank takes part in each forward.
    assert {c.role: c.rank_local for c in trace.calls if c.method == "log_prob"} == {
        "ref": True, "ref_sharded": False}
    torch.testing.assert_close(rows["sharded"], rows["ref_logprobs"], atol=1e-6, rtol=0)


def test_a_raising_reward_function_names_itself_the_sample_and_its_uid(env) -> None:
    lt, session, roles, _ = env

    async def main():
        src = await session.put(prompt_columns(), pool=TRAIN)
        rollout = roles.actor.generate(src, n=2)
        with pytest.raises(af.RemoteStageError) as info:
            await roles.bad.score(rollout)
        ok = await roles.reward.score(rollout)  # the pool still serves
        return info.value, ok

    err, ok = lt.run(main())
    assert (err.role, err.method, err.rank) == ("bad", "score", 0)
    msg = str(err)
    # Answers are 3, 42, 42, 90, 10 with 2 samples each: sample 2 (uid 11) fails first.
    assert "RewardFunctionError" in msg and "test_roles_on_cpu:fails_on_42" in msg
    assert "sample 2 of the 10" in msg and "(uid 11)" in msg and "ZeroDivisionError" in msg
    assert ok.num_rows == 10


def test_checkpoints_roundtrip_on_both_pools(env) -> None:
    lt, session, roles, tmp = env
    actor_dir, critic_dir = str(tmp / "actor"), str(tmp / "critic")

    async def main():
        src = await session.put(prompt_columns(), pool=TRAIN)
        probe = roles.actor.generate(src, n=2)
        await roles.actor.save_checkpoint(actor_dir)
        await roles.critic.save_checkpoint(critic_dir)
        saved_lp = await roles.actor.log_prob(probe).fetch()
        saved_values = await roles.critic.values(probe).fetch()
        batch = af.merge(probe, roles.actor.log_prob(probe), roles.reward.score(probe),
                         roles.critic.values(probe)).map(outcome_advantages)
        await af.gather(roles.actor.update(batch), roles.critic.update(batch))
        changed = await roles.actor.log_prob(probe).fetch()
        await roles.actor.load_checkpoint(actor_dir)
        await roles.critic.load_checkpoint(critic_dir)
        greedy = roles.actor.generate(src, params=GREEDY)
        return (saved_lp, saved_values, changed, await roles.actor.log_prob(probe).fetch(),
                await roles.critic.values(probe).fetch(), await greedy.fetch(),
                await roles.actor.log_prob(greedy).fetch())

    saved_lp, saved_values, changed, loaded_lp, loaded_values, greedy, greedy_lp = lt.run(main())
    assert (changed["old_logprobs"] - saved_lp["old_logprobs"]).abs().max() > 1e-3
    torch.testing.assert_close(loaded_lp["old_logprobs"], saved_lp["old_logprobs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(loaded_values["values"], saved_values["values"], atol=1e-6, rtol=0)
    # The load reached the rollout engines too.
    torch.testing.assert_close(greedy_lp["old_logprobs"], greedy["rollout_logprobs"], atol=1e-5, rtol=0)
