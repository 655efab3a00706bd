"""Weight synchronisation for ``bench.async_rl``: the actor's weights to generation.

- Disaggregated (the keys ``weight_sync_<size>_s`` / ``_bytes``): on real Ray
  workers, an actor on a 1-rank pool (``ActorConfig(rollout=None)``: no second
  copy) publishes ``actor.weights()`` and a rollout role on another 1-rank pool
  pulls them (``rollout.load_weights``), peer to peer over the session's data
  plane. Seconds: the call's median over ``repeats`` after a warm-up; bytes: what
  the rollout rank receives, the model's parameter bytes (t = 1: no padding rows).
- Colocated (``weight_sync_<size>_colocated_s`` / ``_bytes``): the hybrid engine's
  transition ``141-1221`` (4 gloo ranks, training t = 4 to generation tg = 2,
  ``hybridflow``) of the same Llama shape, measured by ``bench.transition``.

Models of about 10 M, 100 M and 500 M parameters (fp32) are built here; nothing is
downloaded. ``weight_sync_<size>_params`` is the exact count.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import bench.transition as transition
from workers.models import TinyModelConfig, save_tiny_model


def params_of(size: str) -> int:
    """Parameters of the ``size`` Llama of ``bench.transition.SIZES`` (untied
    embeddings and head, RMS norms)."""
    hidden, inter, layers, vocab = transition.SIZES[size]
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def _model(size: str) -> TinyModelConfig:
    hidden, inter, layers, vocab = transition.SIZES[size]
    return TinyModelConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                           num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
                           vocab_size=vocab)


async def _pull(model_dir: str, repeats: int) -> list[float]:
    import asyncflow as af
    from workers.roles import ActorConfig, ActorWorker, RolloutWorker, RolloutWorkerConfig

    train = af.ResourcePool(name="train", devices=1, threads=1)
    gen = af.ResourcePool(name="gen", devices=1, threads=1)
    async with af.Session() as session:
        roles = await session.spawn({
            "actor": af.RoleSpec(cls=ActorWorker, pool=train, config=ActorConfig(model_dir=model_dir, rollout=None)),
            "rollout": af.RoleSpec(cls=RolloutWorker, pool=gen, config=RolloutWorkerConfig(model_dir=model_dir)),
        })
        seconds = []
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            await roles.rollout.load_weights(roles.actor.weights())
            seconds.append(time.perf_counter() - start)
    af.shutdown_ray()
    return seconds[1:]


def weight_sync(sizes: Sequence[str] = ("10m", "100m", "500m"), *, repeats: int = 2, colocated: bool = True,
                say: Callable[[str], None] = print) -> dict[str, float]:
    """Measure every size (see the module text); the JSON keys."""
    out: dict[str, float] = {}
    for size in sizes:
        params = params_of(size)
        out[f"weight_sync_{size}_params"] = params
        with tempfile.TemporaryDirectory(prefix="asyncflow-sync-") as tmp:
            model_dir = str(save_tiny_model(Path(tmp) / "policy", _model(size), seed=0))
            seconds = asyncio.run(_pull(model_dir, repeats))
        out[f"weight_sync_{size}_s"] = statistics.median(seconds)
        out[f"weight_sync_{size}_bytes"] = 4 * params
        say(f"weight sync {size} ({params / 1e6:.1f} M params, {4 * params / 2**20:.0f} MiB): pulled by the "
            f"rollout pool in {out[f'weight_sync_{size}_s']:.3f} s (runs: {[round(s, 3) for s in seconds]})")
        if colocated:
            record = transition.measure(world=4, size=size, repeats=repeats, bucket_bytes=64 << 20,
                                        methods=("hybridflow",), layouts=("141-1221",))
            out[f"weight_sync_{size}_colocated_s"] = float(record["hybridflow_141-1221_s"])
            out[f"weight_sync_{size}_colocated_bytes"] = float(record["hybridflow_141-1221_bytes"])
            say(f"weight sync {size}: colocated reshard 141-1221 (hybridflow, 4 ranks) "
                f"{out[f'weight_sync_{size}_colocated_s']:.3f} s, "
                f"{out[f'weight_sync_{size}_colocated_bytes'] / 2**20:.0f} MiB received per rank")
    return out
