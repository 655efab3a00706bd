"""Weight synchronisation for ``bench.async_rl``: the actor's weights to generation.

Two ways, for Llama models of about 10 M, 100 M and 500 M parameters (fp32, shapes
from :data:`bench.transition.SIZES`, random weights built here; nothing is
downloaded):

- Disaggregated (keys ``weight_sync_<size>_s`` / ``_bytes``): on real Ray workers,
  an actor on a 1-rank pool ``train`` (``ActorConfig(rollout=None)``: no second
  copy) publishes ``actor.weights()`` and a rollout role on a 1-rank pool ``gen``
  pulls them (``rollout.load_weights``), peer to peer over the session's data
  plane. Seconds: ``await rollout.load_weights(actor.weights())``, the median over
  ``repeats`` after one warm-up; bytes: what the one rollout rank's store received
  in the last pull (``Session.store_stats``), less the weights' version column.
- Colocated (keys ``weight_sync_<size>_colocated_s`` / ``_bytes``): the hybrid
  engine's reshard of the same Llama shape on 2 gloo processes, training layout
  p1-t2-d1 to generation tg = 1 (``121-1121``, method ``hybridflow``), with
  :mod:`bench.transition`'s shards and measurement. Seconds: the slowest rank's
  ``to_generation()``, median over ``repeats`` after one warm-up; bytes: the most
  one rank received, checked against ``hybrid_engine.expected_bytes``.

``weight_sync_<size>_params`` is the exact parameter count. A size is a key of
``bench.transition.SIZES`` (``"small"`` is a tiny model for the tests); its shape
reaches the gloo ranks as parameter specs, so a size added to that table in this
process is measured too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bench.transition as transition
from channels import StoreStats
from hybrid_engine import ParamSpec, Resharder, expected_bytes, layout_from, make_plan

COLOCATED = layout_from(2, 1)
"""The colocated case's layouts: p1-t2-d1 training, tg = 1 generation (``121-1121``)."""

BUCKET_BYTES = 64 << 20
"""Most gathered bytes of one bucket of the colocated reshard (``bench.transition``'s default)."""


def params_of(size: str) -> int:
    """Parameters of the ``size`` Llama of ``bench.transition.SIZES`` (untied
    embeddings and head, full multi-head attention, RMS norms)."""
    hidden, inter, layers, vocab = transition.SIZES[size]
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def _target(size: str) -> str:
    """How far the count is from the size's name (``"10m"``: 10 M), for the printout."""
    match = re.fullmatch(r"(\d+)m", size)
    if match is None:
        return ""
    target = int(match.group(1)) * 10**6
    return f", {100 * (params_of(size) - target) / target:+.1f} % from {match.group(1)} M"


# ----- disaggregated: a rollout role on another pool pulls the actor's weights -----

def _save_model(size: str, directory: Path) -> tuple[str, int]:
    """Write the ``size`` Llama (and its tokenizer) to ``directory``; its path and
    the parameter bytes its checkpoint holds."""
    # Imported here: the gloo ranks of the colocated case import this module and
    # need no transformers.
    from workers.models import TinyModelConfig, save_tiny_model

    hidden, inter, layers, vocab = transition.SIZES[size]
    config = TinyModelConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
                             vocab_size=vocab)
    path = save_tiny_model(directory, config, seed=0)
    return str(path), sum(_tensor_bytes(f) for f in path.glob("*.safetensors"))


