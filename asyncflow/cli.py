"""The ``asyncflow`` command line.

    asyncflow train CONFIG [--resume] [--set key=value ...]
    asyncflow sft CONFIG                      # only the SFT warm start of CONFIG

A configuration error ends the command with one line naming the key (exit 2); any
other error with one line naming what failed and where (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence

from channels import AsyncflowError, ConfigError


def _say(msg: str) -> None:
    print(msg, flush=True)


def _overrides(pairs: Sequence[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _train(args: argparse.Namespace) -> int:
    from asyncflow.train import Trainer, load_config

    config = load_config(args.config, _overrides(args.set))
    _say(f"asyncflow train: {config.algorithm} on {config.task.digits}-digit arithmetic "
         f"({'+'.join(config.task.operators)}), output in {config.output_dir}")
    trainer = Trainer(config, resume=args.resume, say=_say, progress_bar=not args.no_progress)
    result = asyncio.run(trainer.run())
    if result.plot is not None:
        _say(f"curves: {result.plot}   metrics: {result.output_dir / 'metrics.jsonl'}   "
             f"tensorboard: {result.output_dir / 'tensorboard'}")
    _say(f"accuracy: {result.accuracy_before:.2f} -> {result.accuracy_after:.2f}")
    return 0


def _sft(args: argparse.Namespace) -> int:
    from asyncflow.train import Trainer, load_config

    config = load_config(args.config, _overrides(args.set))
    if config.sft is None:
        raise ConfigError(f"{args.config} has no [sft] section")
    path = Trainer(config, say=_say)._model_dir()
    _say(f"SFT model: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncflow`` command."""
    parser = argparse.ArgumentParser(prog="asyncflow", description="RL for language models as async def loops")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run an RL job from a TOML or YAML config")
    train.add_argument("config", help="path to a .toml/.yaml run configuration")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=5 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=_train)
    sft = sub.add_parser("sft", help="run only the SFT warm start of a config")
    sft.add_argument("config")
    sft.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sft.set_defaults(run=_sft)
    args = parser.parse_args(argv)
    # One progress bar (ours): no per-load bars from transformers here or in the
    # Ray workers, which inherit this environment.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=os.environ.get("ASYNCFLOW_LOG", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except ConfigError as e:
        print(f"asyncflow: configuration error: {e}", file=sys.stderr)
        return 2
    except AsyncflowError as e:
        print(f"asyncflow: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
