"""Asynchronous off-policy GRPO against synchronous GRPO, and weight synchronisation.

Run as ``python -m bench.async_rl --json PATH`` (a Markdown table goes to stdout).

Throughput: the same GRPO workload (a random-initialised Llama, prompts whose
response budgets are long-tailed with a fixed seed, EOS ignored so every sample
generates exactly its budget, a rule reward, one optimizer step a batch) runs in
one session per mode, on this machine's two cores:

- ``sync_one``: the actor generates and trains on one rank with both cores;
- ``sync_dp2``: the actor on two data-parallel ranks, a core each;
- ``async<k>`` for k = 0, 1, 2: the actor trains on one rank, a rollout role
  generates on the other, up to ``k`` steps ahead (the trainer's own
  :class:`~asyncflow.train._ahead.SamplesAhead` and ``grpo_step(rollout=...)``;
  with ``--overlap`` each step starts once the last submitted its update,
  ``train.overlap_steps``);
- ``async1_partial``: ``async1`` with partial rollouts: a generation stops after
  ``AsyncJob.partial_steps`` engine steps and its long samples go on in the next
  batches' (its tokens are those its generations sampled: what the steps trained,
  corrected by the tokens carried in and out of the measured calls; warm-up of
  at least ``max_tokens / partial_steps + 1`` steps).

``sync_tokens_per_s`` is the best synchronous placement (``sync_one``,
``sync_dp2``, or ``async0``, which trains as synchronous training does, metric
for metric); ``async<k>_tokens_per_s`` counts the generated tokens of the measured
steps over their wall time (after ``--warmup`` steps). Each mode runs ``--rounds``
sessions, the modes taking turns, and its median run is the one reported (the
machine's speed drifts over minutes; ``<mode>_tokens_per_s_rounds`` has them
all). ``<mode>_pool_step_ms`` is each pool's busy time a step in the steady state
(:func:`step_busy`) and ``<mode>_step_over_busiest`` the step time over the
busiest pool's: the pools' idle time, 1 where the busiest never waits. Weight
synchronisation (``bench._weight_sync``): seconds and bytes per rank for models of
about 10 M, 100 M and 500 M parameters, pulled by a rollout role on another pool,
and resharded in place by the hybrid engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import asyncflow as af
from asyncflow.algos import GRPOConfig, SamplingConfig, grpo_step
from asyncflow.runtime import long_tail_lengths
from asyncflow.tracing import Trace, summarise
from asyncflow.train import Sampled, SamplesAhead
from workers.engines import TrainingConfig
from workers.models import TinyModelConfig, save_tiny_model
from workers.rewards import RuleRewardConfig
from workers.roles import (
    ActorConfig,
    ActorWorker,
    PartialRollout,
    RewardWorker,
    RolloutWorker,
    RolloutWorkerConfig,
    ScoreConfig,
)
from workers.rollout import NativeRolloutConfig

MODES = ("sync_one", "sync_dp2", "async0", "async1", "async2", "async1_partial", "async2_partial")
"""``asyncK``: ``max_staleness = K``; ``_partial``: with partial rollouts (``AsyncJob.partial_steps``)."""


@dataclass(frozen=True, kw_only=True)
class AsyncJob:
    """The workload's sizes."""

    prompts: int = 8
    """Prompts per step."""
    n: int = 4
    """Samples per prompt (GRPO's group)."""
    median_tokens: int = 16
    """Median response budget."""
    max_tokens: int = 192
    """Longest response budget (the response width)."""
    p99_ratio: float = 8.0
    """The budgets' 99th percentile over their median."""
    micro_batch: int = 8
    """Rows per training micro-batch (each trimmed to its longest response)."""
    prompt_len: int = 8
    hidden: int = 128
    layers: int = 2
    vocab_size: int = 64
    lr: float = 1e-4
    seed: int = 0
    partial_steps: int = 32
    """Partial rollouts (the ``_partial`` modes): engine steps a generation runs before
    its unfinished samples carry over to the next batch's."""
    partial_carries: int = 8
    """... and how many batches a sample may be carried over to."""

    def budgets(self) -> list[int]:
        """Each prompt's response budget (long-tailed, fixed by the seed)."""
        return long_tail_lengths(self.prompts, median=self.median_tokens, p99_ratio=self.p99_ratio,
                                 max_len=self.max_tokens, seed=self.seed)

    @property
    def tokens_per_step(self) -> int:
        """Generated tokens per step."""
        return self.n * sum(self.budgets())

    def save_model(self, directory: Path) -> str:
        """Write the policy (and its tokenizer) to ``directory``; its path."""
        config = TinyModelConfig(hidden_size=self.hidden, intermediate_size=2 * self.hidden,
                                 num_hidden_layers=self.layers, num_attention_heads=4, num_key_value_heads=4,
                                 head_dim=self.hidden // 4, vocab_size=self.vocab_size,
                                 max_position_embeddings=self.prompt_len + self.max_tokens + 8)
        return str(save_tiny_model(directory, config, seed=self.seed))

    def prompts_batch(self) -> dict[str, torch.Tensor]:
        """The prompt rows: ids, mask, uid and each prompt's budget."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(3, 16, (self.prompts, self.prompt_len), generator=g)
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "uid": torch.arange(self.prompts),
                "max_new_tokens": torch.tensor(self.budgets(), dtype=torch.int64)}


def _specs(job: AsyncJob, model_dir: str, mode: str) -> dict[str, af.RoleSpec]:
    training = TrainingConfig(lr=job.lr, micro_batch_size=job.micro_batch)
    rollout = NativeRolloutConfig(seed=job.seed, max_batch_size=job.prompts * job.n)
    reward = (RewardWorker, ScoreConfig(scorer=RuleRewardConfig(tokenizer_dir=model_dir,
                                                                fn="bench._e2e_job:digit_reward")))
    if mode.startswith("sync"):
        devices, threads = (1, 2) if mode == "sync_one" else (2, 1)
        main = af.ResourcePool(name="main", devices=devices, threads=threads)
        actor = ActorConfig(model_dir=model_dir, training=training, rollout=rollout, seed=job.seed)
        return {"actor": af.RoleSpec(cls=ActorWorker, pool=main, config=actor),
                "reward": af.RoleSpec(cls=reward[0], pool=main, config=reward[1])}
    train = af.ResourcePool(name="train", devices=1, threads=1)
    gen = af.ResourcePool(name="gen", devices=1, threads=1)
    actor = ActorConfig(model_dir=model_dir, training=training, rollout=None, seed=job.seed)
    # The reward (milliseconds) beside the actor: on the rollout's pool its call would
    # queue behind the generation running ahead.
    return {"actor": af.RoleSpec(cls=ActorWorker, pool=train, config=actor),
            "reward": af.RoleSpec(cls=reward[0], pool=train, config=reward[1]),
            "rollout": af.RoleSpec(cls=RolloutWorker, pool=gen,
                                   config=RolloutWorkerConfig(model_dir=model_dir, rollout=rollout, seed=job.seed))}


async def measure(job: AsyncJob, mode: str, *, steps: int, warmup: int, transport: str = "auto",
                  overlap: bool = False) -> dict[str, Any]:
    """One session: ``warmup + steps`` GRPO steps in ``mode``; the record. ``overlap``:
    asynchronous modes start each step once the last submitted its update
    (:meth:`SamplesAhead.steps`, ``train.overlap_steps``); else after it ended."""
    config = GRPOConfig(sampling=SamplingConfig(n=job.n, temperature=1.0, max_new_tokens=job.max_tokens,
                                              ignore_eos=True))
    if mode.endswith("_partial"):
        # Warm up until the longest sample's chain of generations (``partial_steps`` each)
        # has run through once: the carry-over is then in its usual state.
        warmup = max(warmup, -(-job.max_tokens // job.partial_steps) + 1)
    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="asyncflow-async-") as tmp:
        model_dir = job.save_model(Path(tmp) / "policy")
        async with af.Session(transport=transport) as session:  # type: ignore[arg-type]
            roles = await session.spawn(_specs(job, model_dir, mode))
            batch = job.prompts_batch()

            async def prompts() -> af.DataFuture[Any]:
                return await session.put(batch, group_size=1)

            ahead = None
            if mode.startswith("async"):
                partial = (PartialRollout(decode_steps=job.partial_steps, max_carries=job.partial_carries)
                           if mode.endswith("_partial") else None)
                ahead = SamplesAhead(session, roles, config.sampling, max_staleness=int(mode[len("async")]),
                                     last_step=total, seed_of=lambda j: job.seed + j, next_prompts=prompts, start=0,
                                     partial=partial)
            trained: dict[int, float] = {}
            began, staleness, carried_before = 0.0, [], None
            if ahead is None:
                for step in range(1, total + 1):
                    if step == warmup + 1:
                        await session.start_trace()
                        began = time.perf_counter()
                    metrics = await grpo_step(roles, await prompts(), config, seed=job.seed + step)
                    trained[step] = metrics["actor/response_tokens"]
            else:
                step_roles = ahead.step_roles()

                async def run(step: int, sampled: Sampled, lag: dict[str, float]) -> dict[str, float]:
                    staleness.append(lag["async/staleness"])
                    return await grpo_step(step_roles, sampled.prompts, config, seed=job.seed + step,
                                           rollout=sampled.rows)

                # The warm-up's last step is not overlapped: the measured steps start from a drained queue.
                run_steps = ahead.steps(1, total, run, overlap=lambda m: overlap and m != warmup)
                async with contextlib.aclosing(run_steps):
                    async for step, metrics in run_steps:
                        trained[step] = metrics["actor/response_tokens"]
                        if step == warmup:
                            if ahead.partial is not None:
                                carried_before = roles.rollout.carried()  # after the generation of batch step + k
                            await session.start_trace()
                            began = time.perf_counter()
            elapsed = time.perf_counter() - began
            tokens = sum(trained[s] for s in range(warmup + 1, total + 1))
            if ahead is not None and carried_before is not None:
                tokens = await _generated(roles, trained, carried_before, first=warmup + 2 + ahead.k) * steps
            trace = session.stop_trace()
    summary = summarise(trace)
    return {"mode": mode, "tokens_per_s": tokens / elapsed, "s_per_step": elapsed / steps, "tokens": tokens,
            "mean_staleness": sum(staleness[warmup:]) / steps if staleness else 0.0,
            "stage_ms": {k: round(1000 * v / steps) for k, v in sorted(summary.stage_busy_s.items())},
            "pool_busy_ms": {k: round(1000 * v / steps) for k, v in summary.busy_s.items()},
            "pool_step_ms": {k: round(1000 * v, 1) for k, v in step_busy(trace, steps).items()}}


def step_busy(trace: Trace, steps: int) -> dict[str, float]:
    """Seconds each pool is busy per step in the steady state: each stage (``role.method``)
    of the pool as many times as it runs a step, each time its mean call (the busiest
    rank's span).

    ``pool_busy_ms`` (the spans inside the measured window, over its steps) falls
    short of it where a pool works ahead: the rollout's pool is generating a batch
    when the window opens (a call the trace does not hold) and has no batch left to
    generate for its last ``k`` steps. A stage runs ``ceil(calls / steps)`` times a
    step (the window misses at most ``k`` of its calls).
    """
    spans: dict[tuple[str, str], list[float]] = {}
    for call in trace.calls:
        if call.ranks:
            spans.setdefault((call.pool, f"{call.role}.{call.method}"), []).append(
                max(span.seconds for span in call.ranks))
    busy = dict.fromkeys(trace.pools, 0.0)
    for (pool, _), seconds in spans.items():
        busy[pool] = busy.get(pool, 0.0) + sum(seconds) / len(seconds) * math.ceil(len(seconds) / steps)
    return busy


async def _generated(roles: Any, trained: dict[int, float], carried_before: Any, *, first: int) -> float:
    """Partial rollouts: the tokens a generation samples on average, over the calls of
    batches ``first ..`` the last: what their steps trained, plus the tokens carried
    after the last call, less those carried before ``first`` (a step's batch may hold
    tokens sampled by earlier calls, and leave some of its own to later ones)."""
    last = max(trained)
    if first > last:  # too few steps to tell: what they trained
        return trained[last]

    def tokens(values: list[dict[str, Any]]) -> int:
        return sum(int(v["tokens"]) for v in values)

    before, after = tokens(await carried_before), tokens(await roles.rollout.carried())
    return (sum(trained[s] for s in range(first, last + 1)) + after - before) / (last - first + 1)


def main(argv: list[str] | None = None) -> None:
    """Run every mode (and the weight-sync sizes), print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog="bench.async_rl")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5,
                        help="sessions of each mode, the modes alternating; the median run of each is kept")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sizes", nargs="*", default=["10m", "100m", "500m"],
                        help="weight-sync model sizes (none: skip weight sync)")
    parser.add_argument("--transport", default="auto", choices=["auto", "object_store"],
                        help="how rows move between workers (asyncflow.Session's transport)")
    parser.add_argument("--overlap", action="store_true",
                        help="asynchronous modes: start each step once the last submitted its update "
                             "(train.overlap_steps = true)")
    parser.add_argument("--job", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="override the workload's sizes (AsyncJob fields), e.g. hidden=256")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    job = AsyncJob(**{k: type(getattr(AsyncJob(), k))(v) for k, v in (item.split("=", 1) for item in args.job)})
    torch.set_num_threads(1)
    af.start_ray(preload=(), keep=True)  # one instance for every mode's session (and the weight sync's)
    try:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for _ in range(args.rounds):
            for mode in args.modes:
                runs[mode].append(asyncio.run(measure(job, mode, steps=args.steps, warmup=args.warmup,
                                                      transport=args.transport, overlap=args.overlap)))
        _report(args, job, {mode: median_run(got) for mode, got in runs.items()},
                {mode: [r["tokens_per_s"] for r in got] for mode, got in runs.items()})
    finally:
        af.shutdown_ray()


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (of an even count, the slower of the middle two):
    a run's own record, its stage and pool times with it."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def _report(args: argparse.Namespace, job: AsyncJob, records: dict[str, dict[str, Any]],
            rounds: dict[str, list[float]]) -> None:
    """Print the table; write the JSON (with the weight sync's measurements)."""
    out: dict[str, Any] = {"job": asdict(job) | {"budgets": job.budgets(), "tokens_per_step": job.tokens_per_step},
                           "steps": args.steps, "warmup": args.warmup, "overlap_steps": args.overlap,
                           "rounds": args.rounds}
    for mode, record in records.items():
        out[f"{mode}_tokens_per_s_rounds"] = rounds[mode]
        out[f"{mode}_tokens_per_s"] = record["tokens_per_s"]
        out[f"{mode}_s_per_step"] = record["s_per_step"]
        out[f"{mode}_pool_step_ms"] = record["pool_step_ms"]
        busiest = max(record["pool_step_ms"].values(), default=0.0) / 1000
        out[f"{mode}_step_over_busiest"] = record["s_per_step"] / busiest if busiest else math.nan
        if mode.startswith("async"):
            out[f"{mode}_mean_staleness"] = record["mean_staleness"]
    # Synchronous training's best placement: max_staleness = 0 on split pools is synchronous too.
    syncs = [records[m]["tokens_per_s"] for m in ("sync_one", "sync_dp2", "async0") if m in records]
    if syncs:
        out["sync_tokens_per_s"] = max(syncs)
        for mode in ("async1", "async2", "async1_partial", "async2_partial"):
            if mode in records:
                out[f"{mode}_over_sync"] = records[mode]["tokens_per_s"] / out["sync_tokens_per_s"]
    print("| mode | tokens/s | s/step | a step's busy ms by pool | step / busiest | "
          "busy ms/step in the window | ms/step by stage (summed over ranks) |")
    print("|---|---|---|---|---|---|---|")
    for mode, record in records.items():
        print(f"| {mode} | {record['tokens_per_s']:.0f} | {record['s_per_step']:.3f} | {record['pool_step_ms']} | "
              f"{out[f'{mode}_step_over_busiest']:.2f} | {record['pool_busy_ms']} | {record['stage_ms']} |")
        out[f"{mode}_stage_ms"] = record["stage_ms"]
    if args.sizes:
        from bench._weight_sync import weight_sync

        out |= weight_sync(tuple(args.sizes))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2, sort_keys=True))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
