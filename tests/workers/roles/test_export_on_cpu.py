"""export_hf of the trained roles on real Ray workers and gloo groups (CPU).

The pools are laid out so that neither exporting role holds the session's rank 0
(``first`` gets it): transformers writes a model only on rank 0 of the default
process group, and an export must still be written by the role's own pool rank 0.
The exported policy directory is self-contained: ``transformers`` loads it and its
greedy generations equal the actor's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import torch
from roles_testlib import TINY, prompt_columns
from transformers import AutoModelForCausalLM, AutoTokenizer

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec
from workers.engines import TrainingConfig, TrainingEngine, ValueHead
from workers.models import VALUE_HEAD_FILE, load_model, save_tiny_model
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
)
from workers.rollout import SamplingParams

# The transform below lives in this file, which workers cannot import.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FIRST = ResourcePool(name="first", devices=1)
POLICY = ResourcePool(name="policy", devices=2)
AUX = ResourcePool(name="aux", devices=1)
R = 6
GREEDY = SamplingParams(max_new_tokens=R, temperature=0.0)


@af.transform(reads=("response_mask",), writes=("advantages", "returns"))
def fixed_advantages(batch):
    """Advantages alternating +1 / -1 by row (enough to move the weights)."""
    mask = batch["response_mask"].float()
    sign = 1.0 - 2.0 * (torch.arange(mask.shape[0]) % 2).float()
    return {"advantages": sign[:, None] * mask, "returns": mask}


@pytest.fixture(scope="module")
def env(loop_thread, tmp_path_factory, shared_ray):
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("policy"), TINY, seed=0))
    session = af.Session()
    roles = loop_thread.run(_start(session, model_dir))
    yield loop_thread, session, roles, model_dir, tmp_path_factory.mktemp("export")
    loop_thread.run(session.close())


async def _start(session: af.Session, model_dir: str) -> af.Roles:
    await session.__aenter__()
    training = TrainingConfig(lr=1e-2)
    return await session.spawn({
        "ref": RoleSpec(cls=ReferenceWorker, pool=FIRST, config=ReferenceConfig(model_dir=model_dir)),
        "actor": RoleSpec(cls=ActorWorker, pool=POLICY, config=ActorConfig(
            model_dir=model_dir, training=training,
            sampling=SamplingParams(max_new_tokens=R, temperature=1.0))),
        "critic": RoleSpec(cls=CriticWorker, pool=AUX, config=CriticConfig(
            model_dir=model_dir, training=training)),
        # A full copy on each rank: no engine group, yet one rank must write.
        "replicated": RoleSpec(cls=CriticWorker, pool=POLICY, config=CriticConfig(
            model_dir=model_dir, head_seed=3, replicate=True)),
    })


def _hf_greedy(model: torch.nn.Module, prompt: list[int], eos: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=R, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_an_exported_policy_generates_what_the_actor_generates(env) -> None:
    lt, session, roles, model_dir, tmp = env
    actor_dir, critic_dir, replicated_dir = (str(tmp / name) for name in ("actor", "critic", "replicated"))

    async def main():
        src = await session.put(prompt_columns(), pool=POLICY)
        rollout = roles.actor.generate(src, n=2)
        batch = af.merge(rollout, roles.actor.log_prob(rollout),
                         roles.critic.values(rollout)).map(fixed_advantages)
        await af.gather(roles.actor.update(batch), roles.critic.update(batch))
        greedy = await roles.actor.generate(src, params=GREEDY).fetch()
        await af.gather(roles.actor.export_hf(actor_dir), roles.critic.export_hf(critic_dir),
                        roles.replicated.export_hf(replicated_dir))
        return (greedy, await roles.critic.values(rollout).fetch(),
                await roles.replicated.values(rollout).fetch(), await rollout.fetch())

    greedy, values, replicated_values, rollout = lt.run(main())
    out = Path(actor_dir)
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file(), name
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(exported.state_dict().values(),
                                                     original.state_dict().values(), strict=True)), \
        "the export holds the trained weights, not the initial ones"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("12+30=")["input_ids"], skip_special_tokens=True) == "12+30="
    eos = exported.generation_config.eos_token_id
    assert greedy["response_mask"].sum(dim=1).max() > 1, "responses long enough to compare"
    for row in range(greedy["prompt_ids"].shape[0]):
        prompt = greedy["prompt_ids"][row][greedy["prompt_mask"][row].bool()].tolist()
        response = greedy["response_ids"][row][greedy["response_mask"][row].bool()].tolist()
        assert _hf_greedy(exported, prompt, eos) == response, row

    # The critics' exports (pools without the session's rank 0) predict their values.
    for directory, expected in ((critic_dir, values), (replicated_dir, replicated_values)):
        assert (Path(directory) / VALUE_HEAD_FILE).is_file(), directory
        critic = TrainingEngine(load_model(directory, kind="value"), config=TrainingConfig(),
                                head=ValueHead())
        torch.testing.assert_close(critic.values(rollout), expected["values"], atol=1e-5, rtol=0)