def _tensor_bytes(file: Path) -> int:
    """Bytes of the tensors in a safetensors file, from its header alone (a
    little-endian u64 length, then JSON naming each tensor's byte range)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0]
               for name, entry in header.items() if name != "__metadata__")


async def _pull(model_dir: str, repeats: int) -> tuple[list[float], int]:
    """One session: the actor on ``train``, the rollout role on ``gen``; the
    seconds of ``1 + repeats`` pulls (the first a warm-up) and the parameter bytes
    the rollout rank received in the last one."""
    # Imported here, as in _save_model: the gloo ranks need neither Ray nor the roles.
    import asyncflow as af
    from workers.roles import (
        WEIGHTS_VERSION,
        ActorConfig,
        ActorWorker,
        RolloutWorker,
        RolloutWorkerConfig,
    )

    train = af.ResourcePool(name="train", devices=1, threads=1)
    gen = af.ResourcePool(name="gen", devices=1, threads=1)
    # The session's workers end when it closes (and Ray with them, if the session
    # started it), freeing every worker's copy of the model before the next size.
    async with af.Session() as session:
        roles = await session.spawn({
            "actor": af.RoleSpec(cls=ActorWorker, pool=train, config=ActorConfig(model_dir=model_dir, rollout=None)),
            "rollout": af.RoleSpec(cls=RolloutWorker, pool=gen, config=RolloutWorkerConfig(model_dir=model_dir)),
        })
        seconds = []
        for _ in range(repeats + 1):
            before = _pulled_by(await session.store_stats(), "gen")
            start = time.perf_counter()
            weights = roles.actor.weights()
            await roles.rollout.load_weights(weights)
            seconds.append(time.perf_counter() - start)
        pulled = _pulled_by(await session.store_stats(), "gen") - before  # the last pull's
        meta = await weights
        version = meta.num_rows * sum(f.row_bytes() for f in meta.fields if f.name == WEIGHTS_VERSION)
    return seconds[1:], pulled - version


def _pulled_by(stores: list[tuple[str, int, StoreStats]], pool: str) -> int:
    """The most bytes one rank of ``pool`` has pulled from other workers."""
    return max(s.bytes_received for p, _, s in stores if p == pool)


def disaggregated(size: str, *, repeats: int) -> tuple[list[float], int, int]:
    """Pull the ``size`` model's weights into a rollout role on its own pool.

    Returns:
        The seconds of the ``repeats`` measured pulls, the bytes one rollout rank
        received and the model's parameter bytes.

    Raises:
        RuntimeError: the received bytes are not the model's parameter bytes.
    """
    with tempfile.TemporaryDirectory(prefix="asyncflow-sync-") as tmp:
        model_dir, model_bytes = _save_model(size, Path(tmp) / "policy")
        seconds, received = asyncio.run(_pull(model_dir, repeats))
    if received != model_bytes:
        raise RuntimeError(f"weight sync {size}: the rollout rank received {received} bytes, the model's "
                           f"parameters are {model_bytes} bytes (a weights future holds each byte once at t = 1)")
    return seconds, received, model_bytes


# ----- colocated: the hybrid engine reshards in place on 2 gloo ranks -----

@dataclass(frozen=True, kw_only=True)
class _ReshardJob:
    """What both ranks run (picklable: it crosses into the spawned processes)."""

    specs: tuple[ParamSpec, ...]
    """The model's parameters, as ``bench.transition.model_specs`` splits them."""
    repeats: int
    store: str
    """The file the ranks rendezvous through."""
    out: str
    """Where rank 0 writes the measurements (JSON)."""


def _reshard_rank(rank: int, job: _ReshardJob) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job.store}", rank=rank, world_size=COLOCATED.world)
    specs = list(job.specs)
    resharder = Resharder(make_plan(COLOCATED, specs, method="hybridflow", bucket_bytes=BUCKET_BYTES), rank,
                          transition._shards(COLOCATED, rank, specs), transition._group)
    resharder.connect()  # group creation is not part of a transition
    rows = []
    for _ in range(job.repeats + 1):
        row = transition._measure_one(resharder, specs, "hybridflow")
        assert resharder.stats is not None
        received = torch.tensor([resharder.stats.received_bytes], dtype=torch.float64)
        dist.all_reduce(received, op=dist.ReduceOp.MAX)  # the most one rank received
        rows.append([*row, received.item()])
    if rank == 0:
        Path(job.out).write_text(json.dumps(rows[1:]))  # the first is a warm-up
    dist.destroy_process_group()


