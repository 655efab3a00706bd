"""Episodes on real Ray workers: the actor (FSDP over two gloo ranks) runs episodes
with an environment; GRPO trains on them, streamed or not; an environment that
raises, one that hangs past its timeout and a malformed tool call each end as
recorded, without failing the step."""

from __future__ import annotations

import asyncio
import sys
import zlib
from collections.abc import Mapping
from typing import Any

import pytest
import ray
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions
from asyncflow.algos import GRPOConfig, SamplingConfig, grpo_step
from support_hf import save_tiny_hf_llama
from workers.engines import TrainingConfig
from workers.episodes import OUTCOMES, EpisodeConfig, ToolEnv
from workers.models import load_prompt_tokenizer
from workers.rewards import RuleRewardConfig
from workers.roles import ActorConfig, ActorWorker, RewardWorker, ScoreConfig
from workers.rollout import SamplingParams

# The environment below lives in this file, which workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAIN = ResourcePool(name="main", devices=2)
KINDS = ("raises", "hangs", "malformed", "fine")
GRADED = 100
"""Prompts from this uid on are ``graded``: as ``fine``, but the last turn's reward
is a score of the model's text, so the samples of a group get different rewards."""


def mul(a: int, b: int) -> int:
    return a * b


class Scripted:
    """What each episode meets depends on its prompt's uid (``KINDS[uid % 4]``, or
    ``graded`` from :data:`GRADED` on)."""

    def __init__(self, answer_on: int = 2) -> None:
        self.answer_on, self.kind, self.turn = answer_on, "", 0
        self.tools = ToolEnv(tools=[mul])

    def reset(self, row: Mapping[str, Any]) -> str:
        uid = int(row["uid"])
        self.kind = "graded" if uid >= GRADED else KINDS[uid % 4]
        return f"Task {row['uid']}: use mul(a, b)."

    async def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        if self.kind == "raises":
            raise ValueError("the calculator service is down")
        if self.kind == "hangs":
            await asyncio.sleep(60)
        if self.turn == 1:  # the model's text stands in for a call here, as the kind says
            call = "mul(12, 3" if self.kind == "malformed" else "mul(12, 3)"
            observation, _, done = await self.tools.step(call)
            return observation, 0.0, done
        if self.kind == "graded":  # in [0, 1), the same for the same text on every run
            return None, zlib.crc32(action.encode()) / 2**32, True
        return None, 1.0, True


@pytest.fixture(scope="module")
def setup(loop_thread: Any, tmp_path_factory: pytest.TempPathFactory, shared_ray: None) -> Any:
    model_dir = str(save_tiny_hf_llama(tmp_path_factory.mktemp("policy"), seed=0))
    session = af.Session()
    episodes = EpisodeConfig(env=Scripted, max_turns=3, max_tokens=160, timeout_s=2.0)
    specs = {
        "actor": RoleSpec(cls=ActorWorker, pool=MAIN, config=ActorConfig(
            model_dir=model_dir, training=TrainingConfig(lr=1e-3), episodes=episodes,
            sampling=SamplingParams(max_new_tokens=8))),
        "reward": RoleSpec(cls=RewardWorker, pool=MAIN, config=ScoreConfig(
            scorer=RuleRewardConfig(fn="workers.episodes:episode_reward", tokenizer_dir=model_dir))),
    }

    async def start() -> af.Roles:
        await session.__aenter__()
        return await session.spawn(specs)

    roles = loop_thread.run(start())
    yield loop_thread, session, roles, load_prompt_tokenizer(model_dir)
    loop_thread.run(session.close())


def _prompts(tokenizer: Any, uids: list[int]) -> dict[str, torch.Tensor]:
    ids = [tokenizer.encode_chat([{"role": "user", "content": f"What is 12 times 3? ({u})"}]) for u in uids]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    return {"prompt_ids": torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
            "prompt_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]),
            "uid": torch.tensor(uids)}


def test_each_failure_ends_only_its_episode_as_recorded(setup: Any) -> None:
    loop, session, roles, tokenizer = setup

    async def go() -> Any:
        prompts = await session.put(_prompts(tokenizer, [0, 1, 2, 3]))
        return await roles.actor.generate(prompts, n=2).fetch()

    rows = loop.run(go())
    outcomes = [OUTCOMES[int(o)] for o in rows["episode_outcome"]]
    assert outcomes == ["error", "error", "timeout", "timeout", "done", "done", "done", "done"]
    assert rows["episode_reward"].tolist() == [0.0] * 4 + [1.0] * 4
    observed = [tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=False)
                for row, mask in zip(rows["response_ids"], rows["observation_mask"], strict=True)]
    for row, text in enumerate(observed[4:6], start=4):  # the malformed call was answered, and the episode went on
        assert "error: the tool call is not valid" in text
        assert rows["episode_turns"][row] == 2
    for text in observed[6:]:
        assert "\n36<|im_end|>" in text
    assert all(text.startswith("<|im_start|>tool\nTask ") for text in observed)


def test_the_actor_reads_the_episode_it_sampled(setup: Any) -> None:
    """The training side's log-probs of the sampled tokens (FSDP over two ranks)
    are the rollout's."""
    loop, session, roles, tokenizer = setup

    async def go() -> Any:
        prompts = await session.put(_prompts(tokenizer, [3, 7, 11, 15]))
        rows = roles.actor.generate(prompts, n=2)
        return await af.merge(rows, roles.actor.log_prob(rows)).fetch()

    rows = loop.run(go())
    sampled = rows["response_mask"].bool()
    assert rows["observation_mask"].any()
    torch.testing.assert_close(rows["old_logprobs"][sampled], rows["rollout_logprobs"][sampled], rtol=0, atol=1e-5)


@pytest.mark.parametrize("stream", [None, StreamOptions(migrate=None)])
def test_grpo_trains_on_episodes(setup: Any, stream: StreamOptions | None) -> None:
    loop, session, roles, tokenizer = setup
    config = GRPOConfig(sampling=SamplingConfig(n=2, max_new_tokens=8))

    async def go() -> tuple[dict[str, float], Any, Any]:
        # Fixed rows whose log-probs the update should move.
        probe = roles.actor.generate(await session.put(_prompts(tokenizer, [3])), n=2)
        before = await af.merge(probe, roles.actor.log_prob(probe)).fetch()
        prompts = await session.put(_prompts(tokenizer, [GRADED + u for u in range(4)]))
        metrics = await grpo_step(roles, prompts, config, seed=1, stream=stream)
        return metrics, before, await roles.actor.log_prob(probe).fetch()

    metrics, before, after = loop.run(go())
    assert metrics["episode/done"] == 1.0 and metrics["episode/turns"] == 2.0  # every episode here ends well
    # The last turn scores the text, so rewards vary and the group-normalised
    # advantages are not all 0 (the gradient is not)...
    assert 0.0 <= metrics["reward/min"] < metrics["reward/max"] < 1.0
    assert metrics["actor/response_tokens"] > 0
    assert all(v == v for v in metrics.values())  # no NaN
    # ...and the update moved the policy.
    assert metrics["actor/steps"] == 1 and metrics["actor/steps_skipped"] == 0
    assert metrics["actor/grad_norm"] > 0
    sampled = before["response_mask"].bool()
    moved = (after["old_logprobs"] - before["old_logprobs"])[sampled].abs().max()
    assert moved > 1e-4, float(moved)
