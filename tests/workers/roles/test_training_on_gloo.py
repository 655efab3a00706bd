"""The roles' update loop and rollout metrics over real gloo groups (CPU), against one
process on the same rows: results must not depend on how rows are spread over the
data-parallel ranks, including ranks without rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from roles_testlib import random_rows, run_ranks, small_lm
from torch.distributed.device_mesh import init_device_mesh

from channels import Batch, ConfigError
from workers.engines import MESH_DIM_NAMES, TrainingConfig, TrainingEngine
from workers.objectives import LossAggregation, PolicyLoss, grpo_advantages
from workers.roles._actor import rollout_consistency
from workers.roles._training import UpdateConfig, run_updates

torch.set_num_threads(1)

LOSS = PolicyLoss(kl_coef=0.05)
FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", *LOSS.required_fields)
# eps=1 keeps Adam's first update proportional to the gradient (see test_engine_single).
CONFIG = {"lr": 1e-3, "eps": 1.0, "micro_batch_size": 2}
UNEVEN = (slice(0, 3), slice(3, 4))
ONE_ROW = (slice(0, 1), slice(1, 1))
GROUPS = (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 6))


def _engine(mesh, **config: object) -> TrainingEngine:
    return TrainingEngine(small_lm(), config=TrainingConfig(**CONFIG, **config), mesh=mesh, loss=LOSS)


def _updates(engine: TrainingEngine, rows: dict, schedule: UpdateConfig) -> dict:
    metrics = run_updates(engine, rows, loss=LOSS, fields=FIELDS, schedule=schedule,
                          generator=torch.Generator().manual_seed(0), prefix="actor/")
    weights = {n: t.detach().cpu().clone() for n, t in engine.named_full_weights()}
    return {"metrics": metrics, "weights": weights}


def _grpo_rows() -> dict[str, torch.Tensor]:
    rows = random_rows(6, seed=3)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.0])
    rows["advantages"] = grpo_advantages(scores, torch.arange(6) // 2, mask=rows["response_mask"])
    return rows


SCHEDULES = {  # scenario: (rows, slices by dp rank, schedule, engine settings)
    "one_row": (lambda: random_rows(1), ONE_ROW, UpdateConfig(epochs=2), {}),
    "uneven": (lambda: random_rows(4), UNEVEN, UpdateConfig(epochs=2, mini_batches=2, shuffle=False), {}),
    "grpo": (_grpo_rows, GROUPS, UpdateConfig(epochs=2, mini_batches=2, shuffle=False),
             {"loss_aggregation": LossAggregation.SEQ_MEAN_TOKEN_MEAN}),
}


def _mesh(dp: int):
    return init_device_mesh("cpu", (1, dp, 1), mesh_dim_names=MESH_DIM_NAMES)


def _two_ranks(rank: int, out: Path) -> None:
    mesh, result = _mesh(2), {}
    for name in ("one_row", "uneven"):
        make, slices, schedule, settings = SCHEDULES[name]
        rows = {k: v[slices[rank]] for k, v in make().items()}
        result[name] = _updates(_engine(mesh, **settings), rows, schedule)
    engine = _engine(mesh)
    uneven = {k: v[UNEVEN[rank]] for k, v in random_rows(4).items()}
    result["consistency"] = rollout_consistency(Batch(uneven), engine)
    one = {k: v[ONE_ROW[rank]] for k, v in random_rows(1).items()}
    with pytest.raises(ConfigError, match=r"1 rows .* UpdateConfig\.mini_batches=2"):
        run_updates(engine, one, loss=LOSS, fields=FIELDS, schedule=UpdateConfig(mini_batches=2),
                    generator=torch.Generator(), prefix="actor/")
    nan = {k: v[UNEVEN[rank]] for k, v in random_rows(4).items()}
    if rank == 1:
        nan["advantages"] = torch.full_like(nan["advantages"], float("nan"))
    result["nan"] = _updates(engine, nan, UpdateConfig(epochs=2))["metrics"]
    # One mini-batch and no row on any rank: no collective counts the rows; the
    # engine skips the step on every rank alike.
    none = {k: v[:0] for k, v in random_rows(1).items()}
    result["no_rows"] = run_updates(engine, none, loss=LOSS, fields=FIELDS, schedule=UpdateConfig(),
                                    generator=torch.Generator(), prefix="actor/")
    torch.save(result, out / f"rank{rank}.pt")


def _four_ranks(rank: int, out: Path) -> None:
    make, slices, schedule, settings = SCHEDULES["grpo"]
    rows = {k: v[slices[rank]] for k, v in make().items()}
    torch.save(_updates(_engine(_mesh(4), **settings), rows, schedule), out / f"rank{rank}.pt")


def _assert_same(got: dict, expected: dict) -> None:
    assert set(got["metrics"]) == set(expected["metrics"])
    for key, value in expected["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _single(name: str) -> dict:
    make, _, schedule, settings = SCHEDULES[name]
    return _updates(_engine(None, **settings), make(), schedule)


def test_updates_and_rollout_metrics_on_two_ranks_equal_one_process(tmp_path: Path) -> None:
    out = run_ranks(2, _two_ranks, tmp_path)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    consistency = rollout_consistency(Batch(random_rows(4)), _engine(None))
    assert {"actor/logprob_mismatch", "actor/logprob_mismatch_max", "actor/kl_to_ref"} <= set(consistency)
    for name in ("one_row", "uneven"):
        expected = _single(name)
        assert expected["metrics"]["actor/steps"] == 2.0 * SCHEDULES[name][2].mini_batches
        assert expected["metrics"]["actor/steps_skipped"] == 0.0
        for got in ranks:
            _assert_same(got[name], expected)
    tokens = [r["consistency"].pop("actor/response_tokens") for r in ranks]
    assert sum(tokens) == consistency.pop("actor/response_tokens")  # per rank, summed by Metrics
    for got in ranks:
        assert got["consistency"] == pytest.approx(consistency, rel=1e-9)
        assert got["nan"]["actor/steps_skipped"] == 2.0 and got["nan"]["actor/steps"] == 2.0
        assert got["no_rows"]["actor/steps_skipped"] == 1.0 and got["no_rows"]["actor/steps"] == 1.0


def test_updates_of_three_grpo_groups_on_four_ranks_equal_one_process(tmp_path: Path) -> None:
    out = run_ranks(4, _four_ranks, tmp_path)
    expected = _single("grpo")
    for rank in range(4):
        _assert_same(torch.load(out / f"rank{rank}.pt", weights_only=False), expected)
