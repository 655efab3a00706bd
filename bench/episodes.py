"""Whether episodes hide their environments' waiting.

Run as ``python -m bench.episodes --json PATH [--episodes 64 --turns 4 --wait-ms 100]``.

``N`` episodes of ``T`` turns (each turn exactly ``--turn-tokens`` tokens) of a
tiny random Llama in the native engine, with an environment that sleeps
``L`` ms per step, run by :class:`workers.episodes.EpisodeRun` (what a rollout
rank runs), three ways, alternated over ``--rounds`` (5; medians):

- ``overlapped_s``: all ``N`` in flight at once, the environment sleeping ``L``;
- ``no_wait_s``: the same episodes, the environment answering at once;
- ``serial_s``: one episode after another, sleeping ``L``.

Also ``episodes_per_s`` (overlapped), ``turns`` (per episode), ``wait_ms`` (``L``),
``hidden_wait_bound_s`` (``1.3 * T * L``: the waiting that cannot be hidden is
the last turns', about ``T * L``) and ``overlapped_minus_no_wait_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from workers.episodes import EpisodeConfig, EpisodeRun
from workers.models import CharTokenizer, PromptTokenizer, TinyModelConfig, build_tiny_model
from workers.rollout import NativeRolloutConfig, NativeRolloutEngine, SamplingParams


class Sleeper:
    """Sleeps ``wait_ms`` per step; done after ``turns`` steps."""

    def __init__(self, turns: int, wait_ms: float) -> None:
        self.turns, self.wait_s, self.seen = turns, wait_ms / 1000, 0

    async def reset(self, row: Any) -> None:
        return None

    async def step(self, action: str) -> tuple[str, float, bool]:
        if self.wait_s:
            await asyncio.sleep(self.wait_s)
        self.seen += 1
        return "7", 0.0, self.seen >= self.turns


def run_episodes(engine: NativeRolloutEngine, tokenizer: Any, prompts: list[list[int]], *, turns: int,
                 wait_ms: float, turn_tokens: int) -> float:
    """Seconds to run one episode per prompt, all in flight at once."""
    config = EpisodeConfig(env=Sleeper, settings={"turns": turns, "wait_ms": wait_ms}, max_turns=turns,
                           max_tokens=turns * (turn_tokens + 4), format="text")
    params = SamplingParams(max_new_tokens=turn_tokens, ignore_eos=True, eos_token_id=tokenizer.eos_token_id,
                            seed=0)
    start = time.perf_counter()
    run = EpisodeRun(engine, prompts, [{} for _ in prompts], n=1, params=params, config=config,
                     tokenizer=tokenizer, where="bench.episodes")
    try:
        while run.pending:
            for episode in run.advance():
                if episode.outcome != "done" or episode.turns != turns:
                    raise RuntimeError(f"episode {episode.index} ended {episode.outcome} after {episode.turns} "
                                       f"turns: {episode.reason}")
    finally:
        run.close()
    return time.perf_counter() - start


def measure(*, episodes: int, turns: int, wait_ms: float, turn_tokens: int, rounds: int) -> dict[str, Any]:
    """The figures of the module docstring."""
    tokenizer = PromptTokenizer(CharTokenizer(), source="bench.episodes")
    model = build_tiny_model(TinyModelConfig(), seed=0)
    engine = NativeRolloutEngine(model, config=NativeRolloutConfig(), tokenizer=tokenizer.tokenizer)
    prompts = [tokenizer.encode_text(f"{i}+{i * 7 % 100}=") for i in range(episodes)]
    common = {"turns": turns, "turn_tokens": turn_tokens}
    run_episodes(engine, tokenizer, prompts[:4], wait_ms=0, **common)  # warm-up
    times: dict[str, list[float]] = {"overlapped_s": [], "no_wait_s": [], "serial_s": []}
    for _ in range(rounds):
        times["overlapped_s"].append(run_episodes(engine, tokenizer, prompts, wait_ms=wait_ms, **common))
        times["no_wait_s"].append(run_episodes(engine, tokenizer, prompts, wait_ms=0, **common))
        times["serial_s"].append(sum(run_episodes(engine, tokenizer, [p], wait_ms=wait_ms, **common)
                                     for p in prompts))
    out: dict[str, Any] = {key: statistics.median(values) for key, values in times.items()}
    out |= {
        "episodes": episodes, "turns": turns, "wait_ms": wait_ms, "turn_tokens": turn_tokens, "rounds": rounds,
        "episodes_per_s": episodes / out["overlapped_s"],
        "overlapped_minus_no_wait_s": out["overlapped_s"] - out["no_wait_s"],
        "hidden_wait_bound_s": 1.3 * turns * wait_ms / 1000,
        "all_rounds": times, "torch_threads": torch.get_num_threads(),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--wait-ms", type=float, default=100.0)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = measure(episodes=args.episodes, turns=args.turns, wait_ms=args.wait_ms, turn_tokens=args.turn_tokens,
                  rounds=args.rounds)
    line = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items() if k != "all_rounds"}
    print(json.dumps(line))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
