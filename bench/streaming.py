"""Streaming generation into inference, with and without long-tail migration.

Run as ``python -m bench.streaming --json PATH`` (Markdown tables go to stdout).

One step is PPO's generation and inference: the actor (native rollout engine)
generates one response per prompt, then the reference (``ReferenceWorker``), the
critic (``CriticWorker``) and a reward model (``RewardWorker`` with a value model)
run a forward pass over every row, each with its own model (the inference models
are replicated, so their calls need no other rank). Three modes:

- ``batch``: inference starts when the whole batch is generated;
- ``stream``: groups flow into inference as they finish (``stream=True``);
- ``stream_migrate``: as ``stream`` with ``migrate="auto"``: the runtime's
  simulator picks the threshold and targets from the previous step's lengths, the
  ranks' step timings and the measured inference cost (no migration when it
  predicts no gain, or with a single generation rank).

Two placements on the machine's two cores, each in its own session:

- ``disaggregated`` (the top-level keys): the actor on a 1-rank pool, the inference
  roles on another; streaming overlaps inference with generation's long tail.
- ``colocated`` (RLHFuse's setting): everything on one 2-rank pool; inference runs
  on the ranks generation freed (a rank whose share is done, or, with migration,
  a rank whose tail moved to the other).

Response lengths are long-tailed with a fixed seed (lognormal, p99 about 9x the
median): each prompt carries its budget in a ``max_new_tokens`` column and EOS is
ignored, so every sample generates exactly its budget with the real model. The
inference models are sized so that batch-mode inference takes about as long as
generation (``inference_over_generation``). The modes alternate within each
repeat and the medians are reported. ``sim_<N>_speedup`` is the simulator's
predicted speed-up of fused (best threshold) over batch for N generation
instances on the same length distribution, with the step and inference costs
measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import asyncflow as af
from asyncflow import ResourcePool, RoleSpec, StreamOptions, collect, merge
from asyncflow.runtime import StepCost, long_tail_lengths, predicted_speedups
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, save_tiny_model
from workers.rewards import ModelRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    CriticConfig,
    CriticWorker,
    ReferenceConfig,
    ReferenceWorker,
    RewardWorker,
    ScoreConfig,
)
from workers.rollout import NativeRolloutConfig, SamplingParams

ACTOR = TinyModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                        max_position_embeddings=1100)
INFERENCE = TinyModelConfig(hidden_size=384, intermediate_size=768, num_hidden_layers=3,
                            num_attention_heads=6, num_key_value_heads=6, head_dim=64,
                            max_position_embeddings=1100)
P99_RATIO = 9.0
"""Asked of the length sampler; the record reports the lengths' own p99 / median."""
MAX_BATCH = 16
"""Decode batch of a generation instance: below it a step costs about the same
whatever the batch (measured here: 0.54 ms at 1 sample, 0.92 ms at 16), the
regime of a GPU below saturation, where the long tail idles the devices."""
INFERENCE_BATCHING = TrainingConfig(micro_batch_size=1)
"""One row per forward pass, no padding: inference costs the same per row whether
its micro-batch came from a stream (rows of similar lengths) or from the whole
batch (mixed lengths, padded to the longest), so the modes differ by overlap only."""
POOL = ResourcePool(name="main", devices=2)
INFERENCE_POOL = ResourcePool(name="inference", devices=1)
GEN_POOL = ResourcePool(name="generation", devices=1)
PLACEMENTS = {
    "disaggregated": "actor on a 1-rank pool, the inference roles on another (a core each)",
    "colocated": "actor and inference roles on one 2-rank pool (RLHFuse's setting)",
    "separate": "actor on a 2-rank pool, the inference roles on a 1-rank pool (3 processes, 2 cores)",
}


def _specs(actor_dir: str, inference_dir: str, max_new: int, placement: str) -> dict[str, RoleSpec]:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    gen = GEN_POOL if placement == "disaggregated" else POOL
    other = POOL if placement == "colocated" else INFERENCE_POOL
    return {
        "actor": RoleSpec(cls=ActorWorker, pool=gen, config=ActorConfig(
            model_dir=actor_dir, sampling=sampling, rollout=NativeRolloutConfig(max_batch_size=MAX_BATCH))),
        "ref": RoleSpec(cls=ReferenceWorker, pool=other, config=ReferenceConfig(
            model_dir=inference_dir, replicate=True, training=INFERENCE_BATCHING)),
        "critic": RoleSpec(cls=CriticWorker, pool=other, config=CriticConfig(
            model_dir=inference_dir, replicate=True, training=INFERENCE_BATCHING)),
        "reward": RoleSpec(cls=RewardWorker, pool=other, config=ScoreConfig(
            scorer=ModelRewardConfig(model_dir=inference_dir, micro_batch_size=1))),
    }


