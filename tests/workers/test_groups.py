"""Reconnectable process groups on real gloo (CPU) process groups, one process per rank.

Each test runs a module-level rank function on new processes whose default (world)
group is plain gloo over a TCPStore; assertions inside a rank fail the test with that
rank's traceback.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ranks import start_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from channels import ConfigError
from workers.engines import MESH_DIM_NAMES, TrainingConfig, TrainingEngine
from workers.host._groups import (
    GroupPoisonedError,
    ReconnectableGroup,
    is_peer_failure,
    local_groups,
)
from workers.host._meshes import heal_all, mesh_from_groups, new_reconnectable_group, poison_all
from workers.models import TinyModelConfig, build_tiny_model
from workers.objectives import PolicyLoss

TIMEOUT = timedelta(seconds=60)
GRID = torch.arange(4).view(1, 2, 2)  # ranks 0,1 and 2,3 are tp pairs; 0,2 and 1,3 dp pairs
ROWS, PROMPT, RESPONSE = 4, 3, 4


def _engine(mesh: DeviceMesh) -> TrainingEngine:
    model = build_tiny_model(TinyModelConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        head_dim=32, num_hidden_layers=1,
    ))  # fmt: skip
    return TrainingEngine(model, config=TrainingConfig(lr=1e-3, eps=1.0, data_parallel="shard"), mesh=mesh,
                          loss=PolicyLoss())


def _batch(mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """This rank's dp slice of a fixed batch, with old log-probs and advantages."""
    gen = torch.Generator().manual_seed(1)
    batch = {
        "prompt_ids": torch.randint(1, 10, (ROWS, PROMPT), generator=gen),
        "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
        "response_ids": torch.randint(1, 10, (ROWS, RESPONSE), generator=gen),
        "response_mask": torch.ones(ROWS, RESPONSE, dtype=torch.long),
        "old_logprobs": -2.0 - torch.rand(ROWS, RESPONSE, generator=gen),
        "advantages": torch.randn(ROWS, RESPONSE, generator=gen),
    }
    dp, half = mesh.get_local_rank("dp"), ROWS // 2
    return {k: v[dp * half:(dp + 1) * half] for k, v in batch.items()}


def _local_params(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in engine.model.named_parameters()}


def _dp_only(engine: TrainingEngine) -> dict[str, Any]:
    return {name: tensor for name, tensor in get_model_state_dict(engine.model).items()
            if isinstance(tensor, DTensor) and tensor.device_mesh.mesh_dim_names == ("dp",)}


