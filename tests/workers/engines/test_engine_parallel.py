"""TrainingEngine over real gloo process groups: TP=2, FSDP2 and replicas over 2 ranks
vs one process.

Each scenario runs once on spawned ranks (the rank functions are module-level so
that spawn can pickle them) and once in the test process; the results must agree.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engines_testlib import (
    TinyValueModel,
    full_weights,
    make_batch,
    run_ranks,
    tiny_config,
    tiny_lm,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM

from workers.engines import (
    MESH_DIM_NAMES,
    EngineConfigError,
    Parallelism,
    TrainingConfig,
    TrainingEngine,
    ValueHead,
)
from workers.objectives import PolicyLoss, ValueLoss

torch.set_num_threads(1)

# eps=1: Adam's first update stays proportional to the gradient (see test_engine_single).
CONFIG = {"lr": 1e-3, "eps": 1.0, "grad_clip": 1.0}
LOSS = PolicyLoss(dual_clip=3.0, kl_coef=0.05)
FSDP_ROWS = (torch.arange(0, 5), torch.arange(5, 8))  # uneven DP slices on purpose


def _mesh(dp: int, tp: int):
    return init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=MESH_DIM_NAMES)


def _lm_run(engine: TrainingEngine, batch: dict, steps: int) -> dict:
    logprobs, entropy = engine.log_probs(batch)
    metrics = [engine.train_step(batch) for _ in range(steps)]
    return {"logprobs": logprobs, "entropy": entropy, "metrics": metrics}


def _tp_ranks(rank: int, out: Path) -> None:
    mesh = _mesh(1, 2)
    batch = make_batch()
    engine = TrainingEngine(
        tiny_lm(), config=TrainingConfig(**CONFIG, micro_batch_size=3), mesh=mesh, loss=LOSS
    )
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor) and q_proj.to_local().shape == (32, 64)
    assert not engine.infers_alone  # its forwards run with the other TP rank
    result = _lm_run(engine, batch, steps=2) | {"weights": full_weights(engine)}
    engine.export_hf(out / "hf")

    critic = TrainingEngine(
        TinyValueModel(), config=TrainingConfig(**CONFIG), mesh=mesh, head=ValueHead(),
        loss=ValueLoss(),
    )  # fmt: skip
    result["values"] = critic.values(batch)
    result["critic_metrics"] = critic.train_step(batch)
    result["critic_weights"] = full_weights(critic)

    with pytest.raises(EngineConfigError, match="cannot fill 2 pipeline stages"):
        TrainingEngine(tiny_lm(layers=1), config=TrainingConfig(), mesh=_mesh_pp2())
    one_head = tiny_config()
    one_head.num_attention_heads, one_head.num_key_value_heads, one_head.head_dim = 1, 1, 64
    with pytest.raises(EngineConfigError, match="num_attention_heads=1 is not divisible"):
        TrainingEngine(LlamaForCausalLM(one_head), config=TrainingConfig(), mesh=mesh)
    if rank == 0:
        torch.save(result, out / "tp.pt")


def _mesh_pp2():
    return init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=MESH_DIM_NAMES)


@contextlib.contextmanager
def _counted(module: Any, name: str) -> Iterator[list[object]]:
    """Record each call of ``module.name`` (which still runs) while the block runs."""
    calls: list[object] = []
    real = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    setattr(module, name, counting)
    try:
        yield calls
    finally:
        setattr(module, name, real)


def _fsdp_ranks(rank: int, out: Path, data_parallel: str = "shard") -> None:
    rows = FSDP_ROWS[rank]
    batch = {k: v[rows] for k, v in make_batch().items()}
    config = TrainingConfig(**CONFIG, max_tokens_per_micro_batch=14, data_parallel=data_parallel)
    engine = TrainingEngine(tiny_lm(), config=config, mesh=_mesh(2, 1), loss=LOSS)
    # Sharded: each rank holds a DTensor shard; replicated: a whole plain tensor.
    assert isinstance(engine.model.lm_head.weight, DTensor) == (data_parallel == "shard")
    assert engine.parallel.replicated == (data_parallel == "replicate")
    result = _lm_run(engine, batch, steps=1)
    engine.save(out / "ckpt")
    with _counted(dist, "all_reduce") as all_reduces:
        result["metrics"].append(engine.train_step(batch))
    result["all_reduces"] = len(all_reduces)
    with _counted(dist, "all_reduce") as all_reduces:
        engine.log_probs(batch)
    result["inference_all_reduces"] = len(all_reduces)
    result["infers_alone"] = engine.infers_alone
    result["sums_and_maxes"] = engine.parallel.sums_and_maxes_over_dp(
        torch.tensor([rank + 1.0, 0.25]), torch.tensor([float(rank), -math.inf]))
    result["weights"] = full_weights(engine)
    engine.export_hf(out / "hf")

    resumed = TrainingEngine(tiny_lm(seed=3), config=config, mesh=_mesh(2, 1), loss=LOSS)
    resumed.load(out / "ckpt")
    result["resumed_metrics"] = resumed.train_step(batch)
    result["resumed_weights"] = full_weights(resumed)
    torch.save(result, out / f"fsdp{rank}.pt")


def _replica_sums_ranks(rank: int, out: Path) -> None:
    parallel = Parallelism(_mesh(2, 1))
    model = parallel.parallelize(torch.nn.Linear(3, 2), replicate=True)
    for p in model.parameters():
        p.grad = torch.full_like(p, rank + 1.0)
    # Rank 0's second addend needs float64: float32 would round it to 1e8.
    sums = torch.tensor([[3.0, 1e8 + 0.125, 1.0], [1.0, 0.5, math.inf]][rank], dtype=torch.float64)
    maxes = torch.tensor([[2.5, -math.inf], [1e8 + 0.25, -math.inf]][rank], dtype=torch.float64)
    summed, maxed = parallel.normalise_gradients(model, sums, maxes)
    torch.save({"summed": summed, "maxed": maxed, "grads": [p.grad for p in model.parameters()]},
               out / f"sums{rank}.pt")


def test_replicas_reduce_their_sums_and_maxima_with_the_gradients_in_float64(tmp_path: Path) -> None:
    out = run_ranks(2, _replica_sums_ranks, tmp_path)
    for rank in range(2):
        got = torch.load(out / f"sums{rank}.pt", weights_only=False)
        assert got["summed"].dtype == torch.float64
        assert got["summed"].tolist() == [4.0, 1e8 + 0.625, math.inf]
        assert got["maxed"].tolist() == [1e8 + 0.25, -math.inf]
        # The gradients are summed over the ranks and divided by the normalisers' sum.
        for grad in got["grads"]:
            assert torch.equal(grad, torch.full_like(grad, 3.0 / 4.0))
    with pytest.raises(EngineConfigError, match="not replicated"):
        Parallelism(None).normalise_gradients(torch.nn.Linear(1, 1), torch.ones(1, dtype=torch.float64),
                                              torch.ones(0, dtype=torch.float64))


def _fsdp_tp_ranks(rank: int, out: Path, data_parallel: str = "shard") -> None:
    mesh = _mesh(2, 2)
    rows = FSDP_ROWS[mesh["dp"].get_local_rank()]
    batch = {k: v[rows] for k, v in make_batch().items()}
    config = TrainingConfig(**CONFIG, micro_batch_size=2, data_parallel=data_parallel)
    engine = TrainingEngine(tiny_lm(), config=config, mesh=mesh, loss=LOSS)
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    # Over dp: FSDP2 adds a mesh dimension; replicas stay TP-only DTensors.
    assert isinstance(q_proj, DTensor) and q_proj.device_mesh.ndim == (2 if data_parallel == "shard" else 1)
    assert not engine.infers_alone  # TP splits every replica
    result = _lm_run(engine, batch, steps=2) | {"weights": full_weights(engine)}
    torch.save(result, out / f"fsdp_tp{rank}.pt")


def _reference(micro: dict, steps: int) -> tuple[TrainingEngine, dict]:
    engine = TrainingEngine(tiny_lm(), config=TrainingConfig(**CONFIG, **micro), loss=LOSS)
    return engine, _lm_run(engine, make_batch(), steps) | {"weights": full_weights(engine)}


def _assert_metrics_close(got: dict, expected: dict) -> None:
    for key in ("loss", "grad_norm", "clip_fraction", "kl", "entropy"):
        if key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def _assert_weights_close(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _assert_hf_export_matches(path: Path, engine: TrainingEngine) -> None:
    loaded = LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 32, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids).logits, engine.model(ids).logits, rtol=1e-5, atol=1e-6
        )


def test_tensor_parallel_step_equals_single_process(tmp_path: Path) -> None:
    out = run_ranks(2, _tp_ranks, tmp_path)
    got = torch.load(out / "tp.pt", weights_only=False)
    engine, expected = _reference({"micro_batch_size": 3}, steps=2)
    assert engine.infers_alone  # one process, no mesh
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["entropy"], expected["entropy"], rtol=1e-5, atol=1e-6)
    for got_m, exp_m in zip(got["metrics"], expected["metrics"], strict=True):
        _assert_metrics_close(got_m, exp_m)
    _assert_weights_close(got["weights"], expected["weights"])
    _assert_hf_export_matches(out / "hf", engine)

    batch = make_batch()
    critic = TrainingEngine(
        TinyValueModel(), config=TrainingConfig(**CONFIG), head=ValueHead(), loss=ValueLoss()
    )
    torch.testing.assert_close(got["values"], critic.values(batch), rtol=1e-5, atol=1e-6)
    _assert_metrics_close(got["critic_metrics"], critic.train_step(batch))
    _assert_weights_close(got["critic_weights"], full_weights(critic))


@pytest.mark.parametrize("data_parallel", ["shard", "replicate"])
def test_data_parallel_step_and_checkpoint_equal_single_process(tmp_path: Path, data_parallel: str) -> None:
    out = run_ranks(2, functools.partial(_fsdp_ranks, data_parallel=data_parallel), tmp_path)
    ranks = [torch.load(out / f"fsdp{r}.pt", weights_only=False) for r in range(2)]
    engine, expected = _reference({}, steps=2)
    for rows, got in zip(FSDP_ROWS, ranks, strict=True):
        torch.testing.assert_close(
            got["logprobs"], expected["logprobs"][rows], rtol=1e-5, atol=1e-6
        )
        for got_m, exp_m in zip(got["metrics"], expected["metrics"], strict=True):
            _assert_metrics_close(got_m, exp_m)
        _assert_weights_close(got["weights"], expected["weights"])
        # Sharded: one all-reduce agrees on the micro-batch count and sums the loss
        # normaliser, one sums the metrics (FSDP2 reduce-scatters the gradients without
        # torch.distributed.all_reduce), and inference agrees on its count. Replicated:
        # the normaliser and the metrics ride in the gradients' one all-reduce, and
        # inference needs none.
        assert got["all_reduces"] == (1 if data_parallel == "replicate" else 2)
        assert got["inference_all_reduces"] == (0 if data_parallel == "replicate" else 1)
        # A replica's forwards use no other rank, so its roles may run them rank-locally.
        assert got["infers_alone"] == (data_parallel == "replicate")
        sums, maxes = got["sums_and_maxes"]
        assert sums.tolist() == [3.0, 0.5] and maxes.tolist() == [1.0, -math.inf]
        # Resuming from the checkpoint replays the second step exactly.
        assert got["resumed_metrics"]["loss"] == got["metrics"][1]["loss"]
        assert got["resumed_metrics"]["grad_norm"] == got["metrics"][1]["grad_norm"]
        _assert_weights_close(got["resumed_weights"], got["weights"])
    _assert_hf_export_matches(out / "hf", engine)


@pytest.mark.parametrize("data_parallel", ["shard", "replicate"])
def test_data_parallel_with_tensor_parallel_2x2_equals_single_process(tmp_path: Path, data_parallel: str) -> None:
    out = run_ranks(4, functools.partial(_fsdp_tp_ranks, data_parallel=data_parallel), tmp_path)
    _, expected = _reference({}, steps=2)
    for rank in range(4):
        got = torch.load(out / f"fsdp_tp{rank}.pt", weights_only=False)
        rows = FSDP_ROWS[rank // 2]  # mesh (1, dp=2, tp=2): ranks 0,1 are dp group 0
        torch.testing.assert_close(
            got["logprobs"], expected["logprobs"][rows], rtol=1e-5, atol=1e-6
        )
        for got_m, exp_m in zip(got["metrics"], expected["metrics"], strict=True):
            _assert_metrics_close(got_m, exp_m)
        _assert_weights_close(got["weights"], expected["weights"])