def _prompts(lengths: list[int], *, n: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """One prompt per group of ``n`` lengths; a group's budget is its longest."""
    g = torch.Generator().manual_seed(seed)
    groups = len(lengths) // n
    ids = torch.randint(3, vocab, (groups, 8), generator=g)
    budget = torch.tensor([max(lengths[i * n:(i + 1) * n]) for i in range(groups)], dtype=torch.int64)
    return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "max_new_tokens": budget}


async def _step(roles: Any, src: Any, *, n: int, params: SamplingParams, stream: StreamOptions | None
                ) -> tuple[float, float]:
    """One generation + inference step; ``(seconds, generation seconds)``."""
    start = time.monotonic()
    rollout = roles.actor.generate(src, n=n, params=params, stream=stream)
    outs = [roles.ref.log_prob(rollout), roles.critic.values(rollout), roles.reward.score(rollout)]
    gen_done = asyncio.ensure_future(_done(rollout))
    batch = collect(merge(rollout, *outs)) if stream is not None else merge(rollout, *outs)
    await batch
    gen_s = await gen_done - start
    if stream is not None:
        global _last_report
        _last_report = await rollout.report()
    return time.monotonic() - start, gen_s


_last_report: Any = None


async def _done(rows: Any) -> float:
    if isinstance(rows, af.DataStream):
        await rows.futures()
    else:
        await rows
    return time.monotonic()


async def _inference_only(roles: Any, rollout: Any) -> float:
    start = time.monotonic()
    await merge(roles.ref.log_prob(rollout), roles.critic.values(rollout), roles.reward.score(rollout))
    return time.monotonic() - start


async def measure(*, placement: str, prompts: int, n: int, median: int, max_new: int, repeats: int,
                  micro_batch: int, seed: int, migrate: int | str = "auto") -> dict[str, Any]:
    """Measure the three modes in one placement (one session)."""
    lengths = long_tail_lengths(prompts * n, median=median, p99_ratio=P99_RATIO, max_len=max_new, seed=seed)
    with tempfile.TemporaryDirectory() as tmp:
        actor_dir = str(save_tiny_model(Path(tmp) / "actor", ACTOR, seed=0))
        inference_dir = str(save_tiny_model(Path(tmp) / "inference", INFERENCE, seed=1))
        async with af.Session() as session:
            roles = await session.spawn(_specs(actor_dir, inference_dir, max_new, placement))
            columns = _prompts(lengths, n=n, vocab=16, seed=seed)
            real = columns["max_new_tokens"].repeat_interleave(n).tolist()
            src = await session.put(columns, pool=GEN_POOL if placement == "disaggregated" else POOL,
                                    group_size=1)
            params = SamplingParams(max_new_tokens=max_new, temperature=1.0, seed=seed, ignore_eos=True)
            plain = StreamOptions(micro_batch=micro_batch, migrate=0)
            auto = StreamOptions(micro_batch=micro_batch, migrate=migrate)  # type: ignore[arg-type]
            # Warm-up: one of each (and the observations "auto" migration needs).
            await _step(roles, src, n=n, params=params, stream=None)
            await _step(roles, src, n=n, params=params, stream=plain)
            rollout = roles.actor.generate(src, n=n, params=params)
            got = (await rollout.fetch())["response_mask"].sum(1).tolist()
            if got != real:
                raise RuntimeError("responses did not get their budgets: the length distribution is off")
            inference_s = await _inference_only(roles, rollout)
            times: dict[str, list[float]] = {"batch": [], "stream": [], "stream_migrate": []}
            gen: list[float] = []
            reports: list[Any] = []
            for _ in range(repeats):
                total, gen_s = await _step(roles, src, n=n, params=params, stream=None)
                times["batch"].append(total)
                gen.append(gen_s)
                times["stream"].append((await _step(roles, src, n=n, params=params, stream=plain))[0])
                times["stream_migrate"].append((await _step(roles, src, n=n, params=params, stream=auto))[0])
                reports.append(_last_report)
            observed = session._scheduler.observed if session._scheduler is not None else None
            gen_ranks = GEN_POOL.devices if placement == "disaggregated" else POOL.devices
            threshold = _last_threshold(observed, n_ranks=gen_ranks, micro_batch=micro_batch)
        af.shutdown_ray()
    med = {k: statistics.median(v) for k, v in times.items()}
    gen_s = statistics.median(gen)
    step = StepCost(base_s=gen_s / max(real), per_sample_s=0.0)
    inference_ranks = POOL.devices if placement == "colocated" else INFERENCE_POOL.devices
    per_sample = inference_s * inference_ranks / len(real)
    sims = predicted_speedups(real, instances=[8, 32, 128], samples_per_instance=len(real) // POOL.devices,
                              step=step, inference_s_per_sample=per_sample, max_batch=MAX_BATCH,
                              micro_batch=micro_batch, seed=seed)
    ordered = sorted(real)
    return {
        "placement": placement, "generation_ranks": gen_ranks,
        "batch_s": med["batch"], "stream_s": med["stream"], "stream_migrate_s": med["stream_migrate"],
        "stream_over_batch": med["stream"] / med["batch"],
        "stream_migrate_over_batch": med["stream_migrate"] / med["batch"],
        "generation_s": gen_s, "inference_s": inference_s, "inference_over_generation": inference_s / gen_s,
        "threshold": threshold[0], "targets": threshold[1],
        "migrated": [getattr(r, "migrated", 0) for r in reports],
        "migrated_at_s": [getattr(r, "migrated_at_s", None) for r in reports],
        **{f"sim_{k}_speedup": v.speedup for k, v in sims.items()},
        **{f"sim_{k}_threshold": v.threshold for k, v in sims.items()},
        "lengths": {"median": float(np.median(ordered)), "p99": float(np.percentile(ordered, 99)),
                    "max": ordered[-1], "samples": len(ordered)},
        "runs": times, "repeats": repeats, "prompts": prompts, "n": n, "micro_batch": micro_batch,
        "models": {"actor": _params(ACTOR), "inference": _params(INFERENCE)},
        "load_avg": os.getloadavg(),
    }


