"""The end-to-end workload through asyncflow's public API (``grpo_step``), one
placement per process: ``python -m bench._e2e_asyncflow --placement one``
prints one JSON record (seconds per step, the per-stage breakdown of a few traced
steps after the timed ones, and where the start-up seconds went, from process
start)."""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402

import asyncflow as af  # noqa: E402 (light: its names load on first use)
from bench._e2e_placements import PLACEMENTS, start_ray_for  # noqa: E402 (light)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench._e2e_asyncflow")
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="one")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: the pool's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the workload and its pools' device")
    parser.add_argument("--model-dir", help="the workload's model (default: saved by this run)")
    return parser


if __name__ == "__main__":  # a run; bench.e2e imports this module for its names only
    _args = _parser().parse_args()
    start_ray_for(_args.placement, device=_args.device, model_given=_args.model_dir is not None)

import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from asyncflow.algos import GRPOConfig, PolicyConfig, SamplingConfig, grpo_step  # noqa: E402
from asyncflow.tracing import summarise  # noqa: E402
from bench._e2e_job import E2EJob  # noqa: E402
from workers.engines import TrainingConfig  # noqa: E402
from workers.rewards import RuleRewardConfig  # noqa: E402
from workers.roles import (  # noqa: E402
    ActorConfig,
    ActorWorker,
    ReferenceConfig,
    ReferenceWorker,
    RewardWorker,
    ScoreConfig,
)


def grpo_config(job: E2EJob) -> GRPOConfig:
    """GRPO's settings for the workload."""
    return GRPOConfig(sampling=SamplingConfig(n=job.n, temperature=1.0, max_new_tokens=job.new_tokens,
                                            ignore_eos=True),
                      policy=PolicyConfig(kl_coef=job.kl_coef))


def role_specs(job: E2EJob, model_dir: str, placement: str, threads: int | None) -> dict[str, af.RoleSpec]:
    """The actor, reference and rule reward on ``placement``'s pools."""
    sizes, where = PLACEMENTS[placement]
    pools = {name: af.ResourcePool(name=name, devices=n, threads=threads, device=job.device)  # type: ignore[arg-type]
             for name, n in sizes.items()}
    training = TrainingConfig(lr=job.lr, micro_batch_size=job.micro_batch)
    built: dict[str, tuple[type, Any]] = {
        "actor": (ActorWorker, ActorConfig(model_dir=model_dir, training=training, seed=job.seed)),
        "ref": (ReferenceWorker, ReferenceConfig(model_dir=model_dir, training=training)),
        "reward": (RewardWorker, ScoreConfig(scorer=RuleRewardConfig(
            tokenizer_dir=model_dir, fn="bench._e2e_job:digit_reward"))),
    }
    return {role: af.RoleSpec(cls=cls, pool=pools[where[role]], config=config)
            for role, (cls, config) in built.items()}


async def put_prompts(session: af.Session, job: E2EJob, placement: str) -> af.DataFuture[Any]:
    """The workload's prompts, stored on ``placement``'s actor pool (one group each)."""
    prompt_ids = job.prompt_ids()
    return await session.put({"prompt_ids": prompt_ids, "prompt_mask": prompt_ids.ne(-1).long(),
                              "uid": torch.arange(job.prompts)}, pool=PLACEMENTS[placement][1]["actor"], group_size=1)


TRACED_STEPS = 3
"""Steps after the timed ones, traced for the per-stage breakdown (tracing costs
the steps it records 1-4 %: the timed steps run without it, as a run does)."""


async def measure(job: E2EJob, placement: str, *, steps: int, warmup: int, threads: int | None,
                  model_dir: str | None = None) -> dict[str, Any]:
    """Start a session, run ``warmup + steps`` GRPO steps on the model in
    ``model_dir`` (default: one this run saves), timed, then :data:`TRACED_STEPS`
    traced ones; the record."""
    config = grpo_config(job)
    marks: dict[str, float] = {"imported": time.time() - _START}
    given = model_dir is not None
    with job.model_dir(model_dir) as model_dir:
        async with af.Session() as session:
            marks["ray_started"] = time.time() - _START
            roles = await session.spawn(role_specs(job, model_dir, placement, threads))
            marks["roles_spawned"] = time.time() - _START
            prompts = await put_prompts(session, job, placement)
            times: list[float] = []
            metrics: dict[str, float] = {}
            for k in range(warmup + steps + TRACED_STEPS):
                if k == warmup + steps:  # the timed steps ran untraced, as a run does by default
                    await session.start_trace()
                start = time.perf_counter()
                session.mark_step()
                metrics = await grpo_step(roles, prompts, config, seed=job.seed + k)
                times.append(time.perf_counter() - start)
                if k == 0:
                    marks["first_step_done"] = time.time() - _START
            trace = session.stop_trace()
        af.shutdown_ray()
    summary = summarise(trace)
    median = statistics.median(times[warmup:warmup + steps])
    return {
        "framework": "asyncflow", "placement": placement, "threads": threads, "device": job.device,
        "s_per_step": median, "tokens_per_s": job.tokens_per_step / median,
        "steps_s": times, "traced_steps": TRACED_STEPS, "startup_s": marks, "model_given": given,
        "driver_imported_transformers": "transformers" in sys.modules,
        "stage_ms": {k: 1000 * v / TRACED_STEPS for k, v in sorted(summary.stage_busy_s.items())},
        "stage_cpu_ms": {k: 1000 * v / TRACED_STEPS for k, v in sorted(summary.stage_cpu_s.items())},
        "pool_busy_ms": {k: 1000 * v / TRACED_STEPS for k, v in summary.busy_s.items()},
        "last_metrics": {k: v for k, v in metrics.items() if k in ("actor/loss", "actor/kl_to_ref", "reward/mean",
                                                                    "actor/logprob_mismatch")},
    }


def main(argv: list[str] | None = None) -> None:
    """Run one placement; print its record as JSON on the last line."""
    args = _parser().parse_args(argv)
    record = asyncio.run(measure(E2EJob.on(args.device), args.placement, steps=args.steps, warmup=args.warmup,
                                 threads=args.threads, model_dir=args.model_dir))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
