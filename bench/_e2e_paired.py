"""asyncflow and the plain-PyTorch floor taking steps in turn, in one run, for
``bench.e2e --paired``: ``python -m bench._e2e_paired --placement dp2`` prints one
JSON record.

The 2-core test machine changes speed from one minute to the next (a core runs
at times 1.8 times slower, for seconds to minutes, whatever runs on it), which
moves runs measured a minute apart by more than the ratio ``bench.e2e`` looks
for. Here asyncflow's session (a placement of ``bench._e2e_asyncflow``) and the
floor's ranks (``bench._e2e_floor``: one process, and two) are all up at once and
take steps in turn, each waiting while another steps: in round k, asyncflow,
``floor_1`` and ``floor_2`` step one after the other, the order rotating by k. So
each round's three steps fall in the same second, and the ratio of each round's
steps is taken before the median.

What waits is not free: asyncflow's idle session (Ray's daemons, the workers'
threads, the rendezvous store) took 4.3 % of the machine's CPU in a 10-second
window, and the floor's waiting ranks (their gloo threads) less, so each side's
steps run beside the other's idle processes, not on an empty machine as in
``bench.e2e``'s separate runs.
"""

from __future__ import annotations

import time

_START = time.time()

import argparse  # noqa: E402

import asyncflow as af  # noqa: E402 (light: its names load on first use)
from bench._e2e_placements import PLACEMENTS, start_ray_for  # noqa: E402 (light)

FLOORS = {"floor_1": 1, "floor_2": 2}
"""The floor's sides: name, ranks."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench._e2e_paired")
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="dp2")
    parser.add_argument("--steps", type=int, default=30, help="rounds timed (each: one step of every side)")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before them")
    parser.add_argument("--model-dir", help="the workload's model (default: saved by this run)")
    return parser


if __name__ == "__main__":  # a run; bench.e2e imports this module for its names only
    _args = _parser().parse_args()
    start_ray_for(_args.placement, model_given=_args.model_dir is not None)

import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch.multiprocessing as mp  # noqa: E402

from asyncflow.algos import grpo_step  # noqa: E402
from bench._e2e_asyncflow import grpo_config, put_prompts, role_specs  # noqa: E402
from bench._e2e_floor import FloorRank, free_port, rank_threads, wait_for_ranks  # noqa: E402
from bench._e2e_job import E2EJob  # noqa: E402

READY_S = 300.0
"""How long the floor's ranks may take to start, and a step to take."""


def _serve(rank: int, world: int, port: int, job: E2EJob, threads: int, model_dir: str, go: Any, done: Any) -> None:
    """A floor rank that takes one step per ``go`` message (None: stop), answering
    on ``done`` with its step's seconds."""
    me = FloorRank(rank, world, port, job, threads, model_dir)
    done.put(("ready", rank))
    while go.get() is not None:
        done.put(("step", sum(me.step())))
    me.close()


class _Floor:
    """One floor side: ``ranks`` processes stepping on command."""

    def __init__(self, ranks: int, job: E2EJob, model_dir: str) -> None:
        ctx = mp.get_context("spawn")
        port, threads = free_port(), rank_threads(ranks)
        self.go = [ctx.Queue() for _ in range(ranks)]
        self.done = [ctx.Queue() for _ in range(ranks)]
        self.procs = [ctx.Process(target=_serve, args=(r, ranks, port, job, threads, model_dir, self.go[r],
                                                       self.done[r]), daemon=True) for r in range(ranks)]
        for p in self.procs:
            p.start()

    def ready(self) -> None:
        """Wait for every rank to be set up."""
        for q in self.done:
            wait_for_ranks(q, self.procs, timeout_s=READY_S)

    def step(self) -> float:
        """One step of every rank; rank 0's seconds (as ``bench._e2e_floor`` reports)."""
        for q in self.go:
            q.put(1)
        seconds = [wait_for_ranks(q, self.procs, timeout_s=READY_S)[1] for q in self.done]
        return float(seconds[0])

    def close(self) -> None:
        for q in self.go:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


async def measure(job: E2EJob, placement: str, *, steps: int, warmup: int, model_dir: str | None = None
                  ) -> dict[str, Any]:
    """``warmup + steps`` rounds of one step of every side (see the module docstring); the record."""
    config = grpo_config(job)
    with job.model_dir(model_dir) as model_dir:
        floors = {name: _Floor(ranks, job, model_dir) for name, ranks in FLOORS.items()}
        try:
            async with af.Session() as session:
                roles = await session.spawn(role_specs(job, model_dir, placement, None))
                prompts = await put_prompts(session, job, placement)
                for floor in floors.values():
                    await asyncio.to_thread(floor.ready)

                async def asyncflow_step(k: int) -> float:
                    start = time.perf_counter()
                    await grpo_step(roles, prompts, config, seed=job.seed + k)
                    return time.perf_counter() - start

                sides: dict[str, Callable[[int], Awaitable[float]]] = {"asyncflow": asyncflow_step}
                sides |= {name: _stepper(floor) for name, floor in floors.items()}
                names = list(sides)
                times: dict[str, list[float]] = {name: [] for name in names}
                for k in range(warmup + steps):
                    turn = k % len(names)
                    for name in names[turn:] + names[:turn]:
                        seconds = await sides[name](k)
                        if k >= warmup:
                            times[name].append(seconds)
        finally:
            for floor in floors.values():
                floor.close()
    af.shutdown_ray()
    return record(job, placement, times)


def _stepper(floor: _Floor) -> Callable[[int], Awaitable[float]]:
    """A step of ``floor``, waited for off the event loop (the session's calls stay served)."""
    def step(_: int) -> Awaitable[float]:
        return asyncio.to_thread(floor.step)
    return step


def record(job: E2EJob, placement: str, times: dict[str, list[float]]) -> dict[str, Any]:
    """The run's record from each side's step seconds, round by round: each side's
    median, the floor side with the lower one, and ``asyncflow_vs_floor``: the
    median over rounds of that floor's step over asyncflow's (tokens/s over tokens/s)."""
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    floor = min(FLOORS, key=lambda name: medians[name])
    ratios = [f / a for f, a in zip(times[floor], times["asyncflow"], strict=True)]
    return {"placement": placement, "rounds": len(times["asyncflow"]), "steps_s": times,
            **{f"{name}_s_per_step": m for name, m in medians.items()},
            "best_floor": floor, "asyncflow_vs_floor": statistics.median(ratios),
            "asyncflow_tokens_per_s": job.tokens_per_step / medians["asyncflow"],
            "floor_tokens_per_s": job.tokens_per_step / medians[floor]}


def main(argv: list[str] | None = None) -> None:
    """Run the sides in turn; print the record as JSON on the last line."""
    args = _parser().parse_args(argv)
    print(json.dumps(asyncio.run(measure(E2EJob.on("cpu"), args.placement, steps=args.steps, warmup=args.warmup,
                                         model_dir=args.model_dir))))


if __name__ == "__main__":
    main()