async def run(*, placements: list[str], **kw: Any) -> dict[str, Any]:
    """Measure every placement; the record's top-level keys are the first one's."""
    found = {p: await measure(placement=p, **kw) for p in placements}
    return {**found[placements[0]], "placements": found}


def _last_threshold(observed: Any, *, n_ranks: int, micro_batch: int) -> tuple[int, int]:
    from asyncflow.runtime import auto_migration

    if observed is None:
        return 0, 1
    return auto_migration(observed, pool=POOL.name, role="actor", method="generate", ranks=n_ranks,
                          micro_batch=micro_batch)


def _params(shape: TinyModelConfig) -> str:
    return (f"{shape.num_hidden_layers} layers x {shape.hidden_size} wide, "
            f"MLP {shape.intermediate_size}")


def table(r: dict[str, Any]) -> str:
    """The record as a Markdown table."""
    lines = ["| mode | seconds (median) | vs batch |", "|---|---|---|"]
    for k in ("batch", "stream", "stream_migrate"):
        lines.append(f"| {k} | {r[k + '_s']:.2f} | {r[k + '_s'] / r['batch_s']:.2f} |")
    lines += ["", f"generation {r['generation_s']:.2f} s, batch inference {r['inference_s']:.2f} s "
              f"(ratio {r['inference_over_generation']:.2f}); lengths median {r['lengths']['median']}, "
              f"p99 {r['lengths']['p99']}, max {r['lengths']['max']}; migration threshold "
              f"{r['threshold']} samples onto {r['targets']} rank(s)", "",
              "| instances (simulated) | predicted speed-up | threshold |", "|---|---|---|"]
    for count in (8, 32, 128):
        lines.append(f"| {count} | {r[f'sim_{count}_speedup']:.2f} | {r[f'sim_{count}_threshold']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the record here")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--median", type=int, default=32, help="median response length")
    parser.add_argument("--max-new", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--migrate", default="auto", help='threshold of stream_migrate ("auto" or an int)')
    parser.add_argument("--placement", action="append", choices=sorted(PLACEMENTS),
                        help="disaggregated and colocated by default; the first gives the top-level keys")
    a = parser.parse_args(argv)
    record = asyncio.run(run(placements=a.placement or ["disaggregated", "colocated"], prompts=a.prompts,
                             n=a.n, median=a.median, max_new=a.max_new, repeats=a.repeats,
                             micro_batch=a.micro_batch, seed=a.seed,
                             migrate=a.migrate if a.migrate == "auto" else int(a.migrate)))
    for r in record["placements"].values():
        print(f"\n### {r['placement']} ({r['generation_ranks']} generation rank(s))\n")
        print(table(r))
    if a.json is not None:
        a.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