def colocated(size: str, *, repeats: int) -> tuple[list[float], int]:
    """Reshard the ``size`` model from p1-t2-d1 to tg = 1 on 2 gloo processes.

    Returns:
        The seconds of the ``repeats`` measured transitions (each the slowest
        rank's) and the most bytes one rank received.

    Raises:
        RuntimeError: a rank's sent or resident bytes differ from
            ``hybrid_engine.expected_bytes``.
    """
    specs = tuple(transition.model_specs(size))
    with tempfile.TemporaryDirectory(prefix="asyncflow-reshard-") as tmp:
        job = _ReshardJob(specs=specs, repeats=repeats, store=os.path.join(tmp, "store"),
                          out=os.path.join(tmp, "rows.json"))
        mp.start_processes(_reshard_rank, args=(job,), nprocs=COLOCATED.world, start_method="spawn", join=True)
        rows = json.loads(Path(job.out).read_text())
    # _measure_one's row: seconds, sent bytes, peak bytes, 1 if a figure differs from the formulas, back seconds;
    # then the received bytes (_reshard_rank's).
    want = expected_bytes(COLOCATED, specs, "hybridflow")
    if any(row[3] or int(row[5]) != want.sent for row in rows):  # the formula's sent is also what each rank receives
        raise RuntimeError(f"weight sync {size}: colocated reshard moved {[int(r[1]) for r in rows]} bytes per rank "
                           f"and received {[int(r[5]) for r in rows]}; hybrid_engine.expected_bytes says "
                           f"{want.sent} sent (= received), {want.resident} resident")
    return [row[0] for row in rows], max(int(row[5]) for row in rows)


def weight_sync(sizes: Sequence[str] = ("10m", "100m", "500m"), *, repeats: int = 2,
                say: Callable[[str], None] = print) -> dict[str, float]:
    """Measure both ways of synchronising weights for every size, one after the
    other (each frees its workers and processes before the next starts).

    Args:
        sizes: keys of ``bench.transition.SIZES``.
        repeats: measured runs per size and way (median), each after one warm-up.
        say: where the progress lines go.

    Returns:
        ``weight_sync_<size>_{params,s,bytes,colocated_s,colocated_bytes}`` (see
        the module text).

    Raises:
        ValueError: ``repeats`` < 1 or a size is not in ``bench.transition.SIZES``.
        RuntimeError: measured bytes differ from the model's or the formulas'.
    """
    if repeats < 1:
        raise ValueError(f"weight_sync: repeats must be >= 1, got {repeats}")
    unknown = [s for s in sizes if s not in transition.SIZES]
    if unknown:
        raise ValueError(f"weight_sync: unknown sizes {unknown}; use keys of bench.transition.SIZES "
                         f"({sorted(transition.SIZES)})")
    mib = 1 << 20
    out: dict[str, float] = {}
    for size in sizes:
        params = params_of(size)
        say(f"weight sync {size}: Llama {transition.SIZES[size]} (hidden, intermediate, layers, vocab): "
            f"{params:,} parameters{_target(size)}, {4 * params / mib:.1f} MiB fp32")
        seconds, received, model_bytes = disaggregated(size, repeats=repeats)
        if model_bytes != 4 * params:
            raise RuntimeError(f"weight sync {size}: the checkpoint holds {model_bytes} parameter bytes, "
                               f"not 4 * {params} (bench.transition.SIZES's shape)")
        out[f"weight_sync_{size}_params"] = params
        out[f"weight_sync_{size}_s"] = statistics.median(seconds)
        out[f"weight_sync_{size}_bytes"] = received
        say(f"weight sync {size}: pulled by a rollout role on its own pool in {statistics.median(seconds):.3f} s "
            f"(runs {[round(s, 3) for s in seconds]}), {received / mib:.1f} MiB received by its rank")
        seconds, received = colocated(size, repeats=repeats)
        out[f"weight_sync_{size}_colocated_s"] = statistics.median(seconds)
        out[f"weight_sync_{size}_colocated_bytes"] = received
        say(f"weight sync {size}: colocated reshard 121-1121 (hybridflow, 2 gloo ranks) in "
            f"{statistics.median(seconds):.3f} s (runs {[round(s, 3) for s in seconds]}), "
            f"{received / mib:.1f} MiB received per rank")
    return out
