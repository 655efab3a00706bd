"""Every algorithm runs two steps under three placements, with no change to the
algorithm's code: all roles on one pool; actor+reference | critic+reward (+cost);
every role on its own pool. Real Ray workers, real tiny models, real rewards."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import asyncflow as af
from asyncflow.algos import (
    DAPOConfig,
    GRPOConfig,
    PolicyConfig,
    PPOConfig,
    ReMaxConfig,
    RLOOConfig,
    SafeRLHFConfig,
    SafeRLHFState,
    SamplingConfig,
    dapo_step,
    grpo_step,
    ppo_step,
    remax_step,
    rloo_step,
    safe_rlhf_step,
)
from support import cost_of_long_answers
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model
from workers.rewards import RuleRewardConfig
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

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
SAMPLING = SamplingConfig(n=2, temperature=1.0, max_new_tokens=4)
POLICY = PolicyConfig(kl_coef=0.01)
ROLES = ("actor", "ref", "critic", "cost_critic", "reward", "cost")

pytestmark = pytest.mark.usefixtures("shared_ray")  # one Ray instance for the module's sessions


PLACEMENTS = {
    "one_pool": {r: "all" for r in ROLES},
    "actor_ref|critic_reward": {"actor": "policy", "ref": "policy", "critic": "scoring",
                                "cost_critic": "scoring", "reward": "scoring", "cost": "scoring"},
    "own_pools": {r: r for r in ROLES},
}


def _specs(model_dir: str, placement: dict[str, str]) -> dict[str, af.RoleSpec]:
    pools = {name: af.ResourcePool(name=name, devices=1) for name in set(placement.values())}
    rule = RuleRewardConfig(tokenizer_dir=model_dir)
    cost = RuleRewardConfig(tokenizer_dir=model_dir, fn=cost_of_long_answers)
    made = {
        "actor": (ActorWorker, ActorConfig(model_dir=model_dir)),
        "ref": (ReferenceWorker, ReferenceConfig(model_dir=model_dir)),
        "critic": (CriticWorker, CriticConfig(model_dir=model_dir)),
        "cost_critic": (CriticWorker, CriticConfig(model_dir=model_dir, seed=1)),
        "reward": (RewardWorker, ScoreConfig(scorer=rule)),
        "cost": (CostWorker, ScoreConfig(scorer=cost)),
    }
    return {r: af.RoleSpec(cls=made[r][0], pool=pools[placement[r]], config=made[r][1]) for r in ROLES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_algorithm_runs_two_steps(placement, model_dir) -> None:
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=16, eval_size=4)).train)

    async def main():
        async with af.Session(cpu_slots=16) as session:
            roles = await session.spawn(_specs(model_dir, PLACEMENTS[placement]))
            state = SafeRLHFState(lagrange=1.0)
            steps = {
                "grpo": lambda p, s: grpo_step(roles, p, GRPOConfig(sampling=SAMPLING, policy=POLICY), seed=s),
                "ppo": lambda p, s: ppo_step(roles, p, PPOConfig(sampling=SAMPLING, policy=POLICY), seed=s),
                "remax": lambda p, s: remax_step(roles, p, ReMaxConfig(sampling=SAMPLING, policy=POLICY), seed=s),
                "safe_rlhf": lambda p, s: safe_rlhf_step(
                    roles, p, SafeRLHFConfig(sampling=SAMPLING, policy=POLICY, cost_limit=0.1), state=state, seed=s),
            }
            out, traces = {}, {}
            for name, step in steps.items():
                for s in range(2):
                    batch = problems[s * 4:(s + 1) * 4]
                    prompts = await session.put(prompt_batch(batch, tok, first_uid=100 * s))
                    if s == 1:
                        await session.start_trace()
                    out[(name, s)] = await step(prompts, s)
                traces[name] = session.stop_trace()
            return out, traces, state.lagrange

    results, traces, lagrange = asyncio_run(main())
    for (name, _), metrics in results.items():
        assert metrics, name
        assert all(math.isfinite(v) for v in metrics.values()), (name, metrics)
        assert "actor/loss" in metrics, (name, sorted(metrics))
    assert "critic/loss" in results[("ppo", 1)] and "reward/mean" in results[("ppo", 1)]
    assert lagrange != 1.0  # the multiplier moved with the observed cost
    # Each step asks for its score statistics before its updates: on a shared pool
    # they run right behind the scores, not after the updates.
    for name, trace in traces.items():
        stats = [c for c in trace.calls if c.method == "stats"]
        updates = [c for c in trace.calls if c.method == "update"]
        assert stats and updates, name
        assert max(c.place for c in stats) < min(c.place for c in updates), name
        if placement == "one_pool":
            assert max(c.started for c in stats) <= min(c.started for c in updates), name


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def test_prompts_for_grpo_keep_groups_whole_across_ranks(model_dir) -> None:
    """With two actor ranks, every prompt's n samples land on one rank (the group
    advantages would be wrong otherwise), and a data-parallel consumer of the
    rollout on two ranks gets whole groups too: 5 groups of 3 split 3 + 2 groups,
    9 and 6 rows (a split group would give 8 and 7)."""
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=8, eval_size=2)).train)

    async def main():
        async with af.Session(cpu_slots=8) as session:
            pool = af.ResourcePool(name="two", devices=2)
            roles = await session.spawn({
                "actor": af.RoleSpec(cls=ActorWorker, pool=pool, config=ActorConfig(model_dir=model_dir)),
                "reward": af.RoleSpec(cls=RewardWorker, pool=pool,
                                      config=ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir))),
            })
            prompts = await session.put(prompt_batch(problems[:5], tok))
            await session.start_trace()
            rollout = roles.actor.generate(prompts, n=3, params=SAMPLING.params(seed=1))
            meta = await rollout
            await roles.reward.score(rollout)
            trace = session.stop_trace()
            rows = await rollout.fetch()
            return meta, rows, trace

    meta, rows, trace = asyncio_run(main())
    assert meta.group_size == 3 and meta.num_rows == 15
    assert torch.equal(rows["uid"].view(5, 3), rows["uid"].view(5, 3)[:, :1].expand(5, 3))
    per_rank = {c.method: sorted((r.rank, r.rows_in, r.rows) for r in c.ranks) for c in trace.calls}
    assert set(per_rank) == {"generate", "score"}, per_rank
    # generate: 3 and 2 prompts in, their 9 and 6 samples out; score: the same rows in.
    assert per_rank["generate"] == [(0, 3, 9), (1, 2, 6)], per_rank
    assert per_rank["score"] == [(0, 9, 9), (1, 6, 6)], per_rank


def test_streamed_grpo_and_ppo_steps_train_exactly_as_the_batch_steps(model_dir) -> None:
    """Two copies of each trained role start equal; one takes batch steps, the
    other streamed steps (inference per micro-batch, on another pool): the metrics
    of every step agree, so the updates saw the same rows in the same order."""
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=16, eval_size=4)).train)
    policy, scoring = af.ResourcePool(name="policy", devices=1), af.ResourcePool(name="scoring", devices=1)
    rule = ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir))

    def copies(tag: str, pool: af.ResourcePool) -> dict[str, af.RoleSpec]:
        return {f"actor{tag}": af.RoleSpec(cls=ActorWorker, pool=policy, config=ActorConfig(model_dir=model_dir)),
                f"ref{tag}": af.RoleSpec(cls=ReferenceWorker, pool=pool, config=ReferenceConfig(model_dir=model_dir)),
                f"critic{tag}": af.RoleSpec(cls=CriticWorker, pool=pool, config=CriticConfig(model_dir=model_dir))}

    async def main():
        async with af.Session(cpu_slots=8) as session:
            roles = await session.spawn({**copies("_batch", scoring), **copies("_stream", scoring),
                                         "reward": af.RoleSpec(cls=RewardWorker, pool=scoring, config=rule)})
            out: dict[tuple[str, str, int], dict[str, float]] = {}
            calls: dict[str, Counter[str]] = {}
            for mode, stream in (("batch", None), ("stream", af.StreamOptions(micro_batch=2))):
                await session.start_trace()
                mine = {"actor": roles[f"actor_{mode}"], "ref": roles[f"ref_{mode}"],
                        "critic": roles[f"critic_{mode}"], "reward": roles.reward}
                for s in range(2):
                    prompts = await session.put(prompt_batch(problems[s * 4:(s + 1) * 4], tok, first_uid=100 * s))
                    grpo = GRPOConfig(sampling=SAMPLING, policy=POLICY)
                    out[("grpo", mode, s)] = await grpo_step(mine, prompts, grpo, seed=s, stream=stream)
                    ppo = PPOConfig(sampling=SAMPLING, policy=POLICY)
                    out[("ppo", mode, s)] = await ppo_step(mine, prompts, ppo, seed=10 + s, stream=stream)
                calls[mode] = Counter(c.role.split("_")[0] + "." + c.method for c in session.stop_trace().calls)
            return out, calls

    out, calls = asyncio_run(main())
    # Streamed, the roles on the scoring pool run per micro-batch (4 prompts x 2
    # samples in micro-batches of 2: 4 calls a step); the actor's log-probs, on the
    # generating pool, once a PPO step on the whole batch (GRPO's update takes them
    # from its own forward: no call).
    assert calls["batch"]["ref.log_prob"] == 4 and calls["batch"]["actor.log_prob"] == 2
    assert calls["stream"]["actor.log_prob"] == 2
    assert calls["stream"]["ref.log_prob"] > 4 and calls["stream"]["critic.values"] > 2, calls
    for algo in ("grpo", "ppo"):
        for s in range(2):
            batch, streamed = out[(algo, "batch", s)], out[(algo, "stream", s)]
            assert batch.keys() == streamed.keys(), (algo, s)
            for k in batch:
                # Log-probs of a micro-batch and of the whole batch differ by float rounding.
                assert math.isclose(batch[k], streamed[k], rel_tol=1e-5, abs_tol=1e-6), (algo, s, k)


def test_dapo_fills_its_batch_from_further_prompts_and_rloo_trains(model_dir) -> None:
    """DAPO drops prompt groups whose rewards are all equal and draws further
    prompt batches until it has the step's number of groups; RLOO takes a step."""
    tok = CharTokenizer.from_pretrained(model_dir)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=64, eval_size=4)).train)
    varied = RuleRewardConfig(tokenizer_dir=model_dir, fn=cost_of_long_answers)  # differs by response length

    async def main():
        async with af.Session(cpu_slots=8) as session:
            pool = af.ResourcePool(name="all", devices=1)
            roles = await session.spawn({
                "actor": af.RoleSpec(cls=ActorWorker, pool=pool, config=ActorConfig(model_dir=model_dir)),
                "reward": af.RoleSpec(cls=RewardWorker, pool=pool, config=ScoreConfig(scorer=varied)),
            })
            drawn = 0

            async def more():
                nonlocal drawn
                drawn += 1
                batch = problems[(drawn - 1) * 4:drawn * 4]
                return await session.put(prompt_batch(batch, tok, first_uid=100 * drawn))

            dapo = DAPOConfig(sampling=SamplingConfig(n=2, temperature=1.0, max_new_tokens=4), max_rounds=8,
                              overlong_buffer=2)
            first = await dapo_step(roles, await more(), dapo, seed=1, more=more)
            rloo = await rloo_step(roles, await more(), RLOOConfig(sampling=SAMPLING), seed=2)
            return first, rloo, drawn

    dapo, rloo, drawn = asyncio_run(main())
    assert dapo["dapo/batch_groups"] == 4.0, dapo  # full, from dapo/rounds prompt batches
    assert dapo["dapo/sampled_groups"] == 4 * dapo["dapo/rounds"] and dapo["dapo/kept_fraction"] <= 1.0
    assert drawn == dapo["dapo/rounds"] + 1  # RLOO's batch was the last one drawn
    assert "actor/loss" in dapo and math.isfinite(dapo["actor/loss"])
    assert "actor/loss" in rloo and "reward/mean" in rloo
