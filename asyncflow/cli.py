"""The ``asyncflow`` command line.

    asyncflow train CONFIG [--resume | --clean] [--set key=value ...] [--trace] [--no-progress] [--verbose] [--debug]
    asyncflow sft CONFIG [--set key=value ...] [--debug]   # only the SFT warm start
    asyncflow plan CONFIG [--devices N] [--write PATH] [--set key=value ...]   # placement planner
    asyncflow --version

Benchmarks are not commands of the package: they run as ``python -m bench.<name>``
(``bench`` sits above ``asyncflow`` and uses it, never the other way round).

The whole configuration is checked before anything starts. An asyncflow error
(:class:`~channels.AsyncflowError`) ends the command with one line on stderr: a
configuration error names the key (exit 2), any other error what failed and where
(exit 1); ``--debug`` adds the traceback and the rest of the message (the remote
traceback of a failed stage). Any other exception is a bug and propagates with its
traceback.

Quiet by default: the engines' own log records (vLLM, Ray, transformers)
below WARNING go to the run's ``engines.log``, in the driver and in the workers
(:mod:`asyncflow.train._quiet`); ``--verbose`` or ``ASYNCFLOW_LOG=info`` (or
``debug``) shows them on the terminal too.

Without ``--address`` (or ``RAY_ADDRESS``) the command starts its own Ray instance,
on the loopback interface; with one it joins that cluster (``ray job submit``
sets ``RAY_ADDRESS`` for it). See ``init_ray`` in ``asyncflow.runtime``.

Only ``argparse`` and the standard library load before a command runs: ``--help``
and ``--version`` import no torch, Ray or runtime module, and each command imports
what it needs when it starts.
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
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from channels import AsyncflowError

LOG_ENV = "ASYNCFLOW_LOG"
"""The environment variable that sets the terminal's log level (``debug``,
``info``, ``warning``; default ``warning``; ``--verbose`` is ``info``)."""

_COMMANDS = {
    "train": "run an RL job from a TOML or YAML config",
    "sft": "run only the SFT warm start of a config",
    "plan": "profile a config's roles and rank their placements",
}
"""Each subcommand's one-line description (``asyncflow --help`` and its own ``--help``)."""


def version() -> str:
    """The installed package's version (``pyproject.toml``'s, through the package
    metadata); ``"unknown"`` when asyncflow runs from a source tree that was never
    installed."""
    try:
        return metadata.version("asyncflow")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _say(msg: str) -> None:
    print(msg, flush=True)


def _overrides(pairs: Sequence[str]) -> dict[str, object]:
    from channels import ConfigError

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


def _overrides_and_file(args: argparse.Namespace) -> dict[str, object]:
    """``--set``'s overrides, after reading and decoding the configuration file:
    both before the heavy imports (torch, the roles: seconds), so that a malformed
    pair, a missing file or a syntax error is reported at once;
    :func:`~asyncflow.train.load_config` reads the file again and checks the rest."""
    from asyncflow.train import read_config_file

    overrides = _overrides(args.set)
    read_config_file(args.config)
    return overrides


def _terminal_level(args: argparse.Namespace) -> int:
    """The lowest level the terminal shows: ``--verbose`` is INFO; else
    ``ASYNCFLOW_LOG`` (a level name), else WARNING."""
    from channels import ConfigError

    if getattr(args, "verbose", False):
        return logging.INFO
    name = os.environ.get(LOG_ENV, "warning").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ConfigError(f"{LOG_ENV}={os.environ[LOG_ENV]!r} is not a log level; use debug, info or warning")
    return level


def _train(args: argparse.Namespace) -> int:
    overrides = _overrides_and_file(args)
    from asyncflow.runtime import start_fork_server, starts_own_instance, stop_fork_server

    if starts_own_instance(args.address):
        start_fork_server()  # the run's workers' libraries import while the configuration is checked
    try:
        return _run_training(args, overrides)
    finally:
        stop_fork_server()  # where the run did not start Ray (its shutdown ends the server)


