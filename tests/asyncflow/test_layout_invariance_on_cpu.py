"""The same rows through a 1-rank pool and a 2-rank pool (real Ray workers, gloo):
whitened GAE and Safe-RLHF advantages, update metrics and updated weights of the
actor and the critic, and reward statistics must not depend on the layout; an
update with fewer rows than ranks must finish."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import asyncflow as af
from asyncflow import DP, Batch, ResourcePool, Role, RoleSpec, register
from asyncflow.algos import PolicyConfig, gae, safe_advantages
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, save_tiny_model
from workers.objectives import ValueLoss, gae_advantages, masked_whiten
from workers.rewards import RuleRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    RewardWorker,
    ScoreConfig,
    UpdateConfig,
)

pytestmark = pytest.mark.usefixtures("shared_ray")

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=32, num_hidden_layers=1)
POOLS = {"1": ResourcePool(name="one", devices=1), "2": ResourcePool(name="two", devices=2)}
ROWS, PROMPT, RESPONSE = 5, 4, 6
GAE = {"gamma": 0.9, "lam": 0.8}
# eps=1 keeps Adam's first steps proportional to the gradient (not sign-like), so
# float rounding in the gradient shows up as rounding in the weights; two
# mini-batches of micro-batches of 2 rows: the ranks hold 3 and 2 rows.
TRAINING = TrainingConfig(lr=0.05, eps=1.0, micro_batch_size=2)
SCHEDULE = UpdateConfig(mini_batches=2, shuffle=False)


class Probe(Role):
    """Shows what a consumer's ranks saw after the transforms."""

    @register(protocol=DP(), reads=("advantages", "returns"), writes=("seen_advantages", "seen_returns"))
    def echo(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"seen_advantages": batch["advantages"].clone(), "seen_returns": batch["returns"].clone()}


