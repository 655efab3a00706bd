"""TrainingEngine with pipeline stages (``pp`` 2 and 4, 1F1B and interleaved) over
real gloo process groups: log-probs, values, metrics and weights equal one process's.

Each rank keeps its stage's layers under their own names, so its weights compare
with the single process's by name."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from engines_testlib import EXACT, TinyValueModel, make_batch, run_ranks, tiny_lm
from torch.distributed.device_mesh import init_device_mesh

from workers.engines import MESH_DIM_NAMES, EngineConfigError, TrainingConfig, TrainingEngine, ValueHead
from workers.objectives import PolicyLoss, ValueLoss

torch.set_num_threads(1)

CONFIG = EXACT | {"grad_clip": 1.0}
LOSS = PolicyLoss(dual_clip=3.0, kl_coef=0.05)
LAYERS = 4


def _weights(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """This rank's parameters by the whole model's names (a chunk's index dropped)."""
    chunks = engine.config.pipeline_chunks
    return {(name.split(".", 1)[1] if chunks > 1 else name): p.detach().clone()
            for name, p in engine.model.named_parameters()}


def _run(engine: TrainingEngine, steps: int) -> dict:
    batch = make_batch()
    logprobs, entropy = engine.log_probs(batch)
    metrics = [engine.train_step(batch) for _ in range(steps)]
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics, "weights": _weights(engine)}


def _critic_run(engine: TrainingEngine) -> dict:
    batch = make_batch()
    values = engine.values(batch)
    return {"values": values, "metrics": [engine.train_step(batch)], "weights": _weights(engine)}


def _pipeline_ranks(rank: int, out: Path, *, pp: int, chunks: int, micro: int) -> None:
    mesh = init_device_mesh("cpu", (pp, 1, 1), mesh_dim_names=MESH_DIM_NAMES)
    config = TrainingConfig(**CONFIG, micro_batch_size=micro, pipeline_chunks=chunks)
    actor = TrainingEngine(tiny_lm(layers=LAYERS), config=config, mesh=mesh, loss=LOSS)
    result = {"actor": _run(actor, steps=2)}
    with pytest.raises(EngineConfigError, match="pipeline stages .* planned"):
        actor.save(out / "ckpt")
    if chunks == 1:
        critic = TrainingEngine(TinyValueModel(layers=LAYERS), config=config, mesh=mesh, head=ValueHead(),
                                loss=ValueLoss())
        result["critic"] = _critic_run(critic)
    torch.save(result, out / f"pp{rank}.pt")


def _assert_close_metrics(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize(("pp", "chunks", "micro"), [(2, 1, 3), (2, 2, 3), (4, 1, 2)],
                         ids=["pp2-1f1b", "pp2-interleaved", "pp4-1f1b"])
def test_pipelined_engine_equals_one_process(tmp_path: Path, pp: int, chunks: int, micro: int) -> None:
    out = run_ranks(pp, functools.partial(_pipeline_ranks, pp=pp, chunks=chunks, micro=micro), tmp_path)
    config = TrainingConfig(**CONFIG, micro_batch_size=micro)
    expected = _run(TrainingEngine(tiny_lm(layers=LAYERS), config=config, loss=LOSS), steps=2)
    critic = _critic_run(TrainingEngine(TinyValueModel(layers=LAYERS), config=config, head=ValueHead(),
                                        loss=ValueLoss()))
    seen: set[str] = set()
    for rank in range(pp):
        got = torch.load(out / f"pp{rank}.pt", weights_only=False)
        for role, reference in [("actor", expected)] + ([("critic", critic)] if chunks == 1 else []):
            mine = got[role]
            for field in ("logprobs", "entropy", "values"):
                if field in reference:  # every stage returns the last stage's outputs
                    torch.testing.assert_close(mine[field], reference[field], rtol=1e-5, atol=1e-6)
            for got_m, exp_m in zip(mine["metrics"], reference["metrics"], strict=True):
                _assert_close_metrics(got_m, exp_m)
            for name, tensor in mine["weights"].items():
                torch.testing.assert_close(tensor, reference["weights"][name], rtol=1e-5, atol=1e-5, msg=name)
                seen.add(f"{role}:{name}")
    # The stages together hold every parameter once.
    assert seen == {f"actor:{n}" for n in expected["weights"]} | (
        {f"critic:{n}" for n in critic["weights"]} if chunks == 1 else set())