def _run_training(args: argparse.Namespace, overrides: dict[str, object]) -> int:
    from asyncflow.train import Trainer, algorithm_in, load_config, module_dirs

    if args.trace:
        overrides.setdefault("train.trace_steps", 3)
    config = load_config(args.config, overrides)
    arithmetic = config.data.arithmetic
    task = (config.data.train if config.data.kind == "files"
            else f"{arithmetic.digits}-digit arithmetic ({'+'.join(arithmetic.operators)})")
    _say(f"asyncflow train: {algorithm_in(config).name} on {task}, output in {config.output_dir}")
    trainer = Trainer(config, resume=args.resume, clean=args.clean, say=_say, progress_bar=not args.no_progress,
                      address=args.address, module_dirs=module_dirs(args.config),
                      terminal_level=_terminal_level(args))
    result = asyncio.run(trainer.run())
    if result.plot is not None:
        _say(f"curves: {result.plot}   metrics: {result.run_dir / 'metrics.jsonl'}   "
             f"tensorboard: {result.run_dir / 'tensorboard'}")
    _say(f"accuracy: {result.accuracy_before:.2f} -> {result.accuracy_after:.2f}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    overrides = _overrides_and_file(args)
    from asyncflow.train import Trainer, load_config, module_dirs
    from channels import ConfigError

    config = load_config(args.config, overrides)
    if config.sft is None:
        raise ConfigError(f"{args.config} has no [sft] section; add one to run the SFT warm start "
                          "(examples/arith_grpo.toml has one)")
    path = Trainer(config, say=_say, module_dirs=module_dirs(args.config)).model_dir()
    _say(f"SFT model: {path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    overrides = _overrides_and_file(args)
    from asyncflow.train import algorithm_in, load_config
    from asyncflow.train._plan import current_placement, plan

    config = load_config(args.config, overrides)
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


def _report(error: AsyncflowError, *, debug: bool) -> int:
    """One line on stderr, and one per note the error carries (where a failed run can
    continue); with ``debug``, the traceback first. Returns the exit code."""
    from channels import ConfigError

    if debug:
        traceback.print_exception(error)
    lines = str(error).splitlines()
    what = "configuration error" if isinstance(error, ConfigError) else type(error).__name__
    print(f"asyncflow: {what}: {lines[0] if lines else ''}", file=sys.stderr, flush=True)
    for note in getattr(error, "__notes__", ()):  # what the error's catcher added: where a run can continue
        print(f"asyncflow: {note}", file=sys.stderr, flush=True)
    return 2 if isinstance(error, ConfigError) else 1


def _command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
             config_help: str = "path to a .toml/.yaml run configuration") -> argparse.ArgumentParser:
    """Subcommand ``name`` with its one-line description, its CONFIG argument and
    the options every command has (``--set``, ``--debug``)."""
    command = sub.add_parser(name, help=_COMMANDS[name], description=_COMMANDS[name])
    command.add_argument("config", help=config_help)
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key, e.g. --set train.steps=5 (repeatable; VALUE is JSON, "
                              "else a string)")
    command.add_argument("--debug", action="store_true",
                         help="on an error, print the traceback and the whole message (remote tracebacks)")
    return command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncflow", description="RL for language models as async def loops")
    parser.add_argument("--version", action="version", version=f"asyncflow {version()}",
                        help="print asyncflow's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = _command(sub, "train")
    train.add_argument("--resume", action="store_true",
                       help="continue the newest run under output_dir that has a checkpoint (its 'latest', unless "
                            "newer runs ended before their first) from its latest checkpoint")
    train.add_argument("--clean", action="store_true",
                       help="delete the earlier runs under output_dir first (without it nothing is deleted)")
    train.add_argument("--address", metavar="HOST:PORT",
                       help="run on this Ray cluster (default: RAY_ADDRESS when set, else a Ray instance of "
                            "this machine's own, on the loopback interface)")
    train.add_argument("--no-progress", action="store_true",
                       help="no progress bar over the RL steps (the per-step lines stay)")
    train.add_argument("--trace", action="store_true",
                       help="trace the first steps (train.trace_steps, default 3): timeline.png, trace.json")
    train.add_argument("--verbose", action="store_true",
                       help=f"show the engines' (vLLM, Ray, transformers) INFO lines on the terminal too "
                            f"(same as {LOG_ENV}=info); without it they go to the run's engines.log only")
    train.set_defaults(run=_train)
    _command(sub, "sft", "path to a .toml/.yaml run configuration with an [sft] section").set_defaults(run=_sft)
    plan = _command(sub, "plan")
    plan.add_argument("--devices", type=int, default=0,
                      help="devices to place on (default: the config's pools' total; on CPU at least the cores)")
    plan.add_argument("--gpu", action="store_true", help="plan for GPUs (no core sharing between pools)")
    plan.add_argument("--write", type=Path, metavar="PATH", help="write the best [pools]/[placement] block here")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncflow`` command.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0, 2 for a configuration error, 1 for any other asyncflow error,
        130 for a Ctrl-C outside the RL steps (whose own handling keeps a checkpoint).
    """
    args = _parser().parse_args(argv)
    # One progress bar (ours): none from the Hugging Face libraries here, whose
    # settings are read when they are imported (the workers get theirs from the
    # trainer's worker environment).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Our own loggers (asyncflow.*) at the terminal's level; the engines' loggers
    # are routed by the trainer (asyncflow.train._quiet).
    logging.basicConfig(level=os.environ.get(LOG_ENV, "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    from channels import AsyncflowError

    try:
        return int(args.run(args))
    except AsyncflowError as e:
        return _report(e, debug=args.debug)
    except KeyboardInterrupt:  # before or after the RL steps: nothing of a run's is lost here
        if args.debug:
            raise
        print(f"asyncflow: interrupted (Ctrl-C) during `asyncflow {args.command}`", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
