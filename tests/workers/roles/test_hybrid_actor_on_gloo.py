"""The actor with a generation layout (the hybrid engine) on real gloo groups: trained
in 1-2-1 generating in 1-1-2-1, trained in 1-4-1 generating in 1-2-2-1 (tensor
parallel generation), and trained in two pipeline stages (2-1-1) generating in
1-1-2-1, it samples the same greedy tokens as a one-rank actor with
the same weights, before and after an update, and its update equals the one-rank
update."""

from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from roles_testlib import advantages_for, local_ctx, prompt_columns, run_ranks
from torch.distributed.tensor import DTensor

from channels import Batch, ConfigError, GenerationLayout, Layout
from workers import WorkerContext
from workers.engines import MESH_DIM_NAMES, TrainingConfig
from workers.host._meshes import mesh_from_groups, new_reconnectable_group
from workers.models import TinyModelConfig, save_tiny_model
from workers.roles import ActorConfig, ActorWorker
from workers.rollout import SamplingParams

torch.set_num_threads(1)

MODEL = TinyModelConfig(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                        head_dim=32, num_hidden_layers=2)
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
LAYOUTS = {
    "121-1121": Layout(t=2, gen=GenerationLayout(tg=1)),
    "141-1221": Layout(t=4, gen=GenerationLayout(tg=2)),
    "211-1121": Layout(p=2, gen=GenerationLayout(tg=1)),  # two pipeline stages, whole weights to generate
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("policy"), MODEL, seed=0))


def _config(model_dir: str) -> ActorConfig:
    # Small buckets: the weights move in many gathers.
    # eps=1 keeps Adam's first update proportional to the gradient: float noise in a
    # near-zero gradient stays noise (see test_training_on_gloo).
    return ActorConfig(model_dir=model_dir, training=TrainingConfig(lr=1e-2, eps=1.0), sampling=GREEDY,
                       reshard_bucket_mb=0.01)


def _rows(actor: ActorWorker) -> Batch:
    rows = actor.generate(Batch(prompt_columns()), n=2)
    return Batch({**rows, "advantages": advantages_for(rows)})


def _steps(actor: ActorWorker) -> dict:
    """Generate, update on those rows, generate again; every rank gets every row."""
    first = actor.generate(Batch(prompt_columns()), n=2)
    metrics = actor.update(Batch({**first, "advantages": advantages_for(first)}))
    weights = {n: t.detach().clone() for n, t in actor.engine.named_full_weights()}
    second = actor.generate(Batch(prompt_columns()), n=2)
    return {"first": first["response_ids"], "metrics": metrics, "weights": weights,
            "second": second["response_ids"], "stats": actor._hybrid.last if actor._hybrid else None}


def _rollout_bytes(actor: ActorWorker) -> int:
    params = actor.rollout.model.parameters()  # type: ignore[attr-defined]
    return sum((p._local_tensor if isinstance(p, DTensor) else p).nbytes for p in params)


def _rank(rank: int, out: Path, *, layout: str, model_dir: str) -> None:
    lay = LAYOUTS[layout]
    ranks = list(range(lay.world))
    timeout = timedelta(seconds=60)
    grid = torch.tensor(ranks).view(lay.p, lay.d, lay.t)
    ctx = WorkerContext(role="actor", pool="policy", rank=rank, world_size=lay.world, global_rank=rank,
                        layout=lay, device=torch.device("cpu"),
                        process_group=new_reconnectable_group(tuple(ranks), timeout),
                        mesh=mesh_from_groups(grid, MESH_DIM_NAMES, "cpu", timeout))
    actor = ActorWorker(ctx, _config(model_dir))
    assert _rollout_bytes(actor) == 0  # no weights between generations
    tensor_parallel = any(isinstance(p, DTensor) for p in actor.rollout.model.parameters())  # type: ignore[attr-defined]
    assert tensor_parallel == (lay.generation.tg > 1)
    result = _steps(actor)
    assert _rollout_bytes(actor) == 0
    torch.save(result, out / f"rank{rank}.pt")


def _sharded_rank(rank: int, out: Path, *, model_dir: str) -> None:
    lay = Layout(d=2, gen=GenerationLayout(tg=1))
    timeout = timedelta(seconds=60)
    ctx = WorkerContext(role="actor", pool="policy", rank=rank, world_size=2, global_rank=rank, layout=lay,
                        device=torch.device("cpu"), process_group=new_reconnectable_group((0, 1), timeout),
                        mesh=mesh_from_groups(torch.tensor([0, 1]).view(1, 2, 1), MESH_DIM_NAMES, "cpu", timeout))
    config = dataclasses.replace(_config(model_dir), training=TrainingConfig(data_parallel="shard"))
    with pytest.raises(ConfigError, match="data_parallel='replicate'"):
        ActorWorker(ctx, config)


def test_the_hybrid_engine_refuses_weights_sharded_over_data_parallel_ranks(model_dir: str,
                                                                           tmp_path: Path) -> None:
    # FSDP2 shards over the data-parallel mesh alone: not a tensor-parallel split.
    run_ranks(2, functools.partial(_sharded_rank, model_dir=model_dir), tmp_path)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hybrid_actor_generates_and_trains_like_one_rank(layout: str, model_dir: str, tmp_path: Path) -> None:
    world = LAYOUTS[layout].world
    out = run_ranks(world, functools.partial(_rank, layout=layout, model_dir=model_dir), tmp_path)
    expected = _steps(ActorWorker(local_ctx("actor"), _config(model_dir)))
    for rank in range(world):
        got = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert torch.equal(got["first"], expected["first"]), (rank, got["first"], expected["first"])
        assert torch.equal(got["second"], expected["second"]), (rank, got["second"], expected["second"])
        assert not torch.equal(got["second"], got["first"])  # the update changed the policy
        for key, value in expected["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        for name, tensor in expected["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        stats = got["stats"]
        assert stats is not None and stats.sent_bytes > 0
