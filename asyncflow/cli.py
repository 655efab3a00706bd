"""The ``asyncflow`` command line.

    asyncflow train CONFIG [--resume | --clean] [--set key=value ...] [--trace] [--no-progress] [--debug]
    asyncflow sft CONFIG [--set key=value ...] [--debug]   # only the SFT warm start
    asyncflow plan CONFIG [--devices N] [--write PATH] [--set key=value ...]   # placement planner
    asyncflow bench ppo [--json PATH] ...                  # the overlapped-PPO benchmark

The whole configuration is checked before anything starts. An asyncflow error
(:class:`~channels.AsyncflowError`) ends the command with one line on stderr: a
configuration error names the key (exit 2), any other error what failed and where
(exit 1); ``--debug`` adds the traceback and the rest of the message (the remote
traceback of a failed stage). Any other exception is a bug and propagates with its
traceback.

Without ``--address`` (or ``RAY_ADDRESS``) the command starts its own Ray instance,
on the loopback interface; with one it joins that cluster (``ray job submit``
sets ``RAY_ADDRESS`` for it). See :func:`asyncflow._ray_start.init_ray`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from channels import AsyncflowError, ConfigError


def _say(msg: str) -> None:
    print(msg, flush=True)


def _overrides(pairs: Sequence[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}; e.g. --set train.steps=5")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _train(args: argparse.Namespace) -> int:
    from asyncflow.train import Trainer, algorithm_in, load_config

    overrides = _overrides(args.set)
    if args.trace:
        overrides.setdefault("train.trace_steps", 3)
    config = load_config(args.config, overrides)
    task = (config.data.train if config.data.train
            else f"{config.task.digits}-digit arithmetic ({'+'.join(config.task.operators)})")
    _say(f"asyncflow train: {algorithm_in(config).name} on {task}, output in {config.output_dir}")
    trainer = Trainer(config, resume=args.resume, clean=args.clean, say=_say, progress_bar=not args.no_progress,
                      address=args.address)
    result = asyncio.run(trainer.run())
    if result.plot is not None:
        _say(f"curves: {result.plot}   metrics: {result.run_dir / 'metrics.jsonl'}   "
             f"tensorboard: {result.run_dir / 'tensorboard'}")
    _say(f"accuracy: {result.accuracy_before:.2f} -> {result.accuracy_after:.2f}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from asyncflow.train import Trainer, load_config

    config = load_config(args.config, _overrides(args.set))
    if config.sft is None:
        raise ConfigError(f"{args.config} has no [sft] section; add one to run the SFT warm start "
                          "(examples/arith_grpo.toml has one)")
    path = Trainer(config, say=_say).model_dir()
    _say(f"SFT model: {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from asyncflow.train import algorithm_in, load_config
    from asyncflow.train._plan import current_placement, plan

    config = load_config(args.config, _overrides(args.set))
    cores = None if args.gpu else (os.cpu_count() or 1)
    devices = args.devices or max(sum(p.devices for p in config.pools.values()), cores or 0)
    _say(f"asyncflow plan: profiling {algorithm_in(config).name}'s roles on {devices} device(s) "
         f"({'GPUs' if cores is None else f'{cores} CPU cores'}) ...")
    _, ranked = asyncio.run(plan(config, devices=devices, cores=cores))
    mine = current_placement(config)
    _say("\n| rank | placement | predicted s/step |\n|---|---|---|")
    for i, (placement, prediction) in enumerate(ranked, 1):
        here = "  (the config's)" if placement == mine else ""
        _say(f"| {i} | {placement.describe()}{here} | {prediction.step_s:.3f} |")
    best = ranked[0][0]
    _say(f"\nbest: {best.describe()}\n\n{best.config_block()}")
    if args.write is not None:
        args.write.write_text(best.config_block())
        _say(f"written to {args.write}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.name != "ppo":
        raise ConfigError(f"unknown benchmark {args.name!r}; available: ppo")
    from bench.ppo import main as bench_main

    bench_main(args.rest)
    return 0


def _report(error: AsyncflowError, *, debug: bool) -> int:
    """One line on stderr (with ``debug``, the traceback first); returns the exit code."""
    if debug:
        traceback.print_exception(error)
    lines = str(error).splitlines()
    what = "configuration error" if isinstance(error, ConfigError) else type(error).__name__
    print(f"asyncflow: {what}: {lines[0] if lines else ''}", file=sys.stderr, flush=True)
    return 2 if isinstance(error, ConfigError) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncflow", description="RL for language models as async def loops")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run an RL job from a TOML or YAML config")
    train.add_argument("config", help="path to a .toml/.yaml run configuration")
    train.add_argument("--resume", action="store_true",
                       help="continue the newest run under output_dir (its 'latest') from its latest checkpoint")
    train.add_argument("--clean", action="store_true",
                       help="delete the earlier runs under output_dir first (without it nothing is deleted)")
    train.add_argument("--address", metavar="HOST:PORT",
                       help="run on this Ray cluster (default: RAY_ADDRESS when set, else a Ray instance of "
                            "this machine's own, on the loopback interface)")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=5 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--trace", action="store_true",
                       help="trace the first steps (train.trace_steps, default 3): timeline.png, trace.json")
    train.set_defaults(run=_train)
    sft = sub.add_parser("sft", help="run only the SFT warm start of a config")
    sft.add_argument("config", help="path to a .toml/.yaml run configuration with an [sft] section")
    sft.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (repeatable)")
    sft.set_defaults(run=_sft)
    plan = sub.add_parser("plan", help="profile a config's roles and rank placements on the devices")
    plan.add_argument("config", help="path to a .toml/.yaml run configuration")
    plan.add_argument("--devices", type=int, default=0,
                      help="devices to place on (default: the config's pools' total; on CPU at least the cores)")
    plan.add_argument("--gpu", action="store_true", help="plan for GPUs (no core sharing between pools)")
    plan.add_argument("--write", type=Path, metavar="PATH", help="write the best [pools]/[placement] block here")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key (repeatable)")
    plan.set_defaults(run=_plan)
    bench = sub.add_parser("bench", help="run a benchmark (bench/): ppo")
    bench.add_argument("name", help="the benchmark: ppo")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options (e.g. --json PATH)")
    bench.set_defaults(run=_bench)
    for command in (train, sft, plan, bench):
        command.add_argument("--debug", action="store_true",
                             help="on an error, print the traceback and the whole message (remote tracebacks)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncflow`` command.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, 2 for a configuration error, 1 for any other asyncflow error.
    """
    args = _parser().parse_args(argv)
    # One progress bar (ours): no per-load bars from transformers here or in the
    # Ray workers, which inherit this environment.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=os.environ.get("ASYNCFLOW_LOG", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except AsyncflowError as e:
        return _report(e, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