def _columns() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    prompt_mask = (torch.arange(PROMPT)[None] >= torch.tensor([3, 0, 2, 1, 3])[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < torch.tensor([6, 1, 4, 2, 5])[:, None]).long()

    def per_token(scale: float) -> torch.Tensor:
        return torch.randn(ROWS, RESPONSE, generator=gen) * scale * response_mask

    return {
        "prompt_ids": torch.randint(3, 19, (ROWS, PROMPT), generator=gen) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(3, 19, (ROWS, RESPONSE), generator=gen) * response_mask,
        "response_mask": response_mask,
        "old_logprobs": (-2.0 - torch.rand(ROWS, RESPONSE, generator=gen)) * response_mask,
        "token_rewards": per_token(1.0), "values": per_token(0.5), "cost_values": per_token(0.5),
        "scores": torch.randn(ROWS, generator=gen), "costs": torch.rand(ROWS, generator=gen),
    }


def _specs(model_dir: str) -> dict[str, RoleSpec]:
    specs = {}
    for n, pool in POOLS.items():
        specs |= {
            f"actor{n}": RoleSpec(cls=ActorWorker, pool=pool, config=ActorConfig(
                model_dir=model_dir, training=TRAINING, update=SCHEDULE)),
            f"critic{n}": RoleSpec(cls=CriticWorker, pool=pool, config=CriticConfig(
                model_dir=model_dir, training=TRAINING, update=SCHEDULE,
                loss=ValueLoss(loss_agg="seq-mean-token-sum"))),  # type: ignore[arg-type]
            f"reward{n}": RoleSpec(cls=RewardWorker, pool=pool, config=ScoreConfig(
                scorer=RuleRewardConfig(tokenizer_dir=model_dir))),
            f"probe{n}": RoleSpec(cls=Probe, pool=pool),
        }
    return specs


async def _run(model_dir: str, out: Path) -> dict:
    async with af.Session(cpu_slots=8) as session:
        roles = await session.spawn(_specs(model_dir))
        columns = _columns()
        src = await session.put(columns, pool=POOLS["2"])
        # A filtered batch smaller than the DP size: the first row only.
        first = columns["scores"][0].item()
        one_row = src.filter("scores", lambda s: s == first)
        batch = src.map(gae, **GAE)
        safe = src.map(safe_advantages, lagrange=0.5, **GAE)
        got: dict = {"driver": await batch.fetch(), "safe_driver": await safe.fetch()}
        for n in POOLS:
            actor, critic = roles[f"actor{n}"], roles[f"critic{n}"]
            got[n] = {
                "gae": await roles[f"probe{n}"].echo(batch).fetch(),
                "safe": await roles[f"probe{n}"].echo(safe).fetch(),
                "one_row_gae": await roles[f"probe{n}"].echo(one_row.map(gae, **GAE)).fetch(),
                "stats": await roles[f"reward{n}"].stats(src),
            }
            got[n]["actor"], got[n]["critic"] = await af.gather(
                actor.update(batch, **PolicyConfig().update_kwargs()), critic.update(batch))
            # One row on two ranks: the second rank joins every collective without rows.
            loss = PolicyConfig(loss_agg="seq-mean-token-mean").update_kwargs()  # type: ignore[arg-type]
            got[n]["actor_one_row"], got[n]["critic_one_row"] = await af.gather(
                actor.update(one_row.map(gae, **GAE), **loss, schedule=UpdateConfig()),
                critic.update(one_row.map(gae, **GAE), schedule=UpdateConfig()))
            # Checkpoints hold the weights as trained (an HF export would name them alike).
            await af.gather(actor.save_checkpoint(str(out / f"actor{n}")),
                            critic.save_checkpoint(str(out / f"critic{n}")))
        return got


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of a ``save_checkpoint`` directory, read on the driver."""
    flat = checkpoint.with_suffix(".pt")
    dcp_to_torch_save(checkpoint, flat)
    weights = torch.load(flat, weights_only=False)["model"]
    assert weights, checkpoint
    return weights


def _assert_same_metrics(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key


def test_one_and_two_rank_pools_give_the_same_numbers(tmp_path: Path) -> None:
    model_dir = str(save_tiny_model(tmp_path / "model", TINY, seed=0))
    got = asyncio.run(_run(model_dir, tmp_path))
    one, two = got["1"], got["2"]
    columns = _columns()
    mask = columns["response_mask"]

    # Whitening over every rank's tokens: the 2-rank consumer sees what one rank sees
    # (and what the driver computes on all rows), not a per-rank whitening.
    for kind, driver in (("gae", "driver"), ("safe", "safe_driver")):
        for pool in (one, two):
            torch.testing.assert_close(pool[kind]["seen_advantages"], got[driver]["advantages"], rtol=0, atol=1e-6)
            torch.testing.assert_close(pool[kind]["seen_returns"], got[driver]["returns"], rtol=0, atol=1e-6)
    white = got["driver"]["advantages"][mask.bool()]
    assert abs(float(white.mean())) < 1e-5 and float(white.std()) == pytest.approx(1.0, rel=1e-4)
    raw, _ = gae_advantages(columns["token_rewards"], columns["values"], mask, **GAE)
    per_rank = torch.cat([masked_whiten(raw[:3], mask[:3]), masked_whiten(raw[3:], mask[3:])])
    assert (per_rank - got["driver"]["advantages"]).abs().max() > 1e-2
    torch.testing.assert_close(two["one_row_gae"]["seen_advantages"], one["one_row_gae"]["seen_advantages"],
                               rtol=0, atol=1e-6)

    assert two["stats"] == pytest.approx(one["stats"], rel=1e-12)
    for name in ("actor", "critic", "actor_one_row", "critic_one_row"):
        _assert_same_metrics(two[name], one[name])
    assert one["actor"]["actor/steps"] == 2.0 and two["actor_one_row"]["actor/steps"] == 1.0
    assert two["actor"]["actor/response_tokens"] == float(mask.sum())

    initial = load_file(str(Path(model_dir) / "model.safetensors"))
    for role in ("actor", "critic"):
        w1, w2 = _weights(tmp_path / f"{role}1"), _weights(tmp_path / f"{role}2")
        assert set(w1) == set(w2)
        for name, tensor in w1.items():
            torch.testing.assert_close(w2[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        if role == "actor":
            common = [k for k in initial if k in w1]
            assert common
            moved = max(float((w1[k] - initial[k]).abs().max()) for k in common)
            assert moved > 1e-3  # the updates changed the weights far beyond the tolerance