def _rank_main(rank: int, world: int, port: int, fn: Callable[[int, Path], None], out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        fn(rank, Path(out))
    finally:
        dist.destroy_process_group()


def _run(world: int, fn: Callable[[int, Path], None], tmp: Path) -> Path:
    """Run ``fn(rank, out_dir)`` on ``world`` new processes; return ``out_dir``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_ranks(_rank_main, (world, port, fn, str(tmp)), world)
    return tmp


# ----- 1. same training step as a plain DeviceMesh; object collectives and DCP -----

def _equivalence_ranks(rank: int, out: Path) -> None:
    mesh = mesh_from_groups(GRID, MESH_DIM_NAMES, "cpu", TIMEOUT)
    plain = DeviceMesh("cpu", GRID, mesh_dim_names=MESH_DIM_NAMES)
    for name in MESH_DIM_NAMES:
        assert isinstance(mesh.get_group(name), ReconnectableGroup)
        assert mesh[name].get_local_rank() == plain[name].get_local_rank()
        assert dist.get_process_group_ranks(mesh.get_group(name)) == \
            dist.get_process_group_ranks(plain.get_group(name))
    engine, reference = _engine(mesh), _engine(plain)
    q_proj = engine.model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor) and q_proj.device_mesh.get_group("tp") is mesh.get_group("tp")

    got, expected = engine.train_step(_batch(mesh)), reference.train_step(_batch(plain))
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    expected_params = _local_params(reference)
    for name, tensor in _local_params(engine).items():
        torch.testing.assert_close(tensor, expected_params[name], rtol=1e-5, atol=1e-7, msg=name)

    dp_group = mesh.get_group("dp")
    seen: list[object] = [None, None]
    dist.all_gather_object(seen, rank, group=dp_group)
    assert seen == dist.get_process_group_ranks(dp_group)
    # DCP over the dp group: the parameters FSDP shards over "dp" only (not TP'd), which
    # the dp group holds whole; each dp group (one tp coordinate) writes its own directory.
    where = out / f"dcp_tp{mesh.get_local_rank('tp')}"
    dcp.save(_dp_only(engine), checkpoint_id=where, process_group=dp_group)
    fresh = _engine(plain)
    state = _dp_only(fresh)
    assert len(state) >= 3  # embeddings, norms, lm_head
    dcp.load(state, checkpoint_id=where, process_group=dp_group)
    set_model_state_dict(fresh.model, state, options=StateDictOptions(strict=False))
    fresh_params = _local_params(fresh)
    for name in state:
        torch.testing.assert_close(fresh_params[name], expected_params[name], msg=name)


def test_mesh_from_groups_trains_like_a_plain_mesh(tmp_path: Path) -> None:
    _run(4, _equivalence_ranks, tmp_path)


# ----- 2. poison while peers are inside a collective, then heal -----

def _poison_ranks(rank: int, out: Path) -> None:
    mesh = mesh_from_groups(GRID, MESH_DIM_NAMES, "cpu", TIMEOUT)
    engine = _engine(mesh)
    batch = _batch(mesh)
    engine.train_step(batch)  # every group connected and FSDP initialised
    logprobs, _ = engine.log_probs(batch)
    # A Work kept alive (as FSDP2 state or the functional-collective registry may)
    # holds its gloo sockets open: poisoning must release it.
    held = dist.all_reduce(torch.ones(1), group=mesh.get_group("dp"), async_op=True)
    held.wait()

    start = time.monotonic()
    if rank == 3:
        time.sleep(1.0)  # the others are blocked in the step's first collectives with us
        poison_all()
    else:
        try:
            engine.train_step(batch)
        except Exception as exc:  # whatever gloo raises; the traceback goes with the block
            failed_after, peer_failure, error = time.monotonic() - start, is_peer_failure(exc), repr(exc)
        else:
            raise AssertionError("the step succeeded though rank 3 poisoned its groups")
        assert failed_after < 10.0, failed_after  # the group timeout is 60 s
        assert peer_failure, error
        assert not is_peer_failure(ValueError("a bug in this rank's own code"))
        poison_all()  # cascade: peers blocked on this rank fail too
    assert all(group.poisoned for group in local_groups())
    with pytest.raises(GroupPoisonedError, match="pending"):
        held.wait()

    heal_all(1)
    assert not any(group.poisoned for group in local_groups())
    # The failed step stopped before the optimizer: the weights are those of step 1.
    torch.testing.assert_close(engine.log_probs(batch)[0], logprobs, rtol=0, atol=0)
    loss = engine.train_step(batch)["loss"]
    losses: list[object] = [None] * 4
    dist.all_gather_object(losses, loss)  # the world group was never involved
    assert losses == [loss] * 4


def test_poison_fails_peers_fast_and_heal_restores_training(tmp_path: Path) -> None:
    _run(4, _poison_ranks, tmp_path)


# ----- 3. heal twice; a poisoned group says so -----

def _heal_twice_ranks(rank: int, out: Path) -> None:
    group = new_reconnectable_group([0, 1], TIMEOUT)
    for epoch in (1, 2):
        group.poison()
        with pytest.raises(GroupPoisonedError, match=r"\(0, 1\).*poisoned.*heal_all"):
            dist.all_reduce(torch.ones(2), group=group)
        heal_all(epoch)
        assert group.epoch == epoch
        total = torch.full((2,), float(rank + 1))
        dist.all_reduce(total, group=group)
        assert total.tolist() == [3.0, 3.0]
    with pytest.raises(ConfigError, match="epoch"):
        group.heal(2)
    maximum = torch.full((1,), float(rank))
    group.allreduce([maximum], dist.ReduceOp.MAX).wait()  # a ReduceOp in place of options
    assert maximum.item() == 1.0
    assert is_peer_failure(GroupPoisonedError("x")) and not is_peer_failure(ValueError("x"))


def test_heal_twice_and_poisoned_group_raises(tmp_path: Path) -> None:
    _run(2, _heal_twice_ranks, tmp_path)


# ----- 4. caching by ranks; 1-rank groups; members whose histories differ -----

def _cache_ranks(rank: int, out: Path) -> None:
    if rank == 0:  # c10d would name (0, 1) differently on the two ranks after this
        alone = new_reconnectable_group([0], TIMEOUT)
        ones = torch.ones(3)
        dist.all_reduce(ones, group=alone)
        assert ones.tolist() == [1.0, 1.0, 1.0]
    pair = new_reconnectable_group([0, 1], TIMEOUT)
    assert new_reconnectable_group((0, 1), TIMEOUT) is pair
    mesh = mesh_from_groups(torch.tensor([[0, 1]]), ("dp", "tp"), "cpu", TIMEOUT)
    again = mesh_from_groups(torch.tensor([[0], [1]]), ("dp", "tp"), "cpu", TIMEOUT)
    assert mesh.get_group("tp") is pair and again.get_group("dp") is pair
    assert mesh.get_group("dp") is again.get_group("tp") is new_reconnectable_group([rank], TIMEOUT)
    assert [g.ranks for g in local_groups()] == sorted({(0, 1), (rank,)})
    total = torch.ones(2)
    dist.all_reduce(total, group=mesh.get_group("dp"))  # a 1-rank group
    assert total.tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="include this rank"):
        new_reconnectable_group([1 - rank], TIMEOUT)


def _values(tensors: list[torch.Tensor]) -> list[float]:
    return torch.cat([t.flatten() for t in tensors]).tolist()


def _every_collective_ranks(rank: int, out: Path) -> None:
    """Each call reaches a different method of the group (or its C++ trampoline)."""
    group, me, peer = new_reconnectable_group([0, 1], TIMEOUT), float(rank), 1 - rank
    pair = [torch.empty(1), torch.empty(1)]
    dist.all_gather(pair, torch.tensor([me]), group=group)
    assert _values(pair) == [0.0, 1.0]
    flat, one = torch.empty(2), torch.empty(1)
    dist.all_gather_into_tensor(flat, torch.tensor([me]), group=group)
    dist.reduce_scatter_tensor(one, torch.tensor([1.0, 2.0]), group=group)
    assert flat.tolist() == [0.0, 1.0] and one.tolist() == [2.0 * (rank + 1)]
    dist.all_to_all_single(flat, torch.tensor([10 * me, 10 * me + 1]), group=group)
    assert flat.tolist() == [rank, 10.0 + rank]
    shared, total = torch.tensor([me]), torch.tensor([me + 1])
    dist.broadcast(shared, group_src=1, group=group)
    dist.reduce(total, group_dst=0, group=group)
    assert shared.item() == 1.0 and (rank == 1 or total.item() == 3.0)
    dist.gather(torch.tensor([me]), pair if rank == 0 else None, group_dst=0, group=group)
    dist.scatter(one, [torch.tensor([5.0]), torch.tensor([6.0])] if rank == 1 else None,
                 group_src=1, group=group)
    assert one.item() == 5.0 + rank and (rank == 1 or _values(pair) == [0.0, 1.0])
    if rank == 0:
        dist.send(torch.tensor([me]), group_dst=peer, group=group)
    else:
        dist.recv(one, group_src=peer, group=group)
    dist.barrier(group=group)
    assert rank == 0 or one.item() == 0.0
    functional = torch.ops._c10d_functional  # DTensor/FSDP's path, through the coalesced names
    gathered = functional.all_gather_into_tensor_coalesced(
        [torch.tensor([me]), torch.tensor([me, me])], 2, group.group_name)
    scattered = functional.reduce_scatter_tensor_coalesced(
        [torch.tensor([1.0, 2.0]), torch.arange(4.0)], "sum", 2, group.group_name)
    waited = [functional.wait_tensor(t) for t in [*gathered, *scattered]]
    assert _values(waited) == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 2.0 * (rank + 1), 4.0 * rank,
                               4.0 * rank + 2.0]


def test_every_collective_reaches_the_inner_backend(tmp_path: Path) -> None:
    _run(2, _every_collective_ranks, tmp_path)


class _SynchronousBackend:
    """Gloo behind NCCL's contract since torch 2.8: a collective whose options say
    ``asyncOp=False`` completes before it returns and returns no ``Work`` (None)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._inner, name)
        if not callable(method):
            return method

        def call(*args: Any) -> Any:
            work = method(*args)
            opts = next((a for a in args if hasattr(a, "asyncOp")), None)
            if opts is None or opts.asyncOp or not isinstance(work, dist.Work):
                return work
            work.wait()
            return None
        return call


