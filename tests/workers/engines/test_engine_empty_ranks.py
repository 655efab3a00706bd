"""TrainingEngine when data-parallel ranks hold few or no rows, on real gloo groups (CPU).

A rank without rows takes part in every collective with a dummy row that weighs
nothing, so outputs, loss, grad norm, metrics and updated weights equal one process's
on the same rows (DP=2 with 1 row; DP=4 with 3 GRPO groups of 2, one rank empty). A
non-finite loss on one rank skips the step on every rank, and a row longer than the
model's positions is refused on every rank alike, even one without rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engines_testlib import SMALL, TinyValueModel, full_weights, make_batch, run_ranks, tiny_lm
from torch.distributed.device_mesh import init_device_mesh

from channels import ConfigError
from workers.engines import MESH_DIM_NAMES, TrainingConfig, TrainingEngine, ValueHead
from workers.objectives import LossAggregation, PolicyLoss, ValueLoss, grpo_advantages

torch.set_num_threads(1)

# eps=1: Adam's first update stays proportional to the gradient (see test_engine_single).
CONFIG = {"lr": 1e-3, "eps": 1.0, "grad_clip": 1.0}
POLICY = PolicyLoss(dual_clip=3.0, kl_coef=0.05)
ONE_ROW = (slice(0, 1), slice(1, 1))  # DP=2: rank 1 has no rows
GROUPS = (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 6))  # DP=4: 3 groups of 2


def _mesh(dp: int):
    return init_device_mesh("cpu", (1, dp, 1), mesh_dim_names=MESH_DIM_NAMES)


def _grpo_batch() -> dict[str, torch.Tensor]:
    batch = make_batch(rows=6, seed=4)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.0])
    groups = torch.arange(6) // 2
    batch["advantages"] = grpo_advantages(scores, groups, mask=batch["response_mask"])
    return batch


def _long_batch() -> dict[str, torch.Tensor]:
    batch = make_batch(rows=1, prompt=30, response=7)
    batch["prompt_mask"].fill_(1)  # 30 + 7 tokens > SMALL's 32 positions
    return batch


def _run(batch: dict, *, mesh, config: dict) -> dict:
    """An LM's log-probs and train step, a value model's values and train step."""
    lm = TrainingEngine(
        tiny_lm(**SMALL), config=TrainingConfig(**CONFIG, **config), mesh=mesh, loss=POLICY
    )
    logprobs, entropy = lm.log_probs(batch)
    metrics = lm.train_step(batch)
    critic = TrainingEngine(
        TinyValueModel(**SMALL), config=TrainingConfig(**CONFIG, **config), mesh=mesh,
        head=ValueHead(), loss=ValueLoss(),
    )  # fmt: skip
    values = critic.values(batch)
    critic_metrics = critic.train_step(batch)
    return {
        "logprobs": logprobs, "entropy": entropy, "metrics": metrics, "weights": full_weights(lm),
        "values": values, "critic_metrics": critic_metrics, "critic_weights": full_weights(critic),
    }  # fmt: skip


def _one_row_ranks(rank: int, out: Path) -> None:
    mesh = _mesh(2)
    batch = {k: v[ONE_ROW[rank]] for k, v in make_batch(rows=1).items()}
    result = _run(batch, mesh=mesh, config={"max_tokens_per_micro_batch": 8})

    # Rank 1's advantages are NaN: the global loss is NaN, every rank skips the step.
    lm = TrainingEngine(tiny_lm(**SMALL), config=TrainingConfig(**CONFIG), mesh=mesh, loss=POLICY)
    before = full_weights(lm)
    nan_batch = {k: v[rank : rank + 1] for k, v in make_batch(rows=2).items()}
    if rank == 1:
        nan_batch["advantages"] = torch.full_like(nan_batch["advantages"], float("nan"))
    result["nan_metrics"] = lm.train_step(nan_batch)
    result["nan_step"] = lm.step
    result["nan_unchanged"] = all(
        torch.equal(t, before[n]) for n, t in full_weights(lm).items()
    )

    # Rank 0's row is too long, rank 1 has none. Sharded: both raise, neither waits.
    long = {k: v[ONE_ROW[rank]] for k, v in _long_batch().items()}
    sharded = TrainingEngine(tiny_lm(**SMALL), config=TrainingConfig(**CONFIG, data_parallel="shard"), mesh=mesh,
                             loss=POLICY)
    with pytest.raises(ConfigError, match="max_position_embeddings is 32") as info:
        sharded.log_probs(long)
    result["long_error"] = str(info.value)
    result["after_error"] = sharded.log_probs(batch)[0]  # the group is still in step
    # Replicated: the inference talks to no peer, so rank 0 raises alone and rank 1,
    # which has no row, returns.
    try:
        result["replica_long"] = lm.log_probs(long)[0].shape
    except ConfigError as error:
        result["replica_long"] = str(error)
    result["replica_after_error"] = lm.log_probs(batch)[0]

    # No rank has a row: sharded or replicated, every rank skips the step (after a
    # real one, Adam's momentum would move the weights even on a zero gradient).
    empty = {k: v[:0] for k, v in batch.items()}
    result["empty_unchanged"] = []
    for engine in (lm, sharded):
        engine.train_step(batch)
        before, steps = full_weights(engine), engine.step
        skipped = engine.train_step(empty)["step_skipped"]
        unchanged = all(torch.equal(t, before[n]) for n, t in full_weights(engine).items())
        result["empty_unchanged"].append(skipped == 1.0 and engine.step == steps and unchanged)
    torch.save(result, out / f"one_row{rank}.pt")


def _grpo_ranks(rank: int, out: Path) -> None:
    batch = {k: v[GROUPS[rank]] for k, v in _grpo_batch().items()}
    config = {"micro_batch_size": 1, "loss_aggregation": LossAggregation.SEQ_MEAN_TOKEN_MEAN}
    torch.save(_run(batch, mesh=_mesh(4), config=config), out / f"grpo{rank}.pt")


def _assert_same_run(got: dict, expected: dict, rows: slice) -> None:
    for name in ("logprobs", "entropy", "values"):
        assert got[name].shape == expected[name][rows].shape, name
        torch.testing.assert_close(got[name], expected[name][rows], rtol=1e-5, atol=1e-6)
    for key in ("metrics", "critic_metrics"):
        assert set(got[key]) == set(expected[key]), key
        for name, value in expected[key].items():
            assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, name)
    for key in ("weights", "critic_weights"):
        for name, tensor in expected[key].items():
            torch.testing.assert_close(got[key][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_rank_without_rows_changes_nothing_and_sharded_errors_reach_every_rank(tmp_path: Path) -> None:
    out = run_ranks(2, _one_row_ranks, tmp_path)
    batch = make_batch(rows=1)
    expected = _run(batch, mesh=None, config={"max_tokens_per_micro_batch": 8})
    assert expected["metrics"]["step_skipped"] == 0.0
    for rank, rows in enumerate(ONE_ROW):
        got = torch.load(out / f"one_row{rank}.pt", weights_only=False)
        _assert_same_run(got, expected, rows)
        assert got["nan_metrics"]["step_skipped"] == 1.0 and got["nan_step"] == 0
        assert got["nan_unchanged"]
        assert "a row has 37 prompt + response tokens" in got["long_error"]
        assert got["after_error"].shape == got["replica_after_error"].shape == (rows.stop - rows.start, 7)
        assert ("a row has 37 prompt + response tokens" in got["replica_long"] if rank == 0
                else got["replica_long"] == (0, 7))
        assert got["empty_unchanged"] == [True, True]
    single = TrainingEngine(tiny_lm(**SMALL), config=TrainingConfig())
    with pytest.raises(ConfigError, match="max_position_embeddings is 32"):
        single.log_probs(_long_batch())


def test_three_grpo_groups_on_four_ranks_equal_one_process(tmp_path: Path) -> None:
    out = run_ranks(4, _grpo_ranks, tmp_path)
    config = {"micro_batch_size": 1, "loss_aggregation": LossAggregation.SEQ_MEAN_TOKEN_MEAN}
    expected = _run(_grpo_batch(), mesh=None, config=config)
    for rank, rows in enumerate(GROUPS):
        _assert_same_run(torch.load(out / f"grpo{rank}.pt", weights_only=False), expected, rows)


def test_empty_batch_in_one_process_returns_empty_outputs() -> None:
    empty = {k: v[:0] for k, v in make_batch(rows=2).items()}
    lm = TrainingEngine(tiny_lm(**SMALL), config=TrainingConfig(**CONFIG), loss=POLICY)
    before = full_weights(lm)
    logprobs, entropy = lm.log_probs(empty)
    assert logprobs.shape == entropy.shape == (0, 7)
    metrics = lm.train_step(empty)
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0 and metrics["step_skipped"] == 1.0
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    for name, tensor in full_weights(lm).items():  # zero gradient, and Adam's first
        torch.testing.assert_close(tensor, before[name], rtol=0, atol=0)  # step is 0 then
