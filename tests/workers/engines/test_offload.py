"""Offload of an engine's state to host memory and back, memory footprints and the
memory estimate.

A CPU engine's ``offload()`` is a no-op (the state is in host memory already), so the
tests drive the engine's offloader directly: the same code path a CUDA engine runs,
moving storages to ``torch.device("cpu")`` from the engine's device (here also the CPU,
where freeing a storage is just as observable).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engines_testlib import full_weights, make_batch, run_ranks, tiny_lm
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from workers.engines import (
    MESH_DIM_NAMES,
    EngineConfigError,
    MemoryFootprint,
    TrainingConfig,
    TrainingEngine,
    estimate_memory,
)
from workers.engines._offload import HostCopies
from workers.objectives import PolicyLoss

torch.set_num_threads(1)

CONFIG = {"lr": 1e-3, "micro_batch_size": 3}
LOSS = PolicyLoss(kl_coef=0.05)
CPU = torch.device("cpu")


def test_host_copies_free_each_storage_once_and_restore_its_bytes() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    tensors = [shared.weight, shared.weight.view(-1)[:4], shared.bias, torch.randn(3)]
    before = [t.clone() for t in tensors]
    copies = HostCopies(tensors, device=CPU, host=CPU)
    # The weight and its view share one storage: three storages, each freed.
    assert copies.nbytes == (64 + 8 + 3) * 4
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    copies.restore()
    for tensor, expected in zip(tensors, before, strict=True):
        assert torch.equal(tensor, expected)
    assert copies.nbytes == 0


def _engine(**settings: object) -> TrainingEngine:
    return TrainingEngine(tiny_lm(), config=TrainingConfig(**CONFIG, **settings), loss=LOSS)  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_after_offload_and_reload_is_bit_identical(precision: str) -> None:
    batch = make_batch()
    plain, offloaded = _engine(precision=precision), _engine(precision=precision)
    for engine in (plain, offloaded):
        engine.train_step(batch)
    resident = offloaded.memory_footprint()
    assert resident.params > 0 and resident.optimizer_state > 0

    offloader = offloaded._offloader  # the CUDA path; a CPU engine's offload() skips it
    offloader.offload()
    assert offloaded.memory_footprint() == MemoryFootprint(
        params=resident.params, grads=0, optimizer_state=0
    )
    with pytest.raises(EngineConfigError, match=r"train_step: .*call engine.reload\(\) first"):
        offloaded.train_step(batch)
    offloaded.log_probs(batch)  # the weights are still there
    offloader.offload(params=True)
    offloader.offload(params=True)  # idempotent
    assert offloaded.memory_footprint().total == 0
    with pytest.raises(EngineConfigError, match="reload"):
        offloaded.log_probs(batch)
    offloaded.reload()
    offloaded.reload()  # idempotent
    assert offloaded.memory_footprint() == resident

    expected, got = plain.train_step(batch), offloaded.train_step(batch)
    assert got == expected
    for name, tensor in full_weights(plain).items():
        assert torch.equal(full_weights(offloaded)[name], tensor), name


def test_offload_is_a_no_op_on_a_cpu_engine() -> None:
    engine = _engine()
    engine.train_step(make_batch())
    before = engine.memory_footprint()
    engine.offload(params=True)
    assert engine.memory_footprint() == before
    engine.train_step(make_batch())
    engine.reload()


def _fsdp_ranks(rank: int, out: Path) -> None:
    mesh = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=MESH_DIM_NAMES)
    rows = (torch.arange(0, 5), torch.arange(5, 8))[rank]
    batch = {k: v[rows] for k, v in make_batch().items()}
    settings = {"data_parallel": "shard", "precision": "bf16"}
    plain = TrainingEngine(tiny_lm(), config=TrainingConfig(**CONFIG, **settings), mesh=mesh, loss=LOSS)
    offloaded = TrainingEngine(tiny_lm(), config=TrainingConfig(**CONFIG, **settings), mesh=mesh, loss=LOSS)
    for engine in (plain, offloaded):
        engine.train_step(batch)
        engine.log_probs(batch)  # leaves FSDP2's root gathered: offload reshards first
    resident = offloaded.memory_footprint()
    offloaded._offloader.offload(params=True)
    emptied = offloaded.memory_footprint()
    offloaded.reload()
    result = {
        "resident": resident,
        "emptied": emptied,
        "expected": (plain.train_step(batch), full_weights(plain)),
        "got": (offloaded.train_step(batch), full_weights(offloaded)),
    }
    torch.save(result, out / f"rank{rank}.pt")


def test_offload_of_an_fsdp2_sharded_engine_is_bit_identical(tmp_path: Path) -> None:
    out = run_ranks(2, _fsdp_ranks, tmp_path)
    parameters = sum(p.numel() for p in tiny_lm().parameters())
    for rank in range(2):
        result = torch.load(out / f"rank{rank}.pt", weights_only=False)
        assert result["emptied"].total == 0
        # Each rank holds about half the float32 parameters (FSDP2 pads each shard).
        assert 2 * parameters <= result["resident"].params <= 2.2 * parameters
        (expected_metrics, expected), (got_metrics, got) = result["expected"], result["got"]
        assert got_metrics == expected_metrics
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name


def test_measured_footprint_matches_the_estimate() -> None:
    engine = _engine()
    parameters = sum(p.numel() for p in engine.model.parameters())
    tensors = len(list(engine.model.parameters()))
    assert engine.memory_footprint().optimizer_state == 0  # AdamW's state appears at step 1
    engine.train_step(make_batch())
    measured = engine.memory_footprint()
    estimate = estimate_memory(parameters, precision="fp32")
    assert measured.params == estimate.params == 4 * parameters
    assert estimate.grads == 4 * parameters and measured.grads == 0  # freed after the step
    # Two float32 moments per parameter, plus one float32 step counter per tensor.
    assert measured.optimizer_state == estimate.optimizer_state + 4 * tensors
    assert measured.as_gib()["total_gib"] == pytest.approx(measured.total / 2**30)


def test_estimate_by_precision_role_and_layout() -> None:
    n = 1_000_001
    assert estimate_memory(n, precision="bf16").total == 16 * n  # fp32 master state
    assert estimate_memory(n, precision="bf16", trainable=False) == MemoryFootprint(
        params=2 * n, grads=0, optimizer_state=0
    )
    assert estimate_memory(n, precision="fp32", trainable=False).params == 4 * n
    sharded = estimate_memory(n, precision="fp32", shards=2, tp=2)
    assert sharded.params == 4 * 250_001 and sharded.optimizer_state == 8 * 250_001
    with pytest.raises(EngineConfigError, match="shards >= 1"):
        estimate_memory(n, precision="fp32", shards=0)
    with pytest.raises(EngineConfigError, match="resolve_precision"):
        estimate_memory(n, precision="auto")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_offloads_to_pinned_host_memory_and_continues_bit_identically() -> None:
    batch = make_batch()
    plain, offloaded = (
        TrainingEngine(tiny_lm().cuda(), config=TrainingConfig(**CONFIG), loss=LOSS) for _ in range(2)
    )
    assert offloaded.precision == "bf16"  # "auto" on CUDA
    groups = offloaded.optimizer.param_groups  # type: ignore[union-attr]
    assert groups and all(group.get("fused") for group in groups)  # plain CUDA tensors
    for engine in (plain, offloaded):
        engine.train_step(batch)
    resident = offloaded.memory_footprint()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    offloaded.offload(params=True)
    assert offloaded.memory_footprint().total == 0
    assert torch.cuda.memory_allocated() <= allocated - resident.total
    offloaded.reload()
    assert offloaded.memory_footprint() == resident
    assert offloaded.train_step(batch) == plain.train_step(batch)
    for name, tensor in full_weights(plain).items():
        assert torch.equal(full_weights(offloaded)[name], tensor), name