def _synchronous_backend_ranks(rank: int, out: Path) -> None:
    group = new_reconnectable_group([0, 1], TIMEOUT)
    group._backends = {"cpu": _SynchronousBackend(group._backends["cpu"])}  # type: ignore[dict-item]
    values = torch.tensor([float(rank)])
    dist.all_reduce(values, group=group)  # the first collective: GPU CI saw it raise
    assert values.tolist() == [1.0]
    work = dist.all_reduce(values, group=group, async_op=True)
    assert work is not None and work.wait() and values.tolist() == [2.0]
    _every_collective_ranks(rank, out)
    poison_all()  # a completed collective has nothing for a poison to take away
    with pytest.raises(GroupPoisonedError):
        dist.all_reduce(values, group=group)


def test_a_backend_that_completes_synchronously_returns_no_work(tmp_path: Path) -> None:
    """NCCL returns None for a synchronous collective; the group's callers get a
    completed Work, not a released one (GroupPoisonedError on a healthy group)."""
    _run(2, _synchronous_backend_ranks, tmp_path)


def test_groups_are_cached_by_ranks_and_one_rank_groups_work(tmp_path: Path) -> None:
    _run(2, _cache_ranks, tmp_path)


# ----- is_peer_failure, without processes -----

def test_is_peer_failure_tells_a_peer_breaking_a_collective_from_own_errors() -> None:
    gloo_closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")
    gloo_timeout = RuntimeError("[unbound_buffer.cc:78] Timed out waiting 60000ms for recv operation")
    assert is_peer_failure(gloo_closed) and is_peer_failure(gloo_timeout)
    assert is_peer_failure(GroupPoisonedError("process group (0, 1) was poisoned"))
    assert is_peer_failure(dist.DistStoreError("wait timeout after 3000ms"))
    wrapped = ValueError("a step failed")
    wrapped.__cause__ = gloo_closed
    assert is_peer_failure(wrapped)
    for own in (ValueError("bad shape"), RuntimeError("CUDA out of memory"), KeyError("loss")):
        assert not is_peer_failure(own)


