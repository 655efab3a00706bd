"""TrainingConfig.activation_checkpointing: blocks recompute in backward and the
gradients do not change, on one process and composed with FSDP2 and TP (2 gloo ranks,
where bf16 mixed precision runs through FSDP2's policy and through autocast)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engines_testlib import EXACT, TinyValueModel, full_weights, make_batch, run_ranks, tiny_lm
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from workers.engines import (
    MESH_DIM_NAMES,
    EngineConfigError,
    TrainingConfig,
    TrainingEngine,
    ValueHead,
)
from workers.objectives import PolicyLoss, ValueLoss

torch.set_num_threads(1)

LOSS = PolicyLoss(kl_coef=0.05, entropy_coef=0.01)


def _grads_and_block_calls(engine: TrainingEngine, block: nn.Module, loss: object) -> tuple[dict, int]:
    """The gradients the optimizer sees in one step, and how often ``block`` ran."""
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in engine.model.named_parameters()}
    engine.optimizer.register_step_pre_hook(  # type: ignore[union-attr]
        lambda opt, _a, _k: grads.update(
            (names[id(p)], p.grad.clone()) for g in opt.param_groups for p in g["params"]
        )
    )
    calls = []
    # A pre-hook: the recompute stops as soon as backward has what it needs, before
    # the block's forward returns, so a forward hook would not see it.
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    engine.train_step(make_batch(), loss=loss)  # type: ignore[arg-type]
    return grads, len(calls)


@pytest.mark.parametrize("value_model", [False, True])
def test_checkpointed_gradients_equal_plain_ones(value_model: bool) -> None:
    results = {}
    for checkpointing in (False, True):
        config = TrainingConfig(**EXACT, micro_batch_size=4, activation_checkpointing=checkpointing)
        if value_model:
            engine = TrainingEngine(TinyValueModel(), config=config, head=ValueHead())
            block, loss = engine.model.backbone.layers[0], ValueLoss()
        else:
            engine = TrainingEngine(tiny_lm(), config=config)
            block, loss = engine.model.model.layers[0], LOSS
        results[checkpointing] = _grads_and_block_calls(engine, block, loss)
    (plain, plain_calls), (checkpointed, checkpointed_calls) = results[False], results[True]
    # Two micro-batches: the block runs once each, and once more in each backward.
    assert (plain_calls, checkpointed_calls) == (2, 4)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-6, msg=name)


def test_checkpointing_needs_a_transformers_model() -> None:
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(EngineConfigError, match=r"activation_checkpointing=True needs a transformers"):
        TrainingEngine(Plain(), config=TrainingConfig(activation_checkpointing=True))


# ------------------------------------------------------------ 2 ranks: FSDP2 and TP

ROWS = (torch.arange(0, 5), torch.arange(5, 8))


def _step(mesh, rows: torch.Tensor | None, **settings: object) -> dict:
    batch = make_batch()
    if rows is not None:
        batch = {k: v[rows] for k, v in batch.items()}
    config = TrainingConfig(**EXACT, micro_batch_size=2, **settings)  # type: ignore[arg-type]
    engine = TrainingEngine(tiny_lm(), config=config, mesh=mesh, loss=LOSS)
    seen: list[torch.dtype] = []
    block = engine.model.model.layers[0]
    block.mlp.up_proj.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    calls: list[int] = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    metrics = engine.train_step(batch)
    return {"metrics": metrics, "weights": full_weights(engine), "dtypes": set(seen), "calls": len(calls)}


def _layout_ranks(rank: int, out: Path) -> None:
    dp = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=MESH_DIM_NAMES)
    tp = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=MESH_DIM_NAMES)
    result = {
        "fsdp_fp32": _step(dp, ROWS[rank], data_parallel="shard"),
        "fsdp_fp32_ac": _step(dp, ROWS[rank], data_parallel="shard", activation_checkpointing=True),
        "fsdp_bf16": _step(dp, ROWS[rank], data_parallel="shard", precision="bf16"),
        "fsdp_bf16_ac": _step(
            dp, ROWS[rank], data_parallel="shard", precision="bf16", activation_checkpointing=True
        ),
        "tp_bf16": _step(tp, None, precision="bf16"),
        "tp_bf16_ac": _step(tp, None, precision="bf16", activation_checkpointing=True),
    }
    torch.save(result, out / f"rank{rank}.pt")


def _assert_same(got: dict, expected: dict, tol: float) -> None:
    assert got["metrics"]["loss"] == pytest.approx(expected["metrics"]["loss"], rel=tol, abs=tol)
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=tol, atol=tol, msg=name)


def test_checkpointing_and_bf16_compose_with_fsdp2_and_tp(tmp_path: Path) -> None:
    out = run_ranks(2, _layout_ranks, tmp_path)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    before = full_weights(TrainingEngine(tiny_lm(), config=TrainingConfig(**EXACT)))
    single = _step(None, None)
    for got in ranks:
        assert got["fsdp_fp32"]["dtypes"] == got["fsdp_fp32_ac"]["dtypes"] == {torch.float32}
        for key in ("fsdp_bf16", "fsdp_bf16_ac", "tp_bf16", "tp_bf16_ac"):
            assert got[key]["dtypes"] == {torch.bfloat16}, key
        # Checkpointing recomputes each block and changes nothing, in either
        # precision and layout.
        for key in ("fsdp_fp32", "fsdp_bf16", "tp_bf16"):
            assert got[f"{key}_ac"]["calls"] == 2 * got[key]["calls"] > 0, key
        _assert_same(got["fsdp_fp32_ac"], got["fsdp_fp32"], 1e-6)
        _assert_same(got["fsdp_bf16_ac"], got["fsdp_bf16"], 1e-6)
        _assert_same(got["tp_bf16_ac"], got["tp_bf16"], 1e-6)
        _assert_same(got["fsdp_fp32"], single, 1e-5)
        # bf16 through FSDP2's policy and through autocast: the fp32 step within bf16 error.
        for key in ("fsdp_bf16", "tp_bf16"):
            assert got[key]["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-2)
            update = {n: got[key]["weights"][n] - before[n] for n in before}
            expected = {n: single["weights"][n] - before[n] for n in before}
            error = sum(float((update[n] - expected[n]).norm() ** 2) for n in before) ** 0.5
            scale = sum(float(expected[n].norm() ** 2) for n in before) ** 0.5
            assert error / scale < 2e-2, key