# ----- GPU: NCCL inner backend, poison and heal (one rank) -----

def _nccl_ranks(rank: int, out: Path) -> None:
    torch.cuda.set_device(0)
    mesh = mesh_from_groups(torch.zeros(1, 1, 1, dtype=torch.long), MESH_DIM_NAMES, "cuda", TIMEOUT)
    group = mesh.get_group("dp")
    values = torch.arange(4.0, device="cuda")
    dist.all_reduce(values, group=group)
    gathered = torch.empty(4, device="cuda")
    dist.all_gather_into_tensor(gathered, values, group=group)
    assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0]
    poison_all()
    with pytest.raises(GroupPoisonedError):
        dist.all_reduce(values, group=group)
    heal_all(1)
    dist.all_reduce(values, group=group)
    torch.cuda.synchronize()
    assert values.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_group_poison_and_heal(tmp_path: Path) -> None:
    _run(1, _nccl_ranks, tmp_path)


def _nccl_pair_ranks(rank: int, out: Path) -> None:
    torch.cuda.set_device(rank)
    group = new_reconnectable_group([0, 1], TIMEOUT)
    values = torch.full((4,), float(rank), device="cuda")
    dist.all_reduce(values, group=group)  # synchronous: NCCL returns no Work
    assert values.tolist() == [1.0] * 4
    work = dist.all_reduce(values, group=group, async_op=True)
    assert work is not None and work.wait()
    received = torch.empty(3, device="cuda")
    if rank == 0:  # a row pull is a point-to-point transfer
        dist.send(torch.arange(3.0, device="cuda"), group_dst=1, group=group)
    else:
        dist.recv(received, group_src=0, group=group)
        assert received.tolist() == [0.0, 1.0, 2.0]
    if rank == 1:  # this rank's call failed: it poisons its groups, and heals with its peer
        poison_all()
        with pytest.raises(GroupPoisonedError):
            dist.all_reduce(values, group=group)
    heal_all(1)
    values.fill_(float(rank + 1))
    dist.all_reduce(values, group=group)
    torch.cuda.synchronize()
    assert values.tolist() == [3.0] * 4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_nccl_group_collectives_point_to_point_poison_and_heal_on_two_gpus(tmp_path: Path) -> None:
    _run(2, _nccl_pair_ranks, tmp_path)
